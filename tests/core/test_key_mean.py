"""Keys rounded less their mean before RoPE: the RoPE helpers, the mean's estimate, and the
reference cache adding the mean back where it reads a 2-bit key."""

import math

import pytest
import torch

from oscar_vllm.core.key_mean import (
    SERVED_BLOCK, SERVED_PAIRS, KeyMean, block_average, pre_rope_mean, rope, served_block_mean, served_pairs,
    strongest_pairs, unrope,
)
from oscar_vllm.core.mixed_cache import LayerCacheSpec, RowQuantizer, mixed_cache_attention

D, HKV = 64, 2


def random_rotation(d: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0].float()


def rope_table(positions: int, d: int = D, base: float = 10_000.0):
    """cos/sin [P, d] in the rotate-half form, as transformers' rotary embeddings return them."""
    inv_freq = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * inv_freq[None]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def test_rope_turns_each_pair_by_its_angle_and_unrope_undoes_it():
    cos, sin = rope_table(300)
    x = torch.randn(300, HKV, D)
    y = rope(x, cos[:, None], sin[:, None])
    # dims i and i + d/2 form a pair, turned as a complex number by position x frequency i
    pairs = torch.complex(x[..., : D // 2].double(), x[..., D // 2:].double())
    angles = torch.atan2(sin[:, : D // 2].double(), cos[:, : D // 2].double())[:, None]
    want = pairs * torch.exp(1j * angles)
    torch.testing.assert_close(y, torch.cat([want.real, want.imag], -1).float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(unrope(y, cos[:, None], sin[:, None]), x, atol=1e-5, rtol=1e-5)


def test_the_mean_at_each_position_is_the_mean_turned_there():
    cos, sin = rope_table(50)
    mean = torch.randn(HKV, D)
    at = KeyMean(mean, cos, sin).at(37)
    assert at.shape == (37, HKV, D)
    torch.testing.assert_close(at[0], mean)  # position 0 is not turned
    torch.testing.assert_close(unrope(at, cos[:37, None], sin[:37, None]), mean.expand(37, -1, -1),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="covers 50 positions, position 50 asked for"):
        KeyMean(mean, cos, sin).at(51)
    with pytest.raises(ValueError, match=r"\[Hkv, d\]"):
        KeyMean(mean[0], cos, sin)


def test_the_estimate_finds_the_mean_before_rope_past_the_sink():
    g = torch.Generator().manual_seed(1)
    cos, sin = rope_table(1000)
    mean = 3 * torch.randn(HKV, D, generator=g)
    seqs = []
    for t in (1000, 613):
        pre = mean + 0.5 * torch.randn(t, HKV, D, generator=g)
        pre[:16] = 40.0  # sink keys unlike the rest: left out
        seqs.append(rope(pre, cos[:t, None], sin[:t, None]))
    est = pre_rope_mean(seqs, cos, sin, skip=16)
    assert est.dtype == torch.float64 and est.shape == (HKV, D)
    assert (est.float() - mean).abs().max() < 0.1  # 0.5 / sqrt(1581) ~ 0.013 per entry
    assert (pre_rope_mean(seqs, cos, sin, skip=0).float() - mean).abs().max() > 0.5
    with pytest.raises(ValueError, match="covers 600 positions"):
        pre_rope_mean(seqs, cos[:600], sin[:600], skip=16)


def exact_attention(q, k, v, r):
    """Every key and value read as it is, in fp32."""
    spec = LayerCacheSpec(r, r, RowQuantizer("bf16"), RowQuantizer("bf16"))
    return mixed_cache_attention(q, k, v, spec, k.shape[0], 1, window_dtype=torch.float32)


def keys_around_a_mean(t: int, noise: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cos, sin = rope_table(t)
    mean = 4 * torch.randn(HKV, D, generator=g)
    k = rope(mean + noise * torch.randn(t, HKV, D, generator=g), cos[:, None], sin[:, None])
    q = torch.randn(t, 2 * HKV, D, generator=g)
    v = torch.randn(t, HKV, D, generator=g)
    return q, k, v, KeyMean(mean, cos, sin)


@pytest.mark.parametrize("t", [97, 700])
def test_rounding_less_the_mean_keeps_what_a_key_adds_to_the_mean(t):
    """Keys that are mostly the mean: 2-bit rows of the whole key lose what each adds to it; rows
    of the key less the mean keep it, at every position RoPE turned the mean to."""
    q, k, v, key_mean = keys_around_a_mean(t, noise=0.3)
    r = random_rotation(D)
    exact = exact_attention(q, k, v, r)

    def error(mean):
        spec = LayerCacheSpec(r, r, RowQuantizer("int2"), RowQuantizer("bf16"), 0.5, mean)
        out = mixed_cache_attention(q, k, v, spec, 16, 32, window_dtype=torch.float32)
        return ((out - exact).norm() / exact.norm()).item()

    assert error(None) > 0.3
    assert error(key_mean) < 0.1
    zero = KeyMean(torch.zeros(HKV, D), key_mean.cos, key_mean.sin)
    assert error(zero) == error(None)


def test_keys_equal_to_their_mean_are_read_exactly_and_not_corrected():
    """A key that is its mean rounds to zero rows (scale 0): read exactly, and the logit correction,
    from the rounded rows' scale, takes nothing off (from the whole key's, it would)."""
    q, k, v, key_mean = keys_around_a_mean(200, noise=0.0)
    r = random_rotation(D, seed=3)
    exact = exact_attention(q, k, v, r)
    spec = LayerCacheSpec(r, r, RowQuantizer("int2"), RowQuantizer("bf16"), 1.0, key_mean)
    out = mixed_cache_attention(q, k, v, spec, 8, 16, window_dtype=torch.float32)
    torch.testing.assert_close(out, exact, atol=5e-3, rtol=5e-3)
    assert math.isfinite(out.abs().max().item())


def test_the_strongest_pairs_keep_both_dims_of_each_pair_and_nothing_else():
    mean = torch.zeros(2, 8)
    mean[0, [1, 5]] = torch.tensor([3.0, -4.0])  # pair 1: energy 25
    mean[0, [2, 6]] = torch.tensor([1.0, 1.0])  # pair 2: energy 2
    mean[0, 0] = 2.0  # pair 0: energy 4
    mean[1, [3, 7]] = torch.tensor([0.5, 0.5])
    kept = strongest_pairs(mean, 2)
    assert kept[0].tolist() == [2.0, 3.0, 0, 0, 0, -4.0, 0, 0]
    torch.testing.assert_close(kept[1], mean[1])  # one pair with energy: kept, the rest zero either way
    torch.testing.assert_close(strongest_pairs(mean, 4), mean)
    with pytest.raises(ValueError, match="5 pairs asked for of 4"):
        strongest_pairs(mean, 5)
    # as served: at most that many pairs, all of a head that has fewer, 0 for all
    assert served_pairs(mean, 2).tolist() == kept.tolist()
    assert served_pairs(mean, 16).tolist() == mean.tolist()
    assert served_pairs(mean, 0) is mean


def test_vllms_table_turns_the_mean_as_the_models_table_does():
    """vLLM's ``cos_sin_cache`` holds each position's d/2 cosines then sines; read as such it turns
    the mean at any positions as the repeated-halves table does."""
    cos, sin = rope_table(50)
    mean = torch.randn(HKV, D)
    vllm_cache = torch.cat([cos[:, : D // 2], sin[:, : D // 2]], dim=-1)
    pos = torch.tensor([0, 7, 49, 7, 3])
    got = KeyMean.from_cos_sin_cache(mean, vllm_cache).turned(pos)
    torch.testing.assert_close(got, KeyMean(mean, cos, sin).at(50)[pos])


def test_shared_strongest_pairs_are_the_same_for_every_head():
    mean = torch.zeros(2, 8)
    mean[0, 0], mean[0, 1], mean[1, 2], mean[1, 6] = 3.0, 1.0, 2.5, 2.5  # pairs (i, i + 4)
    own = strongest_pairs(mean, 1)
    assert own[0].nonzero().flatten().tolist() == [0] and own[1].nonzero().flatten().tolist() == [2, 6]
    shared = strongest_pairs(mean, 1, shared=True)  # pair 2 holds 12.5 over both heads, pair 0 9
    assert shared[0].abs().sum() == 0 and shared[1].nonzero().flatten().tolist() == [2, 6]


def test_a_block_mean_is_one_vector_a_block_turned_to_its_first_position():
    cos, sin = rope_table(300)
    mean = torch.randn(HKV, D)
    blocked = KeyMean(mean, cos, sin, block=64)
    at = blocked.at(300)
    for p0 in range(0, 300, 64):
        torch.testing.assert_close(at[p0:p0 + 64], at[p0].expand_as(at[p0:p0 + 64]))
        torch.testing.assert_close(at[p0], KeyMean(mean, cos, sin).turned(torch.tensor([p0]))[0])


@pytest.mark.parametrize("scale", [1.0, 1.3], ids=["plain", "yarn-scaled"])
def test_the_block_average_is_the_mean_averaged_over_each_blocks_positions(scale):
    """Turned to a block's first position, the block average is the mean's average over the block's
    positions, for every block (RoPE composes), and no other vector a block shares is nearer to its
    keys' means. A table whose pairs carry a scale (YaRN's) is divided by it once."""
    cos, sin = rope_table(640, base=1000.0)
    cos, sin = cos * scale, sin * scale
    mean = torch.randn(HKV, D, dtype=torch.float64)
    exact = KeyMean(mean, cos.double(), sin.double()).at(640).double()  # [P, Hkv, d]
    average = block_average(mean, cos.double(), sin.double(), 64)
    blocked = KeyMean(average, cos.double(), sin.double(), block=64).at(640).double()
    for p0 in (0, 64, 576):
        want = exact[p0:p0 + 64].mean(0)
        torch.testing.assert_close(blocked[p0], want, atol=1e-5 * scale, rtol=1e-5)
        left = (exact[p0:p0 + 64] - blocked[p0]).square().sum()
        for shift in (0.05, -0.05):
            assert (exact[p0:p0 + 64] - blocked[p0] * (1 + shift)).square().sum() > left
    # a pair that turns a whole circle over a block keeps nothing of its mean; a slow one nearly all
    theta = 1000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    kept = average[..., : D // 2].square() + average[..., D // 2:].square()
    energy = mean[..., : D // 2].square() + mean[..., D // 2:].square()
    assert bool((kept[:, theta > 0.5] < 0.01 * energy[:, theta > 0.5]).all())
    assert bool((kept[:, theta < 0.002] > 0.99 * energy[:, theta < 0.002]).all())
    with pytest.raises(ValueError, match="block of 700 positions, the RoPE table covers 640"):
        block_average(mean, cos, sin, 700)


def test_served_block_mean_takes_vllms_table_and_keeps_each_heads_strongest_pairs():
    cos, sin = rope_table(128)
    mean = torch.randn(HKV, D)
    vllm_cache = torch.cat([cos[:, : D // 2], sin[:, : D // 2]], dim=-1)
    served = served_block_mean(mean, vllm_cache, 64, 4)
    torch.testing.assert_close(served, strongest_pairs(block_average(mean, cos, sin, 64), 4))
    assert ((served[:, : D // 2] != 0) | (served[:, D // 2:] != 0)).sum(-1).tolist() == [4] * HKV


def test_what_the_reference_serves_is_what_the_kernels_add():
    from csrc_triton.paged_layout import BLOCK_SIZE, KEY_MEAN_BLOCK, KEY_MEAN_PAIRS

    assert (SERVED_PAIRS, SERVED_BLOCK) == (KEY_MEAN_PAIRS, BLOCK_SIZE) == (KEY_MEAN_PAIRS, KEY_MEAN_BLOCK.value)
