"""Quantize-on-write: rotate K, clip, INT2-quantize and pack K and V into the paged cache,
and keep BF16 copies of the sink and recent-window positions in the request's ring.

Every token is written to the INT2 pages, window positions too: a token that leaves the
recent window needs no demotion pass, its reader simply stops trusting the ring entry
(``window_pos`` no longer names it) and reads the INT2 copy. The ring is written only for
positions a later step can still need: the sink and the last ``recent`` positions of the
sequence after this step.

A program owns ``BLOCK_T`` tokens of one KV head, so the key rotation ``[d, d]`` is read once
per tile and applied as one fp32 matrix product. Values arrive already rotated (the value
rotation is folded into the model's weights). Reference:
:func:`oscar_vllm.reference.oscar_write.oscar_write_reference`.
"""
import torch
import triton
import triton.language as tl

from csrc_triton.paged_layout import (
    BLOCK_SIZE,
    check_int2_cache,
    find_requests,
    launch_bucket,
    param_view,
    to_bf16_rne,
    window_args,
    window_index,
    window_offset,
)

BLOCK_T = 16  # tokens per program (the smallest tile tl.dot takes)
SEARCH_STEPS = 16  # bisection steps of the token -> request lookup: up to 65535 requests
# Warps per program, by tokens per call (the largest key <= tokens). A program is one long
# dependent chain (rotate, two 31-step clip searches, quantize): with few programs (decode) the
# chain is the kernel's time and 16 warps shorten it (H200, Qwen3-8B: 0.024 ms against 0.052 at
# 4 warps, 1-256 tokens); with many (prefill) 8 warps keep more programs resident (8K tokens:
# 0.331 ms against 0.420 at 16). `benchmarks/kernels/oscar_write.py --num-warps 4 8 16`.
WRITE_NUM_WARPS = {1: 16, 2048: 8}


@triton.jit
def _kth_smallest_abs(x, k):
    """The ``k``-th smallest (0-based) ``|x|`` of each row of ``[N, D]``, exactly.

    Bisection on the bit pattern (ordered like the values for non-negative floats): the
    smallest pattern with more than ``k`` entries at or below it is the k-th smallest value.
    31 counting passes, no sort network.
    """
    bits = tl.abs(x).to(tl.int32, bitcast=True)
    lo = tl.zeros([x.shape[0]], tl.int32)
    hi = tl.max(bits, axis=1)
    for _ in tl.static_range(31):
        mid = lo + (hi - lo) // 2
        enough = tl.sum((bits <= mid[:, None]).to(tl.int32), axis=1) > k
        hi = tl.where(enough, mid, hi)
        lo = tl.where(enough, lo, mid + 1)
    return hi.to(tl.float32, bitcast=True)


@triton.jit
def _quantize_rows(x, clip_idx, D: tl.constexpr):
    """OSCAR INT2 of fp32 rows ``[N, D]``: clip, min-max, round; returns (codes, scale, min)."""
    if clip_idx >= 0:
        thr = _kth_smallest_abs(x, clip_idx)[:, None]
        x = tl.minimum(tl.maximum(x, -thr), thr)
    lo = tl.min(x, axis=1)
    hi = tl.max(x, axis=1)
    scale = tl.math.div_rn(tl.maximum(hi - lo, 1e-8), 3.0)
    zero = tl.math.div_rn(-lo, scale)
    # IEEE division, as the PyTorch reference: a fast division flips codes at .5 ties.
    codes = tl.floor(tl.math.div_rn(x, scale[:, None]) + zero[:, None] + 0.5)
    codes = tl.minimum(tl.maximum(codes, 0.0), 3.0).to(tl.int32)
    return codes, scale, lo


