"""The mixed-cache reference attention against a per-query brute force and plain SDPA."""

import math

import pytest
import torch

from oscar_vllm.core.mixed_cache import LayerCacheSpec, RowQuantizer, high_precision_mask, mixed_cache_attention
from oscar_vllm.core.rotation import apply_rotation, rotation_from_moment

EXACT = RowQuantizer("bf16")


def random_rotation(d, heads=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*((heads,) if heads else ()), 4 * d, d, generator=g, dtype=torch.float64)
    return rotation_from_moment(x.transpose(-1, -2) @ x)[0].float()


def brute_force(q, k, v, spec, sink, recent, window_dtype=torch.bfloat16, compute=torch.float32):
    """One query at a time: build exactly the K/V this query reads, then softmax."""
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    g = hq // hkv
    rk = spec.key_rotation if spec.key_rotation is not None else torch.eye(d)
    rv = spec.value_rotation if spec.value_rotation is not None else torch.eye(d)
    kr, vr, qr = (apply_rotation(x.to(compute), r) for x, r in ((k, rk), (v, rv), (q, rk)))
    k_hi, v_hi = kr.to(window_dtype).to(compute), vr.to(window_dtype).to(compute)
    k_lo, v_lo = spec.key_quant(kr).to(compute), spec.value_quant(vr).to(compute)
    out = torch.zeros(tq, hq, d, dtype=compute)
    for i in range(tq):
        t = tk - tq + i
        for h in range(hq):
            kv = h // g
            ks, vs = [], []
            for s in range(t + 1):
                hi = s < sink or t - s < recent
                ks.append((k_hi if hi else k_lo)[s, kv])
                vs.append((v_hi if hi else v_lo)[s, kv])
            p = torch.softmax(torch.stack(ks) @ qr[i, h] / math.sqrt(d), dim=0)
            out[i, h] = p @ torch.stack(vs)
    rv_t = rv.transpose(-1, -2)
    return apply_rotation(out, rv_t)


def int2_spec(d, hkv, per_head, seed=0):
    r_heads = hkv if per_head else None
    return LayerCacheSpec(
        random_rotation(d, r_heads, seed), random_rotation(d, r_heads, seed + 1),
        RowQuantizer("int2", 0.96), RowQuantizer("int2", 0.92),
    )


@pytest.mark.parametrize(
    "tq,tk,hq,hkv,sink,recent,block_q",
    [
        (13, 13, 4, 4, 2, 3, 512),  # odd length, MHA
        (21, 21, 6, 2, 4, 5, 8),  # GQA 3, several query blocks
        (5, 37, 8, 1, 4, 7, 2),  # a chunk at the end of a longer context, MQA
        (1, 40, 9, 3, 8, 16, 512),  # one decode step
        (17, 17, 4, 2, 0, 0, 4),  # no windows: everything quantized
        (17, 17, 4, 2, 64, 256, 512),  # windows cover everything
    ],
)
@pytest.mark.parametrize("per_head", [False, True])
def test_matches_brute_force(tq, tk, hq, hkv, sink, recent, block_q, per_head):
    torch.manual_seed(tq * 100 + tk)
    d = 16
    q, k, v = torch.randn(tq, hq, d), torch.randn(tk, hkv, d) * 2, torch.randn(tk, hkv, d)
    spec = int2_spec(d, hkv, per_head)
    out = mixed_cache_attention(q, k, v, spec, sink, recent, block_q=block_q)
    assert out.shape == (tq, hq, d)
    torch.testing.assert_close(out, brute_force(q, k, v, spec, sink, recent), atol=2e-5, rtol=1e-4)


def test_float64_inputs_are_computed_in_float64():
    """The evaluation's float64 mode, whose table does not depend on the CPU: nothing may be summed
    in fp32 (an fp32 sum would put the output ~1e-7 off the fp64 brute force)."""
    torch.manual_seed(7)
    d, hkv = 16, 2
    q, k, v = (torch.randn(21, h, d, dtype=torch.float64) for h in (6, hkv, hkv))
    spec = int2_spec(d, hkv, per_head=False)
    out = mixed_cache_attention(q, k, v, spec, 4, 5, block_q=8)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, brute_force(q, k, v, spec, 4, 5, compute=torch.float64), atol=1e-12, rtol=1e-12)


def sdpa(q, k, v):
    g = q.shape[1] // k.shape[1]
    tq, tk = q.shape[0], k.shape[0]
    mask = torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(g, 0), v.transpose(0, 1).repeat_interleave(g, 0),
        attn_mask=mask,
    ).transpose(0, 1)


