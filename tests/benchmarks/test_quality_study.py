"""The quality study's arithmetic: bits per element of each row, and a context's figures read from
the first positions of longer windows."""
import math

import pytest
import torch

from benchmarks import quality_study as study
from oscar_vllm.core.quant import clip_index


def test_page_bits_of_the_int2_page_and_its_variants():
    today = study.ROWS_BY_NAME["today"]
    assert today.page_bits(64, 30) == 2.5 and today.page_bits(128, 30) == 2.25  # 72 bytes at d=128
    assert study.ROWS_BY_NAME["key-groups"].page_bits(128, 30) == pytest.approx((2.5 + 2.25) / 2)
    assert study.ROWS_BY_NAME["int4-2layers"].page_bits(128, 30) == pytest.approx((28 * 2.25 + 2 * 4.25) / 30)
    assert study.ROWS_BY_NAME["sink128"].page_bits(128, 30) == 2.25


def test_bits_with_windows_count_the_bf16_sink_and_recent_window():
    today = study.ROWS_BY_NAME["today"]
    assert today.bits_with_windows(128, 30, 2048) == pytest.approx((320 * 16 + 1728 * 2.25) / 2048)
    assert today.bits_with_windows(128, 30, 200) == 16  # all of it in the windows
    grows = study.ROWS_BY_NAME["recent-grows"]
    assert grows.window_tokens(2048) == 64 + 256 and grows.window_tokens(8192) == 64 + 1024
    assert grows.recent_at(torch.tensor([0, 2048, 8191])).tolist() == [256, 256, 1023]
    assert study.cost(today, 30, 64)["capacity_vs_today"] == 1.0


def test_a_context_reads_the_first_positions_of_every_window():
    def window(nll, kl, top1):
        return study.WindowScores(torch.tensor(nll, dtype=torch.float64), torch.tensor(kl, dtype=torch.float64),
                                  torch.tensor(top1))
    ref = [window([1.0, 1.0, 5.0], [0.0] * 3, [True] * 3), window([2.0, 2.0, 5.0], [0.0] * 3, [True] * 3)]
    row = [window([1.5, 1.0, 9.0], [0.1, 0.3, 9.0], [True, False, False]),
           window([2.0, 2.5, 9.0], [0.2, 0.2, 9.0], [True, True, False])]
    at3 = study.summarize(row, ref, 3)  # a context of 3 predicts 2 positions per window
    assert at3["tokens"] == 4
    assert at3["delta_ppl_pct"] == pytest.approx(100 * (math.exp(7.0 / 4) / math.exp(6.0 / 4) - 1))
    assert at3["kl"] == pytest.approx(0.2) and at3["top1"] == 0.75


def test_the_key_mean_row_keeps_the_page_and_gives_each_int2_layer_its_mean():
    row = study.ROWS_BY_NAME["half-key-mean"]
    assert row.page_bits(128, 30) == study.ROWS_BY_NAME["today"].page_bits(128, 30)
    key, value = study.hadamard_rotation_sets([0, 1, 2], 64)
    rot = study.OscarRotations(key, value)
    cos, sin = torch.ones(16, 64), torch.zeros(16, 64)
    means = {i: study.KeyMean(torch.full((3, 64), float(i)), cos, sin) for i in range(3)}
    specs = row.specs(rot, {1}, 3, means)
    assert specs[0].key_mean is means[0] and specs[2].key_mean is means[2]
    assert specs[1].key_quant.kind == "int4" and specs[1].key_mean is means[1]
    assert all(s.key_mean is None for s in study.ROWS_BY_NAME["debiased-half"].specs(rot, set(), 3, means).values())


