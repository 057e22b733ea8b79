"""Rotation math: Hadamard, bit reversal, R = U·H·P, statistics against the reference's loops."""

import math

import pytest
import torch

from oscar_vllm.core.rotation import (
    apply_rotation,
    bit_reversal_permutation,
    eigen_bit_reversal_permutation,
    hadamard,
    hadamard_rotation,
    key_importance_weights,
    key_moment,
    query_moments,
    rotation_from_moment,
    value_moment,
    weighted_value_moments,
)


@pytest.mark.parametrize("n", [1, 2, 4, 64, 128, 256])
def test_hadamard_orthonormal_with_equal_magnitudes(n):
    h = hadamard(n)
    torch.testing.assert_close(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(h.abs(), torch.full((n, n), 1 / math.sqrt(n), dtype=torch.float64))


def test_hadamard_sylvester_order():
    assert (hadamard(2) * math.sqrt(2)).tolist() == [[1, 1], [1, -1]]
    h4 = hadamard(4) * 2
    assert h4.tolist() == [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]


@pytest.mark.parametrize("n", [0, 3, 96])
def test_power_of_two_required(n):
    with pytest.raises(ValueError, match="power of two"):
        hadamard(n)
    with pytest.raises(ValueError, match="power of two"):
        bit_reversal_permutation(n)


def test_bit_reversal():
    assert bit_reversal_permutation(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
    br = bit_reversal_permutation(128)
    assert torch.equal(br[br], torch.arange(128))
    assert int(bin(37)[2:].zfill(7)[::-1], 2) == br[37]


def test_eigen_permutation_matches_loop():
    torch.manual_seed(0)
    eig = torch.rand(64, dtype=torch.float64)
    order, br = torch.argsort(eig, descending=True), bit_reversal_permutation(64)
    expect = torch.zeros(64, dtype=torch.long)
    for i in range(64):
        expect[br[i]] = order[i]
    assert torch.equal(eigen_bit_reversal_permutation(eig), expect)


def random_moment(d, heads=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (heads, 4 * d, d) if heads else (4 * d, d)
    x = torch.randn(*shape, generator=g, dtype=torch.float64) * torch.linspace(0.1, 5, d, dtype=torch.float64)
    return x.transpose(-1, -2) @ x / x.shape[-2]


@pytest.mark.parametrize("d", [64, 128])
def test_rotation_is_u_h_p(d):
    c = random_moment(d)
    r, eig = rotation_from_moment(c)
    torch.testing.assert_close(r.T @ r, torch.eye(d, dtype=torch.float64), atol=1e-10, rtol=0)
    perm = eigen_bit_reversal_permutation(eig)
    p = torch.eye(d, dtype=torch.float64)[:, perm]
    u = r @ p.T @ hadamard(d).T  # undo P, then H
    # U's columns are eigenvectors of C with the eigenvalues eigh returned (ascending)
    torch.testing.assert_close(u.T @ c @ u, torch.diag(eig), atol=1e-9 * eig.max().item(), rtol=0)
    assert torch.all(eig[1:] >= eig[:-1])
    torch.testing.assert_close(eig, torch.linalg.eigvalsh(c))


def test_per_head_rotation_is_batched_single():
    c = random_moment(64, heads=3, seed=1)
    r, eig = rotation_from_moment(c)
    assert r.shape == (3, 64, 64) and eig.shape == (3, 64)
    for h in range(3):
        rh, eh = rotation_from_moment(c[h])
        torch.testing.assert_close(r[h], rh)
        torch.testing.assert_close(eig[h], eh)


@pytest.mark.parametrize("hq,hkv", [(8, 8), (9, 3), (8, 2), (8, 1)])
@pytest.mark.parametrize("per_head", [False, True])
def test_logits_are_invariant(hq, hkv, per_head):
    torch.manual_seed(hq * hkv)
    d, t = 64, 11
    r, _ = rotation_from_moment(random_moment(d, heads=hkv if per_head else None))
    q, k = torch.randn(t, hq, d, dtype=torch.float64), torch.randn(t, hkv, d, dtype=torch.float64)
    g = hq // hkv
    plain = torch.einsum("thd,shd->hts", q, k.repeat_interleave(g, 1))
    qr, kr = apply_rotation(q, r), apply_rotation(k, r)
    rotated = torch.einsum("thd,shd->hts", qr, kr.repeat_interleave(g, 1))
    torch.testing.assert_close(rotated, plain, atol=1e-10, rtol=1e-10)
    assert (kr - k).abs().max() > 0.1


def reference_c_q(q, hkv):
    """The reference's compute_qqt loop."""
    t, hq, d = q.shape
    g = hq // hkv
    cov = torch.zeros(d, d, dtype=torch.float64)
    for h in range(hkv):
        qg = q[:, h * g : (h + 1) * g].reshape(-1, d).double()
        cov += qg.T @ qg / qg.shape[0]
    return cov / hkv


def reference_c_s(q, k, v):
    """The reference's compute_sst loop."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    cov = torch.zeros(d, d, dtype=torch.float64)
    for h in range(hkv):
        qg = q[:, h * g : (h + 1) * g].reshape(-1, d).double()
        kh, vh = k[:, h].double(), v[:, h].double()
        qtq = qg.T @ qg / qg.shape[0]
        w = (kh @ qtq * kh).sum(1)
        w = w / w.sum().clamp(min=1e-12) * t
        vw = vh * w.unsqueeze(1).sqrt()
        cov += vw.T @ vw / t
    return cov / hkv


@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3), (8, 1)])
def test_statistics_match_reference_loops(hq, hkv):
    torch.manual_seed(7)
    t, d = 37, 64
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    qtq_sum = query_moments(q, hkv)
    c_q = key_moment(qtq_sum, t * hq // hkv, per_head=False)
    torch.testing.assert_close(c_q, reference_c_q(q, hkv))
    per_head_qtq = key_moment(qtq_sum, t * hq // hkv, per_head=True)
    c_s = value_moment(v, key_importance_weights(k, per_head_qtq), per_head=False)
    torch.testing.assert_close(c_s, reference_c_s(q, k, v))
    # per head: each head's moment is the single-head reference
    c_s_heads = value_moment(v, key_importance_weights(k, per_head_qtq), per_head=True)
    g = hq // hkv
    for h in range(hkv):
        torch.testing.assert_close(c_s_heads[h],
                                   reference_c_s(q[:, h * g : (h + 1) * g], k[:, h : h + 1], v[:, h : h + 1]))


def test_weights_are_normalized_to_mean_one():
    v = torch.randn(10, 2, 8)
    w = torch.rand(10, 2)
    torch.testing.assert_close(weighted_value_moments(v, w), weighted_value_moments(v, 5 * w))
    uniform = weighted_value_moments(v, torch.ones(10, 2))
    torch.testing.assert_close(uniform, torch.einsum("thi,thj->hij", v.double(), v.double()) / 10)


def test_query_heads_must_group():
    with pytest.raises(ValueError, match="multiple"):
        query_moments(torch.randn(3, 5, 8), 2)


def test_data_free_rotation_is_hadamard():
    assert torch.equal(hadamard_rotation(64), hadamard(64))
