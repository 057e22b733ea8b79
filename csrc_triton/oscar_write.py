"""Quantize-on-write: rotate K, clip, INT2-quantize and pack K and V into the paged cache,
and keep BF16 copies of the sink and recent-window positions in the request's ring.

Two kernels: ``oscar_write`` (Triton) writes prefill chunks after their attention, and decode
steps where the Gluon decode kernel does not serve; ``oscar_write_decode`` (Gluon, at the end of
this file) writes a decode step's tokens before its attention and rotates the step's queries in
the same launch.

Every token is written to the INT2 pages, window positions too: a token that leaves the
recent window needs no demotion pass, its reader simply stops trusting the ring entry
(``window_pos`` no longer names it) and reads the INT2 copy. The ring is written only for
positions a later step can still need: the sink and the last ``recent`` positions of the
sequence after this step.

A program owns ``BLOCK_T`` tokens of one KV head (``paged_layout.WRITE_LAUNCH``), so the key rotation
``[d, d]`` is read once per tile and applied as one fp32 matrix product. Values arrive already
rotated (the value rotation is folded into the model's weights). With a key mean
(``oscar_vllm.core.key_mean``) both writes round each key less its block's mean (one vector for the
64 positions of a cache block: the mean turned to the block's first position, by the model's own
RoPE table); the ring keeps the key as it is. Reference:
:func:`oscar_vllm.reference.oscar_write.oscar_write_reference`.
"""
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from csrc_triton.gluon_layout import decode_write_tiles
from csrc_triton.paged_layout import (
    BLOCK_SIZE,
    KEY_MEAN_BLOCK,
    WRITE_LAUNCH,
    BatchLayout,
    MixedCache,
    cache_args,
    check_key_mean,
    find_requests,
    int2_params_at,
    int2_region_bytes,
    launch_bucket,
    to_bf16_rne,
    window_index,
    v_column,
    window_page,
)

SEARCH_STEPS = 16  # bisection steps of the token -> request lookup: up to 65535 requests
# Both writes peel clip thresholds within this many entries of a row's top off its top (a max
# and a count a round, as many rounds as the rank from the top plus one: a loop with a runtime
# trip count, never unrolled) rather than searching for them (Triton: 31 steps of one count;
# Gluon: 16 of three): the reference's clip ratios (0.96 K, 0.92 V) take 6 and 11 rounds at
# head_dim 128, SmolLM2's fitted ones (0.84-0.93) up to 11 at its head_dim 64.
PEEL_ROUNDS = gl.constexpr(32)
# How the Triton write multiplies its keys by R: "ieee", fp32 FMAs (2,280 FFMA a 32-token tile at
# head_dim 128, sm_90, most of the program's instructions and spills), or "tf32x3", three TF32
# tensor-core products of the operands' high and low parts (232 FFMA and 192 HMMA; within about
# 2^-21 of fp32, a code may flip at a rounding tie as in any other summation order), whose MMA
# layout splits rows over warps, so the clip peel's reductions cross warps (132 barriers against
# 16). Which is faster is the GPU's to say (benchmarks/kernel_bench/oscar_write.py --rotation).
WRITE_ROTATIONS = ("ieee", "tf32x3")
WRITE_ROTATION = "ieee"


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
def _kth_largest_peeled(bits, j, rounds):
    """Per row of ``bits`` ``[N, D]`` (bit patterns of non-negative floats, which order as the
    floats do): its ``j``-th largest entry (0: the largest, copies counted), or -1 where that lies
    deeper than ``rounds`` distinct values from the top (``j + 1`` rounds always reach it). A round
    peels the top value off, all its copies (to -1), and counts the entries peeled so far: the
    first round past ``j`` peeled the answer. ``rounds`` is a runtime value, so the loop is not
    unrolled (the Gluon twin: ``_kth_largest_peeled_warp``)."""
    left = bits
    found = tl.full([bits.shape[0]], -1, tl.int32)
    for _ in range(rounds):
        top = tl.max(left, axis=1)
        left = tl.where(left == top[:, None], -1, left)
        peeled = tl.sum((left < 0).to(tl.int32), axis=1)
        found = tl.where((found < 0) & (peeled > j), top, found)
    return found


@triton.jit
def _clip_threshold(x, clip_idx, D: tl.constexpr):
    """The ``clip_idx``-th smallest (0-based) ``|x|`` of each row of ``[N, D]``, exactly (ties
    counted, as ``_kth_smallest_abs``): peeled off the rows' tops when its rank from the top is
    below ``PEEL_ROUNDS`` (rank + 1 rounds of a max and a count), else the bisection (31 steps of
    a count). sm_90, 32 tokens on 8 warps: 91-103 instructions a round, 82 a bisection step, so
    ranks from about 25 on would search a little faster; no clip ratio in use comes near.
    ``clip_idx`` is one for the whole tile: a uniform branch."""
    rank = D - 1 - clip_idx
    if rank < PEEL_ROUNDS:
        thr = _kth_largest_peeled(tl.abs(x).to(tl.int32, bitcast=True), rank, rank + 1).to(tl.float32, bitcast=True)
    else:
        thr = _kth_smallest_abs(x, clip_idx)
    return thr


