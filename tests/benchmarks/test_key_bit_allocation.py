"""The key bit-allocation study's pieces: patterns, bases, the two stores and the fit."""
import pytest
import torch

from benchmarks.studies import key_bit_allocation as kb
from oscar_vllm.calibration.fit import LayerStats
from oscar_vllm.core.mixed_cache import RowQuantizer
from oscar_vllm.core.rotation import hadamard


def test_bit_patterns_spend_two_bits_a_direction_most_important_first():
    patterns = kb.bit_patterns(64)
    assert (2,) * 8 in patterns and (4, 4, 4, 4, 0, 0, 0, 0) in patterns
    for p in patterns:
        assert len(p) == 8 and sum(p) == 16 and list(p) == sorted(p, reverse=True)
        assert all(0 <= b <= kb.MAX_BITS for b in p)
    assert len(set(patterns)) == len(patterns)


@pytest.mark.parametrize("n", [8, 16, 24, 40, 56, 64])
def test_block_hadamard_is_orthonormal(n):
    h = kb.block_hadamard(n)
    torch.testing.assert_close(h @ h.T, torch.eye(n, dtype=h.dtype), atol=1e-12, rtol=0)


def skewed_layer(tokens: int, seed: int) -> LayerStats:
    """Queries with most of their energy in 8 of 64 directions (SmolLM2's hold 55-69% there),
    keys of unit variance but for 8 larger directions the queries barely read."""
    basis = torch.linalg.qr(torch.randn(64, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64))[0]
    g = torch.Generator().manual_seed(seed)  # calibration and held-out tokens: the same model, other samples
    energy = torch.cat([torch.full((8,), 30.0), torch.ones(40), torch.full((16,), 0.01)]).double()
    q = (torch.randn(tokens, 2, 64, generator=g, dtype=torch.float64) * energy.sqrt()) @ basis.T
    k = (torch.randn(tokens, 1, 64, generator=g, dtype=torch.float64)
         * torch.cat([torch.ones(56), torch.full((8,), 3.0)]).double()) @ basis.T
    stats = LayerStats(num_kv_heads=1)
    stats.add(q.float(), k.float(), torch.randn(tokens, 1, 64, generator=g))
    return stats


def test_fit_spends_bits_where_queries_look_and_beats_uniform_two_bits():
    calib, heldout = skewed_layer(2048, 0), skewed_layer(1024, 1)
    groups, one, f = kb.fit_layer(calib, heldout)
    assert f["pattern"][0] >= 3 and f["pattern"][-1] <= 1  # the queries' directions get more bits
    for store in (groups, one):
        torch.testing.assert_close(store.rotation.T @ store.rotation, torch.eye(64, dtype=torch.float64),
                                   atol=1e-10, rtol=0)
    # Today's way: one 2-bit min-max grid per row after a Hadamard (no clip).
    uniform = kb.logit_error(heldout, hadamard(64), RowQuantizer("int2", 0.0))
    assert f["groups_error"] < 0.2 * uniform
    assert f["one_scale_error"] < 0.3 * uniform
    assert f["groups_error"] <= f["one_scale_error"] * 1.5  # per-group ranges: the ceiling of the two
    assert one.row_bits() == 128 + 16 and groups.row_bits() > 128 + 32


@pytest.mark.parametrize("ratios", [None, "fitted"])
def test_the_rounding_variance_is_the_error_the_store_makes(ratios):
    """On data spread evenly over each group's grid, the variance the logit correction uses per
    element is the squared error the store actually makes (2 bits and up; 0 and 1 bit: their
    calibrated and Gaussian figures, within a factor of two)."""
    torch.manual_seed(0)
    calib, heldout = skewed_layer(2048, 2), skewed_layer(1024, 3)
    groups, one, _ = kb.fit_layer(calib, heldout)
    store = groups if ratios is None else one
    x = heldout.all_keys().double() @ store.rotation
    out, var = store.quantize(x.float())
    assert torch.isfinite(out).all() and (var >= 0).all()
    err = (out.double() - x).square()
    for cols, bits in store.groups:
        ratio = err[..., cols].mean() / var[..., cols].double().mean()
        if bits >= 2 and ratios is None:
            assert 0.7 < ratio < 1.3, (bits, ratio)
        else:
            assert 0.3 < ratio < 3.0, (bits, ratio)


def test_per_head_stores_fit_each_head_its_own_basis():
    """Two KV heads whose queries look along different directions: one basis per head finds both,
    a basis shared by the layer only their average, and makes more error."""
    a, b = skewed_layer(2048, 4), skewed_layer(1024, 5)
    flip = torch.linalg.qr(torch.randn(64, 64, generator=torch.Generator().manual_seed(9), dtype=torch.float64))[0]

    def two_heads(one: LayerStats, seed: int) -> LayerStats:
        g = torch.Generator().manual_seed(seed)
        q = torch.cat([one.qtq_sum, (flip.T @ one.qtq_sum[0] @ flip)[None]])  # head 1: the same queries, turned
        k = one.all_keys()
        stats = LayerStats(num_kv_heads=2, qtq_sum=q, query_rows=one.query_rows)
        stats.keys = [torch.cat([k, (k.double() @ flip).float()], dim=1)]
        stats.values = [torch.randn(k.shape[0], 2, 64, generator=g)]
        return stats

    calib, heldout = two_heads(a, 6), two_heads(b, 7)
    shared = kb.fit_layer(calib, heldout)[2]
    groups, one, per_head = kb.fit_layer_per_head(calib, heldout)
    assert groups.rotation.shape == (2, 64, 64) and len(per_head["patterns"]) == 2
    assert per_head["groups_error"] < 0.5 * shared["groups_error"]
    assert per_head["groups_error"] == pytest.approx(kb.logit_error(heldout, groups.rotation, groups), rel=1e-9)
    x = torch.randn(5, 2, 64)
    out, var = one.quantize(x)
    assert out.shape == var.shape == x.shape
    torch.testing.assert_close(out[:, 1], one.heads[1](x[:, 1]))
