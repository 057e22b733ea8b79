"""Plain-PyTorch twins of the Triton kernels in ``csrc_triton/``, one file per kernel.

They take the same arguments as the kernels' launch wrappers (the cache and the batch as any
objects with the fields of ``csrc_triton.paged_layout.MixedCache`` and ``BatchLayout``:
``paged.MixedCacheLike``, ``paged.BatchLike``), work on the same paged layout
(``csrc_triton/paged_layout.py``), loop over requests in Python and are meant for tests on small
shapes, not for speed.
"""
