"""benchmarks/studies/clip_fit_weights.py: the weighted fit is the calibration's fit when every key
weighs the same, and a weight on the keys a clip hurts lightens the clip."""
from functools import partial

import pytest
import torch

from benchmarks.studies import clip_fit_weights as cfw
from oscar_vllm.calibration.fit import LayerErrorMeasure, LayerStats, best_clip_ratio, fit_clip_ratios
from oscar_vllm.core.rotation_io import KEY, VALUE, RotationSet

D, HKV, G = 16, 2, 2


def stats(seed: int, lengths=(40, 33)) -> LayerStats:
    g = torch.Generator().manual_seed(seed)
    st = LayerStats(HKV)
    for t in lengths:
        q, k, v = (torch.randn(t, h, D, generator=g) for h in (HKV * G, HKV, HKV))
        st.add(q, k, v, score_weights=torch.rand(t, HKV, generator=g))
    return st


def rotation_sets(seed: int) -> tuple[RotationSet, RotationSet]:
    g = torch.Generator().manual_seed(seed)
    rk, rv = (torch.linalg.qr(torch.randn(D, D, generator=g, dtype=torch.float64))[0].float() for _ in range(2))
    return (RotationSet(KEY, "test", {0: rk}, {0: torch.ones(D)}),
            RotationSet(VALUE, "test", {0: rv}, {0: torch.ones(D)}))


def test_uniform_weights_give_the_calibrations_error_and_ratio():
    st, (key, value) = stats(0), rotation_sets(1)
    em = LayerErrorMeasure.build(st, key.rotations[0], value.rotations[0])
    delta = torch.randn(em.keys.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ones = torch.ones(em.keys.shape[:2], dtype=torch.float64)
    assert em.key_error(delta, weights=ones) == pytest.approx(em.key_error(delta), rel=1e-12)
    ratios_k, _, _ = fit_clip_ratios(key, value, {0: st})
    assert cfw.fitted_ratios(st, key.rotations[0], value.rotations[0], sink=0)["uniform"] == ratios_k[0]


def test_the_sink_is_left_out_of_every_fit():
    st, (key, value) = stats(3), rotation_sets(4)
    assert cfw.past_sink(st, 5).tolist() == [i >= 5 for i in range(40)] + [i >= 5 for i in range(33)]
    # Keys past the sink alone, the sink's rows replaced: the same ratios.
    changed = LayerStats(HKV, st.qtq_sum, st.query_rows, [k.clone() for k in st.keys], st.values, st.score_weights)
    for k in changed.keys:
        k[:5] = 1000.0
    assert cfw.fitted_ratios(changed, key.rotations[0], value.rotations[0], sink=5) == \
        cfw.fitted_ratios(st, key.rotations[0], value.rotations[0], sink=5)


def test_weight_on_the_outlier_keys_lightens_the_clip():
    d = 64  # rows long enough that a uniform fit clips Gaussian entries
    g = torch.Generator().manual_seed(5)
    keys = torch.randn(512, 1, d, generator=g, dtype=torch.float64)
    outliers = torch.arange(0, 512, 16)
    keys[outliers, 0, 3] = 12.0  # one entry that sets these keys apart
    em = LayerErrorMeasure(keys, keys, torch.eye(d, dtype=torch.float64)[None], torch.ones(512, 1))
    uniform = torch.ones(512, 1, dtype=torch.float64)
    read = torch.full((512, 1), 1e-3, dtype=torch.float64)
    read[outliers] = 1.0
    read = read / read.mean()
    r_uniform = best_clip_ratio(keys, partial(em.key_error, weights=uniform), None, torch.float16)[0]
    r_read = best_clip_ratio(keys, partial(em.key_error, weights=read), None, torch.float16)[0]
    assert r_read > r_uniform