@triton.jit
def _quantize_rows(x, clip_idx, D: tl.constexpr):
    """OSCAR INT2 of fp32 rows ``[N, D]``: clip, min-max, round; returns (codes, scale, min)."""
    if clip_idx >= 0:
        thr = _clip_threshold(x, clip_idx, D)[:, None]
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
    key_mean_ptr,  # fp32 [HKV, D] each KV head's mean key before RoPE (KEY_MEAN)
    cos_sin_ptr,  # [P, D] RoPE table: each position's D/2 cosines, then its D/2 sines (KEY_MEAN)
    num_tokens,
    num_reqs,
    num_decodes,  # the first num_decodes tokens are one request each (vLLM orders decodes first)
    clip_idx_k,  # sorted-|x| index of the K clip threshold, -1 = no clip
    clip_idx_v,
    stride_cs,  # cos_sin row stride
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
    KEY_MEAN: tl.constexpr,
    ROTATION: tl.constexpr,  # WRITE_ROTATIONS
):
    Q: tl.constexpr = D // 4
    REGION: tl.constexpr = int2_region_bytes(D, BLOCK_SIZE)
    h = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_mapping_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    live = slot >= 0
    dims = tl.arange(0, D)
    t64 = t.to(tl.int64)
    if (tl.program_id(0) + 1) * BLOCK_T <= num_decodes:
        r = t  # a decode tile: token i is request i, no search
    else:
        r = find_requests(cu_q_ptr, num_reqs, t, SEARCH_STEPS)
    r_ok = live & (r >= 0)
    q_start = tl.load(cu_q_ptr + r, mask=r_ok, other=0)
    seq_len = tl.load(seq_lens_ptr + r, mask=r_ok, other=0)
    pos = seq_len - (tl.load(cu_q_ptr + r + 1, mask=r_ok, other=0) - q_start) + (t - q_start)
    v = tl.load(value_ptr + t64[:, None] * stride_vt + h * stride_vh + dims[None, :], mask=live[:, None], other=0.0)
    v = v.to(tl.float32)
    # k @ R in fp32 (with KEY_MEAN, k less its turned mean: what the INT2 page rounds); the
    # windows' k @ R after the INT2 stores, so that the two products are never live together.
    k_int2 = _rotate_keys(key_ptr, rot_k_ptr, key_mean_ptr, cos_sin_ptr, t64, live, r_ok, pos, h, stride_kt, stride_kh,
                          stride_cs, ROT_HEAD_STRIDE, D, BLOCK_T, KEY_MEAN, ROTATION)
    codes_k, scale_k, min_k = _quantize_rows(k_int2, clip_idx_k, D)
    codes_v, scale_v, min_v = _quantize_rows(v, clip_idx_v, D)
    base = (slot // BLOCK_SIZE) * stride_cb + h * REGION
    tok = slot % BLOCK_SIZE
    j = tl.arange(0, Q)[None, :]
    tl.store(codes_ptr + base[:, None] + tok[:, None] * Q + j, _pack_quartered(codes_k, BLOCK_T, D),
             mask=live[:, None])
    tl.store(codes_ptr + base[:, None] + BLOCK_SIZE * Q + j * BLOCK_SIZE + v_column(tok)[:, None],
             _pack_quartered(codes_v, BLOCK_T, D), mask=live[:, None])
    p = params_ptr + (base + int2_params_at(D, BLOCK_SIZE)) // 2 + tok
    tl.store(p, _to_param(scale_k, PARAM_BF16), mask=live)
    tl.store(p + BLOCK_SIZE, _to_param(min_k, PARAM_BF16), mask=live)
    tl.store(p + 2 * BLOCK_SIZE, _to_param(scale_v, PARAM_BF16), mask=live)
    tl.store(p + 3 * BLOCK_SIZE, _to_param(min_v, PARAM_BF16), mask=live)
    if KEY_MEAN:
        k_rot = _rotate_keys(key_ptr, rot_k_ptr, key_mean_ptr, cos_sin_ptr, t64, live, r_ok, pos, h, stride_kt,
                             stride_kh, stride_cs, ROT_HEAD_STRIDE, D, BLOCK_T, False, ROTATION)
    else:
        k_rot = k_int2
    _write_windows(k_rot, v, r, r_ok, pos, seq_len, h, ring_slot_ptr, window_k_ptr, window_v_ptr, window_pages_ptr,
                   window_pos_ptr, stride_wp, stride_page, HKV, D, SINK, RECENT, WIN_E)


@triton.jit
def _rotate_keys(key_ptr, rot_k_ptr, key_mean_ptr, cos_sin_ptr, t64, live, r_ok, pos, h, stride_kt, stride_kh,
                 stride_cs, ROT_HEAD_STRIDE: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
                 KEY_MEAN: tl.constexpr, ROTATION: tl.constexpr):
    """``[BLOCK_T, D]`` fp32: the tile's keys times R (as ``ROTATION``, one of ``WRITE_ROTATIONS``),
    over row slices of R small enough for shared memory at head_dim 256; with ``KEY_MEAN``, the keys
    less their block's mean, turned by RoPE to the first position of the block of ``pos``
    (rotate-half: dim j pairs with j ± D/2 at frequency j mod D/2)."""
    KC: tl.constexpr = D if D <= 128 else 128
    HALF: tl.constexpr = D // 2
    kc = tl.arange(0, KC)
    dims = tl.arange(0, D)
    acc = tl.zeros([BLOCK_T, D], tl.float32)
    for c in tl.static_range(D // KC):
        k = tl.load(key_ptr + t64[:, None] * stride_kt + h * stride_kh + c * KC + kc[None, :], mask=live[:, None],
                    other=0.0).to(tl.float32)
        if KEY_MEAN:
            j = c * KC + kc
            freq = j % HALF
            row = cos_sin_ptr + (pos - pos % KEY_MEAN_BLOCK).to(tl.int64)[:, None] * stride_cs
            cos = tl.load(row + freq[None, :], mask=r_ok[:, None], other=0.0).to(tl.float32)
            sin = tl.load(row + HALF + freq[None, :], mask=r_ok[:, None], other=0.0).to(tl.float32)
            mean = tl.load(key_mean_ptr + h * D + j)
            partner = tl.load(key_mean_ptr + h * D + (j + HALF) % D) * tl.where(j < HALF, -1.0, 1.0)
            k = k - (mean[None, :] * cos + partner[None, :] * sin)
        rot = tl.load(rot_k_ptr + h * ROT_HEAD_STRIDE + (c * KC + kc[:, None]) * D + dims[None, :])
        acc = tl.dot(k, rot, acc, input_precision=ROTATION)
    return acc


@triton.jit
def _write_windows(k_rot, v, r, r_ok, pos, seq_len, h, ring_slot_ptr, window_k_ptr, window_v_ptr, window_pages_ptr,
                   window_pos_ptr, stride_wp, stride_page, HKV: tl.constexpr, D: tl.constexpr, SINK: tl.constexpr,
                   RECENT: tl.constexpr, WIN_E: tl.constexpr):
    """BF16 copies of the tile's sink and recent-window tokens (request ``r`` at ``pos`` of
    ``seq_len``, where ``r_ok``) into their requests' rings."""
    dims = tl.arange(0, D)
    keep = r_ok & ((pos < SINK) | (pos >= seq_len - RECENT))
    ring = tl.load(ring_slot_ptr + r, mask=keep, other=0).to(tl.int64)
    entry = window_index(pos, SINK, RECENT)
    page = window_page(window_pages_ptr, stride_wp, ring, entry, keep, stride_page, WIN_E)[:, None]
    slot = (entry % WIN_E)[:, None]
    tl.store(window_k_ptr + page + slot * (HKV * D) + h * D + dims[None, :], to_bf16_rne(k_rot), mask=keep[:, None])
    tl.store(window_v_ptr + page + (h * D + dims[None, :]) * WIN_E + slot, to_bf16_rne(v), mask=keep[:, None])
    tl.store(window_pos_ptr + ring * (SINK + RECENT) + entry, pos, mask=keep & (h == 0))


def oscar_write(
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    rot_k: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache: MixedCache,
    batch: BatchLayout,
    clip_idx_k: int,
    clip_idx_v: int,
    launch: tuple[int, int] | None = None,
    key_mean: torch.Tensor | None = None,
    cos_sin: torch.Tensor | None = None,
    rotation: str = WRITE_ROTATION,
) -> None:
    """Write ``key``/``value`` ``[T, Hkv, d]`` of ``batch``'s requests into ``cache``: the INT2 pages
    and the BF16 windows.

    ``rot_k``: the key rotation ``[d, d]`` or ``[Hkv, d, d]`` (fp32); ``slot_mapping`` int64 ``[T]``:
    each token's cache slot, tokens whose slot is negative skipped; ``clip_idx_*`` as
    ``oscar_vllm.core.quant.clip_index`` gives them. ``batch.num_decodes``: the batch's first
    requests have one token each (a hint that skips the token -> request search; 0 is always right);
    the block table is not read. ``launch``: (tokens a program, warps), else from ``WRITE_LAUNCH``.
    ``key_mean`` fp32 ``[Hkv, d]`` with ``cos_sin`` ``[P, d]`` (vLLM's ``cos_sin_cache``, over every
    position written): the INT2 pages round the keys less the mean turned to their positions.
    ``rotation``: how ``k @ R`` is multiplied, one of ``WRITE_ROTATIONS``.
    """
    t, hkv, d = key.shape
    if t == 0:
        return
    caches = cache_args(cache, hkv, d)
    check_key_mean(key_mean, cos_sin, hkv, d)
    if rotation not in WRITE_ROTATIONS:
        raise ValueError(f"rotation must be one of {WRITE_ROTATIONS}, got {rotation!r}")
    if batch.num_reqs >= 2**SEARCH_STEPS:
        raise ValueError(f"at most {2**SEARCH_STEPS - 1} requests per batch, got {batch.num_reqs}")
    block_t, num_warps = launch or launch_bucket(WRITE_LAUNCH, t)
    _oscar_write_kernel[(triton.cdiv(t, block_t), hkv)](
        key_ptr=key, value_ptr=value, rot_k_ptr=rot_k.contiguous(), slot_mapping_ptr=slot_mapping,
        cu_q_ptr=batch.cu_q, seq_lens_ptr=batch.seq_lens, ring_slot_ptr=batch.ring_slots,
        key_mean_ptr=key if key_mean is None else key_mean, cos_sin_ptr=key if cos_sin is None else cos_sin,
        num_tokens=t, num_reqs=batch.num_reqs, num_decodes=batch.num_decodes, clip_idx_k=clip_idx_k,
        clip_idx_v=clip_idx_v, stride_cs=0 if cos_sin is None else cos_sin.stride(0),
        stride_kt=key.stride(0), stride_kh=key.stride(1), stride_vt=value.stride(0), stride_vh=value.stride(1),
        ROT_HEAD_STRIDE=d * d if rot_k.dim() == 3 else 0, HKV=hkv, D=d, BLOCK_SIZE=BLOCK_SIZE,
        PARAM_BF16=cache.param_dtype == torch.bfloat16, BLOCK_T=block_t, SEARCH_STEPS=SEARCH_STEPS,
        KEY_MEAN=key_mean is not None, ROTATION=rotation, num_warps=num_warps, **caches,
    )


# ----------------------------------------------------------------- decode: write before attention

@gluon.constexpr_function
def _acc_layout(num_warps):
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, num_warps], instr_shape=[16, 8])