@pytest.mark.parametrize("tq,tk", [(31, 31), (7, 50)])
def test_exact_cache_is_plain_attention_in_any_rotation(tq, tk):
    torch.manual_seed(1)
    q, k, v = torch.randn(tq, 8, 32), torch.randn(tk, 2, 32), torch.randn(tk, 2, 32)
    expect = sdpa(q, k, v)
    for rk, rv in ((None, None), (random_rotation(32), random_rotation(32, seed=3)), (random_rotation(32, 2), None)):
        spec = LayerCacheSpec(rk, rv, EXACT, EXACT)
        # windows over the whole context, kept in fp32: nothing is rounded
        out = mixed_cache_attention(q, k, v, spec, tk, tk, window_dtype=torch.float32, block_q=8)
        torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


def test_quantized_part_is_really_read():
    torch.manual_seed(2)
    q, k, v = torch.randn(40, 4, 32), torch.randn(40, 2, 32), torch.randn(40, 2, 32)
    spec = int2_spec(32, 2, per_head=False)
    windowed = mixed_cache_attention(q, k, v, spec, 4, 8)
    exact = mixed_cache_attention(q, k, v, LayerCacheSpec(spec.key_rotation, spec.value_rotation, EXACT, EXACT), 4, 8)
    # queries whose whole past is in the windows match; later ones differ
    torch.testing.assert_close(windowed[:12], exact[:12])
    assert (windowed[12:] - exact[12:]).abs().amax() > 1e-2


def test_window_mask():
    m = high_precision_mask(torch.arange(6), torch.arange(6), sink=1, recent=2)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    assert (m & causal).int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 0, 1, 1, 0, 0],
        [1, 0, 0, 1, 1, 0],
        [1, 0, 0, 0, 1, 1],
    ]


def test_window_mask_of_prefill_chunks():
    """Chunk [3, 6) reads its own keys in BF16 and the prefix as it stood at position 3."""
    pos = torch.arange(6)
    m = high_precision_mask(pos, pos, sink=1, recent=2, chunk_start=torch.tensor([0, 1, 2, 3, 3, 3]))
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    assert (m & causal).int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 0, 1, 1, 0, 0],
        [1, 0, 1, 1, 1, 0],
        [1, 0, 1, 1, 1, 1],
    ]


def test_bad_shapes():
    spec = LayerCacheSpec(None, None, EXACT, EXACT)
    with pytest.raises(ValueError, match="bad shapes"):
        mixed_cache_attention(torch.randn(4, 3, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8), spec, 0, 0)
    with pytest.raises(ValueError, match="quantizer kind"):
        RowQuantizer("int3")


def one_masked_softmax(q, k, v, spec, sink, recent, chunk_starts=None, logit_bias=None):
    """All keys at once: every query's BF16/quantized choice as one mask, one softmax;
    ``logit_bias`` ``[Hkv, g, Tq, Tk]`` added to the quantized keys' logits."""
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    g = hq // hkv
    kr, vr = apply_rotation(k, spec.key_rotation), apply_rotation(v, spec.value_rotation)
    qr = apply_rotation(q, spec.key_rotation).reshape(tq, hkv, g, d).permute(1, 2, 0, 3)
    k_hi, v_hi = (x.to(torch.bfloat16).float().transpose(0, 1)[:, None] for x in (kr, vr))
    k_lo, v_lo = spec.key_quant(kr).transpose(0, 1)[:, None], spec.value_quant(vr).transpose(0, 1)[:, None]
    pos = torch.arange(tk)
    hi = high_precision_mask(pos[tk - tq:], pos, sink, recent, chunk_starts)
    s_lo = qr @ k_lo.transpose(-1, -2) / math.sqrt(d) + (0 if logit_bias is None else logit_bias)
    s = torch.where(hi, qr @ k_hi.transpose(-1, -2) / math.sqrt(d), s_lo)
    p = torch.softmax(s.masked_fill(pos[None, :] > pos[tk - tq:, None], float("-inf")), dim=-1)
    out = (p * hi) @ v_hi + (p * ~hi) @ v_lo
    return apply_rotation(out.permute(2, 0, 1, 3).reshape(tq, hq, d), spec.value_rotation.transpose(-1, -2))


