"""Calibration and evaluation on transformers: model loading and the attention capture
(``models``), per-layer statistics, rotation sets and clip fits (``fit``), the text
(``corpus``), and the ``oscar-calibrate`` and ``oscar-evaluate`` CLIs. Builds on
``oscar_vllm.core``; never imports vLLM nor ``oscar_vllm.serving``."""
