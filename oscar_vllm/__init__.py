"""oscar_vllm: 2-bit KV cache with OSCAR's attention-aware rotations, for vLLM.

Importing the package is cheap: submodules load torch, transformers or vLLM only when
they are used.
"""

__version__ = "0.1.0"
