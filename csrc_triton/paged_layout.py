"""The OSCAR paged KV layout and the small device helpers the kernels share.

A kernel block holds ``BLOCK_SIZE`` (64) tokens of one layer. Inside it, each KV head owns one
contiguous region of ``BLOCK_SIZE * int2_slot_bytes(d)`` bytes, laid out so that every read of
the attention kernels is a contiguous, 16-byte aligned run (d = head_dim, Q = d/4)::

    [0, B*Q)                 K codes, token-major: token t at t*Q (byte j: dims j, j+Q, j+2Q, j+3Q)
    [B*Q, 2*B*Q)             V codes, dim-major: byte j of token t at j*B + v_column(t)
    [2*B*Q, 2*B*Q + 8*B)     four [B] arrays of 16-bit floats: K scale, K min, V scale, V min

K is token-major and V dim-major because that is what each matrix product wants contiguous:
``q @ K^T`` reduces over dims, ``p @ V`` over tokens. Within a row of V codes the tokens are
permuted (``v_column``): the decode kernel (``oscar_decode``) reads each lane's tokens of a
tile as one 16-byte load whose bytes pair up as its tensor-core fragment takes them. A layer's cache is a uint8 tensor
``[num_blocks, num_kv_heads, BLOCK_SIZE * int2_slot_bytes(d)]``; the kernels read the parameters
through a 16-bit view of the same memory.

The BF16 windows (sink and recent window) of each running request live in pages of the same
pool: vLLM's scheduler gives a request ``window_pages_per_ring`` blocks when it starts and takes
them back when it ends (``oscar_vllm.serving.window_pages``), so they cost memory only for the requests
actually running. Viewed as bf16 (``windows_view``), a page holds ``E = window_entries_per_page``
entries of one ring: ``[E, num_kv_heads, d]`` rotated keys, then the values transposed,
``[num_kv_heads, d, E]``, so that one dim of a page's entries is 16 contiguous bytes (``p @ V``
reduces over entries).
A request's ring has ``sink + recent`` entries; position ``p`` lives at entry ``p`` if
``p < sink``, else ``sink + (p - sink) % recent``; entry ``i`` is in page
``window_pages[ring, i // E]`` at slot ``i % E``. ``E`` divides ``sink`` (a page holds fewer
entries than it could when that is what it takes), so the sink fills pages of its own and the
recent window starts on a fresh page: the sink pages of one request can be the sink pages of
others, and requests that share a cached prefix share its BF16 sink (``oscar_vllm.serving.window_pages``).
``window_pos`` ``[num_rings, sink + recent]`` int32 holds the position each entry holds (-1:
empty). A reader trusts an entry only when ``window_pos`` equals the position it wants, so a
stale or missing entry falls back to the INT2 copy.

The kernels' callers hand them a layer's cache as one ``MixedCache`` and a batch as one
``BatchLayout``. This module also holds what every kernel file shares: the region's formula
(``int2_region_bytes``, callable in Triton and Gluon code alike), the units the INT2 codes enter
the tensor cores in (``UNIT_*``) and the Triton kernels' launch tables (the Gluon kernels' are in
``gluon_layout``).
"""
from typing import Callable, NamedTuple

import torch
import triton
import triton.language as tl

BLOCK_SIZE = 64  # tokens per kernel block: one block is one attention tile
PARAM_BYTES = 8  # K scale, K min, V scale, V min, 16 bits each
WINDOW_ENTRIES = 8  # ring entries per page at the default sink (what the decode kernel reads per page)
KEY_MEAN_PAIRS = 16  # RoPE pairs of a KV head's key mean the kernels add back (key_mean)
# Keys are written less one mean vector per cache block: the KV head's block mean (key_mean.block_average)
# turned to the block's first position, so a read adds one logit per block and query.
KEY_MEAN_BLOCK = tl.constexpr(BLOCK_SIZE)
# What one unit of quarter i's codes is worth: the kernels read code c of dims [iQ, (i+1)Q) as the
# fp16 number c·4^i·2^-24 (a subnormal: the code masked in place), i.e. c·UNIT_i.
UNIT_0 = tl.constexpr(2.0 ** -24)
UNIT_1 = tl.constexpr(2.0 ** -22)
UNIT_2 = tl.constexpr(2.0 ** -20)
UNIT_3 = tl.constexpr(2.0 ** -18)


