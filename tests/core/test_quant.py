"""The reference quantizers against hand-computed cases, the reference's own formula, and
round trips."""

import pytest
import torch

from oscar_vllm.core.quant import (
    Int2Rows,
    clip_index,
    clip_rows,
    dequantize_int2,
    fake_quantize_int2,
    fake_quantize_int4,
    fake_quantize_naive_int2,
    minmax_quantize,
    pack_int2,
    param_dtype_from_name,
    quantize_int2,
    unpack_int2,
)


def reference_int2(x: torch.Tensor, clip_ratio: float) -> torch.Tensor:
    """The OSCAR reference's simulate path, written as it is there: sort, clamp, truncate."""
    x = x.float()
    idx = clip_index(clip_ratio, x.shape[-1])
    if idx >= 0:
        thr = x.abs().sort(-1).values[..., idx : idx + 1]
        x = torch.minimum(torch.maximum(x, -thr), thr)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = (hi - lo).clamp(min=1e-8) / 3
    zero = -lo / scale
    q = (x / scale + zero + 0.5).to(torch.int32).clamp(0, 3)
    return (q.float() - zero) * scale


def test_hand_computed_int2_codes_packing_and_dequant():
    x = torch.tensor([[-1.0, 0.0, 0.5, 2.0]])
    q = quantize_int2(x, clip_ratio=0.0, param_dtype=torch.float32)
    # scale = 3/3 = 1, zero = 1: codes floor([0.5, 1.5, 2.0, 3.5]) = [0, 1, 2, 3]
    assert q.packed.tolist() == [[0 | 1 << 2 | 2 << 4 | 3 << 6]]
    assert q.scale.tolist() == [[1.0]] and q.bias.tolist() == [[-1.0]]
    assert dequantize_int2(q).tolist() == [[-1.0, 0.0, 1.0, 2.0]]


def test_round_half_up_like_the_reference():
    codes, scale, bias = minmax_quantize(torch.tensor([[0.0, 0.5, 1.5, 3.0]]), bits=2)
    assert codes.tolist() == [[0, 1, 2, 3]]  # 0.5 and 1.5 round up
    assert scale.item() == 1.0 and bias.item() == 0.0


def test_clip_index_and_threshold():
    assert clip_index(0.96, 128) == 122
    assert clip_index(0.92, 128) == 117
    assert clip_index(0.96, 64) == 61
    assert clip_index(1.0, 64) == 63
    assert clip_index(0.0, 64) == -1
    x = torch.tensor([[1.0, -2.0, 3.0, -4.0, 5.0, -6.0, 7.0, -100.0]])
    # ratio 0.75 on d=8: index 6 of sorted |x| = 7, so -100 becomes -7
    assert clip_rows(x, 0.75).tolist() == [[1.0, -2.0, 3.0, -4.0, 5.0, -6.0, 7.0, -7.0]]
    assert torch.equal(clip_rows(x, 0.0), x)


def test_per_head_clip_ratios_clip_each_head_as_its_own_ratio():
    torch.manual_seed(0)
    x = torch.randn(5, 3, 16) * torch.tensor([1.0, 4.0, 0.5])[:, None]  # [T, heads, d]
    ratios = (0.8, 0.95, 0.0)
    clipped = clip_rows(x, ratios)
    for h, r in enumerate(ratios):
        assert torch.equal(clipped[:, h], clip_rows(x[:, h], r))
    assert torch.equal(fake_quantize_int2(x, ratios)[:, 1], fake_quantize_int2(x[:, 1], 0.95))
    with pytest.raises(ValueError, match="2 per-head clip ratios for rows of shape"):
        clip_rows(x, (0.9, 0.9))


def test_quartered_layout():
    codes = torch.tensor([[0, 1, 2, 3, 3, 2, 1, 0]], dtype=torch.uint8)  # d = 8: bytes hold dims j, j+2, j+4, j+6
    packed = pack_int2(codes)
    expect = [codes[0, j] | codes[0, j + 2] << 2 | codes[0, j + 4] << 4 | codes[0, j + 6] << 6 for j in range(2)]
    assert packed.tolist() == [[int(b) for b in expect]]


