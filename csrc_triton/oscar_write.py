"""Quantize-on-write: rotate K, clip, INT2-quantize and pack K and V into the paged cache,
and keep BF16 copies of the sink and recent-window positions in the request's ring.

Every token is written to the INT2 pages, window positions too: a token that leaves the
recent window needs no demotion pass, its reader simply stops trusting the ring entry
(``window_pos`` no longer names it) and reads the INT2 copy. The ring is written only for
positions a later step can still need: the sink and the last ``recent`` positions of the
sequence after this step.

Values arrive already rotated (the value rotation is folded into the model's weights), so
only K is rotated here. Reference: :func:`oscar_vllm.reference.oscar_write.oscar_write_reference`.
"""
import torch
import triton
import triton.language as tl

from csrc_triton.paged_layout import find_request, int2_slot_bytes, store_f16_param, to_bf16_rne, window_index


@triton.jit
def _quantize_row(x, clip_idx, D: tl.constexpr):
    """OSCAR INT2 of one fp32 row ``[D]``: clip, min-max, round; returns (codes, scale, min)."""
    if clip_idx >= 0:
        # The clip threshold is the clip_idx-th smallest |x| of the row.
        srt = tl.sort(tl.abs(x))
        thr = tl.sum(tl.where(tl.arange(0, D) == clip_idx, srt, 0.0))
        x = tl.minimum(tl.maximum(x, -thr), thr)
    lo = tl.min(x)
    hi = tl.max(x)
    scale = tl.math.div_rn(tl.maximum(hi - lo, 1e-8), 3.0)
    zero = tl.math.div_rn(-lo, scale)
    # IEEE division, as the PyTorch reference: a fast division flips codes at .5 ties.
    codes = tl.floor(tl.math.div_rn(x, scale) + zero + 0.5)
    codes = tl.minimum(tl.maximum(codes, 0.0), 3.0).to(tl.int32)
    return codes, scale, lo