@triton.jit
def _pack_quartered(codes, N: tl.constexpr, D: tl.constexpr):
    """``[N, D]`` codes -> ``[N, D/4]`` bytes, byte j = dims j, j+D/4, j+D/2, j+3D/4."""
    c = tl.reshape(codes, (N, 4, D // 4))
    shifts = (2 * tl.arange(0, 4))[None, :, None]
    return tl.sum(c << shifts, axis=1).to(tl.uint8)


@triton.jit
def _to_param(x, PARAM_BF16: tl.constexpr):
    if PARAM_BF16:
        y = to_bf16_rne(x)
    else:
        y = x.to(tl.float16)
    return y


# Token and request counts change every step, clip indices from layer to layer: unspecialized,
# so one compiled variant serves them all (see _oscar_attention_kernel).
@triton.jit(
    do_not_specialize=["num_tokens", "num_reqs", "num_decodes", "clip_idx_k", "clip_idx_v"],
    do_not_specialize_on_alignment=["slot_mapping_ptr", "cu_q_ptr", "seq_lens_ptr", "ring_slot_ptr"],
)
def _oscar_write_kernel(
    key_ptr,  # [T, HKV, D] this step's keys, RoPE applied, not rotated
    value_ptr,  # [T, HKV, D] this step's values, already in the rotated basis
    rot_k_ptr,  # fp32 [D, D], or [HKV, D, D] when ROT_HEAD_STRIDE = D*D
    slot_mapping_ptr,  # int64 [T] cache slot of each token, < 0: padding
    cu_q_ptr,  # int32 [R + 1] query start offsets
    seq_lens_ptr,  # int32 [R] sequence length after this step
    ring_slot_ptr,  # int32 [R] window ring of each request
    codes_ptr,  # uint8 [num_blocks, HKV, REGION] INT2 pages (paged_layout)
    params_ptr,  # 16-bit view of the same pages
    window_k_ptr,  # bf16 [num_pages, page_elems] window pages (paged_layout): keys first
    window_v_ptr,  # the same pages from their values
    window_pages_ptr,  # int32 [S, pages per ring] page of each ring's entries
    window_pos_ptr,  # int32 [S, SINK + RECENT]
    num_tokens,
    num_reqs,
    num_decodes,  # the first num_decodes tokens are one request each (vLLM orders decodes first)
    clip_idx_k,  # sorted-|x| index of the K clip threshold, -1 = no clip
    clip_idx_v,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,  # bytes from one cache block to the next
    stride_wp,  # window_pages row stride
    stride_page,  # elements from one window page to the next
    ROT_HEAD_STRIDE: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SINK: tl.constexpr,
    RECENT: tl.constexpr,
    WIN_E: tl.constexpr,  # ring entries per window page
    PARAM_BF16: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    Q: tl.constexpr = D // 4
    REGION: tl.constexpr = BLOCK_SIZE * (D // 2 + 8)
    h = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_mapping_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    live = slot >= 0
    dims = tl.arange(0, D)
    t64 = t.to(tl.int64)
    v = tl.load(value_ptr + t64[:, None] * stride_vt + h * stride_vh + dims[None, :], mask=live[:, None], other=0.0)
    v = v.to(tl.float32)
    # k @ R in fp32, over row slices of R small enough for shared memory at head_dim 256.
    KC: tl.constexpr = D if D <= 128 else 128
    kc = tl.arange(0, KC)
    k_rot = tl.zeros([BLOCK_T, D], tl.float32)
    for c in tl.static_range(D // KC):
        k = tl.load(key_ptr + t64[:, None] * stride_kt + h * stride_kh + c * KC + kc[None, :], mask=live[:, None],
                    other=0.0)
        rot = tl.load(rot_k_ptr + h * ROT_HEAD_STRIDE + (c * KC + kc[:, None]) * D + dims[None, :])
        k_rot = tl.dot(k.to(tl.float32), rot, k_rot, input_precision="ieee")

    codes_k, scale_k, min_k = _quantize_rows(k_rot, clip_idx_k, D)
    codes_v, scale_v, min_v = _quantize_rows(v, clip_idx_v, D)
    base = (slot // BLOCK_SIZE) * stride_cb + h * REGION
    tok = slot % BLOCK_SIZE
    j = tl.arange(0, Q)[None, :]
    tl.store(codes_ptr + base[:, None] + tok[:, None] * Q + j, _pack_quartered(codes_k, BLOCK_T, D),
             mask=live[:, None])
    tl.store(codes_ptr + base[:, None] + BLOCK_SIZE * Q + j * BLOCK_SIZE + tok[:, None],
             _pack_quartered(codes_v, BLOCK_T, D), mask=live[:, None])
    p = params_ptr + (base + 2 * BLOCK_SIZE * Q) // 2 + tok
    tl.store(p, _to_param(scale_k, PARAM_BF16), mask=live)
    tl.store(p + BLOCK_SIZE, _to_param(min_k, PARAM_BF16), mask=live)
    tl.store(p + 2 * BLOCK_SIZE, _to_param(scale_v, PARAM_BF16), mask=live)
    tl.store(p + 3 * BLOCK_SIZE, _to_param(min_v, PARAM_BF16), mask=live)
    _write_windows(k_rot, v, t, live, h, num_reqs, num_decodes, cu_q_ptr, seq_lens_ptr, ring_slot_ptr,
                   window_k_ptr, window_v_ptr, window_pages_ptr, window_pos_ptr, stride_wp, stride_page,
                   HKV, D, SINK, RECENT, WIN_E, BLOCK_T, SEARCH_STEPS)


@triton.jit
def _write_windows(k_rot, v, t, live, h, num_reqs, num_decodes, cu_q_ptr, seq_lens_ptr, ring_slot_ptr,
                   window_k_ptr, window_v_ptr, window_pages_ptr, window_pos_ptr, stride_wp, stride_page,
                   HKV: tl.constexpr, D: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr,
                   WIN_E: tl.constexpr, BLOCK_T: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    """BF16 copies of the tile's sink and recent-window tokens into their requests' rings."""
    dims = tl.arange(0, D)
    if (tl.program_id(0) + 1) * BLOCK_T <= num_decodes:
        r = t  # a decode tile: token i is request i, no search
    else:
        r = find_requests(cu_q_ptr, num_reqs, t, SEARCH_STEPS)
    r_ok = live & (r >= 0)
    q_start = tl.load(cu_q_ptr + r, mask=r_ok, other=0)
    q_len = tl.load(cu_q_ptr + r + 1, mask=r_ok, other=0) - q_start
    seq_len = tl.load(seq_lens_ptr + r, mask=r_ok, other=0)
    pos = seq_len - q_len + (t - q_start)
    keep = r_ok & ((pos < SINK) | (pos >= seq_len - RECENT))
    ring = tl.load(ring_slot_ptr + r, mask=keep, other=0).to(tl.int64)
    entry = window_index(pos, SINK, RECENT)
    w = (window_offset(window_pages_ptr, stride_wp, ring, entry, keep, stride_page, WIN_E, HKV * D)
         + h * D)[:, None] + dims[None, :]
    tl.store(window_k_ptr + w, to_bf16_rne(k_rot), mask=keep[:, None])
    tl.store(window_v_ptr + w, to_bf16_rne(v), mask=keep[:, None])
    tl.store(window_pos_ptr + ring * (SINK + RECENT) + entry, pos, mask=keep & (h == 0))


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
    windows: torch.Tensor,
    window_pages: torch.Tensor,
    window_pos: torch.Tensor,
    clip_idx_k: int,
    clip_idx_v: int,
    sink: int,
    recent: int,
    param_dtype: torch.dtype = torch.float16,
    num_decodes: int = 0,
    num_warps: int | None = None,
) -> None:
    """Write ``key``/``value`` ``[T, Hkv, d]`` into the INT2 ``cache`` and the BF16 windows.

    ``cache``: uint8 ``[num_blocks, Hkv, int2_region_bytes(d)]`` (``paged_layout``); the other
    arguments as documented on the kernel; ``clip_idx_*`` as ``oscar_vllm.quant.clip_index``
    gives them. Tokens whose slot is negative are skipped. ``num_decodes``: the batch's first
    requests have one token each (a hint that skips the token -> request search; 0 is always right).
    ``num_warps``: else from ``WRITE_NUM_WARPS``.
    """
    t, hkv, d = key.shape
    if t == 0:
        return
    check_int2_cache(cache, d)
    if num_reqs >= 2**SEARCH_STEPS:
        raise ValueError(f"at most {2**SEARCH_STEPS - 1} requests per batch, got {num_reqs}")
    _oscar_write_kernel[(triton.cdiv(t, BLOCK_T), hkv)](
        key_ptr=key, value_ptr=value, rot_k_ptr=rot_k.contiguous(), slot_mapping_ptr=slot_mapping, cu_q_ptr=cu_q,
        seq_lens_ptr=seq_lens, ring_slot_ptr=ring_slots, codes_ptr=cache, params_ptr=param_view(cache, param_dtype),
        **window_args(windows, window_pages, window_pos, hkv, d, sink, recent),
        num_tokens=t, num_reqs=num_reqs, num_decodes=num_decodes, clip_idx_k=clip_idx_k, clip_idx_v=clip_idx_v,
        stride_kt=key.stride(0), stride_kh=key.stride(1), stride_vt=value.stride(0), stride_vh=value.stride(1),
        stride_cb=cache.stride(0),
        ROT_HEAD_STRIDE=d * d if rot_k.dim() == 3 else 0,
        HKV=hkv, D=d, BLOCK_SIZE=BLOCK_SIZE, SINK=sink, RECENT=recent,
        PARAM_BF16=param_dtype == torch.bfloat16, BLOCK_T=BLOCK_T, SEARCH_STEPS=SEARCH_STEPS,
        num_warps=num_warps or launch_bucket(WRITE_NUM_WARPS, t),
    )
