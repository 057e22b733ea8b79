"""Triton kernels for the OSCAR KV cache.

Each op is one file here (kernel + launch wrapper): ``oscar_write``, ``oscar_attention``,
``oscar_decode`` (Gluon), ``oscar_dense_kv`` and ``merge_splits``, over the layout in
``paged_layout``, which also defines what every launcher takes (``MixedCache``, ``BatchLayout``)
and the Triton kernels' launch tables (the Gluon kernels' are in ``gluon_layout``). Their PyTorch
twins are under the same names in ``oscar_vllm/reference/``, their tests in ``tests/kernels/``.
``warm_up`` compiles the variants a server launches before it serves. Depends on triton and torch
only.
"""
