"""The torch-only core: quantizers (``quant``), rotations (``rotation``), rotation files and
sets (``rotation_io``), the reference cache (``mixed_cache``) and its keys less their mean
(``key_mean``), the value fold (``fold``), settings, errors and atomic outputs. Never imports
transformers, vLLM or Triton."""
