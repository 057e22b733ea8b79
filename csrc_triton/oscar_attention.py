"""Attention over the OSCAR mixed cache, as vLLM schedules it: the Triton kernel of decode
batches (the fallback where ``oscar_decode`` does not serve) and of prefill chunks over a cached
prefix, and its launchers ``oscar_decode_attention`` and ``oscar_prefill_attention``.

A program owns a q-block (up to ``BLOCK_Q`` query tokens of one request, times the ``G``
query heads of one KV head, so K/V are read once for the whole GQA group) and a split of the
request's cached prefix ``[0, ctx)``, one kernel block (64 tokens) per step:

* INT2 blocks are read packed and never dequantized: the codes become exact small numbers
  (``_codes``: a few bit operations, no int-to-float conversion) that go straight into the
  matrix products, and the per-token scale and min are applied outside them,
  ``score = s_k·(q·c) + m_k·Σq`` and ``out += (p·s_v)·C + Σ p·m_v``. The score of an INT2 key
  also loses the logit correction ``coef·‖q‖²·s_k²`` (``paged_layout.logit_coef``: λ/2 times
  its expected rounding variance); BF16 ring keys and the step's own keys never do.
* Blocks that touch the sink or some query's recent window also read the request's BF16 ring
  and use it where it holds the position (scores and values alike); all other blocks take a
  loop with no ring logic at all.
* The step's own keys come straight from ``k``/``v`` (causal), or, for prefill, from a
  FlashAttention pass run before this kernel, whose output and log-sum-exp are merged in.

Queries are in the key-rotated basis (``q_rot``) against the cache; ``q·k == (qR)·(kR)``
lets the step's own keys use the unrotated ``q``. Values stay in the folded value basis.
Decode splits the prefix over up to ``num_splits`` programs (flash-decoding); the number a
request uses follows its length, computed on the GPU, so the launch depends only on the batch
size and replays in CUDA graphs. ``merge_splits`` merges them by log-sum-exp. Which requests of a
batch take this kernel, and which the dense FlashAttention path over a dequantized prefix, is the
host's choice (``oscar_vllm.serving.prefill``).

Reference: :func:`oscar_vllm.reference.oscar_attention.oscar_attention_reference`.
"""
import torch
import triton
import triton.language as tl

from csrc_triton.merge_splits import merge_splits
from csrc_triton.paged_layout import (
    BLOCK_SIZE,
    DECODE_LAUNCH,
    PREFILL_LAUNCH,
    SMALL_HEAD_PREFILL_LAUNCH,
    UNIT_0,
    UNIT_1,
    UNIT_2,
    UNIT_3,
    BatchLayout,
    MixedCache,
    cache_args,
    check_key_mean,
    find_request,
    int2_params_at,
    int2_region_bytes,
    launch_bucket,
    logit_coef,
    split_scratch,
    window_index,
    v_token,
    window_page,
)
# The decode kernel's split policy, as the backend reads it off the kernel's module (defined in paged_layout).
from csrc_triton.paged_layout import (
    MAX_DECODE_SPLITS as MAX_DECODE_SPLITS,
    decode_split_rows as decode_split_rows,
    decode_splits as decode_splits,
)

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # the same, readable inside kernels
MIN_SPLIT_BLOCKS = tl.constexpr(4)  # a split reads at least 4 blocks (256 tokens): shorter ones cost more to merge


def _unpack_asm(shift: int) -> str:
    """PTX: 4 packed bytes -> their 2-bit codes at bit ``shift``, each as an exact fp16 number.

    A 16-bit pattern whose exponent bits are zero is the subnormal ``mantissa·2^-24``, so a code
    masked in place, ``c << shift``, *is* the fp16 number ``c·2^shift·2^-24``: two byte permutes
    (each byte into its own 16-bit lane) and two ANDs for four codes, no conversion at all. The
    tensor cores take fp16 subnormals exactly; the kernel folds ``2^shift·2^-24`` into its scales.
    """
    mask = 0x0003_0003 << shift
    return (
        "{ .reg .b32 z;\n"
        "mov.b32 z, 0;\n"
        "prmt.b32 $0, z, $2, 0x0504;\n"  # bytes 0, 1 -> the low bytes of two 16-bit lanes
        "prmt.b32 $1, z, $2, 0x0706;\n"  # bytes 2, 3
        f"and.b32 $0, $0, {mask:#010x};\n"
        f"and.b32 $1, $1, {mask:#010x}; }}"
    )


UNPACK_ASM_0 = tl.constexpr(_unpack_asm(0))
UNPACK_ASM_1 = tl.constexpr(_unpack_asm(2))
UNPACK_ASM_2 = tl.constexpr(_unpack_asm(4))
UNPACK_ASM_3 = tl.constexpr(_unpack_asm(6))


