"""The benchmarks, as one package of modules. Each runs from the repository root as a module:

    python -m benchmarks.ab --help                      the A/B harness (ab/)
    python -m benchmarks.kernel_bench.oscar_decode decode    a kernel benchmark (kernels/)
    python -m benchmarks.studies.rotation_error         a one-off study (studies/)
    python -m benchmarks.quality_study                  the rest, beside this file

so that they import one another, and the tests import them, by their package names (pytest.ini
puts the repository root on the path). Not part of the installed distribution: setup.py packages
oscar_vllm and csrc_triton only.

- ``ab/``: vLLM engines side by side, OSCAR against vLLM's KV caches (``tests/gpu/run.sh`` ab);
- ``kernels/``: the kernels against vLLM's FA3 and Triton attention, compile checks, ncu tables;
- ``studies/``: studies that ran for one question, their findings in docs/ and results/ (no stage
  of ``tests/gpu/run.sh`` runs them);
- ``quality_study``, ``quality_vllm``, ``cached_prefix_reads``, ``profile_decode``, ``fidelity.sh``:
  what stages of ``tests/gpu/run.sh`` run; ``vllm_report``: its e2e stage's tables;
  ``readme_tables`` and ``main_job.sh``: the README's and the docs' tables from the result files;
- ``vllm_cpu``: vLLM's engine configs and scheduler on a machine without a GPU (the studies and the
  serving tests use it);
- ``configs/``: model configs for runs with dummy weights.
"""
