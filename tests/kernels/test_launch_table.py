"""The decode and prefill launch choices are a fixed table (filled by
``python -m benchmarks.kernel_bench.oscar_attention sweep``), not autotuning on the serving path."""
import triton

from csrc_triton.paged_layout import (
    DECODE_LAUNCH,
    MAX_DECODE_SPLITS,
    PREFILL_LAUNCH,
    SMALL_HEAD_PREFILL_LAUNCH,
    decode_split_rows,
    decode_splits,
    launch_bucket,
)


def test_decode_table_covers_every_batch_with_valid_choices():
    assert min(DECODE_LAUNCH) == 1
    for n in range(1, 2049):
        warps, stages, ctas = launch_bucket(DECODE_LAUNCH, n)
        assert warps in (1, 2, 4, 8) and 1 <= stages <= 5 and ctas >= 1


def test_prefill_choices_are_valid():
    for block_m, warps, stages in (PREFILL_LAUNCH, SMALL_HEAD_PREFILL_LAUNCH):
        assert block_m >= 16 and triton.next_power_of_2(block_m) == block_m
        assert warps in (1, 2, 4, 8) and 1 <= stages <= 5
    # Below head_dim 128 prefill keeps the 16-row tiles decode runs with (see the table's note).
    assert SMALL_HEAD_PREFILL_LAUNCH[0] == 16


def test_split_scratch_covers_every_batch_size():
    """The builder sizes its scratch once with decode_split_rows: no batch may need more."""
    for hkv in (1, 2, 4, 8):
        rows = decode_split_rows(256, hkv, 132)
        assert all(n * decode_splits(n, hkv, 132) <= rows for n in range(1, 257))
        assert rows <= 256 * MAX_DECODE_SPLITS


def test_write_table_covers_every_token_count():
    from csrc_triton.paged_layout import WRITE_LAUNCH

    assert min(WRITE_LAUNCH) == 1
    # tl.dot takes tiles of 16 rows and more; warps a power of two.
    assert all(t in (16, 32, 64, 128) and w in (4, 8, 16, 32) for t, w in WRITE_LAUNCH.values())


def test_gluon_decode_table_covers_every_batch_with_valid_choices():
    """The Gluon decode kernel's table: register cap (None: ptxas's choice), programs per SM, the
    L2 prefetch depth, a ring tile's weight and whether the split count fills one wave (then every
    program is resident at once); its split scratch covers every batch up to the largest."""
    from csrc_triton import gluon_layout as od

    assert min(od.DECODE_LAUNCH) == 1
    for n in range(1, 2049):
        maxnreg, ctas, prefetch, ring_cost, whole_wave = od.decode_launch(n)
        assert (maxnreg is None or 128 <= maxnreg <= 255) and ctas >= 1 and 0 <= prefetch <= 8 and ring_cost >= 1
        assert isinstance(whole_wave, bool)
    for hkv in (1, 2, 4, 8):
        rows = od.decode_split_rows(256, hkv, 132)
        splits = [od.decode_splits(n, hkv, 132) for n in range(1, 257)]
        assert all(1 <= s <= od.MAX_DECODE_SPLITS for s in splits)
        for n, s in zip(range(1, 257), splits):
            launch = od.decode_launch(n)
            if launch.whole_wave:  # one wave: every program resident at once
                assert n * hkv * s <= launch.ctas_per_sm * 132 or s == 1
            else:
                assert triton.next_power_of_2(s) == s
        assert all(n * s <= rows for n, s in zip(range(1, 257), splits))
