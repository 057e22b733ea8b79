"""Triton kernels for the OSCAR KV cache.

Each op is one file here (kernel + launch wrapper): ``oscar_write``, ``oscar_attention`` and
``oscar_dense_kv``, over the layout in ``paged_layout``. Each has its PyTorch twin under the
same name in ``oscar_vllm/reference/`` and a test ``tests/kernels/test_<op>.py``. ``warm_up`` compiles
the variants a server launches before it serves. Depends on triton and torch only.
"""
