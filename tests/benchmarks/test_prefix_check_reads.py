"""benchmarks/prefix_check_reads.py: vLLM's scheduler on the CPU serves the prefix check as vLLM
did on the H200, and each position reads what its request's chunks give it."""
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

pytest.importorskip("vllm")

import prefix_check_reads  # noqa: E402
from oscar_vllm.calibration.evaluate import CACHED_PREFIX_CUTS  # noqa: E402

# What the H200 run of `tests/gpu/e2e_vllm.py prefix --chunk 256` reported for its 207 scored
# prompts with caching on (results/windows/gpu/prefix_2026-12-02.log).
H200_CACHED_TOKENS = 175_872


@pytest.fixture(scope="module")
def windows():
    """The check's shape: 23 windows of one shared 512-token prefix and distinct text. The tokens
    only name blocks (their hashes); the ranges keep the windows' texts apart."""
    shared = list(range(1000, 1512))
    return [shared + list(range(3_000 + 2_000 * w, 3_000 + 2_000 * w + 1536)) for w in range(23)]


def test_the_cpu_scheduler_hits_what_vllm_hit_on_the_h200(windows, tmp_path):
    scored = prefix_check_reads.schedule_check(windows, 256, True, tmp_path)
    assert len(scored) == 207
    assert sum(r["chunks"][0][0] for r in scored) == H200_CACHED_TOKENS
    for r in scored:
        covered = [a for a, n in r["chunks"]]
        assert covered == sorted(covered) and r["chunks"][-1][0] + r["chunks"][-1][1] == r["len"]
        assert all(n <= 256 for _, n in r["chunks"])
        # Hits stop a ring (4 blocks of 64) short and end at least 256 tokens before the end.
        assert r["chunks"][0][0] % 64 == 0 and r["len"] - r["chunks"][0][0] >= 256 + 4 * 64
    off = prefix_check_reads.schedule_check(windows, 256, False, tmp_path)
    assert all(r["chunks"][0][0] == 0 for r in off)


def test_positions_read_bf16_from_their_chunks_ring_never_under_the_hit():
    cuts = len(CACHED_PREFIX_CUTS)
    first = {"len": 812, "chunks": [(256, 200), (456, 256), (712, 100)]}
    second = {"len": 962, "chunks": [(448, 256), (704, 256), (960, 2)]}
    rest = [{"len": 100, "chunks": [(0, 100)]}] * (cuts - 2)
    starts = prefix_check_reads.bf16_from([first, second, *rest], cuts, chunk=256, recent=256)
    a, b = starts[0], starts[1]
    assert a[300] == 256 and a[500] == 256 and a[800] == 712 - 255  # the ring: never below the hit
    assert a[10] == a[255] == 0  # the shared prefix, as its chunks of 256 from 0 cached it
    assert b[700] == 448 and b[961] == 960 - 255  # b's own chunks
    # b's hit covers a's positions 256-447: they read as a computed them; under a's hit, the
    # shared prefix's reads.
    assert b[440] == 256 and b[100] == 0
    assert len(a) == 812 and len(b) == 962