@triton.jit
def _codes(packed, I: tl.constexpr, DOT_DT: tl.constexpr, USE_ASM: tl.constexpr):
    """Quarter ``I`` of packed INT2 bytes (bits 2I, 2I+1): the code ``c`` as the exact number
    ``c·4^I·2^-24`` in ``DOT_DT``."""
    if USE_ASM:
        if I == 0:
            x = tl.inline_asm_elementwise(UNPACK_ASM_0, "=r,=r,r", [packed], dtype=tl.float16, is_pure=True, pack=4)
        elif I == 1:
            x = tl.inline_asm_elementwise(UNPACK_ASM_1, "=r,=r,r", [packed], dtype=tl.float16, is_pure=True, pack=4)
        elif I == 2:
            x = tl.inline_asm_elementwise(UNPACK_ASM_2, "=r,=r,r", [packed], dtype=tl.float16, is_pure=True, pack=4)
        else:
            x = tl.inline_asm_elementwise(UNPACK_ASM_3, "=r,=r,r", [packed], dtype=tl.float16, is_pure=True, pack=4)
    else:
        # The same bits in plain Triton (runs under the interpreter too).
        bits = (packed.to(tl.int32) & (3 << (2 * I))).to(tl.uint16)
        x = bits.to(tl.float16, bitcast=True).to(DOT_DT)
    return x


@triton.jit
def _load_quarters(ptr, row_off, row_mask, Q: tl.constexpr, DT: tl.constexpr):
    """Four ``[rows, Q]`` tiles in ``DT``: dims ``[iQ, (i+1)Q)`` of rows at ``ptr + row_off``."""
    p = ptr + row_off[:, None] + tl.arange(0, Q)[None, :]
    m = row_mask[:, None]
    x0 = tl.load(p, mask=m, other=0.0).to(DT)
    x1 = tl.load(p + Q, mask=m, other=0.0).to(DT)
    x2 = tl.load(p + 2 * Q, mask=m, other=0.0).to(DT)
    x3 = tl.load(p + 3 * Q, mask=m, other=0.0).to(DT)
    return x0, x1, x2, x3


@triton.jit
def _load_quarters_t(ptr, col_off, col_mask, Q: tl.constexpr, DT: tl.constexpr):
    """Four ``[Q, cols]`` tiles: the transposes of ``_load_quarters`` (keys for ``q @ K^T``)."""
    p = ptr + col_off[None, :] + tl.arange(0, Q)[:, None]
    m = col_mask[None, :]
    x0 = tl.load(p, mask=m, other=0.0).to(DT)
    x1 = tl.load(p + Q, mask=m, other=0.0).to(DT)
    x2 = tl.load(p + 2 * Q, mask=m, other=0.0).to(DT)
    x3 = tl.load(p + 3 * Q, mask=m, other=0.0).to(DT)
    return x0, x1, x2, x3


@triton.jit
def _load_values_t(ptr, row_off, row_mask, Q: tl.constexpr, WIN_E: tl.constexpr, DT: tl.constexpr):
    """Four ``[rows, Q]`` tiles of ring values, which pages store transposed (dim ``d`` of a
    row at ``row_off + d * WIN_E``)."""
    p = ptr + row_off[:, None] + tl.arange(0, Q)[None, :] * WIN_E
    m = row_mask[:, None]
    x0 = tl.load(p, mask=m, other=0.0).to(DT)
    x1 = tl.load(p + Q * WIN_E, mask=m, other=0.0).to(DT)
    x2 = tl.load(p + 2 * Q * WIN_E, mask=m, other=0.0).to(DT)
    x3 = tl.load(p + 3 * Q * WIN_E, mask=m, other=0.0).to(DT)
    return x0, x1, x2, x3


@triton.jit
def _dot4(a0, a1, a2, a3, b0, b1, b2, b3, PRECISION: tl.constexpr):
    """``sum_i a_i @ b_i``: a full-D product assembled from quarter tiles."""
    s = tl.dot(a0, b0, input_precision=PRECISION)
    s = tl.dot(a1, b1, s, input_precision=PRECISION)
    s = tl.dot(a2, b2, s, input_precision=PRECISION)
    return tl.dot(a3, b3, s, input_precision=PRECISION)


@triton.jit
def _online_softmax(m_i, l_i, s):
    """One step of the online softmax over scores ``s`` (log2 domain, masked with -inf).

    Returns the new running max and sum, the factor ``alpha`` the accumulators are rescaled by,
    and the tile's probabilities ``p``.
    """
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return m_new, l_i * alpha + tl.sum(p, axis=1), alpha, p


@triton.jit
def _ring_lookup(window_pos_ptr, ring, kp, k_ok, SINK: tl.constexpr, RECENT: tl.constexpr):
    """Ring entry of each key position ``kp`` and whether the ring holds that position."""
    entry = window_index(kp, SINK, RECENT)
    held = tl.load(window_pos_ptr + ring * (SINK + RECENT) + entry, mask=k_ok, other=-1) == kp
    return entry, held


