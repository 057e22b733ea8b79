"""Triton kernels for the OSCAR KV cache.

Each op is one file here (kernel + launch wrapper), with its PyTorch reference in
``oscar_vllm`` and a test of the same name in ``tests/``. Depends on triton and torch only.
"""
