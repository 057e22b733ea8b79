"""OSCAR rotations in plain PyTorch: statistics, Hadamard, bit-reversal, ``R = U H P``.

Row-vector convention throughout: ``x_rot = x @ R`` for ``x`` of shape ``[..., d]``.
Statistics and eigendecompositions run in float64; rotations are returned in float64 and
stored in float32 by :mod:`oscar_vllm.core.rotation_io`.

Shapes: ``T`` tokens, ``Hq`` query heads, ``Hkv`` KV heads, ``g = Hq // Hkv``, ``d`` head dim.
"""

from __future__ import annotations

import math

import torch


def _check_power_of_two(n: int, what: str) -> None:
    if n < 1 or n & (n - 1):
        raise ValueError(f"{what} must be a power of two, got {n}")


def hadamard(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix ``[n, n]``: ``H_2n = [[H, H], [H, -H]] / sqrt(2)``."""
    _check_power_of_two(n, "Hadamard size")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(dtype)


def bit_reversal_permutation(d: int) -> torch.Tensor:
    """``br[i]`` = ``i`` with its ``log2(d)`` bits reversed (int64 ``[d]``)."""
    _check_power_of_two(d, "bit-reversal size")
    bits = d.bit_length() - 1
    i = torch.arange(d)
    out = torch.zeros_like(i)
    for b in range(bits):
        out |= ((i >> b) & 1) << (bits - 1 - b)
    return out


def eigen_bit_reversal_permutation(eigenvalues: torch.Tensor) -> torch.Tensor:
    """Column order of ``P_br``: ``perm[br[i]] = argsort(eigenvalues, descending)[i]``.

    Spreads the importance ranks over the channels so that every quantization group gets a
    share of each importance level. Works on ``[d]`` or batched ``[..., d]`` eigenvalues.
    """
    d = eigenvalues.shape[-1]
    order = torch.argsort(eigenvalues, dim=-1, descending=True)
    perm = torch.empty_like(order)
    perm[..., bit_reversal_permutation(d).to(order.device)] = order
    return perm


def rotation_from_moment(moment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``R = U · H · P_br`` from a second moment ``[d, d]`` or per head ``[H, d, d]``.

    ``U`` holds the eigenvectors of the symmetrized moment (float64 ``eigh``), ``H`` the
    orthonormal Hadamard, ``P_br = I[:, perm]``. Returns ``(R, eigenvalues)`` in float64;
    eigenvalues in ``eigh``'s ascending order, as the reference stores them.
    """
    m = moment.double()
    m = (m + m.transpose(-1, -2)) / 2
    eigenvalues, u = torch.linalg.eigh(m)
    uh = u @ hadamard(m.shape[-1]).to(m.device)
    perm = eigen_bit_reversal_permutation(eigenvalues)
    rot = torch.gather(uh, -1, perm.unsqueeze(-2).expand_as(uh))
    return rot, eigenvalues


def query_moments(queries: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Per KV head ``Q_hᵀ Q_h`` summed over tokens, unnormalized: float64 ``[Hkv, d, d]``.

    queries: ``[T, Hq, d]``; ``Q_h`` stacks the ``g`` query heads of group ``h`` as rows.
    Divide by ``T · g`` for the mean (sums let calibration stream over batches).
    """
    t, hq, d = queries.shape
    if hq % num_kv_heads:
        raise ValueError(f"{hq} query heads are not a multiple of {num_kv_heads} KV heads")
    q = queries.double().reshape(t, num_kv_heads, hq // num_kv_heads, d)
    return torch.einsum("thgi,thgj->hij", q, q)


def key_importance_weights(keys: torch.Tensor, qtq: torch.Tensor) -> torch.Tensor:
    """The shipped C_S proxy weights ``w_t = k_t · qtq_h · k_tᵀ``: float64 ``[T, Hkv]``.

    keys: ``[T, Hkv, d]``; qtq: per-head mean query moment ``[Hkv, d, d]``. It is the mean
    squared logit that token ``t`` receives: how strongly it is attended to, up to softmax.
    """
    k = keys.double().transpose(0, 1)  # [Hkv, T, d]
    return ((k @ qtq.double()) * k).sum(-1).transpose(0, 1)


def weighted_value_moments(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per KV head ``Σ_t w_t v_tᵀ v_t / T`` with ``w`` normalized to mean 1: ``[Hkv, d, d]``.

    values: ``[T, Hkv, d]``; weights: ``[T, Hkv]`` (non-negative).
    """
    t = values.shape[0]
    w = weights.double()
    w = w / w.sum(dim=0, keepdim=True).clamp(min=1e-12) * t
    v = values.double().transpose(0, 1)  # [Hkv, T, d]
    return (v * w.transpose(0, 1)[..., None]).transpose(-1, -2) @ v / t


def key_moment(qtq_sum: torch.Tensor, num_query_rows: int, per_head: bool) -> torch.Tensor:
    """``C_Q``: mean over KV heads of ``Q_hᵀQ_h / (T·g)`` (``[d, d]``), or per head ``[Hkv, d, d]``."""
    per_kv_head = qtq_sum.double() / num_query_rows
    return per_kv_head if per_head else per_kv_head.mean(dim=0)


def value_moment(
    values: torch.Tensor, weights: torch.Tensor, per_head: bool
) -> torch.Tensor:
    """``C_S``: score-weighted value moment, mean over KV heads or per head."""
    per_kv_head = weighted_value_moments(values, weights)
    return per_kv_head if per_head else per_kv_head.mean(dim=0)


def hadamard_rotation(head_dim: int) -> torch.Tensor:
    """The data-free rotation for ablations (QuaRot-like): ``R = H``."""
    return hadamard(head_dim)


def apply_rotation(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """``x @ R`` for ``x`` ``[..., H, d]`` with a shared ``[d, d]`` or per-head ``[H, d, d]`` R.

    With a per-head R of ``Hkv`` heads and ``x`` of ``Hq = g·Hkv`` heads (queries), query
    head ``i`` uses ``R[i // g]``, the rotation of its KV head.
    """
    r = rotation.to(x.dtype)
    if r.dim() == 2:
        return x @ r
    heads = x.shape[-2]
    if heads % r.shape[0]:
        raise ValueError(f"{heads} heads cannot share {r.shape[0]} per-head rotations")
    r = r.repeat_interleave(heads // r.shape[0], dim=0)
    return torch.einsum("...hi,hij->...hj", x, r)