@gluon.jit
def _kth_smallest_abs_4ary(x, k):
    """The ``k``-th smallest (0-based) ``|x|`` of each row of ``[R, D]``, exactly: a search on
    the bit pattern (ordered like the values for non-negative floats), two bits a step (16
    steps of three independent counts instead of 31 of one). Rows live in one warp each, so a
    count is a warp's shuffles, never a barrier."""
    bits = gl.abs(x).to(gl.int32, bitcast=True)
    lo = gl.zeros([x.shape[0]], gl.int32, layout=gl.SliceLayout(1, x.type.layout))
    hi = gl.max(bits, axis=1)
    for _ in gl.static_range(16):
        q1 = lo + (hi - lo) // 4
        q2 = lo + (hi - lo) // 2
        q3 = hi - (hi - lo) // 4
        # The smallest pattern with more than k entries at or below it lies in [lo, hi].
        c1 = gl.sum((bits <= q1[:, None]).to(gl.int32), axis=1) > k
        c2 = gl.sum((bits <= q2[:, None]).to(gl.int32), axis=1) > k
        c3 = gl.sum((bits <= q3[:, None]).to(gl.int32), axis=1) > k
        new_hi = gl.where(c1, q1, gl.where(c2, q2, gl.where(c3, q3, hi)))
        lo = gl.where(c1, lo, gl.where(c2, q1 + 1, gl.where(c3, q2 + 1, q3 + 1)))
        hi = new_hi
    return hi.to(gl.float32, bitcast=True)


