"""Attention over the OSCAR mixed cache: one kernel for prefill, chunked prefill, decode
and mixed batches, as vLLM schedules them.

A program owns a q-block (up to ``BLOCK_Q`` query tokens of one request, times the ``G``
query heads of one KV head, so K/V are loaded once for the whole GQA group) and a split of
the request's cached prefix:

* the cached prefix ``[0, ctx)`` is read from the packed INT2 pages, dequantized in
  registers. Where a key is in the sink or in the query's recent window and the request's
  ring still holds it, the BF16 copy replaces it (scores and values alike). Queries are
  in the key-rotated basis (``q_rot``); values stay in the folded value basis.
* this step's own keys ``[ctx, seq_len)`` come straight from ``k``/``v`` (BF16, causal),
  with the unrotated ``q``: ``q·k == (qR)·(kR)`` for orthogonal ``R``.

Everything is done in quarters of the head dimension, which is how the codes are packed
(byte j holds dims j, j+d/4, j+d/2, j+3d/4), so no dequantized copy is ever assembled.

Decode batches split the prefix over ``NUM_SPLITS`` programs (split-K); partial results
with their log-sum-exp are merged by ``_merge_splits_kernel``.

Reference: :func:`oscar_vllm.reference.oscar_attention.oscar_attention_reference`.
"""
import math

import torch
import triton
import triton.language as tl

from csrc_triton.paged_layout import find_request, int2_slot_bytes, load_f16_param, window_index

LOG2E = 1.4426950408889634
DECODE_SPLITS = 16


@triton.jit
def _load_quarters(ptr, row_off, row_mask, Q: tl.constexpr):
    """Four ``[rows, Q]`` tiles: dims ``[iQ, (i+1)Q)`` of rows at ``ptr + row_off``."""
    cols = tl.arange(0, Q)[None, :]
    p = ptr + row_off[:, None] + cols
    m = row_mask[:, None]
    x0 = tl.load(p, mask=m, other=0.0)
    x1 = tl.load(p + Q, mask=m, other=0.0)
    x2 = tl.load(p + 2 * Q, mask=m, other=0.0)
    x3 = tl.load(p + 3 * Q, mask=m, other=0.0)
    return x0, x1, x2, x3


@triton.jit
def _load_int2_quarters(cache_ptr, base, byte_off, param_off, mask, DT: tl.constexpr,
                        Q: tl.constexpr, PARAM_BF16: tl.constexpr):
    """Dequantized ``[N, Q]`` quarter tiles of K (``byte_off`` 0) or V (``byte_off`` Q)."""
    packed = tl.load(cache_ptr + base[:, None] + byte_off + tl.arange(0, Q)[None, :],
                     mask=mask[:, None], other=0).to(tl.int32)
    scale = load_f16_param(cache_ptr, base + param_off, mask, PARAM_BF16)[:, None]
    bias = load_f16_param(cache_ptr, base + param_off + 2, mask, PARAM_BF16)[:, None]
    x0 = ((packed & 3).to(tl.float32) * scale + bias).to(DT)
    x1 = (((packed >> 2) & 3).to(tl.float32) * scale + bias).to(DT)
    x2 = (((packed >> 4) & 3).to(tl.float32) * scale + bias).to(DT)
    x3 = (((packed >> 6) & 3).to(tl.float32) * scale + bias).to(DT)
    return x0, x1, x2, x3


@triton.jit
def _dot4(a0, a1, a2, a3, b0, b1, b2, b3, PRECISION: tl.constexpr):
    """``sum_i a_i @ b_i^T``: a full-D dot product assembled from quarter tiles."""
    s = tl.dot(a0, tl.trans(b0), input_precision=PRECISION)
    s = tl.dot(a1, tl.trans(b1), s, input_precision=PRECISION)
    s = tl.dot(a2, tl.trans(b2), s, input_precision=PRECISION)
    return tl.dot(a3, tl.trans(b3), s, input_precision=PRECISION)


