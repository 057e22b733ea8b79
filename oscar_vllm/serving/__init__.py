"""Serving on vLLM: the plugin entry point (``plugin``), the attention backend (``backend``), the
kernels each batch's requests take (``prefill``) and the backend's hooks into vLLM
(``vllm_hooks``), window pages, where rotations come from (``rotation_source``), startup checks
(``preflight``) and the ``oscar-vllm`` CLI (``serve``). Builds on ``oscar_vllm.core`` and the
kernels in ``csrc_triton``; never imports ``oscar_vllm.calibration``."""