@gluon.jit
def _kth_largest_peeled_warp(bits, j, rounds):
    """Per row of ``bits`` ``[R, D]`` (bit patterns of non-negative floats, which order as the
    floats do; a row a warp): its ``j[r]``-th largest entry (0: the largest, copies counted), or
    -1 where that lies deeper than ``rounds`` distinct values from the top. A round peels the
    top value off: two warp reductions, the max and the count of its copies."""
    ROWS: gl.constexpr = gl.SliceLayout(1, bits.type.layout)
    left = bits
    above = gl.zeros([bits.shape[0]], gl.int32, layout=ROWS)
    found = gl.full([bits.shape[0]], -1, gl.int32, layout=ROWS)
    for _ in range(rounds):
        top = gl.max(left, axis=1)
        is_top = left == top[:, None]
        copies = gl.sum(is_top.to(gl.int32), axis=1)
        found = gl.where((found < 0) & (above + copies > j), top, found)
        above += copies
        left = gl.where(is_top, -1, left)
    return found


@gluon.jit
def _quantize_rows_warp(x, clip_idx, clip_k, clip_v):
    """``_quantize_rows`` for rows that each live in one warp, each row its own ``clip_idx``
    (``[R]``: ``clip_k`` or ``clip_v``, -1 = no clip): (codes, scale, min). The thresholds are
    peeled off the rows' tops when every clipping row's lies within ``PEEL_ROUNDS`` of it."""
    D: gl.constexpr = x.shape[1]
    if (clip_k >= 0) | (clip_v >= 0):
        # The deepest rank from the top any clipping row's threshold has.
        rank = -gl.minimum(gl.where(clip_k >= 0, clip_k, D), gl.where(clip_v >= 0, clip_v, D)) + (D - 1)
        if rank < PEEL_ROUNDS:
            bits = gl.abs(x).to(gl.int32, bitcast=True)
            thr = _kth_largest_peeled_warp(bits, -clip_idx + (D - 1), rank + 1).to(gl.float32, bitcast=True)
        else:
            thr = _kth_smallest_abs_4ary(x, clip_idx)
        thr = gl.where(clip_idx >= 0, thr, float("inf"))[:, None]
        x = gl.minimum(gl.maximum(x, -thr), thr)
    lo = gl.min(x, axis=1)
    hi = gl.max(x, axis=1)
    scale = gl.div_rn(gl.maximum(hi - lo, 1e-8), 3.0)
    zero = gl.div_rn(-lo, scale)
    codes = gl.floor(gl.div_rn(x, scale[:, None]) + zero[:, None] + 0.5)
    codes = gl.minimum(gl.maximum(codes, 0.0), 3.0).to(gl.int32)
    return codes, scale, lo