@pytest.mark.parametrize("shape", [(1, 4), (3, 64), (2, 5, 128), (7, 3, 256)])
def test_pack_unpack_round_trip(shape):
    codes = torch.randint(0, 4, shape, dtype=torch.uint8)
    packed = pack_int2(codes)
    assert packed.shape == (*shape[:-1], shape[-1] // 4) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int2(packed), codes)


def test_pack_rejects_bad_head_dim():
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_int2(torch.zeros(2, 6, dtype=torch.uint8))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("clip", [0.0, 0.92, 0.96])
def test_matches_reference_formula_with_fp32_params(d, clip):
    torch.manual_seed(d)
    x = torch.randn(257, d) * torch.rand(257, 1) * 4 + torch.randn(257, 1)
    torch.testing.assert_close(fake_quantize_int2(x, clip, param_dtype=torch.float32), reference_int2(x, clip),
                               atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("group_div", [1, 2, 4])
@pytest.mark.parametrize("dtype_name", ["fp16", "bf16", "fp32"])
def test_error_bounded_by_half_step(group_div, dtype_name):
    torch.manual_seed(0)
    d = 128
    x = torch.randn(3, 33, d) * 3
    dtype = param_dtype_from_name(dtype_name)
    q = quantize_int2(x, 0.96, group_size=d // group_div, param_dtype=dtype)
    assert q.scale.shape == (3, 33, group_div) and q.scale.dtype == dtype and q.bias.dtype == dtype
    xc = clip_rows(x, 0.96)
    step = q.scale.float().repeat_interleave(d // group_div, -1)
    # half a step, plus what rounding the parameters to 16 bits can move
    slack = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 1.6e-2}[dtype_name] * (xc.abs().amax(-1, keepdim=True) + step)
    err = (dequantize_int2(q) - xc).abs()
    assert (err <= step / 2 + slack).all()
    assert err.mean() > 0.01  # it really quantized


def test_groups_have_their_own_range():
    x = torch.cat([torch.linspace(-1, 1, 32), torch.linspace(-100, 100, 32)])[None]
    coarse = (fake_quantize_int2(x, 0.0, group_size=64) - x)[0, :32].abs().max()
    fine = (fake_quantize_int2(x, 0.0, group_size=32) - x)[0, :32].abs().max()
    assert fine < 0.5 and coarse > 10 * fine


def test_near_constant_rows_stay_finite_in_16_bit():
    x = torch.full((4, 64), 5.0)
    x[1] += torch.linspace(0, 1e-6, 64)
    for dtype in (torch.float16, torch.bfloat16):
        out = fake_quantize_int2(x, 0.96, param_dtype=dtype)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, x, atol=0.02, rtol=0)


def test_unknown_scale_dtype():
    with pytest.raises(ValueError, match="scale dtype"):
        param_dtype_from_name("fp8")


def test_int4_hand_case_and_bound():
    x = torch.tensor([[0.0, 1.0, 7.0, 15.0]])
    assert fake_quantize_int4(x, param_dtype=torch.float32).tolist() == x.tolist()  # scale 1: exact
    y = torch.randn(100, 64)
    step = (y.amax(-1, keepdim=True) - y.amin(-1, keepdim=True)) / 15
    assert ((fake_quantize_int4(y) - y).abs() <= step / 2 + 1e-2 * step).all()


def test_naive_int2_levels():
    x = torch.tensor([[-3.0, -1.0, 0.2, 3.0]])  # amax 3: levels +-1, +-3
    assert fake_quantize_naive_int2(x, torch.float32).tolist() == [[-3.0, -1.0, 1.0, 3.0]]
    y = torch.randn(50, 64)
    out = fake_quantize_naive_int2(y, torch.float32)
    assert out.unique().numel() <= 4 * 50


def test_int2_rows_is_what_the_cache_stores():
    q = quantize_int2(torch.randn(2, 3, 64), 0.96)
    assert isinstance(q, Int2Rows)
    assert q.packed.shape == (2, 3, 16) and q.scale.shape == (2, 3, 1)
