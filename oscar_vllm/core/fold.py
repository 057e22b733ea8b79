"""Fold the value rotation into the weights: ``W_v <- R^T W_v`` (and ``b_v <- b_v R``) in
the qkv projection, ``W_o[:, head] <- W_o[:, head] R`` in the output projection. Values
then come out of the projection already rotated and the attention output goes back through
``o_proj`` unrotated, so the value path costs nothing at run time. Torch only."""
from __future__ import annotations

import torch


class RotationFoldError(RuntimeError):
    """The value rotation would be folded into weights that already hold it."""


def kv_heads_of_shard(total_kv_heads: int, tp_size: int, tp_rank: int) -> list[int]:
    """Global KV-head ids held by tensor-parallel rank ``tp_rank`` (vLLM's QKV sharding)."""
    if total_kv_heads >= tp_size:
        per = total_kv_heads // tp_size
        return list(range(tp_rank * per, (tp_rank + 1) * per))
    replicas = tp_size // total_kv_heads
    return [tp_rank // replicas]


def per_head(rot_v: torch.Tensor, kv_heads: list[int]) -> torch.Tensor:
    """fp32 ``[len(kv_heads), d, d]``: the rotation of each listed KV head."""
    r = rot_v.float()
    return r.expand(len(kv_heads), *r.shape) if r.dim() == 2 else r[kv_heads]


@torch.no_grad()
def fold_value_rotation(
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    o_weight: torch.Tensor,
    rot: torch.Tensor,
    num_q_heads: int,
    head_dim: int,
) -> None:
    """In place, on one shard: ``qkv_weight`` ``[(Hq + 2 Hkv) d, hidden]`` (q, k, v rows),
    ``o_weight`` ``[hidden, Hq d]``, ``rot`` ``[Hkv, d, d]`` for this shard's KV heads."""
    hkv, d = rot.shape[0], head_dim
    if qkv_weight.shape[0] != (num_q_heads + 2 * hkv) * d or o_weight.shape[1] != num_q_heads * d:
        raise ValueError(
            f"cannot fold: qkv {tuple(qkv_weight.shape)} / o_proj {tuple(o_weight.shape)} do not match "
            f"{num_q_heads} query heads, {hkv} KV heads of dim {d}"
        )
    r = rot.to(qkv_weight.device, torch.float32)
    v_rows = slice((num_q_heads + hkv) * d, (num_q_heads + 2 * hkv) * d)
    w_v = qkv_weight[v_rows].float().view(hkv, d, -1)
    qkv_weight[v_rows] = torch.einsum("hji,hjk->hik", r, w_v).reshape(hkv * d, -1).to(qkv_weight.dtype)
    if qkv_bias is not None:
        b_v = qkv_bias[v_rows].float().view(hkv, d)
        qkv_bias[v_rows] = torch.einsum("hj,hji->hi", b_v, r).reshape(-1).to(qkv_bias.dtype)
    g = num_q_heads // hkv
    r_q = r.repeat_interleave(g, dim=0)  # query head i reads KV head i // g
    w_o = o_weight.float().view(o_weight.shape[0], num_q_heads, d)
    o_weight.copy_(torch.einsum("ohj,hji->ohi", w_o, r_q).reshape(o_weight.shape).to(o_weight.dtype))
