"""Decode attention over the OSCAR mixed cache, in Gluon (Triton's explicit-layout dialect).

One warp owns a (request, KV head, split) and walks its share of the request's keys in tiles
of 64: first the BF16 ring (sink and recent window, 8 pages of 8 entries per tile), then the
INT2 blocks. Each tile is two tensor-core products with the keys on M and the ``G`` query heads
of the KV head on N (``N`` = 8, or 16 for ``G`` > 8), so a 64-key tile costs 64 ``m16n8k16``
instead of the 4x padded products of heads-on-M (``oscar_attention``'s decode path):

* ``S[key, head] = K·Qᵀ``: the INT2 codes of quarter ``i`` (dims ``[iQ, (i+1)Q)``) go into the
  A fragment as they are: a byte permute and a mask make each code ``c`` the fp16 subnormal
  ``c·4^i·2^-24`` (exact), and the queries carry ``4^-i``; per-key scale and min are applied
  outside the product, ``s_k·(q·c) + m_k·Σq``, less the logit correction ``coef·‖q‖²·s_k²``
  (``paged_layout.logit_coef``: λ/2 times the key's expected rounding variance; BF16 ring keys
  never take it).
* ``Oᵀ[dim, head] += Vᵀ·Pᵀ``, per quarter, with ``P·s_v`` as the B fragment and ``Σ P·m_v``
  added once at the end.

Every operand is loaded straight into its fragment: the pages' layout (``paged_layout``) puts a
lane's bytes next to each other. A lane's rows of a tile are keys ``8·r .. 8·r + 7`` (row
``κ = r + 8i`` holds token ``8r + i``), so its scales and mins are one 16-byte load each; its
columns of Vᵀ are 16 consecutive bytes of a row of V codes (``v_column``), paired as the
fragment pairs them. The softmax state is the warp's own (no shared memory, no barriers);
splits are merged by ``merge_splits``. The launch table is ``gluon_layout``'s.

The step's own key is read from the ring: the backend writes decode tokens before attention
(``oscar_write`` with ``q``), so a decode query attends to positions ``[0, seq_len)`` of the
cache, the window being the sink and the ``recent`` positions ending at ``seq_len - 1``.

Reference: :func:`oscar_vllm.reference.oscar_decode.oscar_decode_reference`. Gluon does not run
under ``TRITON_INTERPRET``: the CPU tests compile it for sm_90 and read the machine code
(``tests/kernels/test_kernels_compile.py``), the GPU tests compare it with the reference.
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from csrc_triton.gluon_layout import MEAN_PAIRS, TILE, WINDOW_ENTRIES, decode_launch
from csrc_triton.merge_splits import merge_splits
from csrc_triton.paged_layout import (
    UNIT_0,
    UNIT_1,
    UNIT_2,
    UNIT_3,
    BatchLayout,
    MixedCache,
    cache_args,
    int2_params_at,
    int2_region_bytes,
    logit_coef,
    split_scratch,
)
# The decode kernel's split policy, as the backend reads it off the kernel's module (defined in gluon_layout).
from csrc_triton.gluon_layout import (
    MAX_DECODE_SPLITS as MAX_DECODE_SPLITS,
    decode_split_rows as decode_split_rows,
    decode_splits as decode_splits,
)

LOG2E = 1.4426950408889634
# A split reads at least this many tiles (one: short contexts gain from more programs).
MIN_SPLIT_TILES = gl.constexpr(1)
# PTX: a word of packed codes -> each byte's code of each quarter i (bits 2i, 2i+1) as an fp16
# subnormal. Two byte permutes put bytes (0, 1) and (2, 3) into the low halves of 16-bit lanes,
# shared by the four quarters; one mask per quarter and pair leaves c·2^(2i) in the mantissa,
# i.e. c·4^i·2^-24, already paired as the tensor cores take fp16 operands. Output 4i + b:
# quarter i of byte b.
_UNPACK_ASM = (
    "{ .reg .b32 z, lo, hi, t;\n"
    "mov.b32 z, 0;\n"
    "prmt.b32 lo, z, $16, 0x0504;\n"
    "prmt.b32 hi, z, $16, 0x0706;\n"
    + "".join(
        f"and.b32 t, {half}, {0x0003_0003 << (2 * i):#010x};\nmov.b32 {{${4 * i + 2 * k}, ${4 * i + 2 * k + 1}}}, t;\n"
        for i in range(4) for k, half in enumerate(("lo", "hi")))
    + "}"
)
UNPACK_ASM = gl.constexpr(_UNPACK_ASM)


@gluon.constexpr_function
def _prefetch_asm(nbytes):
    """PTX: bring ``nbytes`` of the cache from an address into L2 (sm_90's bulk prefetch: no
    register waits on it). Inline asm must return a value: ``$0`` is a dummy."""
    return f"cp.async.bulk.prefetch.L2.global [$1], {nbytes};\nmov.b32 $0, 0;"


@gluon.constexpr_function
def _vmem_layout(Q, RANK3):
    """Layout of a ``[Q, 64]`` tile indexed by memory column (``[Q, 8, 8]``: page, slot, with
    ``RANK3``): a lane's 16 bytes of a row are contiguous, and the same lanes and registers as
    the Vᵀ fragment once the columns are relabelled as keys (``_keys_of_columns``)."""
    dims = [1 << b for b in range(3, Q.bit_length() - 1)]
    if RANK3:
        regs = [[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 1, 0]] + [[d, 0, 0] for d in dims]
        lanes = [[0, 2, 0], [0, 4, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
        shape = [Q, 8, 8]
    else:
        regs = [[0, 1], [0, 2], [0, 4], [0, 8]] + [[d, 0] for d in dims]
        lanes = [[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]]
        shape = [Q, 64]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=[], block_bases=[], shape=shape)


@gluon.constexpr_function
def _rows_by_token_layout():
    """A ``[64]`` per-key vector indexed by token: a lane's 8 tokens in registers (one 16-byte
    load of 16-bit parameters); relabelled by ``_keys_of_tokens`` it is the score rows' layout."""
    return gl.DistributedLinearLayout(reg_bases=[[1], [2], [4]], lane_bases=[[0], [0], [8], [16], [32]],
                                      warp_bases=[], block_bases=[], shape=[64])


@gluon.jit
def _keys_of_columns(x, Q: gl.constexpr):
    """``[Q, 64]`` by memory column ``16c + 2g + e`` -> by key ``8g + 2c + e`` (free: a relabelling)."""
    x = gl.reshape(x, [Q, 2, 2, 2, 2, 2, 2])
    return gl.reshape(gl.permute(x, [0, 3, 4, 5, 1, 2, 6]), [Q, 64])


@gluon.jit
def _keys_of_tokens(x):
    """``[64]`` by token ``8r + i`` -> by key ``r + 8i`` (free: a relabelling)."""
    return gl.reshape(gl.permute(gl.reshape(x, [8, 8]), [1, 0]), [64])


