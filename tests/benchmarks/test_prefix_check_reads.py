"""benchmarks/studies/prefix_check_reads.py: vLLM's scheduler on the CPU serves the prefix check as vLLM
did on the H200, and each position reads what its request's chunks give it."""
import pytest

pytest.importorskip("vllm")

from benchmarks.studies import prefix_check_reads  # noqa: E402
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
    two = prefix_check_reads.schedule_check(windows, 256, True, tmp_path, rings=2)
    assert all(r["len"] - r["chunks"][0][0] >= 256 + 8 * 64 for r in two)
    # A request whose hit the second ring does not empty starts 4 blocks earlier than with one.
    moved = [(a["chunks"][0][0], b["chunks"][0][0]) for a, b in zip(scored, two) if b["chunks"][0][0] > 0]
    assert moved and all(b == a - 4 * 64 for a, b in moved)


def test_with_rings_reused_later_requests_hit_further_and_read_the_copied_ring(windows, tmp_path):
    """hit_ring "reuse": a request admitted after one of its window (or the shared prefix's) ended
    copies that ring and hits where vLLM's hit ends; its positions read BF16 from the ring's first."""
    one = prefix_check_reads.schedule_check(windows, 256, True, tmp_path)
    reused = prefix_check_reads.schedule_check(windows, 256, True, tmp_path, reuse_rings=True)
    took = [(a, b) for a, b in zip(one, reused) if b["ring"]]
    assert took and all(a["ring"] is None for a in one)
    for a, b in took:
        lo, hi = b["ring"]
        assert b["chunks"][0][0] == hi > a["chunks"][0][0] and hi - lo >= 256 - 64 - 1
    assert sum(r["chunks"][0][0] for r in reused) > sum(r["chunks"][0][0] for r in one)
    starts = prefix_check_reads.bf16_from(reused, len(CACHED_PREFIX_CUTS), chunk=256)
    i = next(i for i, r in enumerate(reused) if r["ring"])
    lo, hi = reused[i]["ring"]
    assert starts[i][hi] == max(lo, hi - 255), "the first new position reads the copied ring in BF16"


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


# A run's meta as main() writes it, less what each report test sets.
META = {"date": "d", "hardware": "h", "command": "c", "versions": "v", "model": "m", "dtype": "float32",
        "rotations": "r", "method": "oscar-int2-fit", "chunk": 256}


def test_the_report_pairs_every_row_with_caching_off_and_two_rings_with_one():
    meta = {**META, "windows": 1, "tokens": 4}
    off = [1.0, 2.0, 3.0, 4.0]
    result = {"caching off": {"nll": off, "ppl": 1.0, "mean_hit": 0},
              "caching on": {"nll": [1.1, 2.1, 3.1, 4.1], "ppl": 1.0, "mean_hit": 850},
              "caching on, two rings recomputed": {"nll": [1.0, 2.2, 3.0, 4.2], "ppl": 1.0, "mean_hit": 594}}
    text = prefix_check_reads.report(result, meta)
    assert "| caching on | 850 | 1.000 | +10.00% | 0.00% | 0.0% |" in text
    # Two rings against caching off: differences 0, .2, 0, .2 (mean .1, SD .1155, SE .0577).
    assert "| caching on, two rings recomputed | 594 | 1.000 | +10.00% | 5.77% | 11.5% |" in text
    # Against one ring: -.1, .1, -.1, .1.
    assert "paired over the same tokens: +0.00% ± 5.77% (per-token SD 11.5%)" in text
    # Rings reused against one recomputed: 0, 0, .1, -.1 (SD .0816, SE .0408).
    result["caching on, rings reused"] = {"nll": [1.1, 2.1, 3.2, 4.0], "ppl": 1.0, "mean_hit": 960}
    assert "Rings reused against one recomputed (the plugin's default), paired over the same tokens: +0.00% ± 4.08%" \
        in prefix_check_reads.report(result, meta)
    del result["caching on, two rings recomputed"]
    assert "Two rings" not in prefix_check_reads.report(result, meta)


def test_the_report_scores_every_computed_position_with_the_windows_as_clusters():
    meta = {**META, "windows": 2, "tokens": 18}
    cuts = len(CACHED_PREFIX_CUTS)
    result = {"caching off": {"nll": [1.0] * 2 * cuts, "ppl": 1.0, "mean_hit": 0, "tail_nll": [2.0] * 2 * cuts,
                              "tail_tokens": 5000},
              "caching on": {"nll": [1.0] * 2 * cuts, "ppl": 1.0, "mean_hit": 850,
                             "tail_nll": [2.01] * cuts + [2.03] * cuts, "tail_tokens": 5000}}
    text = prefix_check_reads.report(result, meta)
    # Window means +1% and +3%: their mean +2%, SE std(.01, .03) / sqrt(2) = 1%.
    assert "| caching on | 5,000 | +2.00% | 1.00% |" in text
    del result["caching on"]["tail_nll"]
    assert "Every position" not in prefix_check_reads.report(result, meta)
