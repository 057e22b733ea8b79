"""oscar_vllm: 2-bit KV cache with OSCAR's attention-aware rotations, for vLLM.

Four layers (tests/test_layers.py keeps their rules):

- ``core``: quantizers, rotations, rotation files, the reference cache, the value fold,
  settings, errors; torch (and safetensors) only.
- ``reference``: the Triton kernels' plain-PyTorch twins; torch and ``core`` only.
- ``calibration``: model loading, statistics and fits, the corpus, ``oscar-calibrate`` and
  ``oscar-evaluate``; ``core`` plus transformers.
- ``serving``: the vLLM plugin, attention backend and hooks, ``oscar-vllm``; ``core``, the
  kernels in ``csrc_triton`` and vLLM.

Calibration and serving never import each other. Importing the package is cheap:
submodules load torch, transformers or vLLM only when they are used.
"""

__version__ = "0.1.0"