class MixedCache(NamedTuple):
    """A layer's cache as the kernels and their twins take it: the INT2 pages and the BF16 rings."""

    pages: torch.Tensor  # uint8 [num_blocks, Hkv, int2_region_bytes(d)]: the INT2 pages
    windows: torch.Tensor  # bf16 [num_pages, page_elems]: the ring pages (windows_view of pages when serving)
    window_pages: torch.Tensor  # int32 [rings, pages per ring]: the page of each ring's entries
    window_pos: torch.Tensor  # int32 [rings, sink + recent]: the position each ring entry holds (-1: none)
    sink: int
    recent: int
    param_dtype: torch.dtype = torch.float16  # the scales' and mins' 16-bit type


class BatchLayout(NamedTuple):
    """A batch as the kernels and their twins take it: requests in vLLM's order, decodes first."""

    block_table: torch.Tensor  # int32 [R, max_blocks]
    seq_lens: torch.Tensor  # int32 [R]: sequence lengths, this step's tokens included
    cu_q: torch.Tensor  # int32 [R + 1]: query start offsets, from 0
    ring_slots: torch.Tensor  # int32 [R]: each request's ring (a row of window_pages and window_pos)
    num_reqs: int
    num_decodes: int = 0  # the first requests, one query token each
    max_query_len: int | None = None  # at least the longest query (the host orchestration needs it)

    def requests(self, lo: int, hi: int, max_query_len: int | None = None) -> "BatchLayout":
        """Requests ``[lo, hi)`` as a batch of their own (query offsets from 0 again, on the device)."""
        cu_q = self.cu_q[lo:hi + 1] if lo == 0 else self.cu_q[lo:hi + 1] - self.cu_q[lo]
        return BatchLayout(self.block_table[lo:hi], self.seq_lens[lo:hi], cu_q, self.ring_slots[lo:hi], hi - lo,
                           max(0, min(hi, self.num_decodes) - lo), max_query_len or self.max_query_len)


@triton.constexpr_function
def int2_slot_bytes(head_dim: int) -> int:
    """Bytes of one (token, KV head): K and V codes plus four 16-bit parameters."""
    if head_dim % 4:
        raise ValueError(f"head_dim must be a multiple of 4 to pack INT2, got {head_dim}")
    return head_dim // 2 + PARAM_BYTES


@triton.constexpr_function
def int2_region_bytes(head_dim: int, block_size: int = BLOCK_SIZE) -> int:
    """Bytes of one (block, KV head) region (called in a Triton or Gluon kernel: a constexpr)."""
    return block_size * int2_slot_bytes(head_dim)


