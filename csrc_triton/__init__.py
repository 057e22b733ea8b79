"""Triton kernels for the OSCAR KV cache.

Each op is one file here (kernel + launch wrapper): ``oscar_write`` and
``oscar_attention``, over the layout in ``paged_layout``. Each has its PyTorch twin under the
same name in ``oscar_vllm/reference/`` and a test ``tests/test_<op>.py``. Depends on triton
and torch only.
"""