def test_keys_per_channel_round_each_blocks_channels_on_their_own_range():
    """``ChannelBlockKeys``: every channel of every 64-position block on four levels between its own
    minimum and maximum there (fp16 parameters), the last block short; its rounding variance the
    step² / 12 of that channel and block; the page bits those of a scale and minimum per channel a block."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(150, 2, 8, generator=gen) * torch.arange(1, 9)  # channels of different ranges
    x[70, 1, 3] = 40.0  # one key that stands out: its channel's block only takes the wider range
    out, var = study.ChannelBlockKeys(64).quantize(x)
    assert out.shape == var.shape == x.shape
    for b0 in (0, 64, 128):
        blk = x[b0:b0 + 64]
        lo, hi = blk.amin(0), blk.amax(0)
        step = (hi - lo) / 3
        torch.testing.assert_close(var[b0], step.square() / 12, rtol=3e-3, atol=0)  # fp16 parameters
        got = out[b0:b0 + 64]
        level = (got - lo) / step  # on one of the channel's four levels, the nearest to the key
        torch.testing.assert_close(level, level.round().clamp(0, 3), rtol=0, atol=5e-3)
        assert ((got - blk).abs() <= step / 2 * 1.01 + 1e-3).all()
    assert (var[70, 1, 3] > 3 * max(var[10, 1, 3], var[130, 1, 3]) and var[10, 1, 3] == var[63, 1, 3]
            and var[70, 0, 3] < var[70, 1, 3])
    assert study.ROWS_BY_NAME["quarter-key-channels"].page_bits(64, 30) == 2.5
    assert study.ROWS_BY_NAME["quarter-key-channels"].page_bits(128, 30) == pytest.approx((2 + 0.5 + 2.25) / 2)
    assert study.ROWS_BY_NAME["quarter-key-channels-unrotated"].specs(
        study.OscarRotations(*study.hadamard_rotation_sets([0], 8)), set(), 1)[0].key_rotation is None


def test_values_less_their_mean_take_it_in_the_value_rotations_basis():
    """A value equal to its layer's mean, as the cache holds it (rotated by ``R_V``), comes back
    exactly: the mean goes in the rotated basis, where the rows are rounded."""
    key, value = study.hadamard_rotation_sets([0], 16)
    mean = torch.randn(2, 16, generator=torch.Generator().manual_seed(1)) * 3
    row = study.ROWS_BY_NAME["uncorrected-key-mean-16pairs-value-mean"]
    spec = row.specs(study.OscarRotations(key, value), set(), 1, {0: None}, {0: mean})[0]
    held = study.apply_rotation(mean, value.rotations[0]).expand(5, 2, 16)  # what the cache is given
    torch.testing.assert_close(spec.value_quant(held), held, rtol=0, atol=1e-6)
    assert (spec.value_quant.quant(held) - held).abs().max() > 0.1, "rounded whole, the same rows are not exact"
    assert (study.ValuesLessMean(spec.value_quant.quant, mean)(held) - held).abs().max() > 0.1, "nor in the wrong basis"


def test_clip_shift_rows_clip_each_key_row_at_more_sorted_entries_than_its_layers_ratio():
    """``half-clip-moreN``: each layer's fitted key ratio (a sorted-|x| index) moved N entries down,
    per KV head where the file has a ratio a head; values and INT4 layers keep theirs."""
    key, value = study.hadamard_rotation_sets([0, 1, 2], 64)
    rot = study.OscarRotations(key, value, [57.5 / 64, [56.5 / 64, 58.5 / 64], 0.9], [55.5 / 64] * 3)
    specs = study.ROWS_BY_NAME["half-clip-more2"].specs(rot, {2}, 3)
    assert clip_index(specs[0].key_quant.clip_ratio, 64) == 55
    assert [clip_index(r, 64) for r in specs[1].key_quant.clip_ratio] == [54, 56]
    assert specs[2].key_quant.kind == "int4"
    assert clip_index(specs[0].value_quant.clip_ratio, 64) == 55
    assert specs[0].logit_correction == 0.5
    x = torch.randn(9, 2, 64, generator=torch.Generator().manual_seed(0))
    clipped = specs[0].key_quant(x)
    top = x.abs().sort(-1).values
    # Nothing beyond the 56th smallest |x| survives (but the fp16 rounding of the stored range).
    assert (clipped.abs().amax(-1) <= top[..., 55] * (1 + 2**-9)).all()
    shipped = study.ROWS_BY_NAME["debiased-half"].specs(rot, set(), 3)
    assert clip_index(shipped[0].key_quant.clip_ratio, 64) == 57
    assert (shipped[0].key_quant(x).abs().amax(-1) > top[..., 56]).all()
