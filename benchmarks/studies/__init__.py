"""One-off studies: each asked one question, and docs/ and results/ hold its answer (the page and
the result folder each module's docstring names). No stage of ``tests/gpu/run.sh`` runs them; they
stay runnable, from the repository root: ``python -m benchmarks.studies.NAME --help``.

- ``chunking_dependence``: how much OSCAR's next tokens depend on the prefill chunks (reliability.md);
- ``noise_sensitivity``: how much a 2-bit cache amplifies small upstream differences (reliability.md);
- ``prefix_check_reads``: vLLM's prefix check at small chunks, replayed in the reference cache (backend.md);
- ``key_bit_allocation``: keys with their bits where the queries look (quality.md);
- ``rotation_error``: the quantity OSCAR minimizes, per rotation (fidelity.md);
- ``window_capacity``: the KV capacity with the windows, from two engines' logs (backend.md)."""
