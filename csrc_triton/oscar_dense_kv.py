"""Dense keys and values of prefill requests, for a FlashAttention pass over a cached prefix.

A prefill chunk over a long cached prefix is compute-bound: its cost is the query-key products,
which FlashAttention 3 does at several times the rate an INT2-reading kernel reaches. So, as the
OSCAR reference does, the prefix is dequantized once per layer into a dense buffer and the chunk
runs plain causal attention over ``[prefix ; chunk]``. Request ``r`` owns rows
``[cu_k[r], cu_k[r] + seq_len[r])`` of the buffer, position ``p`` at row ``cu_k[r] + p``:

* ``p < ctx`` (cached): the BF16 ring's copy where the ring holds ``p`` and ``p`` is in the sink
  or the ``recent`` positions before ``ctx``, else the INT2 copy, ``scale·c + min``; exactly the
  keys and values the INT2 attention kernel reads for the chunk;
* ``ctx <= p < seq_len``: the chunk's own keys and values as given (keys already rotated).

Everything stays in the rotated basis, so the queries that go with it are ``q_rot``.

A prefill that reads as decode does (``prefill_read="decode"``) fills two such buffers per chunk
(``oscar_vllm.serving.prefill.oscar_decode_read_prefill``): the BF16 rows of its window, from position
``first_pos[r]`` on (row ``cu_k[r] + p - first_pos[r]``), before the chunk is written; and, after
the write, every position but the last ``drop_last`` from the INT2 pages, the ring only for the
sink (``ring_recent=False``, with a ``cu_q`` of empty chunks: every position counts as cached).

With a key mean (``key_mean``: the INT2 keys of block ``b`` were rounded less ``RoPE_{64b}(μ)``,
rotated), each INT2 row gets it back: ``RoPE_p(μ) @ R_K`` is linear in position ``p``'s row of the
RoPE table, so it is that row times a ``[d, d]`` matrix per KV head (:func:`key_mean_basis`), kept
to the ``K`` table columns of the pairs the mean has (twice the 16 the backend serves a head). One
vector a block and KV head, ``[K] x [K, d]`` in fp32, added to the block's INT2 rows. The ring's
rows and the chunk's own keys are whole keys and take none.

No logit correction on this path: the INT2 kernels lower an INT2 key's logit by
``λ/2·scale²·‖q‖²·s_k²/12`` (``paged_layout.logit_coef``), a bias that depends on both the query
and the key, and a FlashAttention pass over dense keys takes none. Chunks that take it attend
as with λ = 0, whatever λ the backend serves with. Reference:
:func:`oscar_vllm.reference.oscar_dense_kv.oscar_dense_kv_reference`.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from csrc_triton.paged_layout import (
    BLOCK_SIZE,
    BatchLayout,
    MixedCache,
    cache_args,
    check_rope_table,
    int2_params_at,
    int2_region_bytes,
    to_bf16_rne,
    window_index,
    v_token,
    window_page,
)


@triton.jit
def _store_rows(ptr, off, mask, x, OUT_BF16: tl.constexpr):
    if OUT_BF16:
        y = to_bf16_rne(x)  # the interpreter's bf16 cast truncates; the GPU's rounds
    else:
        y = x.to(ptr.dtype.element_ty)
    tl.store(ptr + off, y, mask=mask)


# The prefill part of a batch is a slice of its metadata, at any int32 offset, and the block
# table's width is the server's (see _oscar_attention_kernel). Without a key mean its column
# pointer is the ring slots', so it takes their offsets too.
@triton.jit(
    do_not_specialize=["stride_bt", "drop_last"],
    do_not_specialize_on_alignment=["block_table_ptr", "seq_lens_ptr", "cu_q_ptr", "cu_k_ptr", "ring_slot_ptr",
                                    "first_pos_ptr", "mean_cols_ptr"],
)
def _oscar_dense_kv_kernel(
    k_out_ptr,  # [total_k, HKV, D] dense keys, rotated basis
    v_out_ptr,  # [total_k, HKV, D] dense values
    k_new_ptr,  # [T, HKV, D] this step's keys, rotated
    v_new_ptr,  # [T, HKV, D] this step's values
    codes_ptr,  # uint8 [num_blocks, HKV, REGION] INT2 pages (paged_layout)
    params_ptr,  # 16-bit view of the same pages
    window_k_ptr,  # bf16 [num_pages, page_elems] window pages (paged_layout): keys first
    window_v_ptr,  # the same pages from their values
    window_pages_ptr,  # int32 [S, pages per ring] page of each ring's entries
    window_pos_ptr,  # int32 [S, SINK + RECENT]
    block_table_ptr,  # int32 [R, max_blocks]
    seq_lens_ptr,  # int32 [R] sequence length including this step
    cu_q_ptr,  # int32 [R + 1] query start offsets
    cu_k_ptr,  # int32 [R + 1] first buffer row of each request
    ring_slot_ptr,  # int32 [R]
    first_pos_ptr,  # int32 [R] first position written (HAS_FIRST), else 0
    mean_basis_ptr,  # fp32 [MEAN_K, HKV, D] the key mean's rows per RoPE table column (KEY_MEAN: key_mean_basis)
    mean_cols_ptr,  # int32 [HKV, MEAN_K] the table column each of those rows multiplies (KEY_MEAN)
    cos_sin_ptr,  # fp32 [P, D] RoPE table: each position's D/2 cosines, then its D/2 sines (KEY_MEAN)
    drop_last,  # positions >= seq_len - drop_last are not written
    stride_nt, stride_nh, stride_vt, stride_vh, stride_bt,
    stride_cs,  # cos_sin row stride
    stride_cb,  # bytes from one cache block to the next
    stride_wp,  # window_pages row stride
    stride_page,  # elements from one window page to the next
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SINK: tl.constexpr,
    RECENT: tl.constexpr,
    WIN_E: tl.constexpr,  # ring entries per window page
    OUT_BF16: tl.constexpr,
    HAS_FIRST: tl.constexpr,
    RING_RECENT: tl.constexpr,  # the ring's recent entries replace INT2 copies (else the sink's only)
    KEY_MEAN: tl.constexpr,  # INT2 keys of block b are read plus RoPE_64b(mean) @ R_K
    MEAN_K: tl.constexpr,  # rows of the mean's basis: twice the pairs it has, a power of two >= 16
):
    Q: tl.constexpr = D // 4
    REGION: tl.constexpr = int2_region_bytes(D, BLOCK_SIZE)
    r = tl.program_id(0)
    blk = tl.program_id(1)
    h = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + r)
    end = seq_len - drop_last
    first = 0
    if HAS_FIRST:
        first = tl.load(first_pos_ptr + r)
    if (blk * BLOCK_SIZE >= end) | ((blk + 1) * BLOCK_SIZE <= first):
        return
    q_start = tl.load(cu_q_ptr + r)
    ctx = seq_len - (tl.load(cu_q_ptr + r + 1) - q_start)
    col = tl.arange(0, BLOCK_SIZE)
    tok = v_token(col)  # the block in the V codes' column order: contiguous V loads
    pos = blk * BLOCK_SIZE + tok
    j = tl.arange(0, Q)
    keep = (pos >= first) & (pos < end)
    row = (tl.load(cu_k_ptr + r) + pos - first).to(tl.int64)
    out_off = (row * HKV + h)[:, None] * D + j[None, :]  # [BS, Q]: quarter 0 of each row

    if blk * BLOCK_SIZE < ctx:
        cached = (pos < ctx) & keep
        base = tl.load(block_table_ptr + r * stride_bt + blk).to(tl.int64) * stride_cb + h * REGION
        k_codes = tl.load(codes_ptr + base + tok[:, None] * Q + j[None, :])  # [BS, Q] token-major
        v_codes = tl.load(codes_ptr + base + BLOCK_SIZE * Q + j[None, :] * BLOCK_SIZE + col[:, None])
        p_ptr = params_ptr + (base + int2_params_at(D, BLOCK_SIZE)) // 2 + tok
        k_scale = tl.load(p_ptr).to(tl.float32)[:, None]
        k_min = tl.load(p_ptr + BLOCK_SIZE).to(tl.float32)[:, None]
        v_scale = tl.load(p_ptr + 2 * BLOCK_SIZE).to(tl.float32)[:, None]
        v_min = tl.load(p_ptr + 3 * BLOCK_SIZE).to(tl.float32)[:, None]
        ring = tl.load(ring_slot_ptr + r).to(tl.int64)
        entry = window_index(pos, SINK, RECENT)
        held = tl.load(window_pos_ptr + ring * (SINK + RECENT) + entry, mask=cached, other=-1) == pos
        if RING_RECENT:
            use_ring = (held & ((pos < SINK) | (ctx - pos < RECENT)))[:, None]
        else:
            use_ring = (held & (pos < SINK))[:, None]
        page = window_page(window_pages_ptr, stride_wp, ring, entry, held, stride_page, WIN_E)[:, None]
        slot = (entry % WIN_E)[:, None]
        k_off = page + slot * (HKV * D) + h * D + j[None, :]
        v_off = page + (h * D + j[None, :]) * WIN_E + slot
        if KEY_MEAN:
            c = tl.arange(0, MEAN_K)
            cols = tl.load(mean_cols_ptr + h * MEAN_K + c)
            # the block's first position's RoPE table row, the mean's columns
            turn = tl.load(cos_sin_ptr + (blk * BLOCK_SIZE).to(tl.int64) * stride_cs + cols)
        for i in tl.static_range(4):
            # c·scale is exact in fp32 (2-bit times 16-bit), so this rounds once, as the reference.
            k = ((k_codes >> (2 * i)) & 3).to(tl.float32) * k_scale + k_min
            if KEY_MEAN:
                basis = tl.load(mean_basis_ptr + (c[:, None] * HKV + h) * D + i * Q + j[None, :])  # [MEAN_K, Q]
                k += tl.sum(turn[:, None] * basis, axis=0)[None, :]
            v = ((v_codes >> (2 * i)) & 3).to(tl.float32) * v_scale + v_min
            k = tl.where(use_ring, tl.load(window_k_ptr + k_off + i * Q, mask=use_ring, other=0.0).to(tl.float32), k)
            v_ring = tl.load(window_v_ptr + v_off + i * Q * WIN_E, mask=use_ring, other=0.0)
            v = tl.where(use_ring, v_ring.to(tl.float32), v)
            _store_rows(k_out_ptr, out_off + i * Q, cached[:, None], k, OUT_BF16)
            _store_rows(v_out_ptr, out_off + i * Q, cached[:, None], v, OUT_BF16)

    if (blk + 1) * BLOCK_SIZE > ctx:
        new = (pos >= ctx) & keep
        src = (q_start + pos - ctx).to(tl.int64)
        for i in tl.static_range(4):
            k = tl.load(k_new_ptr + (src * stride_nt + h * stride_nh)[:, None] + i * Q + j[None, :],
                        mask=new[:, None], other=0.0)
            v = tl.load(v_new_ptr + (src * stride_vt + h * stride_vh)[:, None] + i * Q + j[None, :],
                        mask=new[:, None], other=0.0)
            _store_rows(k_out_ptr, out_off + i * Q, new[:, None], k.to(tl.float32), OUT_BF16)
            _store_rows(v_out_ptr, out_off + i * Q, new[:, None], v.to(tl.float32), OUT_BF16)


def oscar_dense_kv(
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    *,
    cache: MixedCache,
    batch: BatchLayout,
    cu_k: torch.Tensor,
    max_seq_len: int,
    first_pos: torch.Tensor | None = None,
    drop_last: int = 0,
    ring_recent: bool = True,
    mean_basis: "KeyMeanBasis | None" = None,
    cos_sin: torch.Tensor | None = None,
) -> None:
    """Fill rows ``[0, cu_k[num_reqs])`` of ``k_out``/``v_out`` ``[>= total_k, Hkv, d]``.

    ``k_new``/``v_new`` ``[T, Hkv, d]``: the step's keys (rotated) and values, ``batch.cu_q`` their
    request offsets; ``cu_k`` int32 ``[R + 1]`` the cumulative ``seq_lens``; ``max_seq_len`` at
    least the longest ``seq_lens`` entry (it sizes the grid; a larger value only idles programs).
    ``first_pos`` int32 ``[R]``: request ``r`` writes positions ``[first_pos[r], seq_lens[r] -
    drop_last)`` to rows from ``cu_k[r]`` (then ``cu_k`` counts those); ``ring_recent=False``: only
    the sink comes from the ring. ``mean_basis`` (:func:`key_mean_basis`) and ``cos_sin`` fp32
    ``[P, d]`` (the RoPE table the key mean was taken off with): INT2 keys are read plus their mean
    (``key_mean`` "on").
    """
    num_reqs = batch.num_reqs
    if num_reqs == 0 or max_seq_len == 0:
        return
    _, hkv, d = k_new.shape
    caches = cache_args(cache, hkv, d)
    if (mean_basis is None) != (cos_sin is None):
        raise ValueError("a key mean's basis needs its RoPE table and the table its basis: pass both or neither")
    if mean_basis is not None:
        check_key_mean_basis(mean_basis, hkv, d)
        check_rope_table(cos_sin, d)
        if cos_sin.dtype != torch.float32:
            raise ValueError(f"the RoPE table must be fp32, got {cos_sin.dtype}")
    for name, x in (("k_out", k_out), ("v_out", v_out)):
        if x.dim() != 3 or x.shape[1:] != (hkv, d) or not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous [rows, {hkv}, {d}], got {tuple(x.shape)}")
    if k_new.stride(-1) != 1 or v_new.stride(-1) != 1:
        raise ValueError("k_new and v_new need unit stride along head_dim")
    ring_slots = batch.ring_slots
    _oscar_dense_kv_kernel[(num_reqs, triton.cdiv(max_seq_len, BLOCK_SIZE), hkv)](
        k_out_ptr=k_out, v_out_ptr=v_out, k_new_ptr=k_new, v_new_ptr=v_new, block_table_ptr=batch.block_table,
        seq_lens_ptr=batch.seq_lens, cu_q_ptr=batch.cu_q, cu_k_ptr=cu_k, ring_slot_ptr=ring_slots,
        first_pos_ptr=ring_slots if first_pos is None else first_pos,
        mean_basis_ptr=k_new if mean_basis is None else mean_basis.rows,
        mean_cols_ptr=ring_slots if mean_basis is None else mean_basis.columns,
        cos_sin_ptr=k_new if cos_sin is None else cos_sin,
        drop_last=drop_last,
        stride_nt=k_new.stride(0), stride_nh=k_new.stride(1), stride_vt=v_new.stride(0), stride_vh=v_new.stride(1),
        stride_bt=batch.block_table.stride(0), stride_cs=0 if cos_sin is None else cos_sin.stride(0),
        HKV=hkv, D=d, BLOCK_SIZE=BLOCK_SIZE, OUT_BF16=k_out.dtype == torch.bfloat16,
        HAS_FIRST=first_pos is not None, RING_RECENT=ring_recent, KEY_MEAN=mean_basis is not None,
        MEAN_K=16 if mean_basis is None else mean_basis.rows.shape[0], num_warps=4, **caches,
    )


class KeyMeanBasis(NamedTuple):
    """What the dense fill adds a key mean with (:func:`key_mean_basis`)."""

    rows: torch.Tensor  # fp32 [K, Hkv, d]: row k of head h, what table column columns[h, k] contributes
    columns: torch.Tensor  # int32 [Hkv, K]: the RoPE table column each row multiplies


def key_mean_basis(key_mean: torch.Tensor, rot_k: torch.Tensor) -> KeyMeanBasis:
    """``RoPE_p(μ_h) @ R_K`` as a position's RoPE table row (``d/2`` cosines, then ``d/2`` sines)
    times a matrix per KV head, kept to the table columns of the pairs the mean has: ``rows``
    ``[K, Hkv, d]`` and the column each multiplies, ``columns`` ``[Hkv, K]``. ``K`` is twice the
    most pairs a head has (its cosine and sine columns), a power of two and at least 16 (the tensor
    cores' depth); rows past a head's pairs are zero. ``key_mean`` fp32 ``[Hkv, d]`` (before RoPE;
    rotate-half RoPE: pair ``i`` is dims ``i`` and ``i + d/2``; zero outside its pairs, as
    ``served_pairs`` leaves it), ``rot_k`` ``[d, d]`` or ``[Hkv, d, d]``."""
    hkv, d = key_mean.shape
    half = d // 2
    m1, m2 = key_mean.float().cpu().chunk(2, dim=-1)  # [Hkv, d/2]
    has = (m1 != 0) | (m2 != 0)
    k = max(16, triton.next_power_of_2(2 * int(has.sum(dim=1).max())))
    # A head's pairs first (ascending), then pair 0 again with zero rows to fill K/2.
    order = torch.sort((~has).to(torch.int8), dim=1, stable=True).indices[:, : k // 2]  # [Hkv, K/2]
    live = torch.gather(has, 1, order)
    pair = torch.where(live, order, torch.zeros_like(order))
    a = torch.where(live, torch.gather(m1, 1, pair), torch.zeros(()))  # μ_i
    b = torch.where(live, torch.gather(m2, 1, pair), torch.zeros(()))  # μ_{i+d/2}
    # RoPE_p(μ)_i = μ_i·cos_i - μ_{i+d/2}·sin_i and RoPE_p(μ)_{i+d/2} = μ_{i+d/2}·cos_i + μ_i·sin_i:
    # the table's column i (cos_i) and d/2 + i (sin_i) each reach dims i and i + d/2.
    unrotated = torch.zeros(hkv, k, d, dtype=torch.float64)
    heads = torch.arange(hkv)[:, None]
    cos_row, sin_row = torch.arange(k // 2)[None, :], k // 2 + torch.arange(k // 2)[None, :]
    unrotated[heads, cos_row, pair] = a.double()
    unrotated[heads, cos_row, pair + half] = b.double()
    unrotated[heads, sin_row, pair] = -b.double()
    unrotated[heads, sin_row, pair + half] = a.double()
    # in fp64: an fp32 product may run in TF32 where a process allows it (torch's matmul precision)
    rot = rot_k.double().cpu()
    rotated = unrotated @ rot if rot.dim() == 2 else torch.einsum("hki,hij->hkj", unrotated, rot)
    columns = torch.cat([pair, pair + half], dim=1).to(torch.int32)
    device = key_mean.device
    return KeyMeanBasis(rotated.transpose(0, 1).float().contiguous().to(device), columns.contiguous().to(device))


def check_key_mean_basis(basis: KeyMeanBasis, hkv: int, d: int) -> None:
    """``basis`` is what :func:`key_mean_basis` gives for ``hkv`` KV heads of ``d`` dims, else an
    error naming what differs."""
    if not isinstance(basis, KeyMeanBasis):
        raise ValueError(f"the key mean's basis must be a KeyMeanBasis (key_mean_basis), got {type(basis).__name__}")
    rows, columns = basis
    k = rows.shape[0] if rows.dim() == 3 else 0
    if (rows.shape != (k, hkv, d) or rows.dtype != torch.float32 or not rows.is_contiguous() or k < 16
            or k & (k - 1) or k > d):
        raise ValueError(f"the key mean's basis rows must be contiguous fp32 [K, {hkv}, {d}] with K a power of two in "
                         f"[16, {d}] (key_mean_basis), got {rows.dtype} {tuple(rows.shape)}")
    if columns.shape != (hkv, k) or columns.dtype != torch.int32 or not columns.is_contiguous():
        raise ValueError(f"the key mean's basis columns must be contiguous int32 [{hkv}, {k}], got {columns.dtype} "
                         f"{tuple(columns.shape)}")
