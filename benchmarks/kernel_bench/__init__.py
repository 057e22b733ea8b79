"""The kernel benchmarks: each kernel against vLLM's FA3 and Triton attention at model shapes
(``oscar_decode``, ``oscar_attention``, ``oscar_write``, ``oscar_dense_kv``; ``common``: shapes,
paged caches, timing, reports), the machine code without a GPU (``compile_check``,
``sass_histogram``, ``warm_up_compile``) and Nsight Compute's output as a table (``ncu_summary``).
Run each from the repository root: ``python -m benchmarks.kernel_bench.oscar_decode decode --out DIR``."""