@triton.jit
def _attend_int2_block(
    state, query, blk, ctx, h, ring, pages, rings, mean, qk_scale,
    HKV: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, SINK: tl.constexpr, RECENT: tl.constexpr,
    WIN_E: tl.constexpr, WINDOW: tl.constexpr, DOT_DT: tl.constexpr, USE_ASM: tl.constexpr,
    PRECISION: tl.constexpr, KEY_MEAN: tl.constexpr,
):
    """Attend to the prefix keys of block ``blk`` (logical index in the request's table): the
    running softmax ``state``, ``(m_i, l_i, acc0, acc1, acc2, acc3, acc_min)``, updated.

    ``query``: ``(qs0, qs1, qs2, qs3, q_sum, q_corr, row_ok)``. ``qs_i`` are query quarters times
    ``4^-i``, so that ``sum_i qs_i @ codes_i = 2^-24 (q·c)``; ``acc_i`` hold values times
    ``4^i·2^-24`` (``UNIT_i``), as the INT2 products leave them. ``q_corr`` ``[rows]``:
    ``coef·‖q‖²``, each row's logit correction per unit of ``s_k²``. ``pages``: ``(codes_ptr,
    params_ptr, stride_cb, bt_ptr)``, the INT2 pages and the request's block table row;
    ``rings``: ``(window_k_ptr, window_v_ptr, window_pages_ptr, window_pos_ptr, stride_wp,
    stride_page)``, the ring pages (``ring``: the request's ring). With ``WINDOW`` the BF16 ring
    replaces a key wherever it holds it and the key is in the sink or the ``RECENT`` keys before
    ``ctx`` (the window as the step found it, the same for every query of a prefill chunk; a
    partial last block is masked); without, the block is full and INT2 only, and the loop carries
    no masks at all. ``KEY_MEAN``: the INT2 keys were rounded less their block's mean, the mean
    turned to the block's first position, which ``mean``, ``(q_mean, cos_sin_ptr, stride_cs)``,
    adds back: each row's ``q_mean`` ``[rows, D]`` (``key_mean_coefficients``) times that RoPE
    table row, one logit a row for the whole block.
    """
    m_i, l_i, acc0, acc1, acc2, acc3, acc_min = state
    qs0, qs1, qs2, qs3, q_sum, q_corr, row_ok = query
    codes_ptr, params_ptr, stride_cb, bt_ptr = pages
    window_k_ptr, window_v_ptr, window_pages_ptr, window_pos_ptr, stride_wp, stride_page = rings
    q_mean, cos_sin_ptr, stride_cs = mean
    Q: tl.constexpr = D // 4
    REGION: tl.constexpr = int2_region_bytes(D, BLOCK_SIZE)
    # The block's keys in the V codes' column order, so that V loads stay contiguous.
    col = tl.arange(0, BLOCK_SIZE)
    tok = v_token(col)
    kp = blk * BLOCK_SIZE + tok
    base = tl.load(bt_ptr + blk).to(tl.int64) * stride_cb + h * REGION
    j = tl.arange(0, Q)
    # Whole blocks are read (they are allocated); keys past ctx are masked in window blocks.
    k_codes = tl.load(codes_ptr + base + tok[None, :] * Q + j[:, None])  # [Q, BS]: K^T, dims contiguous
    v_codes = tl.load(codes_ptr + base + BLOCK_SIZE * Q + j[None, :] * BLOCK_SIZE + col[:, None])  # [BS, Q]
    p_ptr = params_ptr + (base + int2_params_at(D, BLOCK_SIZE)) // 2 + tok
    # Scales and mins per key, with the softmax scale (and 2^24 for the codes) folded in.
    k_scale = tl.load(p_ptr).to(tl.float32)
    k_var = k_scale * k_scale
    k_scale = k_scale * (qk_scale * 16777216.0)
    k_min = tl.load(p_ptr + BLOCK_SIZE).to(tl.float32) * qk_scale
    v_scale = tl.load(p_ptr + 2 * BLOCK_SIZE).to(tl.float32)
    v_min = tl.load(p_ptr + 3 * BLOCK_SIZE).to(tl.float32)

    s = tl.dot(qs0, _codes(k_codes, 0, DOT_DT, USE_ASM), input_precision=PRECISION)
    s = tl.dot(qs1, _codes(k_codes, 1, DOT_DT, USE_ASM), s, input_precision=PRECISION)
    s = tl.dot(qs2, _codes(k_codes, 2, DOT_DT, USE_ASM), s, input_precision=PRECISION)
    s = tl.dot(qs3, _codes(k_codes, 3, DOT_DT, USE_ASM), s, input_precision=PRECISION)
    # The min term, and the logit correction (exactly nothing at λ = 0); ring keys replace both.
    s = s * k_scale[None, :] + q_sum[:, None] * k_min[None, :] - q_corr[:, None] * k_var[None, :]
    if KEY_MEAN:
        first_row = tl.load(cos_sin_ptr + blk * BLOCK_SIZE * stride_cs + tl.arange(0, D))  # < 2^31: P·D
        s += (tl.sum(q_mean * first_row.to(tl.float32)[None, :], axis=1) * qk_scale)[:, None]
    if WINDOW:
        k_ok = kp < ctx
        # Zeroed past ctx, where the bytes are whatever the allocator left (NaN would poison p·s_v).
        v_scale = tl.where(k_ok, v_scale, 0.0)
        v_min = tl.where(k_ok, v_min, 0.0)
        entry, held = _ring_lookup(window_pos_ptr, ring, kp, k_ok, SINK, RECENT)
        in_window = (held & ((kp < SINK) | (ctx - kp < RECENT)))[None, :]
        page = window_page(window_pages_ptr, stride_wp, ring, entry, held, stride_page, WIN_E)
        slot = entry % WIN_E
        rk0, rk1, rk2, rk3 = _load_quarters_t(window_k_ptr, page + slot * (HKV * D) + h * D, held, Q, DOT_DT)
        s_ring = _dot4((qs0 * 1.0).to(DOT_DT), (qs1 * 4.0).to(DOT_DT), (qs2 * 16.0).to(DOT_DT),
                       (qs3 * 64.0).to(DOT_DT), rk0, rk1, rk2, rk3, PRECISION)
        s = tl.where(in_window, s_ring * qk_scale, s)
        s = tl.where(row_ok[:, None] & k_ok[None, :], s, float("-inf"))
    m_prev = m_i
    m_i, l_i, alpha, p = _online_softmax(m_i, l_i, s)
    # Past the first blocks (the sink holds the largest scores) the running max rarely moves:
    # rescale the accumulators only when it did.
    if tl.max(m_i - m_prev, axis=0) > 0:
        acc0 = acc0 * alpha[:, None]
        acc1 = acc1 * alpha[:, None]
        acc2 = acc2 * alpha[:, None]
        acc3 = acc3 * alpha[:, None]
        acc_min = acc_min * alpha
    if WINDOW:
        p_int2 = tl.where(in_window, 0.0, p)
    else:
        p_int2 = p
    acc_min += tl.sum(p_int2 * v_min[None, :], axis=1)
    pv = (p_int2 * v_scale[None, :]).to(DOT_DT)
    acc0 = tl.dot(pv, _codes(v_codes, 0, DOT_DT, USE_ASM), acc0, input_precision=PRECISION)
    acc1 = tl.dot(pv, _codes(v_codes, 1, DOT_DT, USE_ASM), acc1, input_precision=PRECISION)
    acc2 = tl.dot(pv, _codes(v_codes, 2, DOT_DT, USE_ASM), acc2, input_precision=PRECISION)
    acc3 = tl.dot(pv, _codes(v_codes, 3, DOT_DT, USE_ASM), acc3, input_precision=PRECISION)
    if WINDOW:
        p_ring = tl.where(in_window, p, 0.0).to(DOT_DT)
        rv0, rv1, rv2, rv3 = _load_values_t(window_v_ptr, page + h * D * WIN_E + slot, held, Q, WIN_E, DOT_DT)
        acc0, acc1, acc2, acc3 = _add_true_values(acc0, acc1, acc2, acc3, p_ring, rv0, rv1, rv2, rv3, PRECISION)
    return m_i, l_i, acc0, acc1, acc2, acc3, acc_min


