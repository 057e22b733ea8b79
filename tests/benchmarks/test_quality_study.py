"""The quality study's arithmetic: bits per element of each row, and a context's figures read from
the first positions of longer windows."""
import math
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import quality_study as study  # noqa: E402


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
