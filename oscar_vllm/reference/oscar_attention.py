"""Reference for ``csrc_triton/oscar_attention.py``: attention over the mixed paged cache."""
from __future__ import annotations

import torch

from oscar_vllm.quant import dequantize_int2, Int2Rows
from oscar_vllm.reference.oscar_write import window_index


def read_int2_slots(cache: torch.Tensor, slots: torch.Tensor, param_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized K and V (fp32 ``[N, Hkv, d]``) of cache slots ``slots`` ``[N]``."""
    hkv, nbytes = cache.shape[-2:]
    d = 2 * (nbytes - 8)
    raw = cache.view(-1, hkv, nbytes)[slots.long()]
    params = raw[..., d // 2 :].contiguous().view(param_dtype)  # [N, Hkv, 4]
    k = dequantize_int2(Int2Rows(raw[..., : d // 4], params[..., 0:1], params[..., 1:2]))
    v = dequantize_int2(Int2Rows(raw[..., d // 4 : d // 2], params[..., 2:3], params[..., 3:4]))
    return k, v


def oscar_attention_reference(
    q: torch.Tensor,
    q_rot: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    window_k: torch.Tensor,
    window_v: torch.Tensor,
    window_pos: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_q: torch.Tensor,
    ring_slots: torch.Tensor,
    num_reqs: int,
    scale: float,
    sink: int,
    recent: int,
    param_dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """fp32 ``[T, Hq, d]``: what :func:`csrc_triton.oscar_attention.oscar_attention` writes."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    block_size = cache.shape[1]
    out = torch.zeros(t, hq, d, dtype=torch.float32)
    for r in range(num_reqs):
        q0, q1 = int(cu_q[r]), int(cu_q[r + 1])
        if q1 == q0:
            continue
        ctx = int(seq_lens[r]) - (q1 - q0)
        kp = torch.arange(ctx)
        qpos = ctx + torch.arange(q1 - q0)
        slots = block_table[r].long().cpu()[kp // block_size] * block_size + kp % block_size
        k_lo, v_lo = read_int2_slots(cache.cpu(), slots, param_dtype)
        ring = int(ring_slots[r])
        idx = window_index(kp, sink, recent)
        held = window_pos[ring].long().cpu()[idx] == kp
        k_hi = window_k[ring].float().cpu()[idx]
        v_hi = window_v[ring].float().cpu()[idx]
        hi = held[None, :] & ((kp[None, :] < sink) | (qpos[:, None] - kp[None, :] < recent))  # [Tq, ctx]

        def heads(x: torch.Tensor) -> torch.Tensor:  # [N, Hkv, d] -> [Hq, N, d]
            return x.float().cpu().repeat_interleave(g, dim=1).transpose(0, 1)

        qr = q_rot[q0:q1].float().cpu().transpose(0, 1)  # [Hq, Tq, d]
        qq = q[q0:q1].float().cpu().transpose(0, 1)
        s_prefix = torch.where(hi, qr @ heads(k_hi).transpose(1, 2), qr @ heads(k_lo).transpose(1, 2))
        s_new = qq @ heads(k[q0:q1]).transpose(1, 2)
        causal = torch.arange(q1 - q0)[None, :] <= torch.arange(q1 - q0)[:, None]
        s_new = s_new.masked_fill(~causal, float("-inf"))
        p = torch.softmax(torch.cat([s_prefix, s_new], dim=-1) * scale, dim=-1)
        p_pre, p_new = p[..., :ctx], p[..., ctx:]
        o = (p_pre * hi) @ heads(v_hi) + (p_pre * ~hi) @ heads(v_lo) + p_new @ heads(v[q0:q1])
        out[q0:q1] = o.transpose(0, 1)
    return out