@triton.jit
def _add_true_values(acc0, acc1, acc2, acc3, p, v0, v1, v2, v3, PRECISION: tl.constexpr):
    """``acc_i += (p @ v_i)·UNIT_i``: plain values into the accumulators' INT2 units."""
    acc0 += tl.dot(p, v0, input_precision=PRECISION) * UNIT_0
    acc1 += tl.dot(p, v1, input_precision=PRECISION) * UNIT_1
    acc2 += tl.dot(p, v2, input_precision=PRECISION) * UNIT_2
    acc3 += tl.dot(p, v3, input_precision=PRECISION) * UNIT_3
    return acc0, acc1, acc2, acc3


@triton.jit
def _attend_new_keys(
    state, q_ptr, k_ptr, v_ptr, tok, hq, qi, row_ok, q_start, n_new, h, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DT: tl.constexpr, PRECISION: tl.constexpr,
):
    """Attend to this step's own keys ``[0, n_new)`` of the request, causally, from ``k``/``v``
    (``state`` as ``_attend_int2_block`` takes and returns it)."""
    m_i, l_i, acc0, acc1, acc2, acc3, acc_min = state
    Q: tl.constexpr = D // 4
    q0, q1, q2, q3 = _load_quarters(q_ptr, tok * stride_qt + hq * stride_qh, row_ok, Q, DOT_DT)
    for j0 in range(0, n_new, BLOCK_N):
        ki = j0 + tl.arange(0, BLOCK_N)
        k_ok = ki < n_new
        ktok = (q_start + ki).to(tl.int64)
        c0, c1, c2, c3 = _load_quarters_t(k_ptr, ktok * stride_kt + h * stride_kh, k_ok, Q, DOT_DT)
        s = _dot4(q0, q1, q2, q3, c0, c1, c2, c3, PRECISION)
        ok = row_ok[:, None] & k_ok[None, :] & (ki[None, :] <= qi[:, None])
        m_i, l_i, alpha, p = _online_softmax(m_i, l_i, tl.where(ok, s * qk_scale, float("-inf")))
        u0, u1, u2, u3 = _load_quarters(v_ptr, ktok * stride_vt + h * stride_vh, k_ok, Q, DOT_DT)
        acc0, acc1, acc2, acc3 = _add_true_values(acc0 * alpha[:, None], acc1 * alpha[:, None],
                                                  acc2 * alpha[:, None], acc3 * alpha[:, None],
                                                  p.to(DOT_DT), u0, u1, u2, u3, PRECISION)
        acc_min = acc_min * alpha
    return m_i, l_i, acc0, acc1, acc2, acc3, acc_min