@triton.jit
def _oscar_attention_kernel(
    out_ptr,  # [T, HQ, D] output (NUM_SPLITS == 1)
    part_out_ptr,  # fp32 [T, HQ, NUM_SPLITS, D] normalized partial outputs (NUM_SPLITS > 1)
    part_lse_ptr,  # fp32 [T, HQ, NUM_SPLITS] partial log2-sum-exp2
    q_ptr,  # [T, HQ, D] queries after RoPE
    q_rot_ptr,  # [T, HQ, D] the same queries in the key-rotated basis
    k_ptr,  # [T, HKV, D] this step's keys (not rotated)
    v_ptr,  # [T, HKV, D] this step's values (folded basis)
    cache_ptr,  # uint8 [num_blocks * BLOCK_SIZE * HKV * SLOT] INT2 pages
    window_k_ptr,  # bf16 [S, SINK + RECENT, HKV, D] rotated keys of the windows
    window_v_ptr,  # bf16 [S, SINK + RECENT, HKV, D]
    window_pos_ptr,  # int32 [S, SINK + RECENT] position held by each ring entry
    block_table_ptr,  # int32 [R, max_blocks]
    seq_lens_ptr,  # int32 [R] sequence length including this step
    cu_q_ptr,  # int32 [R + 1] query start offsets
    ring_slot_ptr,  # int32 [R]
    num_reqs,
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh, stride_rt, stride_rh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_bt,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    SLOT: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SINK: tl.constexpr,
    RECENT: tl.constexpr,
    PARAM_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    Q: tl.constexpr = D // 4
    W: tl.constexpr = SINK + RECENT
    DT = q_ptr.dtype.element_ty
    qb = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)

    r = find_request(cu_q_ptr, num_reqs, qb, BLOCK_Q, True)
    q_start = tl.load(cu_q_ptr + r)
    q_len = tl.load(cu_q_ptr + r + 1) - q_start
    q_first = (qb - (q_start // BLOCK_Q + r)) * BLOCK_Q
    if q_first >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + r)
    ctx = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    qi = q_first + rows // G
    row_ok = (rows // G < BLOCK_Q) & (qi < q_len)
    tok = (q_start + qi).to(tl.int64)
    hq = h * G + rows % G
    qpos = ctx + qi
    qr0, qr1, qr2, qr3 = _load_quarters(q_rot_ptr, tok * stride_rt + hq * stride_rh, row_ok, Q)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc0 = tl.zeros([BLOCK_M, Q], tl.float32)
    acc1 = tl.zeros([BLOCK_M, Q], tl.float32)
    acc2 = tl.zeros([BLOCK_M, Q], tl.float32)
    acc3 = tl.zeros([BLOCK_M, Q], tl.float32)

    ring = tl.load(ring_slot_ptr + r).to(tl.int64)
    n_tiles = tl.cdiv(ctx, BLOCK_N)
    per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    tile_lo = split * per_split
    tile_hi = tl.minimum(n_tiles, tile_lo + per_split)
    qpos_min = ctx + q_first
    for tile in range(tile_lo, tile_hi):
        kp = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ok = kp < ctx
        blk = tl.load(block_table_ptr + r * stride_bt + kp // BLOCK_SIZE, mask=k_ok, other=0)
        base = ((blk.to(tl.int64) * BLOCK_SIZE + kp % BLOCK_SIZE) * HKV + h) * SLOT
        k0, k1, k2, k3 = _load_int2_quarters(cache_ptr, base, 0, 2 * Q, k_ok, DT, Q, PARAM_BF16)
        s = _dot4(qr0, qr1, qr2, qr3, k0, k1, k2, k3, PRECISION)
        # A tile needs the ring when it touches the sink or some query's recent window.
        need_hi = (tile * BLOCK_N < SINK) | (tile * BLOCK_N + BLOCK_N - 1 > qpos_min - RECENT)
        hi = tl.zeros([BLOCK_M, BLOCK_N], tl.int1)
        if need_hi:
            widx = ring * W + window_index(kp, SINK, RECENT)
            held = tl.load(window_pos_ptr + widx, mask=k_ok, other=-1) == kp
            hi = held[None, :] & ((kp[None, :] < SINK) | (qpos[:, None] - kp[None, :] < RECENT))
            w_off = (widx * HKV + h) * D
            h0, h1, h2, h3 = _load_quarters(window_k_ptr, w_off, held, Q)
            s_hi = _dot4(qr0, qr1, qr2, qr3, h0.to(DT), h1.to(DT), h2.to(DT), h3.to(DT), PRECISION)
            s = tl.where(hi, s_hi, s)
        s = tl.where(row_ok[:, None] & k_ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        acc0 = acc0 * alpha[:, None]
        acc1 = acc1 * alpha[:, None]
        acc2 = acc2 * alpha[:, None]
        acc3 = acc3 * alpha[:, None]
        p_lo = tl.where(hi, 0.0, p).to(DT)
        v0, v1, v2, v3 = _load_int2_quarters(cache_ptr, base, Q, 2 * Q + 4, k_ok, DT, Q, PARAM_BF16)
        acc0 = tl.dot(p_lo, v0, acc0, input_precision=PRECISION)
        acc1 = tl.dot(p_lo, v1, acc1, input_precision=PRECISION)
        acc2 = tl.dot(p_lo, v2, acc2, input_precision=PRECISION)
        acc3 = tl.dot(p_lo, v3, acc3, input_precision=PRECISION)
        if need_hi:
            widx = ring * W + window_index(kp, SINK, RECENT)
            held = tl.load(window_pos_ptr + widx, mask=k_ok, other=-1) == kp
            p_hi = tl.where(hi, p, 0.0).to(DT)
            w0, w1, w2, w3 = _load_quarters(window_v_ptr, (widx * HKV + h) * D, held, Q)
            acc0 = tl.dot(p_hi, w0.to(DT), acc0, input_precision=PRECISION)
            acc1 = tl.dot(p_hi, w1.to(DT), acc1, input_precision=PRECISION)
            acc2 = tl.dot(p_hi, w2.to(DT), acc2, input_precision=PRECISION)
            acc3 = tl.dot(p_hi, w3.to(DT), acc3, input_precision=PRECISION)

    if split == NUM_SPLITS - 1:
        # This step's own keys: BF16 from the inputs, causal.
        q0, q1, q2, q3 = _load_quarters(q_ptr, tok * stride_qt + hq * stride_qh, row_ok, Q)
        n_new = tl.minimum(q_len, q_first + BLOCK_Q)
        for j in range(0, tl.cdiv(n_new, BLOCK_N)):
            ki = j * BLOCK_N + tl.arange(0, BLOCK_N)
            kc_ok = ki < n_new
            ktok = (q_start + ki).to(tl.int64)
            c0, c1, c2, c3 = _load_quarters(k_ptr, ktok * stride_kt + h * stride_kh, kc_ok, Q)
            s = _dot4(q0, q1, q2, q3, c0, c1, c2, c3, PRECISION)
            ok = row_ok[:, None] & kc_ok[None, :] & (ki[None, :] <= qi[:, None])
            s = tl.where(ok, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
            pd = p.to(DT)
            u0, u1, u2, u3 = _load_quarters(v_ptr, ktok * stride_vt + h * stride_vh, kc_ok, Q)
            acc0 = tl.dot(pd, u0, acc0 * alpha[:, None], input_precision=PRECISION)
            acc1 = tl.dot(pd, u1, acc1 * alpha[:, None], input_precision=PRECISION)
            acc2 = tl.dot(pd, u2, acc2 * alpha[:, None], input_precision=PRECISION)
            acc3 = tl.dot(pd, u3, acc3 * alpha[:, None], input_precision=PRECISION)

    inv_l = tl.where(l_i > 0, 1.0 / l_i, 0.0)[:, None]
    cols = tl.arange(0, Q)[None, :]
    if NUM_SPLITS == 1:
        o = out_ptr + tok[:, None] * stride_ot + hq[:, None] * stride_oh + cols
        ty = out_ptr.dtype.element_ty
        tl.store(o, (acc0 * inv_l).to(ty), mask=row_ok[:, None])
        tl.store(o + Q, (acc1 * inv_l).to(ty), mask=row_ok[:, None])
        tl.store(o + 2 * Q, (acc2 * inv_l).to(ty), mask=row_ok[:, None])
        tl.store(o + 3 * Q, (acc3 * inv_l).to(ty), mask=row_ok[:, None])
    else:
        part = (tok * HQ + hq) * NUM_SPLITS + split
        o = part_out_ptr + part[:, None] * D + cols
        tl.store(o, acc0 * inv_l, mask=row_ok[:, None])
        tl.store(o + Q, acc1 * inv_l, mask=row_ok[:, None])
        tl.store(o + 2 * Q, acc2 * inv_l, mask=row_ok[:, None])
        tl.store(o + 3 * Q, acc3 * inv_l, mask=row_ok[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [T, HQ, D]
    part_out_ptr,  # fp32 [T, HQ, NUM_SPLITS, D]
    part_lse_ptr,  # fp32 [T, HQ, NUM_SPLITS]
    stride_ot, stride_oh,
    HQ: tl.constexpr,
    D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    hq = tl.program_id(1)
    part = (t * HQ + hq) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    lse = tl.load(part_lse_ptr + part)
    mx = tl.max(lse)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - tl.where(mx == float("-inf"), 0.0, mx)))
    o = tl.load(part_out_ptr + part[:, None] * D + tl.arange(0, D)[None, :])
    o = tl.sum(w[:, None] * o, axis=0) / tl.maximum(tl.sum(w), 1e-30)
    tl.store(out_ptr + t * stride_ot + hq * stride_oh + tl.arange(0, D), o.to(out_ptr.dtype.element_ty))


def launch_shape(num_queries_per_kv: int, max_query_len: int) -> tuple[int, int]:
    """Fixed heuristic: ``(BLOCK_M, BLOCK_Q)``, small rows for decode, larger for prefill."""
    block_m = 16 if max_query_len <= 1 else 64
    block_m = max(block_m, triton.next_power_of_2(num_queries_per_kv))
    return block_m, block_m // num_queries_per_kv


def oscar_attention(
    out: torch.Tensor,
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
    max_query_len: int,
    scale: float,
    sink: int,
    recent: int,
    param_dtype: torch.dtype = torch.float16,
    part_out: torch.Tensor | None = None,
    part_lse: torch.Tensor | None = None,
    block_n: int = 32,
) -> torch.Tensor:
    """Attention of ``q`` ``[T, Hq, d]`` over the mixed cache and this step's ``k``/``v``.

    Writes ``out`` ``[T, Hq, d]``. Decode batches (``max_query_len == 1``) are split over
    ``DECODE_SPLITS`` programs per (request, KV head) when ``part_out``
    ``[>=T, Hq, DECODE_SPLITS, d]`` and ``part_lse`` ``[>=T, Hq, DECODE_SPLITS]`` (fp32)
    are given. The launch depends only on shapes, so it is CUDA-graph capturable.
    """
    t, hq, d = q.shape
    hkv = k.shape[1]
    if t == 0:
        return out
    if hq % hkv or d % 64:
        raise ValueError(f"unsupported heads {hq}/{hkv} or head_dim {d} (needs a multiple of 64)")
    g = hq // hkv
    block_m, block_q = launch_shape(g, max_query_len)
    splits = DECODE_SPLITS if (max_query_len <= 1 and part_out is not None) else 1
    grid = (triton.cdiv(t, block_q) + num_reqs, hkv, splits)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _oscar_attention_kernel[grid](
        out, part_out if splits > 1 else out, part_lse if splits > 1 else out,
        q, q_rot, k, v, cache, window_k, window_v, window_pos,
        block_table, seq_lens, cu_q, ring_slots,
        num_reqs, scale * LOG2E,
        q.stride(0), q.stride(1), q_rot.stride(0), q_rot.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), block_table.stride(0),
        HQ=hq, HKV=hkv, G=g, D=d, SLOT=int2_slot_bytes(d), BLOCK_SIZE=cache.shape[1],
        SINK=sink, RECENT=recent, PARAM_BF16=param_dtype == torch.bfloat16,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n, NUM_SPLITS=splits,
        PRECISION=precision,
    )
    if splits > 1:
        _merge_splits_kernel[(t, hq)](
            out, part_out, part_lse, out.stride(0), out.stride(1),
            HQ=hq, D=d, NUM_SPLITS=splits,
        )
    return out