@pytest.mark.parametrize("tq,tk,sink,recent,block_q,chunk", [
    (300, 300, 4, 16, 64, 0),  # long context: most keys in the far part, several query blocks
    (100, 300, 0, 8, 32, 0),  # a late chunk, no sink
    (300, 300, 8, 16, 64, 48),  # prefill chunks of 48 tokens
    (300, 300, 8, 0, 64, 48),  # chunks without a ring
])
def test_far_keys_split_matches_one_masked_softmax(tq, tk, sink, recent, block_q, chunk):
    torch.manual_seed(tq + sink + chunk)
    d, hkv = 32, 2
    q, k, v = torch.randn(tq, 6, d), torch.randn(tk, hkv, d) * 2, torch.randn(tk, hkv, d)
    spec = int2_spec(d, hkv, per_head=False)
    pos = torch.arange(tk - tq, tk)
    starts = pos // chunk * chunk if chunk else None
    out = mixed_cache_attention(q, k, v, spec, sink, recent, block_q=block_q, chunk_starts=starts)
    torch.testing.assert_close(out, one_masked_softmax(q, k, v, spec, sink, recent, starts), atol=2e-5, rtol=1e-4)


def test_a_window_per_query_is_each_query_with_its_own_window():
    torch.manual_seed(5)
    d, hkv = 32, 2
    q, k, v = torch.randn(120, 4, d), torch.randn(120, hkv, d), torch.randn(120, hkv, d)
    spec = int2_spec(d, hkv, per_head=False)
    recent = torch.arange(120) // 4 + 3  # grows with the position
    out = mixed_cache_attention(q, k, v, spec, 4, recent, block_q=32)
    for t in (0, 37, 119):
        want = mixed_cache_attention(q[t:t + 1], k[:t + 1], v[:t + 1], spec, 4, int(recent[t]))
        torch.testing.assert_close(out[t:t + 1], want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out, one_masked_softmax(q, k, v, spec, 4, recent), atol=2e-5, rtol=1e-4)


def test_logit_correction_is_the_rounding_variance_taken_off_each_quantized_logit():
    torch.manual_seed(6)
    d, hkv, tk = 32, 2, 200
    q, k, v = torch.randn(tk, 4, d), torch.randn(tk, hkv, d) * 2, torch.randn(tk, hkv, d)
    for group in (None, 16):
        base = int2_spec(d, hkv, per_head=False)
        quant = RowQuantizer("int2", 0.96, group)
        plain = LayerCacheSpec(base.key_rotation, base.value_rotation, quant, base.value_quant)
        corrected = LayerCacheSpec(base.key_rotation, base.value_rotation, quant, base.value_quant,
                                   logit_correction=1.5)
        kr = apply_rotation(k, base.key_rotation)
        var = quant.rounding_variance(kr)  # [Tk, Hkv, G]
        assert var.shape == (tk, hkv, d // (group or d))
        qr = apply_rotation(q, base.key_rotation).reshape(tk, hkv, 2, 1, var.shape[-1], d // var.shape[-1])
        # The logit of query t for key s, as a dot product of the query with the dequantized key and
        # its variance: what the kernels would compute from the stored scales.
        norms = qr.square().sum(-1)[:, :, :, 0]  # [T, Hkv, g, G]: each query group's squared norm
        bias = torch.einsum("thgn,shn->hgts", norms, var)
        want = one_masked_softmax(q, k, v, plain, 4, 16, logit_bias=-0.75 * bias / d)
        got = mixed_cache_attention(q, k, v, corrected, 4, 16, block_q=64)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(mixed_cache_attention(q, k, v, plain, 4, 16, block_q=64),
                                   one_masked_softmax(q, k, v, plain, 4, 16), atol=2e-5, rtol=1e-4)


def test_logit_correction_takes_back_the_attention_that_rounding_noise_adds():
    """The quantized part of a long context draws more attention than the exact keys would
    (exp of a noisy logit is larger on average); the correction brings it back."""
    torch.manual_seed(7)
    d, tk, recent = 64, 2000, 1000  # as many exact keys as quantized ones: half the attention each
    q, k = torch.randn(1, 128, d), torch.randn(tk, 1, d)
    v = torch.zeros(tk, 1, d)
    v[: tk - recent, 0, 0] = 1  # output dim 0: the attention the quantized keys get
    exact = RowQuantizer("bf16")
    keys = {"exact": exact, "int2": RowQuantizer("int2", 0.96)}
    mass = {}
    for name, lam in (("exact", 0.0), ("int2", 0.0), ("corrected", 1.0)):
        spec = LayerCacheSpec(None, None, keys.get(name, keys["int2"]), exact, logit_correction=lam)
        mass[name] = mixed_cache_attention(q, k, v, spec, 0, recent, scale=0.25, window_dtype=torch.float32)[0, :, 0]
    over, left = ((mass[name] - mass["exact"]).mean() for name in ("int2", "corrected"))
    assert over > 0.02 and left.abs() < 0.5 * over, (over, left)  # a bias, not the per-query noise