@triton.constexpr_function
def int2_params_at(head_dim: int, block_size: int = BLOCK_SIZE) -> int:
    """Where a region's parameters start, in bytes: after its K and V codes."""
    return 2 * block_size * (head_dim // 4)


def int2_cache_shape(num_blocks: int, num_kv_heads: int, head_dim: int,
                     block_size: int = BLOCK_SIZE) -> tuple[int, int, int]:
    return (num_blocks, num_kv_heads, int2_region_bytes(head_dim, block_size))


def check_int2_cache(cache: torch.Tensor, head_dim: int) -> None:
    """A layer's pages: blocks may sit apart (vLLM pads pages in some layouts), heads may not."""
    region = int2_region_bytes(head_dim)
    if (cache.dtype != torch.uint8 or cache.dim() != 3 or cache.shape[-1] != region
            or cache.stride()[1:] != (region, 1) or cache.stride(0) % 16):
        raise ValueError(
            f"cache {tuple(cache.shape)} {cache.dtype} is not an OSCAR INT2 cache for head_dim {head_dim} "
            f"(uint8 [num_blocks, num_kv_heads, {int2_region_bytes(head_dim)}])"
        )


def windows_view(cache: torch.Tensor) -> torch.Tensor:
    """The cache's pages as bf16 ``[num_blocks, page_elems]``: where the windows live."""
    return cache.view(torch.bfloat16).flatten(1)


def window_entries_per_page(page_elems: int, num_kv_heads: int, head_dim: int, sink: int) -> int:
    """Ring entries (K and V of every KV head) one page of ``page_elems`` bf16 holds: as many as
    fit, or fewer, the most that divide ``sink``, so that the sink fills whole pages."""
    fit = page_elems // (2 * num_kv_heads * head_dim)
    if fit < 1:
        raise ValueError(f"a page of {page_elems} bf16 cannot hold one window entry of {num_kv_heads} x {head_dim}")
    return max(e for e in range(1, fit + 1) if sink % e == 0)


def window_pages_per_ring(sink: int, recent: int, page_elems: int, num_kv_heads: int, head_dim: int) -> int:
    """Pages one request's ring of ``sink`` + ``recent`` entries takes."""
    per_page = window_entries_per_page(page_elems, num_kv_heads, head_dim, sink)
    return sink // per_page + -(-recent // per_page)


def cache_page_elems(num_kv_heads: int, head_dim: int) -> int:
    """bf16 elements of one cache block of one layer (a window page)."""
    return num_kv_heads * int2_region_bytes(head_dim) // 2


def window_pages_per_request(sink: int, recent: int, num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """``(pages, sink pages)`` of one request's ring in cache blocks (a block of one layer is its page)."""
    elems = cache_page_elems(num_kv_heads, head_dim)
    per_page = window_entries_per_page(elems, num_kv_heads, head_dim, sink)
    return window_pages_per_ring(sink, recent, elems, num_kv_heads, head_dim), sink // per_page


def window_args(windows: torch.Tensor, window_pages: torch.Tensor, window_pos: torch.Tensor, num_kv_heads: int,
                head_dim: int, sink: int, recent: int) -> dict:
    """The window arguments of every kernel that reads or writes the rings, checked (``cache_args``
    adds the pages')."""
    per_page = window_entries_per_page(windows.shape[-1], num_kv_heads, head_dim, sink)
    if (windows.dtype != torch.bfloat16 or windows.dim() != 2 or windows.stride(1) != 1
            or window_pages.dtype != torch.int32 or window_pages.stride(1) != 1
            or window_pages.shape[1] * per_page < sink + recent
            or window_pos.dtype != torch.int32 or not window_pos.is_contiguous()
            or tuple(window_pos.shape) != (window_pages.shape[0], sink + recent)):
        raise ValueError(
            f"windows {tuple(windows.shape)} {windows.dtype}, pages {tuple(window_pages.shape)} {window_pages.dtype}, "
            f"positions {tuple(window_pos.shape)} {window_pos.dtype} do not hold rings of {sink} + {recent} entries "
            f"of {num_kv_heads} x {head_dim} "
            "(bf16 [num_pages, page_elems], int32 [rings, pages], int32 [rings, entries])"
        )
    # The kernels are compiled with the values as 16-byte aligned as the keys (Triton's pointer
    # specialization): an odd offset would compile a slower variant while serving.
    values_at = per_page * num_kv_heads * head_dim
    if (values_at * windows.element_size()) % 16:
        raise ValueError(
            f"window values start {values_at} elements into a page, not a multiple of 16 bytes "
            f"({per_page} entries x {num_kv_heads} KV heads x head_dim {head_dim})"
        )
    return dict(
        window_k_ptr=windows, window_v_ptr=windows[:, values_at:],
        window_pages_ptr=window_pages, window_pos_ptr=window_pos, stride_wp=window_pages.stride(0),
        stride_page=windows.stride(0), WIN_E=per_page,
    )


def param_view(cache: torch.Tensor, param_dtype: torch.dtype) -> torch.Tensor:
    """The cache's 16-bit view, through which the kernels read and write scales and mins."""
    if param_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the paged cache stores 16-bit scales, not {param_dtype}")
    return cache.view(param_dtype)


def cache_args(cache: MixedCache, num_kv_heads: int, head_dim: int) -> dict:
    """The cache arguments every kernel takes alike, checked: the pages (``codes_ptr``, their 16-bit
    view ``params_ptr``, ``stride_cb``), the rings (``window_args``), ``SINK`` and ``RECENT``."""
    check_int2_cache(cache.pages, head_dim)
    return dict(codes_ptr=cache.pages, params_ptr=param_view(cache.pages, cache.param_dtype),
                stride_cb=cache.pages.stride(0), SINK=cache.sink, RECENT=cache.recent,
                **window_args(cache.windows, cache.window_pages, cache.window_pos, num_kv_heads, head_dim, cache.sink,
                              cache.recent))


def launch_bucket(table: dict, n: int):
    """The entry of a launch table for size ``n``: the largest key <= ``n`` (the smallest key
    below all of them)."""
    keys = sorted(table)
    return table[max([k for k in keys if k <= n] or keys[:1])]


def split_count(programs: int, per_split: int, cap: int, whole_wave: bool = False) -> int:
    """Splits of a decode batch's keys, 1 to ``cap``, for ``programs`` programs in all when one
    split is ``per_split`` (requests x KV heads) of them: enough for them, rounded up to a power
    of two, or (``whole_wave``) as many as fit in them."""
    per_split = max(1, per_split)
    want = programs // per_split if whole_wave else triton.next_power_of_2(triton.cdiv(programs, per_split))
    return max(1, min(cap, want))


def split_rows(splits: Callable[[int], int], max_num_reqs: int) -> int:
    """Rows of split scratch (``requests * splits``) any batch up to ``max_num_reqs`` needs, each
    batch of ``n`` splitting ``splits(n)`` ways."""
    return max(n * splits(n) for n in range(1, max_num_reqs + 1))


# ---------------------------------------------------------------- the Triton kernels' launches

# Decode (oscar_attention's fallback decode): (num_warps, num_stages, CTAs per SM the split count
# aims for), by batch bucket. From `python -m benchmarks.kernel_bench.oscar_attention sweep` on the H200
# (results/kernels/sweep_decode.md): one request gains from more, smaller programs; from 8 requests
# on, one warp per program issues the fewest instructions per block and two programs per SM already
# keep it busy.
DECODE_LAUNCH = {
    1: (2, 3, 8),
    8: (1, 3, 2),
}
MAX_DECODE_SPLITS = 64
# Prefill (q-blocks over the cached prefix): (BLOCK_M, num_warps, num_stages).
PREFILL_LAUNCH = (128, 8, 2)
# At head_dim 64 (quarter tiles of 16) Triton's warpgroup MMA path (BLOCK_M >= 64) computed
# wrong results and faulted on the H200, with or without the PTX unpacking; the decode kernel's
# 16-row tiles were right at every launch tried: below head_dim 128 prefill uses those.
SMALL_HEAD_PREFILL_LAUNCH = (16, 4, 3)
# The Triton write (oscar_write): (tokens a program, warps) by tokens per call (the largest key <=
# tokens). A program is one long dependent chain (rotate, two clip searches, quantize): with
# few programs (decode steps where the Gluon decode write does not serve) the chain is the kernel's
# time and 16 warps on 16 tokens shorten it (H200, Qwen3-8B: 0.024 ms against 0.052 at 4 warps, 1-256
# tokens). With many (prefill) the instructions a token count: at 32 tokens and 8 warps each row's
# search stays in one warp (tl.dot's layout gives a warp whole rows from 32 rows on), 16 barriers in
# all instead of 122 and 26% fewer instructions a token than 16 tokens on 8 warps (sm_90,
# compile_check; 27% with the thresholds peeled); H200, 8K tokens, bisected: 0.310 ms against 0.406.
# `python -m benchmarks.kernel_bench.oscar_write --launch 16x8 32x8`.
WRITE_LAUNCH = {1: (16, 16), 2048: (32, 8)}


def decode_splits(num_reqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Most splits a decode batch of ``num_reqs`` requests uses on the Triton decode (a power of two, >= 1)."""
    programs = launch_bucket(DECODE_LAUNCH, num_reqs)[2] * num_sms
    return split_count(programs, num_reqs * num_kv_heads, MAX_DECODE_SPLITS)


def decode_split_rows(max_num_reqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Rows of split scratch any Triton decode batch up to ``max_num_reqs`` needs (``tokens * splits``)."""
    return split_rows(lambda n: decode_splits(n, num_kv_heads, num_sms), max_num_reqs)


def split_scratch(part_out: torch.Tensor | None, part_lse: torch.Tensor | None, rows: int,
                  head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``rows`` partial outputs (``rows * head_dim`` fp32) and log-sum-exps of a split
    decode's scratch, flat; scratch too short for them is refused (a slice of it would hand the
    kernel fewer rows than it writes: ``decode_split_rows`` sizes it, each kernel's own)."""
    if part_out is None or part_lse is None or part_out.numel() < rows * head_dim or part_lse.numel() < rows:
        have = [None if x is None else x.numel() for x in (part_out, part_lse)]
        raise ValueError(f"a split decode of {rows} rows needs part_out of >= {rows * head_dim} and part_lse of "
                         f">= {rows} fp32 elements (decode_split_rows), got {have[0]} and {have[1]}")
    return part_out.view(-1)[: rows * head_dim], part_lse.view(-1)[:rows]


def logit_coef(logit_correction: float, scale: float) -> float:
    """What the attention kernels take for the logit correction λ
    (``oscar_vllm.core.mixed_cache.LayerCacheSpec.logit_correction``): an INT2 key's logit, in
    log2 units, loses ``coef · ‖q‖² · s_k²``, the natural-log ``λ/2 · scale² · ‖q‖² · s_k²/12``
    (``s_k`` its stored scale, ``q`` the whole head's rotated query) times log2 e."""
    lam = float(logit_correction)
    if not lam >= 0.0 or lam == float("inf"):
        raise ValueError(f"logit_correction must be a finite number >= 0, got {logit_correction!r}")
    return lam / 24.0 * scale * scale * 1.4426950408889634


@triton.jit
def find_request(cu_q_ptr, num_reqs, target, BLOCK_Q: tl.constexpr, Q_BLOCK_MODE: tl.constexpr):
    """The request holding token ``target`` (or q-block ``target`` in q-block mode).

    ``cu_q_ptr``: int32 ``[num_reqs + 1]`` query start offsets. In q-block mode request ``r``
    owns q-blocks starting at ``cu_q[r] // BLOCK_Q + r``.
    """
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(cu_q_ptr + mid)
        if Q_BLOCK_MODE:
            start = start // BLOCK_Q + mid
        if start <= target:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


def check_key_mean(key_mean: torch.Tensor | None, cos_sin: torch.Tensor | None, num_kv_heads: int,
                   head_dim: int) -> None:
    """A key mean comes with its RoPE table: fp32 ``[Hkv, d]`` contiguous, and ``[P, d]`` rows of
    ``d/2`` cosines then ``d/2`` sines, unit stride along a row (vLLM's ``cos_sin_cache``)."""
    if key_mean is None and cos_sin is None:
        return
    if key_mean is None or cos_sin is None:
        raise ValueError("a key mean needs its RoPE table and the table its mean: pass both or neither")
    if key_mean.shape != (num_kv_heads, head_dim) or key_mean.dtype != torch.float32 or not key_mean.is_contiguous():
        raise ValueError(f"the key mean must be contiguous fp32 [{num_kv_heads}, {head_dim}], got "
                         f"{key_mean.dtype} {tuple(key_mean.shape)}")
    check_rope_table(cos_sin, head_dim)


def check_rope_table(cos_sin: torch.Tensor, head_dim: int) -> None:
    """A RoPE table as the key-mean kernels read it: ``[P, d]`` rows of ``d/2`` cosines then ``d/2``
    sines, unit stride along a row."""
    if cos_sin.dim() != 2 or cos_sin.shape[1] != head_dim or cos_sin.stride(1) != 1:
        raise ValueError(f"the RoPE table must be [positions, {head_dim}] with unit stride along a row, got "
                         f"{tuple(cos_sin.shape)} strides {cos_sin.stride()}")


@triton.jit
def find_requests(cu_q_ptr, num_reqs, tokens, STEPS: tl.constexpr):
    """Vector form of ``find_request``: the request of each token in ``tokens`` ``[N]``.

    A fixed number of bisection steps (``STEPS >= log2(num_reqs + 1)``) keeps it branch-free.
    """
    lo = tl.zeros_like(tokens)
    hi = tl.zeros_like(tokens) + num_reqs
    for _ in tl.static_range(STEPS):
        live = lo < hi
        mid = (lo + hi) // 2
        start = tl.load(cu_q_ptr + mid, mask=live, other=0)
        go_right = live & (start <= tokens)
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(live & ~go_right, mid, hi)
    return lo - 1


@triton.jit
def window_index(pos, SINK: tl.constexpr, RECENT: tl.constexpr):
    """Index of position ``pos`` in a request's window ring."""
    return tl.where(pos < SINK, pos, SINK + (pos - SINK) % RECENT)


@triton.jit
def v_column(token):
    """Column of ``token`` (0..63) in its block's rows of V codes: ``16a + 2c + b`` for token
    ``16a + 8b + c`` (twin: ``oscar_vllm.reference.paged.v_column``)."""
    return 16 * ((token >> 4) & 3) + 2 * (token & 7) + ((token >> 3) & 1)


@triton.jit
def v_token(column):
    """The token in ``column`` of a block's rows of V codes (``v_column``'s inverse): kernels
    that walk a block in column order read V codes with contiguous loads."""
    return 16 * (column >> 4) + 8 * (column & 1) + ((column >> 1) & 7)


@triton.jit
def window_page(window_pages_ptr, stride_wp, ring, entry, mask, stride_page, WIN_E: tl.constexpr):
    """Element offset of the page that holds ring entry ``entry``. In it, the entry's key of
    head ``h`` is at ``(entry % WIN_E) * HKV * D + h * D`` (``window_k_ptr``), its value of
    dim ``d`` at ``(h * D + d) * WIN_E + entry % WIN_E`` (``window_v_ptr``)."""
    page = tl.load(window_pages_ptr + ring * stride_wp + entry // WIN_E, mask=mask, other=0).to(tl.int64)
    return page * stride_page


@triton.jit
def bf16_bits_rne(x):
    """fp32 -> bf16 bit pattern (uint16), rounding to nearest even.

    Spelled out in integers because the interpreter's ``.to(tl.bfloat16)`` truncates
    (whatever ``fp_downcast_rounding`` says), and CPU tests must round like the GPU.
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16)


@triton.jit
def to_bf16_rne(x):
    """fp32 -> bf16, rounding to nearest even on the GPU and in the interpreter alike."""
    return bf16_bits_rne(x).to(tl.bfloat16, bitcast=True)
