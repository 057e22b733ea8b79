"""The torch-only core: quantizers (``quant``), rotations (``rotation``), rotation files and
sets (``rotation_io``), the reference cache (``mixed_cache``), the value fold (``fold``),
settings, errors and atomic outputs. Never imports transformers, vLLM or Triton."""