@gluon.jit
def _gl_bf16_bits_rne(x):
    """fp32 -> bf16 bit pattern, round to nearest even (as ``paged_layout.bf16_bits_rne``)."""
    bits = x.to(gl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(gl.uint16)


@gluon.jit
def _gl_to_param(x, PARAM_BF16: gl.constexpr):
    if PARAM_BF16:
        y = _gl_bf16_bits_rne(x).to(gl.bfloat16, bitcast=True)
    else:
        y = x.to(gl.float16)
    return y


@gluon.jit
def _times_rotation(x, r_hi, r_lo, acc):
    """``x @ R`` for 16-bit rows ``x`` (A fragment), R as two bf16 terms (B fragments): the
    small term first. fp16 rows are split into a bf16 high and low part (exact)."""
    if x.dtype == gl.bfloat16:
        acc = mma_v2(x, r_lo, acc)
        acc = mma_v2(x, r_hi, acc)
    else:
        xf = x.to(gl.float32)
        x_hi = xf.to(gl.bfloat16)
        x_lo = (xf - x_hi.to(gl.float32)).to(gl.bfloat16)
        acc = mma_v2(x_lo, r_lo, acc)
        acc = mma_v2(x_hi, r_lo, acc)
        acc = mma_v2(x_lo, r_hi, acc)
        acc = mma_v2(x_hi, r_hi, acc)
    return acc


@gluon.jit
def _turned_mean(key_mean_ptr, cos_sin_ptr, stride_cs, h, pos, ok, dim, D: gl.constexpr):
    """fp32 ``[R, D]``: KV head ``h``'s block mean before RoPE turned to the first position of the
    block of each row's position ``pos`` ``[R]`` (rows not ``ok``: zero) by the table's rows, in the
    rotate-half form (dim ``i`` pairs with ``i ± D/2``); ``dim`` ``[D]`` indexes the columns."""
    HALF: gl.constexpr = D // 2
    pair = dim % HALF
    mu = gl.load(key_mean_ptr + h * D + dim)
    other = gl.load(key_mean_ptr + h * D + (dim + HALF) % D)
    rot_half = gl.where(dim < HALF, -other, other)
    row = cos_sin_ptr + (pos - pos % KEY_MEAN_BLOCK).to(gl.int64)[:, None] * stride_cs + pair[None, :]
    cos = gl.load(row, mask=ok[:, None], other=0.0)
    sin = gl.load(row + HALF, mask=ok[:, None], other=0.0)
    return mu[None, :] * cos + rot_half[None, :] * sin


# One program: TP decode tokens (one request each) of one KV head.
@gluon.jit(do_not_specialize=["num_tokens", "clip_idx_k", "clip_idx_v"],
           do_not_specialize_on_alignment=["slot_mapping_ptr", "seq_lens_ptr", "ring_slot_ptr"])
def _oscar_write_decode_kernel(
    key_ptr,  # [T, HKV, D] this step's keys, RoPE applied, not rotated
    value_ptr,  # [T, HKV, D] this step's values, already in the rotated basis
    query_ptr,  # [T, HKV * G, D] this step's queries, RoPE applied
    q_rot_ptr,  # [T, HKV * G, D] out: the queries in the key-rotated basis (query's dtype)
    rot_t_ptr,  # bf16 [2, D, D] (or [2, HKV, D, D]): R transposed ([.., j, i] = R[i, j]) as hi + lo
    slot_mapping_ptr,  # int64 [T] cache slot of each token, < 0: padding
    seq_lens_ptr,  # int32 [T] sequence length after this step (token t is request t)
    ring_slot_ptr,  # int32 [T]
    codes_ptr,  # uint8 [num_blocks, HKV, REGION] INT2 pages (paged_layout)
    params_ptr,  # 16-bit view of the same pages
    window_k_ptr,  # bf16 [num_pages, page_elems] window pages: keys first
    window_v_ptr,  # the same pages from their values, stored transposed
    window_pages_ptr,  # int32 [S, pages per ring]
    window_pos_ptr,  # int32 [S, SINK + RECENT]
    num_tokens,
    clip_idx_k,  # sorted-|x| index of the K clip threshold, -1 = no clip
    clip_idx_v,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb,  # bytes from one cache block to the next
    stride_wp,  # window_pages row stride
    stride_page,  # elements from one window page to the next
    key_mean_ptr,  # fp32 [HKV, D] each KV head's mean key before RoPE (KEY_MEAN)
    cos_sin_ptr,  # fp32 [P, D] RoPE table: each position's D/2 cosines, then its D/2 sines (KEY_MEAN)
    stride_cs,
    ROT_HEAD_STRIDE: gl.constexpr,
    HKV: gl.constexpr,
    G: gl.constexpr,
    D: gl.constexpr,
    SINK: gl.constexpr,
    RECENT: gl.constexpr,
    WIN_E: gl.constexpr,
    PARAM_BF16: gl.constexpr,
    TP: gl.constexpr,  # tokens a program
    QM: gl.constexpr,  # TP * G padded to a power of two >= 16: the queries' MMA rows
    KM: gl.constexpr,  # TP padded to a power of two >= 16: the keys' MMA rows
    R_TERM: gl.constexpr,  # elements from one bf16 term of rot_t to the next
    KEY_MEAN: gl.constexpr,  # the page rounds the keys less their mean before RoPE; the ring keeps them whole
):
    NW: gl.constexpr = gl.num_warps()
    Q: gl.constexpr = D // 4
    REGION: gl.constexpr = int2_region_bytes(D)
    h = gl.program_id(1)
    t0 = gl.program_id(0) * TP

    # Keys and queries times R on the tensor cores: R (fp32) as two bf16 terms (``decode_rotation``:
    # 16 significant bits, within 2^-16 of each entry) and the keys as one or two (bf16 models:
    # exact; fp16: high and low part), products exact. R's load is the kernel's largest cost (a
    # KV head's R into each program: results/kernels/write_decode_variants); a third term, exact
    # to fp32, cost 2/3 more of it for differences far below the 2-bit codes' steps.
    ACC: gl.constexpr = _acc_layout(NW)
    A_X: gl.constexpr = gl.DotOperandLayout(0, ACC, 8)
    B_R: gl.constexpr = gl.DotOperandLayout(1, ACC, 8)
    rk = gl.arange(0, D, layout=gl.SliceLayout(1, B_R))
    rj = gl.arange(0, D, layout=gl.SliceLayout(0, B_R))
    r_ptr = rot_t_ptr + h * ROT_HEAD_STRIDE + rj[None, :] * D + rk[:, None]
    r_hi = gl.load(r_ptr)
    r_lo = gl.load(r_ptr + R_TERM)
    xd = gl.arange(0, D, layout=gl.SliceLayout(0, A_X))

    qr = gl.arange(0, QM, layout=gl.SliceLayout(1, A_X))
    q_ok = (qr < TP * G) & (t0 + qr // G < num_tokens)
    q = gl.load(query_ptr + (t0 + qr // G).to(gl.int64)[:, None] * stride_qt + (h * G + qr % G)[:, None] * stride_qh
                + xd[None, :], mask=q_ok[:, None], other=0.0)
    q_rot = _times_rotation(q, r_hi, r_lo, gl.zeros([QM, D], gl.float32, layout=ACC))
    orow = gl.arange(0, QM, layout=gl.SliceLayout(1, ACC))
    o_ok = (orow < TP * G) & (t0 + orow // G < num_tokens)
    gl.store(q_rot_ptr + (t0 + orow // G).to(gl.int64)[:, None] * stride_ot + (h * G + orow % G)[:, None] * stride_oh
             + gl.arange(0, D, layout=gl.SliceLayout(0, ACC))[None, :], q_rot.to(q_rot_ptr.dtype.element_ty),
             mask=o_ok[:, None])

    kr = gl.arange(0, KM, layout=gl.SliceLayout(1, A_X))
    k_ok = (kr < TP) & (t0 + kr < num_tokens)
    k = gl.load(key_ptr + (t0 + kr).to(gl.int64)[:, None] * stride_kt + h * stride_kh + xd[None, :],
                mask=k_ok[:, None], other=0.0)
    k_rot = _times_rotation(k, r_hi, r_lo, gl.zeros([KM, D], gl.float32, layout=ACC))
    if KEY_MEAN:
        # The mean turned to each key's position, times R apart (fp32 rows: a high and a low term).
        # Rows a full CUDA graph pads the batch with have sequence length 0: position -1 would read
        # the row before the table (an illegal address on the H100, 2026-12-05), so they get no mean.
        k_pos = gl.load(seq_lens_ptr + t0 + kr, mask=k_ok, other=0) - 1
        mean = _turned_mean(key_mean_ptr, cos_sin_ptr, stride_cs, h, k_pos, k_ok & (k_pos >= 0), xd, D)
        mean_rot = _times_rotation(mean, r_hi, r_lo, gl.zeros([KM, D], gl.float32, layout=ACC))

    # Clip, quantize, pack: one set of rows, the TP keys (rotated) then the TP values, a row per
    # warp, lane l holding dims l, l+Q, l+2Q, l+3Q (the byte of the quartered packing it writes).
    # The keys' MMA rows from TP on are exact zeros, so the values are loaded into rows TP..2TP-1
    # and the remaining zero rows summed away: each warp runs one clip search (most of the
    # kernel's instructions) over a row of its own, for K and V alike.
    QL: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [NW, 1], [1, 0])
    XM: gl.constexpr = 2 * TP
    xr = gl.arange(0, KM, layout=gl.SliceLayout(1, QL))
    dq = gl.arange(0, D, layout=gl.SliceLayout(0, QL))
    vt = t0 + xr - TP
    v_ok = (xr >= TP) & (xr < XM) & (vt < num_tokens)
    v = gl.load(value_ptr + vt.to(gl.int64)[:, None] * stride_vt + h * stride_vh + dq[None, :], mask=v_ok[:, None],
                other=0.0).to(gl.float32)
    x = gl.convert_layout(k_rot, QL) + v
    if KM > XM:
        x = gl.convert_layout(gl.sum(gl.reshape(x, [KM // XM, XM, D]), axis=0), QL)
    x_page = x
    if KEY_MEAN:  # rows past the keys' are zero in mean_rot: the value rows keep their own
        m = gl.convert_layout(mean_rot, QL)
        if KM > XM:
            m = gl.convert_layout(gl.sum(gl.reshape(m, [KM // XM, XM, D]), axis=0), QL)
        x_page = x - m
    r = gl.arange(0, XM, layout=gl.SliceLayout(1, QL))
    is_k = r < TP
    t_ok = t0 + r % TP < num_tokens
    tok = (t0 + r % TP).to(gl.int64)
    slot = gl.load(slot_mapping_ptr + tok, mask=t_ok, other=-1)
    live = slot >= 0
    codes, scale, x_min = _quantize_rows_warp(x_page, gl.where(is_k, clip_idx_k, clip_idx_v), clip_idx_k, clip_idx_v)
    base = (slot // 64) * stride_cb + h * REGION
    blk_tok = (slot % 64).to(gl.int32)
    shift = 2 * (dq // Q)
    packed = gl.convert_layout(gl.sum(gl.reshape(codes << shift[None, :], [XM, 4, Q]), axis=1).to(gl.uint8), QL)
    jb = gl.arange(0, Q, layout=gl.SliceLayout(0, QL))
    # K codes: a token's Q bytes in a row; V codes: Q rows of 64 tokens, in v_column's order.
    v_col = 16 * ((blk_tok >> 4) & 3) + 2 * (blk_tok & 7) + ((blk_tok >> 3) & 1)
    code_at = gl.where(is_k[:, None], blk_tok[:, None] * Q + jb[None, :], 64 * Q + jb[None, :] * 64 + v_col[:, None])
    gl.store(codes_ptr + base[:, None] + code_at, packed, mask=live[:, None])
    # Scales then mins, K's 64 tokens then V's.
    p = params_ptr + (base + int2_params_at(D)) // 2 + blk_tok + gl.where(is_k, 0, 128)
    gl.store(p, _gl_to_param(scale, PARAM_BF16), mask=live)
    gl.store(p + 64, _gl_to_param(x_min, PARAM_BF16), mask=live)

    # The ring: a decode token is the newest position, always in the recent window (and in the
    # sink while the sequence is shorter than it).
    seq_len = gl.load(seq_lens_ptr + tok, mask=live, other=1)
    pos = seq_len - 1
    keep = live & ((pos < SINK) | (RECENT > 0))
    ring = gl.load(ring_slot_ptr + tok, mask=keep, other=0).to(gl.int64)
    entry = gl.where(pos < SINK, pos, SINK + (pos - SINK) % gl.maximum(RECENT, 1))
    page = gl.load(window_pages_ptr + ring * stride_wp + entry // WIN_E, mask=keep, other=0).to(gl.int64) * stride_page
    wslot = (entry % WIN_E).to(gl.int64)
    # Keys as rows of the page, values transposed (the unclipped rows, as the reference keeps).
    w_ptr = gl.where(is_k[:, None], window_k_ptr + (page + wslot * (HKV * D) + h * D)[:, None] + dq[None, :],
                     window_v_ptr + (page + h * D * WIN_E + wslot)[:, None] + dq[None, :] * WIN_E)
    gl.store(w_ptr, _gl_bf16_bits_rne(x).to(gl.bfloat16, bitcast=True), mask=keep[:, None])
    gl.store(window_pos_ptr + ring * (SINK + RECENT) + entry, pos, mask=keep & is_k & (h == 0))


def oscar_write_decode(
    key: torch.Tensor,
    value: torch.Tensor,
    query: torch.Tensor,
    q_rot: torch.Tensor,
    *,
    rot_t: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache: MixedCache,
    batch: BatchLayout,
    clip_idx_k: int,
    clip_idx_v: int,
    num_warps: int | None = None,
    query_rows: int | None = None,
    key_mean: torch.Tensor | None = None,
    cos_sin: torch.Tensor | None = None,
) -> None:
    """A decode batch's write, before its attention: token ``t`` (request ``t`` of ``batch``, whose
    ``seq_lens`` and ``ring_slots`` it reads) of ``key``/``value`` ``[T, Hkv, d]`` into the INT2 pages
    and its ring (as ``oscar_write``), and its queries ``query`` ``[T, Hq, d]`` rotated into ``q_rot``
    (same shape, in the same launch). ``rot_t``: the key rotation as ``decode_rotation`` gives it.
    ``num_warps``, ``query_rows``: instead of ``decode_write_tiles``' (benchmarks, tests).
    ``key_mean``, ``cos_sin``: the pages round the keys less their mean before RoPE (as
    ``oscar_write``'s)."""
    t, hkv, d = key.shape
    if t == 0:
        return
    caches = cache_args(cache, hkv, d)
    check_key_mean(key_mean, cos_sin, hkv, d)
    g = query.shape[1] // hkv
    tiles = decode_write_tiles(g, d, t, query_rows)
    if num_warps:
        tiles["num_warps"] = num_warps
    _oscar_write_decode_kernel[(triton.cdiv(t, tiles["TP"]), hkv)](
        key_ptr=key, value_ptr=value, query_ptr=query, q_rot_ptr=q_rot, rot_t_ptr=rot_t, slot_mapping_ptr=slot_mapping,
        seq_lens_ptr=batch.seq_lens, ring_slot_ptr=batch.ring_slots, num_tokens=t, clip_idx_k=clip_idx_k,
        clip_idx_v=clip_idx_v, stride_kt=key.stride(0), stride_kh=key.stride(1), stride_vt=value.stride(0),
        stride_vh=value.stride(1), stride_qt=query.stride(0), stride_qh=query.stride(1), stride_ot=q_rot.stride(0),
        stride_oh=q_rot.stride(1), key_mean_ptr=key if key_mean is None else key_mean,
        cos_sin_ptr=key if cos_sin is None else cos_sin, stride_cs=0 if cos_sin is None else cos_sin.stride(0),
        ROT_HEAD_STRIDE=d * d if rot_t.dim() == 4 else 0, HKV=hkv, G=g, D=d,
        PARAM_BF16=cache.param_dtype == torch.bfloat16, R_TERM=rot_t[0].numel(), KEY_MEAN=key_mean is not None,
        **caches, **tiles,
    )


def decode_rotation(rot_k: torch.Tensor) -> torch.Tensor:
    """``rot_k`` ``[d, d]`` or ``[Hkv, d, d]`` (fp32) transposed and split into two bf16 terms,
    the rounded value and the rounded rest (their sum within 2^-16 of each entry, relative),
    ``[2, ..., d, d]``: ``oscar_write_decode``'s operand."""
    r = rot_k.transpose(-1, -2).contiguous().float()
    hi = r.to(torch.bfloat16)
    return torch.stack([hi, (r - hi.float()).to(torch.bfloat16)])