@triton.jit
def _store_quarters(ptr, row_off, row_mask, x0, x1, x2, x3, Q: tl.constexpr):
    p = ptr + row_off[:, None] + tl.arange(0, Q)[None, :]
    ty = ptr.dtype.element_ty
    tl.store(p, x0.to(ty), mask=row_mask[:, None])
    tl.store(p + Q, x1.to(ty), mask=row_mask[:, None])
    tl.store(p + 2 * Q, x2.to(ty), mask=row_mask[:, None])
    tl.store(p + 3 * Q, x3.to(ty), mask=row_mask[:, None])


# Counts and per-call strides change from step to step: unspecialized, so that Triton compiles
# one variant per launch configuration rather than one per size class (==1, %16) met while serving.
# Sliced metadata (a batch's prefill part) starts at any int32 offset: no alignment variants either.
# csrc_triton/warm_up.py relies on this to compile, before serving, all that serving launches.
@triton.jit(
    do_not_specialize=["num_reqs", "num_splits", "stride_lse_h", "stride_bt"],
    do_not_specialize_on_alignment=["self_lse_ptr", "block_table_ptr", "seq_lens_ptr", "cu_q_ptr", "ring_slot_ptr"],
)
def _oscar_attention_kernel(
    out_ptr,  # [T, HQ, D] output; with MERGE_SELF it holds the step's own-keys attention on entry
    self_lse_ptr,  # fp32 [HQ, T] natural-log LSE of the step's own-keys attention (MERGE_SELF)
    part_out_ptr,  # fp32 [T, HQ, num_splits, D] normalized partial outputs (SPLIT)
    part_lse_ptr,  # fp32 [T, HQ, num_splits] partial log2-sum-exp2 (SPLIT)
    q_ptr,  # [T, HQ, D] queries after RoPE (NEW_KEYS)
    q_rot_ptr,  # [T, HQ, D] the same queries in the key-rotated basis
    q_mean_ptr,  # fp32 [T, HQ, D] each query's key-mean coefficients (KEY_MEAN: key_mean_coefficients)
    cos_sin_ptr,  # [P, D] RoPE table: each position's D/2 cosines, then its D/2 sines (KEY_MEAN)
    k_ptr,  # [T, HKV, D] this step's keys, not rotated (NEW_KEYS)
    v_ptr,  # [T, HKV, D] this step's values, folded basis (NEW_KEYS)
    codes_ptr,  # uint8 [num_blocks, HKV, REGION] INT2 pages (paged_layout)
    params_ptr,  # 16-bit view of the same pages
    window_k_ptr,  # bf16 [num_pages, page_elems] window pages: [WIN_E, HKV, D] rotated keys first
    window_v_ptr,  # the same pages from their values: [WIN_E, HKV, D] at window_k_ptr + WIN_E*HKV*D
    window_pages_ptr,  # int32 [S, >= ceil((SINK + RECENT) / WIN_E)] page of each ring's entries
    window_pos_ptr,  # int32 [S, SINK + RECENT] position held by each ring entry
    block_table_ptr,  # int32 [R, max_blocks]
    seq_lens_ptr,  # int32 [R] sequence length including this step
    cu_q_ptr,  # int32 [R + 1] query start offsets
    ring_slot_ptr,  # int32 [R]
    num_reqs,
    num_splits,  # most programs a request's prefix is split over (SPLIT)
    qk_scale,  # softmax scale * log2(e)
    logit_coef,  # INT2 keys' log2 logits lose logit_coef * |q|^2 * s_k^2 (paged_layout.logit_coef; 0: off)
    stride_qt, stride_qh, stride_rt, stride_rh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_bt, stride_lse_h, stride_mt, stride_mh, stride_cs,
    stride_cb,  # bytes from one cache block to the next
    stride_wp,  # window_pages row stride
    stride_page,  # elements from one window page to the next
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SINK: tl.constexpr,
    RECENT: tl.constexpr,
    WIN_E: tl.constexpr,  # ring entries per window page
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    SPLIT: tl.constexpr,
    DECODE: tl.constexpr,  # one query token per request, program 0 indexes requests
    NEW_KEYS: tl.constexpr,  # attend to this step's own keys here
    MERGE_SELF: tl.constexpr,  # merge with the own-keys attention already in out / self_lse
    DOT_DT: tl.constexpr,
    USE_ASM: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_N_NEW: tl.constexpr,
    KEY_MEAN: tl.constexpr,
):
    Q: tl.constexpr = D // 4
    h = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:
        r = tl.program_id(0)
        q_first = 0
    else:
        qb = tl.program_id(0)
        r = find_request(cu_q_ptr, num_reqs, qb, BLOCK_Q, True)
        q_first = (qb - (tl.load(cu_q_ptr + r) // BLOCK_Q + r)) * BLOCK_Q
    q_start = tl.load(cu_q_ptr + r)
    q_len = tl.load(cu_q_ptr + r + 1) - q_start
    if q_first >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + r) - q_len

    rows = tl.arange(0, BLOCK_M)
    qi = q_first + rows // G
    row_ok = (rows // G < BLOCK_Q) & (qi < q_len)
    tok = (q_start + qi).to(tl.int64)
    hq = h * G + rows % G
    # Query quarters times 4^-i, in the unit the INT2 codes come in (see _codes).
    qr0, qr1, qr2, qr3 = _load_quarters(q_rot_ptr, tok * stride_rt + hq * stride_rh, row_ok, Q, tl.float32)
    qs0 = qr0.to(DOT_DT)
    qs1 = (qr1 * 0.25).to(DOT_DT)
    qs2 = (qr2 * 0.0625).to(DOT_DT)
    qs3 = (qr3 * 0.015625).to(DOT_DT)
    # Σq of the very numbers that enter the products, for the min term of the scores.
    q_sum = (tl.sum(qs0.to(tl.float32), axis=1) + 4.0 * tl.sum(qs1.to(tl.float32), axis=1)
             + 16.0 * tl.sum(qs2.to(tl.float32), axis=1) + 64.0 * tl.sum(qs3.to(tl.float32), axis=1))
    # The logit correction per unit of s_k², from the whole head's ‖q‖².
    q_corr = (tl.sum(qr0 * qr0, axis=1) + tl.sum(qr1 * qr1, axis=1) + tl.sum(qr2 * qr2, axis=1)
              + tl.sum(qr3 * qr3, axis=1)) * logit_coef
    if KEY_MEAN:
        q_mean = tl.load(q_mean_ptr + (tok * stride_mt + hq * stride_mh)[:, None] + tl.arange(0, D)[None, :],
                         mask=row_ok[:, None], other=0.0)
    else:
        q_mean = q_corr

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_min = tl.zeros([BLOCK_M], tl.float32)
    acc0 = tl.zeros([BLOCK_M, Q], tl.float32)
    acc1 = tl.zeros([BLOCK_M, Q], tl.float32)
    acc2 = tl.zeros([BLOCK_M, Q], tl.float32)
    acc3 = tl.zeros([BLOCK_M, Q], tl.float32)

    n_blocks = tl.cdiv(ctx, BLOCK_SIZE)
    if SPLIT:
        # As many splits as the request is long, at most num_splits: computed here so that the
        # launch depends on the batch size only (CUDA graphs).
        active = tl.minimum(num_splits, tl.maximum(1, tl.cdiv(n_blocks, MIN_SPLIT_BLOCKS)))
        per_split = tl.cdiv(n_blocks, active)
        b_lo = split * per_split
        b_hi = tl.minimum(n_blocks, b_lo + per_split)
    else:
        b_lo = 0
        b_hi = n_blocks
    ring = tl.load(ring_slot_ptr + r).to(tl.int64)
    bt_ptr = block_table_ptr + r * stride_bt
    # Blocks [0, sink_end) touch the sink, blocks from recent_start touch the recent window or
    # end past ctx; the full blocks between are INT2 for every row.
    sink_end: tl.constexpr = (SINK + BLOCK_SIZE - 1) // BLOCK_SIZE
    recent_start = tl.maximum(sink_end, tl.minimum(ctx // BLOCK_SIZE, tl.maximum(ctx - RECENT + 1, 0) // BLOCK_SIZE))
    # The running softmax, the queries' operands, the request's pages, the rings, the key mean's
    # operands: what each block's step takes (_attend_int2_block).
    state = (m_i, l_i, acc0, acc1, acc2, acc3, acc_min)
    query = (qs0, qs1, qs2, qs3, q_sum, q_corr, row_ok)
    pages = (codes_ptr, params_ptr, stride_cb, bt_ptr)
    rings = (window_k_ptr, window_v_ptr, window_pages_ptr, window_pos_ptr, stride_wp, stride_page)
    mean = (q_mean, cos_sin_ptr, stride_cs)
    for blk in range(b_lo, tl.minimum(b_hi, sink_end)):
        state = _attend_int2_block(state, query, blk, ctx, h, ring, pages, rings, mean, qk_scale, HKV, D, BLOCK_SIZE,
                                   SINK, RECENT, WIN_E, True, DOT_DT, USE_ASM, PRECISION, KEY_MEAN)
    for blk in range(tl.maximum(b_lo, sink_end), tl.minimum(b_hi, recent_start)):
        state = _attend_int2_block(state, query, blk, ctx, h, ring, pages, rings, mean, qk_scale, HKV, D, BLOCK_SIZE,
                                   SINK, RECENT, WIN_E, False, DOT_DT, USE_ASM, PRECISION, KEY_MEAN)
    for blk in range(tl.maximum(b_lo, recent_start), b_hi):
        state = _attend_int2_block(state, query, blk, ctx, h, ring, pages, rings, mean, qk_scale, HKV, D, BLOCK_SIZE,
                                   SINK, RECENT, WIN_E, True, DOT_DT, USE_ASM, PRECISION, KEY_MEAN)

    if NEW_KEYS:
        if split == 0:
            state = _attend_new_keys(
                state, q_ptr, k_ptr, v_ptr, tok, hq, qi, row_ok, q_start, tl.minimum(q_len, q_first + BLOCK_Q), h,
                qk_scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                D, BLOCK_N_NEW, DOT_DT, PRECISION)
    m_i, l_i, acc0, acc1, acc2, acc3, acc_min = state

    # Back from INT2 units; the min term adds the same amount to every dim of a row.
    acc0 = acc0 * (1.0 / UNIT_0) + acc_min[:, None]
    acc1 = acc1 * (1.0 / UNIT_1) + acc_min[:, None]
    acc2 = acc2 * (1.0 / UNIT_2) + acc_min[:, None]
    acc3 = acc3 * (1.0 / UNIT_3) + acc_min[:, None]
    o_off = tok * stride_ot + hq * stride_oh
    if MERGE_SELF:
        lse_self = tl.load(self_lse_ptr + hq * stride_lse_h + tok, mask=row_ok, other=0.0) * _LOG2E
        s0, s1, s2, s3 = _load_quarters(out_ptr, o_off, row_ok, Q, tl.float32)
        mx = tl.maximum(m_i, lse_self)
        w_pre = tl.exp2(m_i - mx)
        w_self = tl.exp2(lse_self - mx)
        inv = 1.0 / (w_pre * l_i + w_self)
        _store_quarters(out_ptr, o_off, row_ok, (w_pre[:, None] * acc0 + w_self[:, None] * s0) * inv[:, None],
                        (w_pre[:, None] * acc1 + w_self[:, None] * s1) * inv[:, None],
                        (w_pre[:, None] * acc2 + w_self[:, None] * s2) * inv[:, None],
                        (w_pre[:, None] * acc3 + w_self[:, None] * s3) * inv[:, None], Q)
    else:
        inv_l = tl.where(l_i > 0, 1.0 / l_i, 0.0)[:, None]
        if not SPLIT:
            _store_quarters(out_ptr, o_off, row_ok, acc0 * inv_l, acc1 * inv_l, acc2 * inv_l, acc3 * inv_l, Q)
        else:
            part = (tok * HQ + hq) * num_splits + split
            _store_quarters(part_out_ptr, part * D, row_ok, acc0 * inv_l, acc1 * inv_l, acc2 * inv_l,
                            acc3 * inv_l, Q)
            lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
            tl.store(part_lse_ptr + part, lse, mask=row_ok)


def _common(q, k, cache: MixedCache, use_asm):
    t, hq, d = q.shape
    hkv = k.shape[1]
    if hq % hkv or d % 64:
        raise ValueError(f"unsupported heads {hq}/{hkv} or head_dim {d} (needs a multiple of 64)")
    caches = cache_args(cache, hkv, d)
    dot_dt = tl.float32 if q.dtype == torch.float32 else tl.float16
    if use_asm is None:
        use_asm = q.is_cuda and dot_dt == tl.float16
    return hq, hkv, d, dict(
        HQ=hq, HKV=hkv, G=hq // hkv, D=d, BLOCK_SIZE=BLOCK_SIZE,
        DOT_DT=dot_dt, USE_ASM=bool(use_asm), PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **caches,
    )


def key_mean_coefficients(q: torch.Tensor, key_mean: torch.Tensor) -> torch.Tensor:
    """fp32 ``[T, Hq, d]``: each query's ``[a | b]``, so that its product with the key mean turned
    to position ``p`` is ``[a | b] · cos_sin[p]`` (the table's ``d/2`` cosines then sines):
    ``a_i = q_i μ_i + q_{i+d/2} μ_{i+d/2}``, ``b_i = q_{i+d/2} μ_i - q_i μ_{i+d/2}`` (rotate-half
    RoPE), for queries ``q`` ``[T, Hq, d]`` (after RoPE, not rotated) and ``key_mean`` ``[Hkv, d]``."""
    t, hq, d = q.shape
    hkv = key_mean.shape[0]
    qq = q.float().view(t, hkv, hq // hkv, d)
    q1, q2 = qq.chunk(2, dim=-1)
    m1, m2 = key_mean.float()[None, :, None].chunk(2, dim=-1)
    return torch.cat([q1 * m1 + q2 * m2, q2 * m1 - q1 * m2], dim=-1).view(t, hq, d)


def _tensor_args(q, q_rot, k, v, out, batch: BatchLayout, key_mean=None, cos_sin=None) -> dict:
    """The kernel arguments both launches pass alike: tensors and their strides, the batch's (and
    the key mean's: the queries' coefficients and the RoPE table, where ``key_mean`` is given)."""
    check_key_mean(key_mean, cos_sin, k.shape[1], k.shape[2])
    q_mean = q_rot if key_mean is None else key_mean_coefficients(q, key_mean)
    return dict(
        q_mean_ptr=q_mean, cos_sin_ptr=q_rot if cos_sin is None else cos_sin,
        stride_mt=q_mean.stride(0), stride_mh=q_mean.stride(1), stride_cs=0 if cos_sin is None else cos_sin.stride(0),
        KEY_MEAN=key_mean is not None,
        q_ptr=q, q_rot_ptr=q_rot, k_ptr=k, v_ptr=v,
        block_table_ptr=batch.block_table, seq_lens_ptr=batch.seq_lens, cu_q_ptr=batch.cu_q,
        ring_slot_ptr=batch.ring_slots, num_reqs=batch.num_reqs,
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_rt=q_rot.stride(0), stride_rh=q_rot.stride(1),
        stride_kt=k.stride(0), stride_kh=k.stride(1), stride_vt=v.stride(0), stride_vh=v.stride(1),
        stride_ot=out.stride(0), stride_oh=out.stride(1), stride_bt=batch.block_table.stride(0),
    )


def oscar_decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    q_rot: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cache: MixedCache,
    batch: BatchLayout,
    scale: float,
    num_splits: int = 1,
    part_out: torch.Tensor | None = None,
    part_lse: torch.Tensor | None = None,
    launch: tuple[int, int] | None = None,
    use_asm: bool | None = None,
    logit_correction: float = 0.0,
    key_mean: torch.Tensor | None = None,
    cos_sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of ``batch``'s requests, each at most one query token (``q`` ``[T, Hq, d]``).

    Writes ``out`` ``[T, Hq, d]``. With ``num_splits > 1`` the prefix is split over up to
    that many programs per (request, KV head), which needs fp32 scratch ``part_out``
    ``[>= T * Hq * num_splits * d]`` and ``part_lse`` ``[>= T * Hq * num_splits]``.
    ``launch``: ``(num_warps, num_stages)``, else from ``DECODE_LAUNCH``. ``logit_correction``:
    λ, INT2 keys' logits lowered by λ/2 times their expected rounding variance (``logit_coef``).
    ``key_mean`` fp32 ``[Hkv, d]`` and ``cos_sin`` ``[P, d]`` (vLLM's ``cos_sin_cache``): the INT2
    keys were written less their mean before RoPE (``oscar_write``), and are read plus it.
    """
    t, num_reqs = q.shape[0], batch.num_reqs
    if t == 0 or num_reqs == 0:
        return out
    hq, hkv, d, consts = _common(q, k, cache, use_asm)
    num_warps, num_stages = launch or launch_bucket(DECODE_LAUNCH, num_reqs)[:2]
    if num_splits > 1:
        part_out, part_lse = split_scratch(part_out, part_lse, t * hq * num_splits, d)
        part_out, part_lse = part_out.view(t, hq, num_splits, d), part_lse.view(t, hq, num_splits)
    block_m = max(16, triton.next_power_of_2(hq // hkv))
    split = num_splits > 1
    _oscar_attention_kernel[(num_reqs, hkv, num_splits)](
        out_ptr=out, self_lse_ptr=out, part_out_ptr=part_out if split else out,
        part_lse_ptr=part_lse if split else out, **_tensor_args(q, q_rot, k, v, out, batch, key_mean, cos_sin),
        num_splits=num_splits, qk_scale=scale * LOG2E, logit_coef=logit_coef(logit_correction, scale),
        stride_lse_h=0, BLOCK_M=block_m, BLOCK_Q=1, SPLIT=split, DECODE=True, NEW_KEYS=True, MERGE_SELF=False,
        BLOCK_N_NEW=16, num_warps=num_warps, num_stages=num_stages, **consts,
    )
    if num_splits > 1:
        merge_splits(out, part_out, part_lse, t, num_splits)
    return out


def oscar_prefill_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    q_rot: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cache: MixedCache,
    batch: BatchLayout,
    scale: float,
    self_lse: torch.Tensor | None = None,
    launch: tuple[int, int, int] | None = None,
    use_asm: bool | None = None,
    logit_correction: float = 0.0,
    key_mean: torch.Tensor | None = None,
    cos_sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``batch``'s prefill chunks (any query lengths) over the mixed cache.

    Without ``self_lse`` the kernel also attends to the chunk's own keys ``k``/``v``
    (causal). With it, ``out`` already holds the chunk's own-keys attention (FlashAttention's
    output) and ``self_lse`` fp32 ``[Hq, T]`` its natural-log LSE: the kernel adds the prefix.
    ``launch``: ``(BLOCK_M, num_warps, num_stages)``, else ``PREFILL_LAUNCH``.
    ``logit_correction``, ``key_mean``, ``cos_sin``: as for ``oscar_decode_attention`` (prefix
    INT2 keys only).
    """
    t, num_reqs = q.shape[0], batch.num_reqs
    if t == 0 or num_reqs == 0:
        return out
    hq, hkv, d, consts = _common(q, k, cache, use_asm)
    block_m, num_warps, num_stages = launch or (PREFILL_LAUNCH if d >= 128 else SMALL_HEAD_PREFILL_LAUNCH)
    if key_mean is not None and d >= 128 and launch is None:
        # Each row's mean coefficients, fp32 [rows, d], are held for the whole loop: at head_dim 128
        # and 128 rows they spill 496 B a thread, at 64 rows 136 (sm_90 compile, compile_check.py).
        block_m, num_stages = (64, 2) if d == 128 else (32, 1)
    g = hq // hkv
    if q.dtype == torch.float32:
        block_m = min(block_m, 32)  # fp32 tiles: keep the registers
    block_m = max(block_m, triton.next_power_of_2(g))
    block_q = block_m // g
    merge = self_lse is not None
    _oscar_attention_kernel[(triton.cdiv(t, block_q) + num_reqs, hkv, 1)](
        out_ptr=out, self_lse_ptr=self_lse if merge else out, part_out_ptr=out, part_lse_ptr=out,
        **_tensor_args(q, q_rot, k, v, out, batch, key_mean, cos_sin),
        num_splits=1, qk_scale=scale * LOG2E, logit_coef=logit_coef(logit_correction, scale),
        stride_lse_h=self_lse.stride(0) if merge else 0, BLOCK_M=block_m, BLOCK_Q=block_q, SPLIT=False,
        DECODE=False, NEW_KEYS=not merge, MERGE_SELF=merge, BLOCK_N_NEW=32,
        num_warps=num_warps, num_stages=num_stages, **consts,
    )
    return out