@gluon.jit
def _bytes_of_words(b0, b1, b2, b3):
    """Four ``[R, W]`` tensors (byte b of each word) -> ``[R, 4W]`` in byte order (free)."""
    x = gl.join(gl.join(b0, b2), gl.join(b1, b3))
    return gl.reshape(x, [x.shape[0], 4 * x.shape[1]])


@gluon.jit
def _unpack_int2(words):
    """int32 ``[R, W]`` words of packed codes -> four fp16 ``[R, 4W]`` tensors (quarters 0..3),
    code c of quarter i as ``c·UNIT_i``, column ``4w + b`` from byte b of word w."""
    c = gl.inline_asm_elementwise(UNPACK_ASM, "=h," * 16 + "r", [words], dtype=(gl.float16,) * 16, is_pure=True,
                                  pack=1)
    return (_bytes_of_words(c[0], c[1], c[2], c[3]), _bytes_of_words(c[4], c[5], c[6], c[7]),
            _bytes_of_words(c[8], c[9], c[10], c[11]), _bytes_of_words(c[12], c[13], c[14], c[15]))


@gluon.jit
def _pair(a, b):
    """Two ``[R, C]`` quarters side by side, ``[R, 2C]`` (free)."""
    x = gl.permute(gl.join(a, b), [0, 2, 1])
    return gl.reshape(x, [x.shape[0], 2 * x.shape[2]])


@gluon.jit
def _softmax_step(s, state, v_min):
    """Online-softmax step over scores ``s`` ``[64, N]`` (log2 domain, -inf where masked): the
    probabilities, and ``state``, ``(m_i, l_i, a_min, o0, o1, o2, o3)``, rescaled where the running
    max grew, their sums added."""
    m_i, l_i, a_min, o0, o1, o2, o3 = state
    m_new = gl.maximum(m_i, gl.max(s, axis=0))
    if gl.max((m_new > m_i).to(gl.int32), axis=0) > 0:
        alpha = gl.exp2(m_i - gl.where(m_new == float("-inf"), 0.0, m_new))
        l_i = l_i * alpha
        a_min = a_min * alpha
        o0 = o0 * alpha[None, :]
        o1 = o1 * alpha[None, :]
        o2 = o2 * alpha[None, :]
        o3 = o3 * alpha[None, :]
        m_i = m_new
    p = gl.exp2(s - gl.where(m_i == float("-inf"), 0.0, m_i)[None, :])
    l_i = l_i + gl.sum(p, axis=0)
    a_min = a_min + gl.sum(p * v_min[:, None], axis=0)
    return p, (m_i, l_i, a_min, o0, o1, o2, o3)


