"""Reference for ``csrc_triton/oscar_attention.py``: attention over the mixed paged cache."""
from __future__ import annotations

import torch

from oscar_vllm.core.key_mean import KeyMean
from oscar_vllm.core.quant import dequantize_int2, Int2Rows
from oscar_vllm.reference.oscar_write import window_index
from oscar_vllm.reference.paged import (
    BatchLike,
    MixedCacheLike,
    block_size_of,
    layout_views,
    read_ring,
    rotated_key_mean,
    v_column,
)


def read_int2_slots(cache: torch.Tensor, slots: torch.Tensor, head_dim: int,
                    param_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized K and V (fp32 ``[N, Hkv, d]``) of cache slots ``slots`` ``[N]``."""
    k_codes, v_codes, params = layout_views(cache, head_dim, param_dtype)
    bs = k_codes.shape[2]
    slots = slots.long().to(cache.device)
    blk, tok = slots // bs, slots % bs
    p = params[blk, :, :, tok]  # [N, Hkv, 4]
    k = dequantize_int2(Int2Rows(k_codes[blk, :, tok], p[..., 0:1], p[..., 1:2]))
    v = dequantize_int2(Int2Rows(v_codes[blk, :, :, v_column(tok)], p[..., 2:3], p[..., 3:4]))
    return k.cpu(), v.cpu()


def read_int2_key_scales(cache: torch.Tensor, slots: torch.Tensor, head_dim: int,
                         param_dtype: torch.dtype) -> torch.Tensor:
    """The stored K scale (one group per head) of cache slots ``slots`` ``[N]``: fp32 ``[N, Hkv]``."""
    _, _, params = layout_views(cache, head_dim, param_dtype)
    bs = params.shape[-1]
    slots = slots.long().to(cache.device)
    return params[slots // bs, :, 0, slots % bs].float().cpu()


def logit_correction_bias(q: torch.Tensor, k_scale: torch.Tensor, logit_correction: float, scale: float
                          ) -> torch.Tensor:
    """What the logit correction subtracts from natural-log logits against INT2 keys:
    ``λ/2 · scale² · ‖q‖² · s_k²/12``, ``[Hq, Tq, N]`` for queries ``q`` ``[Hq, Tq, d]`` and key
    scales ``k_scale`` ``[N, Hq]`` (per query head)."""
    q_sq = q.float().square().sum(-1)  # [Hq, Tq]
    return (0.5 * logit_correction * scale * scale / 12) * q_sq[..., None] * k_scale.float().square().T[:, None, :]


def oscar_attention_reference(
    q: torch.Tensor,
    q_rot: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cache: MixedCacheLike,
    batch: BatchLike,
    scale: float,
    logit_correction: float = 0.0,
    key_mean: KeyMean | None = None,
    rot_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 ``[T, Hq, d]``: what :func:`oscar_vllm.serving.prefill.oscar_attention` writes through
    the INT2 kernels (the prefix's INT2 keys' logits lowered by ``logit_correction_bias``; with
    ``key_mean``, its INT2 keys read plus their mean turned to their positions, rotated by ``rot_k``)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    sink, recent, param_dtype = cache.sink, cache.recent, cache.param_dtype
    bs = block_size_of(cache.pages, d)
    out = torch.zeros(t, hq, d, dtype=torch.float32)
    for r in range(batch.num_reqs):
        q0, q1 = int(batch.cu_q[r]), int(batch.cu_q[r + 1])
        if q1 == q0:
            continue
        ctx = int(batch.seq_lens[r]) - (q1 - q0)
        kp = torch.arange(ctx)
        slots = batch.block_table[r].long().cpu()[kp // bs] * bs + kp % bs
        k_lo, v_lo = read_int2_slots(cache.pages, slots, d, param_dtype)
        if key_mean is not None:
            k_lo = k_lo + rotated_key_mean(key_mean, rot_k, kp)
        ring = int(batch.ring_slots[r])
        idx = window_index(kp, sink, recent)
        held = cache.window_pos[ring].long().cpu()[idx] == kp
        k_hi, v_hi = read_ring(cache.windows, cache.window_pages, ring, idx, hkv, d, sink)
        # The window as the step finds it, the same for every query of a chunk.
        hi = (held & ((kp < sink) | (ctx - kp < recent)))[None, :]  # [1, ctx]

        def heads(x: torch.Tensor) -> torch.Tensor:  # [N, Hkv, d] -> [Hq, N, d]
            return x.float().cpu().repeat_interleave(g, dim=1).transpose(0, 1)

        qr = q_rot[q0:q1].float().cpu().transpose(0, 1)  # [Hq, Tq, d]
        qq = q[q0:q1].float().cpu().transpose(0, 1)
        s_lo = (qr @ heads(k_lo).transpose(1, 2)) * scale
        if logit_correction:
            k_scale = read_int2_key_scales(cache.pages, slots, d, param_dtype).repeat_interleave(g, dim=1)
            s_lo = s_lo - logit_correction_bias(qr, k_scale, logit_correction, scale)
        s_prefix = torch.where(hi, (qr @ heads(k_hi).transpose(1, 2)) * scale, s_lo)
        s_new = (qq @ heads(k[q0:q1]).transpose(1, 2)) * scale
        causal = torch.arange(q1 - q0)[None, :] <= torch.arange(q1 - q0)[:, None]
        s_new = s_new.masked_fill(~causal, float("-inf"))
        p = torch.softmax(torch.cat([s_prefix, s_new], dim=-1), dim=-1)
        p_pre, p_new = p[..., :ctx], p[..., ctx:]
        # Chosen, not masked by a product: ring entries nobody wrote may hold anything (NaN).
        v_pre = torch.where(hi[0][:, None, None], v_hi.float().cpu(), v_lo.float().cpu())
        o = p_pre @ heads(v_pre) + p_new @ heads(v[q0:q1])
        out[q0:q1] = o.transpose(0, 1)
    return out


def causal_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, num_reqs: int,
    scale: float, window_left: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen causal attention as FlashAttention runs it for the backend: request ``r``'s
    queries ``q[cu_q[r]:cu_q[r+1]]`` are the last positions of its keys ``k[cu_k[r]:cu_k[r+1]]``
    (``cu_k = cu_q``: a chunk's attention to its own keys), the mask aligned to the bottom right
    (more queries than keys: the first ones see none). ``window_left >= 0``: a query sees only the
    ``window_left`` keys before its own position and that one. fp32 output ``[T, Hq, d]`` (0
    where a query sees no key) and natural-log LSE ``[Hq, T]`` (-inf there)."""
    t, hq, d = q.shape
    g = hq // k.shape[1]
    out = torch.zeros(t, hq, d, dtype=torch.float32)
    lse = torch.full((hq, t), float("-inf"), dtype=torch.float32)
    for r in range(num_reqs):
        a, b = int(cu_q[r]), int(cu_q[r + 1])
        ka, kb = int(cu_k[r]), int(cu_k[r + 1])
        if a == b:
            continue
        qq = q[a:b].float().cpu().transpose(0, 1)  # [Hq, n, d]
        kk = k[ka:kb].float().cpu().repeat_interleave(g, dim=1).transpose(0, 1)
        vv = v[ka:kb].float().cpu().repeat_interleave(g, dim=1).transpose(0, 1)
        s = (qq @ kk.transpose(1, 2)) * scale
        own = torch.arange(b - a)[:, None] + (kb - ka) - (b - a)  # each query's own position among the keys
        key = torch.arange(kb - ka)[None, :]
        hidden = (key > own) | ((key < own - window_left) if window_left >= 0 else False)
        s = s.masked_fill(hidden, float("-inf"))
        lse[:, a:b] = torch.logsumexp(s, dim=-1)
        sees = ~hidden.all(dim=-1)  # [n]
        p = torch.softmax(s[:, sees], dim=-1)
        out[a:b][sees] = (p @ vv).transpose(0, 1)
    return out, lse


def decode_read_attention_reference(
    q_rot: torch.Tensor, k_bf16: torch.Tensor, v_bf16: torch.Tensor, k_int2: torch.Tensor, v_int2: torch.Tensor,
    seq_lens: torch.Tensor, cu_q: torch.Tensor, num_reqs: int, scale: float, recent: int,
) -> torch.Tensor:
    """Prefill chunks read as a decode step reads the cache, fp32 ``[T, Hq, d]``: the query at
    position ``p`` attends to keys ``[0, p]``, the BF16 row where the key is among the last
    ``recent`` (``key > p - recent``), else the INT2 row. Rows: request ``r``'s positions
    ``[0, seq_len)`` one after another, ``[sum(seq_lens), Hkv, d]``, the INT2 rows' sink from the
    ring (BF16, as decode reads it). No logit correction."""
    t, hq, d = q_rot.shape
    g = hq // k_bf16.shape[1]
    out = torch.zeros(t, hq, d, dtype=torch.float32)
    start = 0
    for r in range(num_reqs):
        a, b, n = int(cu_q[r]), int(cu_q[r + 1]), int(seq_lens[r])
        rows = slice(start, start + n)
        start += n
        if a == b:
            continue
        qq = q_rot[a:b].float().cpu().transpose(0, 1)  # [Hq, m, d]

        def heads(x):
            return x[rows].float().cpu().repeat_interleave(g, dim=1).transpose(0, 1)  # [Hq, n, d]

        s_bf16 = (qq @ heads(k_bf16).transpose(1, 2)) * scale  # [Hq, m, n]
        s_int2 = (qq @ heads(k_int2).transpose(1, 2)) * scale
        pos = torch.arange(b - a)[:, None] + n - (b - a)
        key = torch.arange(n)[None, :]
        window = key > pos - recent
        s = torch.where(window, s_bf16, s_int2).masked_fill(key > pos, float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[a:b] = ((p * window) @ heads(v_bf16) + (p * ~window) @ heads(v_int2)).transpose(0, 1)
    return out
