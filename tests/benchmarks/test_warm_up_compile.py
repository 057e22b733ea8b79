"""benchmarks/kernel_bench/warm_up_compile.py: the compiles it times are the warm-up's own."""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.kernel_bench import warm_up_compile
from csrc_triton.warm_up import gluon_decode_variants

REPO = Path(__file__).resolve().parents[2]


def test_the_variants_are_the_warm_ups_distinct_compiles():
    variants = warm_up_compile.decode_variants(1024, 132)
    launches = gluon_decode_variants(1024, 8, 132)
    # one compile per (register cap, prefetch, ring weight, split or not); the split count is a runtime value
    assert len(variants) == len({(m, p, c, s > 1) for m, p, c, s in launches}) == 4
    assert {(m, c["PREFETCH"], c["RING_COST"], c["SPLIT"]) for m, c in variants} == \
        {(m, p, c, s > 1) for m, p, c, s in launches}


def test_compiling_leaves_no_cache_folder_behind(tmp_path, monkeypatch):
    """Each run compiles into an empty Triton cache of its own, removed after it, and the caller's
    TRITON_CACHE_DIR is put back (the suite once left a /tmp/oscar-warm-up-* folder per run)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the run makes its cache
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "callers-cache"))
    caches = []  # the cache each compile saw (the compiler itself is not what is tested here)
    monkeypatch.setattr(warm_up_compile, "compile_kernel", lambda *args: caches.append(os.environ["TRITON_CACHE_DIR"]))
    warm_up_compile.compile_all([(None, {}), (168, {})], 2)
    assert len(caches) == 2 and len(set(caches)) == 1
    assert Path(caches[0]).parent == tmp_path and Path(caches[0]).name.startswith("oscar-warm-up-2-")
    assert list(tmp_path.iterdir()) == []
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "callers-cache")
    monkeypatch.delenv("TRITON_CACHE_DIR")
    warm_up_compile.compile_all([], 1)
    assert "TRITON_CACHE_DIR" not in os.environ and list(tmp_path.iterdir()) == []


def test_a_run_compiles_and_writes_its_table(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a real compile, for sm_90
    (tmp_path / "tmp").mkdir()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.kernel_bench.warm_up_compile", "--threads", "1", "2",
                           "--max-num-seqs", "1", "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          env={**env, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path / "tmp")}, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert not list((tmp_path / "tmp").glob("oscar-warm-up-*")), "the run's Triton caches are left behind"
    result = json.loads((tmp_path / "warm_up_compile.json").read_text())
    assert [(r["threads"], r["variants"]) for r in result["rows"]] == [(1, 1), (2, 1)]
    assert all(r["seconds"] > 0 for r in result["rows"])
    assert "| 2 | 1 |" in (tmp_path / "warm_up_compile.md").read_text()