@gluon.constexpr_function
def _k_words_layout(Q):
    """int32 words ``[64, Q/4]`` of K codes (4 dims a word): a lane holds the words its K
    fragment's bytes are in (rows ``r + 8i``, bytes ``4c .. 4c+3`` (and ``+16`` at Q = 32))."""
    regs = [[8, 0]] + ([[0, 4]] if Q == 32 else []) + [[16, 0], [32, 0]]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[], block_bases=[], shape=[64, Q // 4])


@gluon.constexpr_function
def _v_words_layout(Q):
    """int32 words ``[Q, 16]`` of V codes (``_vmem_layout`` less its two byte bits)."""
    regs = [[0, 1], [0, 2]] + [[1 << b, 0] for b in range(3, Q.bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[], block_bases=[], shape=[Q, 16])


@gluon.jit
def _query_operand(q_base, stride_qh, I: gl.constexpr, G: gl.constexpr, N: gl.constexpr, D: gl.constexpr):
    """Dims ``[I·KQ, (I+1)·KQ)`` of the G queries as fp16 ``[KQ, N]``, each dim times ``4^-quarter``
    (KQ = max(D/4, 32)), its Σ over dims in the codes' unit, ``[N]``, and its Σ of squares
    (true units, fp32), ``[N]``."""
    Q: gl.constexpr = D // 4
    KQ: gl.constexpr = Q if Q > 32 else 32
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    B_Q: gl.constexpr = gl.DotOperandLayout(1, ACC, KQ // 8)
    dim = I * KQ + gl.arange(0, KQ, layout=gl.SliceLayout(1, B_Q))
    n = gl.arange(0, N, layout=gl.SliceLayout(0, B_Q))
    q = gl.load(q_base + n[None, :] * stride_qh + dim[:, None], mask=(n < G)[None, :], other=0.0).to(gl.float32)
    unit = gl.exp2(2.0 * (dim // Q).to(gl.float32))  # 4^quarter, exact
    qs = (q / unit[:, None]).to(gl.float16)
    q_sum = gl.convert_layout(gl.sum(qs.to(gl.float32) * unit[:, None], axis=0), gl.SliceLayout(0, ACC))
    q_sq = gl.convert_layout(gl.sum(q * q, axis=0), gl.SliceLayout(0, ACC))
    return qs, q_sum, q_sq


@gluon.jit
def _query_operands(q_base, stride_qh, G: gl.constexpr, N: gl.constexpr, D: gl.constexpr):
    """The K products' query operands (``_query_operand``; at head_dim 64 there are two, the
    last two repeat them unused), Σq and ‖q‖²."""
    qs0, q_sum, q_sq = _query_operand(q_base, stride_qh, 0, G, N, D)
    qs1, sum1, sq1 = _query_operand(q_base, stride_qh, 1, G, N, D)
    q_sum = q_sum + sum1
    q_sq = q_sq + sq1
    if D // 4 == 16:
        qs2 = qs0
        qs3 = qs1
    else:
        qs2, sum2, sq2 = _query_operand(q_base, stride_qh, 2, G, N, D)
        qs3, sum3, sq3 = _query_operand(q_base, stride_qh, 3, G, N, D)
        q_sum = q_sum + sum2 + sum3
        q_sq = q_sq + sq2 + sq3
    return qs0, qs1, qs2, qs3, q_sum, q_sq


@gluon.jit
def _load_int2_block(pages, blk, h, Q: gl.constexpr, N: gl.constexpr):
    """The packed codes (int32 words) and parameters of logical block ``blk`` of KV head ``h``:
    ``(k_codes, v_codes, k_scale, k_min, v_scale, v_min)``. ``pages``: ``(codes_ptr, params_ptr,
    stride_cb, bt_ptr)``, the INT2 pages and the request's block table row."""
    codes_ptr, params_ptr, stride_cb, bt_ptr = pages
    K_WORDS: gl.constexpr = _k_words_layout(Q)
    V_WORDS: gl.constexpr = _v_words_layout(Q)
    P_TOK: gl.constexpr = _rows_by_token_layout()
    REGION: gl.constexpr = int2_region_bytes(4 * Q)
    base = gl.load(bt_ptr + blk).to(gl.int64) * stride_cb + h * REGION
    words = (codes_ptr + base).to(gl.pointer_type(gl.int32))
    rows = gl.arange(0, TILE, layout=gl.SliceLayout(1, K_WORDS))
    k_tok = 8 * (rows % 8) + rows // 8
    k_words = gl.load(words + k_tok[:, None] * (Q // 4)
                      + gl.arange(0, Q // 4, layout=gl.SliceLayout(0, K_WORDS))[None, :])
    v_words = gl.load(words + TILE * Q // 4 + gl.arange(0, Q, layout=gl.SliceLayout(1, V_WORDS))[:, None] * (TILE // 4)
                      + gl.arange(0, TILE // 4, layout=gl.SliceLayout(0, V_WORDS))[None, :])
    p = params_ptr + (base + int2_params_at(4 * Q)) // 2 + gl.arange(0, TILE, layout=P_TOK)
    return k_words, v_words, gl.load(p), gl.load(p + TILE), gl.load(p + 2 * TILE), gl.load(p + 3 * TILE)


@gluon.jit
def _prefetch_int2_block(pages, blk, h, Q: gl.constexpr):
    """Logical block ``blk`` of KV head ``h`` into L2, one bulk prefetch of its whole region (one
    address for the warp: lanes with addresses of their own become a loop, one prefetch a lane):
    its loads a few steps later then wait for L2, not DRAM (registers hold one block ahead only)."""
    codes_ptr, _, stride_cb, bt_ptr = pages
    REGION: gl.constexpr = int2_region_bytes(4 * Q)
    base = gl.load(bt_ptr + blk).to(gl.int64) * stride_cb + h * REGION
    gl.inline_asm_elementwise(_prefetch_asm(REGION), "=r,l", [codes_ptr + base], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _load_v_params(pages, blk, h, Q: gl.constexpr):
    """The V scales and mins of logical block ``blk`` of KV head ``h`` (``_load_int2_block``'s last two)."""
    _, params_ptr, stride_cb, bt_ptr = pages
    P_TOK: gl.constexpr = _rows_by_token_layout()
    REGION: gl.constexpr = int2_region_bytes(4 * Q)
    base = gl.load(bt_ptr + blk).to(gl.int64) * stride_cb + h * REGION
    p = params_ptr + (base + int2_params_at(4 * Q)) // 2 + gl.arange(0, TILE, layout=P_TOK)
    return gl.load(p + 2 * TILE), gl.load(p + 3 * TILE)


@gluon.constexpr_function
def _mean_pairs_layout(N):
    """``[MEAN_PAIRS, N]`` per pair and query head, laid out so that a sum over the pairs leaves each
    head's number where the scores keep their column (``SliceLayout(0, ACC)``: head bit 0 in a
    register, bits 1 and 2 in lane bits 0 and 1, bit 3 in a register at N = 16); the pairs over lane
    bits 2-4 and a register, so the sum is two adds and three shuffles."""
    regs = [[0, 1], [8, 0]] + ([[0, 8]] if N == 16 else [])
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[], block_bases=[], shape=[16, N])


@gluon.jit
def _mean_coefficients(q_base, stride_qh, mean_ptr, pairs_ptr, h, qk_scale, G: gl.constexpr, N: gl.constexpr,
                       D: gl.constexpr):
    """Each head's ``a``, ``b`` ``[MEAN_PAIRS, N]`` (log2 logits) over KV head ``h``'s pairs, so that
    its product with the mean turned to position ``p`` is ``Σ a·cos_sin[p, j] + b·cos_sin[p, j + D/2]``
    (``oscar_attention.key_mean_coefficients``), and the pairs' columns ``[MEAN_PAIRS]``."""
    L: gl.constexpr = _mean_pairs_layout(N)
    col = gl.load(pairs_ptr + h * MEAN_PAIRS + gl.arange(0, MEAN_PAIRS, layout=gl.SliceLayout(1, L)))
    n = gl.arange(0, N, layout=gl.SliceLayout(0, L))
    m1 = gl.load(mean_ptr + h * D + col)[:, None]
    m2 = gl.load(mean_ptr + h * D + col + D // 2)[:, None]
    qp = q_base + n[None, :] * stride_qh + col[:, None]
    q1 = gl.load(qp, mask=(n < G)[None, :], other=0.0).to(gl.float32)
    q2 = gl.load(qp + D // 2, mask=(n < G)[None, :], other=0.0).to(gl.float32)
    return (q1 * m1 + q2 * m2) * qk_scale, (q2 * m1 - q1 * m2) * qk_scale, col


@gluon.jit
def _block_mean_scores(blk, mean_a, mean_b, mean_col, cos_sin_ptr, stride_cs, D: gl.constexpr):
    """``[N]``: what every key of block ``blk`` gains, ``q·RoPE_{64b}(μ)`` (log2 logits), from the
    RoPE table's row of the block's first position, in the scores' column layout."""
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    row = cos_sin_ptr + (blk * TILE).to(gl.int64) * stride_cs + mean_col
    f = gl.sum(mean_a * gl.load(row)[:, None] + mean_b * gl.load(row + D // 2)[:, None], axis=0)
    return gl.convert_layout(f, gl.SliceLayout(0, ACC), assert_trivial=True)


@gluon.jit
def _attend_int2_block(
    state, query, block, use, qk_scale, blk, mean,
    Q: gl.constexpr, N: gl.constexpr, MASKED: gl.constexpr, CORRECT: gl.constexpr, KEY_MEAN: gl.constexpr,
):
    """One INT2 block, ``block`` (``_load_int2_block``'s): scores from the codes, probabilities into
    the running softmax ``state``, ``(m_i, l_i, a_min, o0, o1, o2, o3)`` (the quarter accumulators
    in INT2 units), which it returns. ``query``: ``(qs0, qs1, qs2, qs3, q_sum, q_corr)``, the K
    products' operands (``_query_operands``). ``MASKED``: only rows ``use`` count (the block meets
    the window or ``seq_len``). ``CORRECT``: the logit correction, ``q_corr`` ``[N]`` being
    ``coef·‖q‖²`` of each head over ``(qk_scale·2^24)²``, its amount per unit of the squared scale
    as the scores apply it. ``KEY_MEAN``: the keys were rounded less their block's mean, whose
    logit is added back here (``mean``: ``_block_mean_scores``' arguments but the block's)."""
    qs0, qs1, qs2, qs3, q_sum, q_corr = query
    k_codes, v_codes, k_scale, k_min, v_scale, v_min = block
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    ROWS: gl.constexpr = gl.SliceLayout(1, ACC)
    A_V: gl.constexpr = gl.DotOperandLayout(0, ACC, 2)
    B_P: gl.constexpr = gl.DotOperandLayout(1, ACC, 2)
    k_scale = gl.convert_layout(_keys_of_tokens(k_scale), ROWS, assert_trivial=True).to(gl.float32)
    k_min = gl.convert_layout(_keys_of_tokens(k_min), ROWS, assert_trivial=True).to(gl.float32)
    v_scale = gl.convert_layout(_keys_of_tokens(v_scale), ROWS, assert_trivial=True).to(gl.float32)
    v_min = gl.convert_layout(_keys_of_tokens(v_min), ROWS, assert_trivial=True).to(gl.float32)
    c0, c1, c2, c3 = _unpack_int2(k_codes)
    if Q == 16:
        # Two quarters a product: K operands of 32 dims (the tensor cores' k_width 4 wants 32).
        A_K: gl.constexpr = gl.DotOperandLayout(0, ACC, 4)
        s = mma_v2(gl.convert_layout(_pair(c0, c1), A_K, assert_trivial=True), qs0,
                   gl.zeros([TILE, N], gl.float32, layout=ACC))
        s = mma_v2(gl.convert_layout(_pair(c2, c3), A_K, assert_trivial=True), qs1, s)
    else:
        A_K: gl.constexpr = gl.DotOperandLayout(0, ACC, Q // 8)
        s = mma_v2(gl.convert_layout(c0, A_K, assert_trivial=True), qs0, gl.zeros([TILE, N], gl.float32, layout=ACC))
        s = mma_v2(gl.convert_layout(c1, A_K, assert_trivial=True), qs1, s)
        s = mma_v2(gl.convert_layout(c2, A_K, assert_trivial=True), qs2, s)
        s = mma_v2(gl.convert_layout(c3, A_K, assert_trivial=True), qs3, s)
    # Scale and min with the softmax scale folded in (and 2^24 for the codes' unit): two FMAs a
    # score, the block mean's logit riding in the second. The logit correction, coef·‖q‖²·s_k², as
    # the scale times (scale · q_corr): one FMA a score more, and no other per-key vector held.
    k_scale = k_scale * (qk_scale * 16777216.0)
    if CORRECT:
        s = s - k_scale[:, None] * q_corr[None, :]
    if KEY_MEAN:
        offset = _block_mean_scores(blk, mean[0], mean[1], mean[2], mean[3], mean[4], 4 * Q)[None, :]
    else:
        offset = 0.0
    s = s * k_scale[:, None] + ((k_min * qk_scale)[:, None] * q_sum[None, :] + offset)
    if MASKED:
        s = gl.where(use[:, None], s, float("-inf"))
        # Unwritten or window rows may hold anything: zero what multiplies their zero probability.
        v_scale = gl.where(use, v_scale, 0.0)
        v_min = gl.where(use, v_min, 0.0)
    p, state = _softmax_step(s, state, v_min)
    m_i, l_i, a_min, o0, o1, o2, o3 = state
    pv = gl.convert_layout((p * v_scale[:, None]).to(gl.float16), B_P)
    u0, u1, u2, u3 = _unpack_int2(v_codes)
    o0 = mma_v2(gl.convert_layout(_keys_of_columns(u0, Q), A_V, assert_trivial=True), pv, o0)
    o1 = mma_v2(gl.convert_layout(_keys_of_columns(u1, Q), A_V, assert_trivial=True), pv, o1)
    o2 = mma_v2(gl.convert_layout(_keys_of_columns(u2, Q), A_V, assert_trivial=True), pv, o2)
    o3 = mma_v2(gl.convert_layout(_keys_of_columns(u3, Q), A_V, assert_trivial=True), pv, o3)
    return m_i, l_i, a_min, o0, o1, o2, o3


@gluon.jit
def _held_rows(window_pos_ptr, ring, blk, seq_len, last, SINK: gl.constexpr, RECENT: gl.constexpr):
    """Rows of block ``blk`` that count in the INT2 pass: keys before ``seq_len`` that the ring
    does not hold for the window (a ring entry counts only where it holds that very position)."""
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    ROWS: gl.constexpr = gl.SliceLayout(1, ACC)
    rows = gl.arange(0, TILE, layout=ROWS)
    pos = blk * TILE + 8 * (rows % 8) + rows // 8
    ok = pos < seq_len
    entry = gl.where(pos < SINK, pos, SINK + (pos - SINK) % RECENT)
    held = gl.load(window_pos_ptr + ring * (SINK + RECENT) + entry, mask=ok, other=-1) == pos
    in_window = held & ((pos < SINK) | (last - pos < RECENT))
    return ok & ~in_window


@gluon.jit
def _attend_window_block(
    state, query, blk, seq_len, last, ring, h, qk_scale, pages, window_pos_ptr, mean,
    Q: gl.constexpr, N: gl.constexpr, SINK: gl.constexpr, RECENT: gl.constexpr, CORRECT: gl.constexpr,
    KEY_MEAN: gl.constexpr,
):
    """An INT2 block that meets the sink, the recent window or ``seq_len``: its keys the ring
    holds for the window are left to the ring tiles (a block the ring covers is not read).
    ``state``, ``query``, ``mean``: ``_attend_int2_block``'s; ``pages``: ``_load_int2_block``'s."""
    use = _held_rows(window_pos_ptr, ring, blk, seq_len, last, SINK, RECENT)
    if gl.max(use.to(gl.int32), axis=0) > 0:
        state = _attend_int2_block(state, query, _load_int2_block(pages, blk, h, Q, N), use, qk_scale, blk, mean,
                                   Q, N, True, CORRECT, KEY_MEAN)
    return state


@gluon.jit
def _attend_ring_tile(
    state, tile, ring, h, last, qk_scale, q_base, stride_qh, rings,
    HKV: gl.constexpr, G: gl.constexpr, N: gl.constexpr, D: gl.constexpr, SINK: gl.constexpr,
    RECENT: gl.constexpr,
):
    """Ring entries ``[64·tile, 64·tile + 64)`` (8 pages) of ring ``ring``: those that hold a window
    position attend in BF16, into ``state`` (``_attend_int2_block``'s, accumulators in true units).
    ``rings``: ``(window_k_ptr, window_v_ptr, window_pages_ptr, window_pos_ptr, stride_wp,
    stride_page)``; ``q_base``: the KV head's first query head."""
    window_k_ptr, window_v_ptr, window_pages_ptr, window_pos_ptr, stride_wp, stride_page = rings
    Q: gl.constexpr = D // 4
    RING: gl.constexpr = SINK + RECENT
    RW: gl.constexpr = D if D < 64 else 64  # dims per key product (k_width 8 wants 64)
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    ROWS: gl.constexpr = gl.SliceLayout(1, ACC)
    A_R: gl.constexpr = gl.DotOperandLayout(0, ACC, RW // 8)
    B_R: gl.constexpr = gl.DotOperandLayout(1, ACC, RW // 8)
    B_P: gl.constexpr = gl.DotOperandLayout(1, ACC, 2)
    V3: gl.constexpr = _vmem_layout(Q, True)
    # Score rows: key κ = r + 8i holds entry 16((κ>>1)&3) + 2(κ>>3) + (κ&1), the entry that the
    # Vᵀ fragment's column κ holds too.
    rows = gl.arange(0, TILE, layout=ROWS)
    entry = tile * TILE + 16 * ((rows >> 1) & 3) + 2 * (rows >> 3) + (rows & 1)
    pos = gl.load(window_pos_ptr + ring * RING + entry, mask=entry < RING, other=-1)
    valid = (pos >= 0) & (pos <= last) & ((pos < SINK) | (last - pos < RECENT))
    if gl.max(valid.to(gl.int32), axis=0) > 0:
        page = gl.load(window_pages_ptr + ring * stride_wp + entry // WINDOW_ENTRIES, mask=valid, other=0)
        k_off = page.to(gl.int64) * stride_page + (entry % WINDOW_ENTRIES) * (HKV * D) + h * D
        k_off = gl.convert_layout(k_off, gl.SliceLayout(1, A_R), assert_trivial=True)
        k_ok = gl.convert_layout(valid, gl.SliceLayout(1, A_R), assert_trivial=True)
        rd = gl.arange(0, RW, layout=gl.SliceLayout(0, A_R))
        qd = gl.arange(0, RW, layout=gl.SliceLayout(1, B_R))
        qn = gl.arange(0, N, layout=gl.SliceLayout(0, B_R))
        s = gl.zeros([TILE, N], gl.float32, layout=ACC)
        for t in gl.static_range(D // RW):
            kr = gl.load(window_k_ptr + k_off[:, None] + t * RW + rd[None, :], mask=k_ok[:, None], other=0.0)
            qb = gl.load(q_base + qn[None, :] * stride_qh + t * RW + qd[:, None], mask=(qn < G)[None, :], other=0.0)
            s = mma_v2(kr.to(gl.bfloat16), qb.to(gl.bfloat16), s)
        s = gl.where(valid[:, None], s * qk_scale, float("-inf"))
        p, state = _softmax_step(s, state, gl.zeros([TILE], gl.float32, layout=ROWS))
        m_i, l_i, a_min, o0, o1, o2, o3 = state
        pb = gl.convert_layout(p.to(gl.bfloat16), B_P)
        # Values: the tile's 8 pages hold [HKV, D, 8] each; a lane reads 8 entries of a dim at once.
        pg = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, V3)))
        sl = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, V3)))
        vd = gl.arange(0, Q, layout=gl.SliceLayout(1, gl.SliceLayout(2, V3)))
        page_entry = tile * TILE + 8 * pg
        v_page = gl.load(window_pages_ptr + ring * stride_wp + page_entry // WINDOW_ENTRIES, mask=page_entry < RING,
                         other=0)
        v_ptr = window_v_ptr + (v_page.to(gl.int64) * stride_page)[None, :, None] + sl[None, None, :] \
            + ((h * D + vd) * WINDOW_ENTRIES)[:, None, None]
        if gl.min(valid.to(gl.int32), axis=0) > 0:
            # Every entry is a window position (the steady state): whole pages, 16-byte loads.
            o0 = _ring_values(o0, pb, v_ptr, None, 0, Q)
            o1 = _ring_values(o1, pb, v_ptr, None, 1, Q)
            o2 = _ring_values(o2, pb, v_ptr, None, 2, Q)
            o3 = _ring_values(o3, pb, v_ptr, None, 3, Q)
        else:
            # Entries nobody wrote may hold anything (NaN): load zeros there, not 0·NaN later.
            e2 = tile * TILE + 8 * gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(0, V3)))[:, None] \
                + gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, V3)))[None, :]
            p2 = gl.load(window_pos_ptr + ring * RING + e2, mask=e2 < RING, other=-1)
            v_ok = ((p2 >= 0) & (p2 <= last) & ((p2 < SINK) | (last - p2 < RECENT)))[None, :, :]
            o0 = _ring_values(o0, pb, v_ptr, v_ok, 0, Q)
            o1 = _ring_values(o1, pb, v_ptr, v_ok, 1, Q)
            o2 = _ring_values(o2, pb, v_ptr, v_ok, 2, Q)
            o3 = _ring_values(o3, pb, v_ptr, v_ok, 3, Q)
        state = (m_i, l_i, a_min, o0, o1, o2, o3)
    return state


@gluon.jit
def _ring_values(o, pb, v_ptr, v_ok, I: gl.constexpr, Q: gl.constexpr):
    """``o += Vᵀ·Pᵀ`` for dims ``[I·Q, (I+1)·Q)`` of a ring tile."""
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    A_V: gl.constexpr = gl.DotOperandLayout(0, ACC, 2)
    if v_ok is None:
        v = gl.load(v_ptr + I * Q * WINDOW_ENTRIES)
    else:
        v = gl.load(v_ptr + I * Q * WINDOW_ENTRIES, mask=v_ok, other=0.0)
    v = v.to(gl.bfloat16)
    v = gl.convert_layout(_keys_of_columns(gl.reshape(v, [Q, TILE]), Q), A_V, assert_trivial=True)
    return mma_v2(v, pb, o)


@gluon.jit
def _store_output(o, n, d, l_i, a_min, unit, dest, I: gl.constexpr, G: gl.constexpr, HQ: gl.constexpr,
                  D: gl.constexpr, SPLIT: gl.constexpr):
    """Quarter ``I`` of the output rows (dims ``[I·Q, (I+1)·Q)``), back from INT2 units, to ``dest``:
    ``(out_ptr, part_out_ptr, stride_ot, stride_oh, r, h, split, num_splits)``."""
    out_ptr, part_out_ptr, stride_ot, stride_oh, r, h, split, num_splits = dest
    Q: gl.constexpr = D // 4
    inv_l = gl.where(l_i > 0, 1.0 / l_i, 0.0)
    x = (o * (1.0 / unit) + a_min[None, :]) * inv_l[None, :]
    hq = h * G + n
    mask = (n < G)[None, :]
    if SPLIT:
        part = ((r * HQ + hq) * num_splits + split).to(gl.int64)
        gl.store(part_out_ptr + part[None, :] * D + I * Q + d[:, None], x, mask=mask)
    else:
        gl.store(out_ptr + r.to(gl.int64) * stride_ot + hq[None, :] * stride_oh + I * Q + d[:, None],
                 x.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _split_ring(active, n_blocks, RING_TILES: gl.constexpr, RING_COST: gl.constexpr):
    """A split's share of the cost (a ring tile counting ``RING_COST`` blocks), the ring tiles a
    split takes (as many as fit in a share, at least one) and how many splits hold ring tiles."""
    per = gl.cdiv(RING_TILES * RING_COST + n_blocks, active)
    k = gl.maximum(per // RING_COST, gl.cdiv(RING_TILES, active))
    return per, k, gl.cdiv(RING_TILES, k)


@gluon.jit
def _split_tiles(split, active, n_blocks, RING_TILES: gl.constexpr, RING_COST: gl.constexpr):
    """Ring tiles ``[t_lo, t_hi)`` of split ``split`` of ``active`` (``split_shares``: the Python twin)."""
    _, k, _ = _split_ring(active, n_blocks, RING_TILES, RING_COST)
    t_lo = gl.minimum(split * k, RING_TILES)
    return t_lo, gl.minimum(t_lo + k, RING_TILES)


@gluon.jit
def _split_blocks(split, active, n_blocks, RING_TILES: gl.constexpr, RING_COST: gl.constexpr):
    """INT2 blocks ``[b_lo, b_hi)`` of split ``split`` of ``active``: the splits that hold ring tiles
    are topped up with blocks to a share, the others take a whole share each. Arithmetic, not
    branches: with branches the INT2 loop's trip count went to 64 bits and spilled at 168 registers."""
    per, k, ring_splits = _split_ring(active, n_blocks, RING_TILES, RING_COST)
    fill = gl.maximum(per - k * RING_COST, 0)
    last_fill = gl.maximum(per - (RING_TILES - (ring_splits - 1) * k) * RING_COST, 0)
    b_lo = _blocks_before(split, per, fill, last_fill, ring_splits)
    b_hi = _blocks_before(split + 1, per, fill, last_fill, ring_splits)
    return gl.minimum(b_lo, n_blocks), gl.minimum(b_hi, n_blocks)


@gluon.jit
def _blocks_before(s, per, fill, last_fill, ring_splits):
    """Blocks splits ``[0, s)`` hold: ``fill`` for each ring split but the last, ``last_fill`` for
    the last, ``per`` for each split past the ring."""
    return gl.minimum(s, ring_splits - 1) * fill + gl.maximum(s - ring_splits + 1, 0) * last_fill \
        + gl.maximum(s - ring_splits, 0) * (per - last_fill)


# Batch-dependent counts and strides change every step: unspecialized, one compiled variant per
# launch configuration (csrc_triton/warm_up.py compiles them all before serving).
@gluon.jit(
    do_not_specialize=["num_splits", "stride_bt"],
    do_not_specialize_on_alignment=["block_table_ptr", "seq_lens_ptr", "ring_slot_ptr"],
)
def _oscar_decode_kernel(
    out_ptr,  # [R, HQ, D] output (not SPLIT)
    part_out_ptr,  # fp32 [R, HQ, num_splits, D] normalized partial outputs (SPLIT)
    part_lse_ptr,  # fp32 [R, HQ, num_splits] partial log2-sum-exp2 (SPLIT)
    q_rot_ptr,  # [R, HQ, D] bf16/fp16 queries in the key-rotated basis (request r's is row r)
    codes_ptr,  # uint8 [num_blocks, HKV, REGION] INT2 pages (paged_layout)
    params_ptr,  # 16-bit view of the same pages
    window_k_ptr,  # bf16 [num_pages, page_elems] window pages: [8, HKV, D] rotated keys first
    window_v_ptr,  # the same pages from their values, [HKV, D, 8]
    window_pages_ptr,  # int32 [S, >= (SINK + RECENT) / 8] page of each ring's entries
    window_pos_ptr,  # int32 [S, SINK + RECENT] position held by each ring entry
    block_table_ptr,  # int32 [R, max_blocks]
    seq_lens_ptr,  # int32 [R] sequence length, this step's token included (already written)
    ring_slot_ptr,  # int32 [R]
    num_splits,  # most programs a request's keys are split over (SPLIT)
    qk_scale,  # softmax scale * log2(e)
    logit_coef,  # INT2 keys' log2 logits lose logit_coef * |q|^2 * s_k^2 (paged_layout.logit_coef; 0: off)
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cb,  # bytes from one cache block to the next
    stride_wp,  # window_pages row stride
    stride_page,  # elements from one window page to the next
    q_ptr,  # [R, HQ, D] the queries before the key rotation (KEY_MEAN)
    stride_mt, stride_mh,  # q_ptr's strides
    key_mean_ptr,  # fp32 [HKV, D] each KV head's block mean before RoPE, zero outside its pairs (KEY_MEAN)
    mean_pairs_ptr,  # int32 [HKV, MEAN_PAIRS] those pairs (dims j and j + D/2)
    cos_sin_ptr,  # fp32 [P, D] the RoPE table the keys were written with: row 64b turns block b's mean
    stride_cs,
    HKV: gl.constexpr,
    G: gl.constexpr,  # query heads per KV head
    N: gl.constexpr,  # G padded to the MMA's N (8 or 16)
    D: gl.constexpr,
    SINK: gl.constexpr,
    RECENT: gl.constexpr,
    SPLIT: gl.constexpr,
    PREFETCH: gl.constexpr,  # the INT2 block this many steps ahead goes into L2 (< 2: none; the next is in registers)
    RING_COST: gl.constexpr,  # INT2 blocks a ring tile counts as when splits share the keys (DECODE_LAUNCH)
    CORRECT: gl.constexpr,  # logit_coef != 0: INT2 logits take the logit correction
    KEY_MEAN: gl.constexpr,  # the INT2 keys were written less their block's mean (key_mean)
):
    Q: gl.constexpr = D // 4
    HQ: gl.constexpr = HKV * G
    RING_TILES: gl.constexpr = (SINK + RECENT + TILE - 1) // TILE
    SINK_BLOCKS: gl.constexpr = (SINK + TILE - 1) // TILE
    ACC: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    COLS: gl.constexpr = gl.SliceLayout(0, ACC)

    r = gl.program_id(0)
    h = gl.program_id(1)
    split = gl.program_id(2)
    seq_len = gl.load(seq_lens_ptr + r)
    last = seq_len - 1
    n_blocks = gl.cdiv(seq_len, TILE)
    tiles = RING_TILES + n_blocks
    if SPLIT:
        # As many splits as the request is long, at most num_splits: computed here so that the
        # launch depends on the batch size only (CUDA graphs).
        active = gl.minimum(num_splits, gl.maximum(1, gl.cdiv(tiles, MIN_SPLIT_TILES)))
        if split >= active:
            # No keys here: only the log-sum-exp the merge weighs by (its partial output is never
            # read), so a split count sized for long requests costs short ones little.
            n = gl.arange(0, N, layout=COLS)
            part = ((r * HQ + h * G + n) * num_splits + split).to(gl.int64)
            gl.store(part_lse_ptr + part, gl.full([N], float("-inf"), gl.float32, layout=COLS), mask=n < G)
            return
        # Both ranges here, before the query operands are live: computed after the ring loop
        # they cost the INT2 loop two more reloads (compile_check).
        t_lo, t_hi = _split_tiles(split, active, n_blocks, RING_TILES, RING_COST)
        b_lo, b_hi = _split_blocks(split, active, n_blocks, RING_TILES, RING_COST)
    else:
        t_lo, t_hi = 0, RING_TILES
        b_lo, b_hi = 0, n_blocks
    ring = gl.load(ring_slot_ptr + r).to(gl.int64)
    bt_ptr = block_table_ptr + r.to(gl.int64) * stride_bt
    q_base = q_rot_ptr + r.to(gl.int64) * stride_qt + (h * G) * stride_qh

    # Queries of quarter i times 4^-i, in the unit of the codes, as the K operands take them
    # (one quarter each, or two at head_dim 64); Σq of those very numbers; the logit correction
    # per unit of s_k², once per head, in the unit of the code products (_attend_int2_block).
    qs0, qs1, qs2, qs3, q_sum, q_sq = _query_operands(q_base, stride_qh, G, N, D)
    q_corr = q_sq * (logit_coef / ((qk_scale * 16777216.0) * (qk_scale * 16777216.0)))
    if KEY_MEAN:
        mean_a, mean_b, mean_col = _mean_coefficients(q_ptr + r.to(gl.int64) * stride_mt + (h * G) * stride_mh,
                                                      stride_mh, key_mean_ptr, mean_pairs_ptr, h, qk_scale, G, N, D)
        mean = (mean_a, mean_b, mean_col, cos_sin_ptr, stride_cs)
    else:
        mean = (0, 0, 0, cos_sin_ptr, stride_cs)

    m_i = gl.full([N], float("-inf"), gl.float32, layout=COLS)
    l_i = gl.zeros([N], gl.float32, layout=COLS)
    a_min = gl.zeros([N], gl.float32, layout=COLS)
    o0 = gl.zeros([Q, N], gl.float32, layout=ACC)
    o1 = gl.zeros([Q, N], gl.float32, layout=ACC)
    o2 = gl.zeros([Q, N], gl.float32, layout=ACC)
    o3 = gl.zeros([Q, N], gl.float32, layout=ACC)

    # The running softmax and the operands every step takes, as tuples (Triton 3.6's Gluon exports no
    # @aggregate); a tuple is flattened into its values, so the machine code is that of separate arguments.
    state = (m_i, l_i, a_min, o0, o1, o2, o3)
    rings = (window_k_ptr, window_v_ptr, window_pages_ptr, window_pos_ptr, stride_wp, stride_page)
    for tile in range(t_lo, t_hi):
        state = _attend_ring_tile(state, tile, ring, h, last, qk_scale, q_base, stride_qh, rings, HKV, G, N, D, SINK,
                                  RECENT)
    # From here on the accumulators hold INT2 units (what the code products leave).
    m_i, l_i, a_min, o0, o1, o2, o3 = state
    state = (m_i, l_i, a_min, o0 * UNIT_0, o1 * UNIT_1, o2 * UNIT_2, o3 * UNIT_3)
    query = (qs0, qs1, qs2, qs3, q_sum, q_corr)
    pages = (codes_ptr, params_ptr, stride_cb, bt_ptr)

    # Blocks [0, SINK_BLOCKS) meet the sink, blocks from recent_start the recent window or
    # seq_len; the ones between are INT2 for every key and take the loop without masks.
    window_start = gl.maximum(last - RECENT + 1, 0)
    recent_start = gl.maximum(SINK_BLOCKS, gl.minimum(n_blocks, window_start // TILE))
    for blk in range(b_lo, gl.minimum(b_hi, SINK_BLOCKS)):
        state = _attend_window_block(state, query, blk, seq_len, last, ring, h, qk_scale, pages, window_pos_ptr, mean,
                                     Q, N, SINK, RECENT, CORRECT, KEY_MEAN)
    p_lo = gl.maximum(b_lo, SINK_BLOCKS)
    p_hi = gl.minimum(b_hi, recent_start)
    if p_lo < p_hi:
        # One block in flight ahead of the one in the tensor cores. A block's V scales and mins,
        # needed only after its scores and softmax, are loaded at the start of its own step (beside
        # the next block's codes), not carried: that leaves the registers q_corr takes, and the
        # 168-register launch does not spill in this loop.
        kc, vc, ks, km, _, _ = _load_int2_block(pages, p_lo, h, Q, N)
        for i in gl.static_range(2, PREFETCH):
            _prefetch_int2_block(pages, gl.minimum(p_lo + i, p_hi - 1), h, Q)
        for blk in range(p_lo, p_hi):
            if PREFETCH > 1:
                _prefetch_int2_block(pages, gl.minimum(blk + PREFETCH, p_hi - 1), h, Q)
            vs, vm = _load_v_params(pages, blk, h, Q)
            kc2, vc2, ks2, km2, _, _ = _load_int2_block(pages, gl.minimum(blk + 1, p_hi - 1), h, Q, N)
            state = _attend_int2_block(state, query, (kc, vc, ks, km, vs, vm), None, qk_scale, blk, mean, Q, N, False,
                                       CORRECT, KEY_MEAN)
            kc, vc, ks, km = kc2, vc2, ks2, km2
    for blk in range(gl.maximum(b_lo, recent_start), b_hi):
        state = _attend_window_block(state, query, blk, seq_len, last, ring, h, qk_scale, pages, window_pos_ptr, mean,
                                     Q, N, SINK, RECENT, CORRECT, KEY_MEAN)
    m_i, l_i, a_min, o0, o1, o2, o3 = state

    # Back from INT2 units; the min term adds the same amount to every dim of a head.
    d = gl.arange(0, Q, layout=gl.SliceLayout(1, ACC))
    n = gl.arange(0, N, layout=COLS)
    dest = (out_ptr, part_out_ptr, stride_ot, stride_oh, r, h, split, num_splits)
    _store_output(o0, n, d, l_i, a_min, UNIT_0, dest, 0, G, HQ, D, SPLIT)
    _store_output(o1, n, d, l_i, a_min, UNIT_1, dest, 1, G, HQ, D, SPLIT)
    _store_output(o2, n, d, l_i, a_min, UNIT_2, dest, 2, G, HQ, D, SPLIT)
    _store_output(o3, n, d, l_i, a_min, UNIT_3, dest, 3, G, HQ, D, SPLIT)
    if SPLIT:
        lse = gl.where(l_i > 0, m_i + gl.log2(gl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        part = ((r * HQ + h * G + n) * num_splits + split).to(gl.int64)
        gl.store(part_lse_ptr + part, lse, mask=n < G)


def split_shares(n_blocks: int, active: int, ring_tiles: int, ring_cost: int) -> list[tuple[int, int, int, int]]:
    """``(t_lo, t_hi, b_lo, b_hi)`` of each of ``active`` splits, as the kernel divides a request:
    ring tiles first, ``k`` a split (as many as fit in a share of the cost, a ring tile counting
    ``ring_cost`` blocks, at least one), the splits holding ring tiles topped up with blocks to a
    share, every other split a whole share of blocks. The Python twin of ``_split_tiles`` and
    ``_split_blocks``."""
    per = -(-(ring_tiles * ring_cost + n_blocks) // active)
    k = max(per // ring_cost, -(-ring_tiles // active))
    ring_splits = -(-ring_tiles // k)
    fill = max(per - k * ring_cost, 0)
    last_fill = max(per - (ring_tiles - (ring_splits - 1) * k) * ring_cost, 0)
    before = [min(s, ring_splits - 1) * fill + max(s - ring_splits + 1, 0) * last_fill
              + max(s - ring_splits, 0) * (per - last_fill) for s in range(active + 1)]
    return [(min(s * k, ring_tiles), min(s * k + k, ring_tiles), min(before[s], n_blocks), min(before[s + 1], n_blocks))
            for s in range(active)]


def supports(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, sink: int) -> bool:
    """Whether this kernel serves the shape: 16-bit models, head_dim 64 or 128, up to 16 query
    heads per KV head, rings whose pages hold 8 entries (a sink that is a multiple of 8)."""
    g = num_heads // num_kv_heads
    return (dtype in (torch.float16, torch.bfloat16) and head_dim in (64, 128) and 1 <= g <= 16
            and num_heads % num_kv_heads == 0 and sink % WINDOW_ENTRIES.value == 0)


def oscar_decode(
    out: torch.Tensor,
    q_rot: torch.Tensor,
    *,
    cache: MixedCache,
    batch: BatchLayout,
    scale: float,
    num_splits: int = 1,
    part_out: torch.Tensor | None = None,
    part_lse: torch.Tensor | None = None,
    maxnreg: int | None = -1,
    logit_correction: float = 0.0,
    prefetch: int | None = None,
    ring_cost: int | None = None,
    q: torch.Tensor | None = None,
    key_mean: dict | None = None,
) -> torch.Tensor:
    """Decode attention of ``batch``'s requests, one query each (row r of ``q_rot``
    ``[>= num_reqs, Hq, d]``, key-rotated basis), over positions ``[0, seq_lens[r])`` of the
    cache, this step's token already written. Writes ``out`` ``[>= num_reqs, Hq, d]``.

    With ``num_splits > 1`` a request's keys are split over up to that many programs, which
    needs fp32 scratch ``part_out`` ``[>= num_reqs * Hq * num_splits * d]`` and ``part_lse``
    ``[>= num_reqs * Hq * num_splits]``, merged by ``merge_splits``. ``maxnreg``:
    registers per thread (None: no cap), else from ``DECODE_LAUNCH``. ``logit_correction``: λ,
    INT2 keys' logits lowered by λ/2 times their expected rounding variance (``logit_coef``).
    ``prefetch``: the INT2 block that many steps ahead is prefetched into L2 (< 2: none; None:
    ``DECODE_LAUNCH``'s). ``ring_cost``: INT2 blocks a ring tile counts as in the split partition
    (None: ``DECODE_LAUNCH``'s; 1 counts every tile alike). ``key_mean``: the INT2 keys were written
    less their block's mean (``key_mean_operands``), which needs the queries before the key
    rotation, ``q`` (``q_rot``'s shape).
    """
    num_reqs = batch.num_reqs
    if num_reqs == 0:
        return out
    hq, d = q_rot.shape[1], q_rot.shape[2]
    hkv = cache.pages.shape[1]
    if not supports(hq, hkv, d, q_rot.dtype, cache.sink) or num_splits < 1:
        raise ValueError(f"oscar_decode does not serve {hq}/{hkv} heads of {d} in {q_rot.dtype}, sink {cache.sink}, "
                         f"{num_splits} splits (see supports())")
    coef = logit_coef(logit_correction, scale)
    g = hq // hkv
    c = cache_args(cache, hkv, d)
    if c["WIN_E"] != WINDOW_ENTRIES.value:
        raise ValueError(f"oscar_decode reads rings of {WINDOW_ENTRIES.value} entries per page")
    n_pad = 8 if g <= 8 else 16
    if key_mean is not None and (q is None or q.shape[1:] != q_rot.shape[1:]):
        raise ValueError("the decode kernel adds a key mean from the queries before the key rotation: pass q")
    mean = key_mean or dict(key_mean=out, mean_pairs=out, cos_sin=out)
    table = decode_launch(num_reqs)
    if maxnreg == -1:
        maxnreg = table.maxnreg if n_pad == 8 else None
    if prefetch is None:
        prefetch = table.prefetch
    split = num_splits > 1
    if split:
        part_out, part_lse = split_scratch(part_out, part_lse, num_reqs * hq * num_splits, d)
    q_mean = q_rot if q is None else q
    # Runtime arguments by position, constexprs by name (tests read the launch so).
    _oscar_decode_kernel[(num_reqs, hkv, num_splits)](
        out, part_out if split else out, part_lse if split else out, q_rot, c["codes_ptr"], c["params_ptr"],
        c["window_k_ptr"], c["window_v_ptr"], c["window_pages_ptr"], c["window_pos_ptr"], batch.block_table,
        batch.seq_lens, batch.ring_slots, num_splits, scale * LOG2E, coef, q_rot.stride(0), q_rot.stride(1),
        out.stride(0), out.stride(1), batch.block_table.stride(0), c["stride_cb"], c["stride_wp"], c["stride_page"],
        q_mean, q_mean.stride(0), q_mean.stride(1), mean["key_mean"], mean["mean_pairs"], mean["cos_sin"],
        mean["cos_sin"].stride(0),
        HKV=hkv, G=g, N=n_pad, D=d, SINK=cache.sink, RECENT=cache.recent, SPLIT=split, PREFETCH=prefetch,
        RING_COST=ring_cost or table.ring_cost, CORRECT=coef != 0.0, KEY_MEAN=key_mean is not None, num_warps=1,
        **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )
    if split:
        merge_splits(out, part_out, part_lse, num_reqs, num_splits)
    return out


def key_mean_operands(key_mean: torch.Tensor, cos_sin: torch.Tensor) -> dict:
    """What ``oscar_decode`` takes to add a layer's key mean back: ``key_mean`` fp32 ``[Hkv, d]``
    (the block mean before RoPE, ``oscar_vllm.core.key_mean.block_average``, zero outside each
    head's ``MEAN_PAIRS`` pairs of most energy: what the kernel adds), ``cos_sin`` fp32 ``[P, d]``
    the RoPE table the keys were written with. Adds ``mean_pairs`` int32 ``[Hkv, MEAN_PAIRS]``:
    each head's pairs, ascending."""
    hkv, d = key_mean.shape
    half = d // 2
    pairs_n = int(MEAN_PAIRS.value)
    if key_mean.dtype != torch.float32 or cos_sin.dtype != torch.float32 or cos_sin.shape[1] != d:
        raise ValueError(f"a key mean fp32 [Hkv, {d}] and an fp32 RoPE table [P, {d}] are needed, got "
                         f"{key_mean.dtype} {tuple(key_mean.shape)} and {cos_sin.dtype} {tuple(cos_sin.shape)}")
    energy = key_mean[:, :half].square() + key_mean[:, half:].square()
    pairs = energy.topk(min(pairs_n, half), dim=-1).indices.sort(dim=-1).values
    kept = torch.zeros_like(energy, dtype=torch.bool).scatter_(-1, pairs, True)
    if bool((energy[~kept] > 0).any()):
        raise ValueError(f"the decode kernel adds {pairs_n} RoPE pairs of each head's key mean; this mean has more "
                         "(keep each head's strongest: oscar_vllm.core.key_mean.strongest_pairs)")
    return dict(key_mean=key_mean, mean_pairs=pairs.to(dtype=torch.int32).contiguous(), cos_sin=cos_sin)
