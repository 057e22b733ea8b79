"""What the Gluon kernels (``oscar_decode`` and ``oscar_write.oscar_write_decode``) share of the
paged layout, and their launch tables. The layout itself, the region's formula and the units the
INT2 codes come in are ``paged_layout``'s (Gluon's constexprs are Triton's)."""
from typing import NamedTuple

import triton
from triton.experimental.gluon import language as gl

from csrc_triton.paged_layout import (
    KEY_MEAN_PAIRS,
    WINDOW_ENTRIES as _WINDOW_ENTRIES,
    launch_bucket,
    split_count,
    split_rows,
)

WINDOW_ENTRIES = gl.constexpr(_WINDOW_ENTRIES)  # ring entries a page holds where the Gluon decode serves
TILE = gl.constexpr(64)  # keys per decode step: one INT2 block, or 8 ring pages
# key_mean: the RoPE pairs of each KV head's block mean the decode kernel adds back (KEY_MEAN_PAIRS: the
# study's 16 strongest do what all do, docs/quality.md). A block's keys were all written less one
# vector, so they all gain one logit a query head: MEAN_PAIRS products a block, not a key.
MEAN_PAIRS = gl.constexpr(KEY_MEAN_PAIRS)

MAX_DECODE_SPLITS = 256


# Decode launch by batch size (the largest key <= requests): (registers a thread may use, one-warp
# programs the split count aims for per SM, the INT2 block prefetched into L2 this many steps
# ahead, INT2 blocks a BF16 ring tile counts as when the splits share a request's keys, whether
# the split count fills one whole wave of those programs rather than the power of two above).
# Uncapped, ptxas takes 255 registers (the ring tile's loads), 8 warps an SM: one request's
# splits fit in one wave and run fastest so, with 256 splits and blocks 4 ahead in L2 (a split's
# loads then wait for L2, not DRAM). From 8 requests on, 168 registers (12 warps an SM, a few
# bytes of spills outside the INT2 loop) and 2 blocks ahead. The split count follows the time:
# from 8 to 32 requests one whole wave of 12 programs an SM is the fastest count (8 x 32K 24
# splits 0.078 ms against 0.086 at 64; 32 x 32K 6, 0.240 against 0.246 at 16), a count leaving
# part of a second wave the slowest; from 33, powers of two at 16 an SM (64 x 8K: 8 splits 4%
# ahead of a wave's 3; results/kernels/sweep_wave_ctas12/). The ring tile's weight: counted as
# one block, the split holding the five ring tiles was the one the others waited for (1 x 32K 41
# us, 28 at 4); from 16 requests the programs run in several waves and 2 is best or within 3%.
# H200, Qwen3-8B shape: `python -m benchmarks.kernel_bench.oscar_decode sweep` (results/kernels/prefetch/,
# results/kernels/ring/).
class DecodeLaunch(NamedTuple):
    maxnreg: int | None
    ctas_per_sm: int
    prefetch: int
    ring_cost: int
    whole_wave: bool


DECODE_LAUNCH = {
    1: DecodeLaunch(None, 8, 4, 4, False),
    8: DecodeLaunch(168, 12, 2, 4, True),
    16: DecodeLaunch(168, 12, 2, 2, True),
    33: DecodeLaunch(168, 16, 2, 2, False),
}
# A fixed split count (the backend's decode_splits setting: replies that do not depend on the
# batch) needs split boundaries that do not follow the batch size either: one ring weight for
# every batch, the table's largest bucket's. With the table's per batch, a request's boundaries,
# hence its merged sums, moved as its batch crossed 16 requests.
FIXED_SPLITS_RING_COST = DECODE_LAUNCH[max(DECODE_LAUNCH)].ring_cost

# Query rows of a decode write program's MMA tile, by tokens in the call (the largest key <=
# tokens): the program takes rows // G tokens, which share one load of R (64 KB at head_dim 128,
# two bf16 terms, from L2: the kernel's largest cost at 256 tokens, where two terms instead of three
# took 36% off). 16 rows is one m16 tile (4 tokens at G = 4).
DECODE_WRITE_LAUNCH = {1: 16}


def decode_launch(num_reqs: int) -> DecodeLaunch:
    """The launch of a decode batch of ``num_reqs`` requests (``DECODE_LAUNCH``'s bucket)."""
    return launch_bucket(DECODE_LAUNCH, num_reqs)


def decode_ring_cost(num_reqs: int, fixed_splits: int = 0) -> int:
    """INT2 blocks a ring tile counts as when a batch of ``num_reqs`` requests splits their keys:
    ``DECODE_LAUNCH``'s, or ``FIXED_SPLITS_RING_COST`` for every batch when the split count is
    fixed (``fixed_splits`` > 0)."""
    return FIXED_SPLITS_RING_COST if fixed_splits else decode_launch(num_reqs).ring_cost


def decode_splits(num_reqs: int, num_kv_heads: int, num_sms: int, ctas_per_sm: int | None = None,
                  max_splits: int | None = None, whole_wave: bool | None = None) -> int:
    """Most splits a decode batch of ``num_reqs`` requests uses (>= 1): enough one-warp programs
    for ``ctas_per_sm`` per SM, rounded up to a power of two, or (``whole_wave``) as many as fit
    in one wave of that many (a count that need not be a power of two: at 8 x 32K, 64 splits made
    4,096 programs, 2.6 waves at the 12 an SM 168 registers allow), at most ``max_splits`` (else
    ``MAX_DECODE_SPLITS``). ``ctas_per_sm`` and ``whole_wave`` left None: ``DECODE_LAUNCH``'s."""
    launch = decode_launch(num_reqs)
    programs = (ctas_per_sm or launch.ctas_per_sm) * num_sms
    wave = launch.whole_wave if whole_wave is None else whole_wave
    return split_count(programs, num_reqs * num_kv_heads, max_splits or MAX_DECODE_SPLITS, wave)


def decode_split_rows(max_num_reqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Rows of split scratch any decode batch up to ``max_num_reqs`` needs (``requests * splits``)."""
    return split_rows(lambda n: decode_splits(n, num_kv_heads, num_sms), max_num_reqs)


def decode_write_tiles(g: int, d: int, tokens: int = 1, query_rows: int | None = None) -> dict:
    """A decode write program's tiling for ``g`` query heads a KV head and a call of ``tokens``:
    ``TP`` tokens (as many as keep its queries within ``query_rows``, else ``DECODE_WRITE_LAUNCH``'s
    rows), ``QM``/``KM`` the queries' and keys' MMA rows (the keys' with room for the values' rows
    after them), and ``num_warps``, a warp per K or V row (at most one per 8 dims: the MMA tiles'
    width; rows beyond it share a warp). H200, Qwen3-8B: 11 µs at 1 and 32 tokens, 28 and 27 with a
    16-row tile's rows a warp (``benchmarks/kernel_bench/oscar_write.py``)."""
    rows = query_rows or launch_bucket(DECODE_WRITE_LAUNCH, tokens)
    # At most 16 tokens: every warp holds the keys' whole A operand (the warps split R's columns).
    tp = max(1, min(16, rows // triton.next_power_of_2(g)))
    return dict(TP=tp, QM=max(16, triton.next_power_of_2(tp * g)), KM=max(16, 2 * tp),
                num_warps=min(max(4, 2 * tp), 16, d // 8))