@triton.jit
def _pack_quartered(codes, D: tl.constexpr):
    """``[D]`` codes -> ``[D/4]`` bytes, byte j = dims j, j+D/4, j+D/2, j+3D/4."""
    c = tl.reshape(codes, (4, D // 4))
    shifts = (2 * tl.arange(0, 4))[:, None]
    return tl.sum(c << shifts, axis=0).to(tl.uint8)


@triton.jit
def _oscar_write_kernel(
    key_ptr,  # [T, HKV, D] this step's keys, RoPE applied, not rotated
    value_ptr,  # [T, HKV, D] this step's values, already in the rotated basis
    rot_k_ptr,  # fp32 [D, D], or [HKV, D, D] when ROT_HEAD_STRIDE = D*D
    slot_mapping_ptr,  # int64 [T] cache slot of each token, < 0: padding
    cu_q_ptr,  # int32 [R + 1] query start offsets
    seq_lens_ptr,  # int32 [R] sequence length after this step
    ring_slot_ptr,  # int32 [R] window ring of each request
    cache_ptr,  # uint8 [num_blocks * BLOCK_SIZE * HKV * SLOT]
    window_k_ptr,  # bf16 [S, SINK + RECENT, HKV, D]
    window_v_ptr,  # bf16 [S, SINK + RECENT, HKV, D]
    window_pos_ptr,  # int32 [S, SINK + RECENT]
    num_reqs,
    clip_idx_k,  # int: sorted-|x| index of the K clip threshold, -1 = no clip
    clip_idx_v,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    ROT_HEAD_STRIDE: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    SLOT: tl.constexpr,
    SINK: tl.constexpr,
    RECENT: tl.constexpr,
    PARAM_BF16: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    Q: tl.constexpr = D // 4
    dims = tl.arange(0, D)

    k = tl.load(key_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + dims).to(tl.float32)
    v = tl.load(value_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + dims).to(tl.float32)
    rot = tl.load(rot_k_ptr + h * ROT_HEAD_STRIDE + dims[:, None] * D + dims[None, :])
    k_rot = tl.sum(k[:, None] * rot, axis=0)  # k @ R, exact fp32 products

    base = (slot * HKV + h) * SLOT
    codes_k, scale_k, min_k = _quantize_row(k_rot, clip_idx_k, D)
    codes_v, scale_v, min_v = _quantize_row(v, clip_idx_v, D)
    tl.store(cache_ptr + base + tl.arange(0, Q), _pack_quartered(codes_k, D))
    tl.store(cache_ptr + base + Q + tl.arange(0, Q), _pack_quartered(codes_v, D))
    store_f16_param(cache_ptr, base + 2 * Q, scale_k, PARAM_BF16)
    store_f16_param(cache_ptr, base + 2 * Q + 2, min_k, PARAM_BF16)
    store_f16_param(cache_ptr, base + 2 * Q + 4, scale_v, PARAM_BF16)
    store_f16_param(cache_ptr, base + 2 * Q + 6, min_v, PARAM_BF16)

    r = find_request(cu_q_ptr, num_reqs, t, 1, False)
    q_start = tl.load(cu_q_ptr + r)
    q_len = tl.load(cu_q_ptr + r + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + r)
    pos = seq_len - q_len + (t - q_start)
    if (pos < SINK) | (pos >= seq_len - RECENT):
        ring = tl.load(ring_slot_ptr + r).to(tl.int64)
        idx = ring * (SINK + RECENT) + window_index(pos, SINK, RECENT)
        w = (idx * HKV + h) * D + dims
        tl.store(window_k_ptr + w, to_bf16_rne(k_rot))
        tl.store(window_v_ptr + w, to_bf16_rne(v))
        if h == 0:
            tl.store(window_pos_ptr + idx, pos)


def oscar_write(
    key: torch.Tensor,
    value: torch.Tensor,
    rot_k: torch.Tensor,
    slot_mapping: torch.Tensor,
    cu_q: torch.Tensor,
    seq_lens: torch.Tensor,
    ring_slots: torch.Tensor,
    num_reqs: int,
    cache: torch.Tensor,
    window_k: torch.Tensor,
    window_v: torch.Tensor,
    window_pos: torch.Tensor,
    clip_idx_k: int,
    clip_idx_v: int,
    sink: int,
    recent: int,
    param_dtype: torch.dtype = torch.float16,
) -> None:
    """Write ``key``/``value`` ``[T, Hkv, d]`` into the INT2 ``cache`` and the BF16 windows.

    ``cache``: uint8 ``[num_blocks, block_size, Hkv, int2_slot_bytes(d)]``; the other
    arguments as documented on the kernel; ``clip_idx_*`` as ``oscar_vllm.quant.clip_index``
    gives them. Tokens whose slot is negative are skipped.
    """
    t, hkv, d = key.shape
    if t == 0:
        return
    if cache.shape[-1] != int2_slot_bytes(d) or cache.dtype != torch.uint8:
        raise ValueError(f"cache {tuple(cache.shape)} {cache.dtype} is not an INT2 cache for head_dim {d}")
    if param_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the paged cache stores 16-bit scales, not {param_dtype}")
    if window_k.dtype != torch.bfloat16 or window_v.dtype != torch.bfloat16:
        raise ValueError(f"the windows are bf16, got {window_k.dtype}/{window_v.dtype}")
    _oscar_write_kernel[(t, hkv)](
        key, value, rot_k.contiguous(), slot_mapping, cu_q, seq_lens, ring_slots,
        cache, window_k, window_v, window_pos,
        num_reqs, clip_idx_k, clip_idx_v,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        ROT_HEAD_STRIDE=d * d if rot_k.dim() == 3 else 0,
        HKV=hkv, D=d, SLOT=int2_slot_bytes(d), SINK=sink, RECENT=recent,
        PARAM_BF16=param_dtype == torch.bfloat16,
    )
