"""The paged INT2 layout of ``csrc_triton/paged_layout.py`` as PyTorch views, for the twins.

Torch only: the block size follows from the cache's region size and the head dimension, so the
twins read the layout on their own rather than through the kernels' module. For the same reason
they take the kernels' parameter objects (``csrc_triton.paged_layout.MixedCache`` and
``BatchLayout``) by their fields alone: any object with the fields of ``MixedCacheLike`` and
``BatchLike`` will do.
"""
from __future__ import annotations

from typing import Protocol

import torch

from oscar_vllm.core.key_mean import KeyMean

PARAM_BYTES = 8  # K scale, K min, V scale, V min, 16 bits each


class MixedCacheLike(Protocol):
    """A layer's cache: ``csrc_triton.paged_layout.MixedCache``'s fields."""

    pages: torch.Tensor  # uint8 [num_blocks, Hkv, region]
    windows: torch.Tensor  # bf16 [num_pages, page_elems]
    window_pages: torch.Tensor  # int32 [rings, pages per ring]
    window_pos: torch.Tensor  # int32 [rings, sink + recent]
    sink: int
    recent: int
    param_dtype: torch.dtype


class BatchLike(Protocol):
    """A batch: ``csrc_triton.paged_layout.BatchLayout``'s fields the twins read."""

    block_table: torch.Tensor  # int32 [R, max_blocks]
    seq_lens: torch.Tensor  # int32 [R]
    cu_q: torch.Tensor  # int32 [R + 1]
    ring_slots: torch.Tensor  # int32 [R]
    num_reqs: int


def block_size_of(cache: torch.Tensor, head_dim: int) -> int:
    """Tokens per block of a uint8 ``[num_blocks, Hkv, region]`` cache at ``head_dim``."""
    slot = head_dim // 2 + PARAM_BYTES
    if cache.shape[-1] % slot:
        raise ValueError(f"a region of {cache.shape[-1]} bytes is not whole slots of {slot} (head_dim {head_dim})")
    return cache.shape[-1] // slot


def layout_views(cache: torch.Tensor, head_dim: int, param_dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Writable views of a uint8 ``[num_blocks, Hkv, region]`` cache (B tokens per block).

    ``k_codes`` ``[num_blocks, Hkv, B, d/4]`` (token-major), ``v_codes``
    ``[num_blocks, Hkv, d/4, B]`` (dim-major; token ``t`` in column ``v_column(t)``) and ``params``
    ``[num_blocks, Hkv, 4, B]`` (K scale, K min, V scale, V min) in ``param_dtype``.
    """
    nb, hkv, _ = cache.shape
    bs = block_size_of(cache, head_dim)
    if bs != 64:
        raise ValueError(f"the V codes' column order is defined for blocks of 64 tokens, not {bs}")
    q = head_dim // 4
    codes = bs * q
    k_codes = cache[:, :, :codes].view(nb, hkv, bs, q)
    v_codes = cache[:, :, codes: 2 * codes].view(nb, hkv, q, bs)
    params = cache[:, :, 2 * codes:].view(param_dtype).view(nb, hkv, 4, bs)
    return k_codes, v_codes, params


def v_column(token: torch.Tensor) -> torch.Tensor:
    """Column of each token (0..63) in its block's rows of V codes (``csrc_triton.paged_layout.v_column``)."""
    return 16 * ((token >> 4) & 3) + 2 * (token & 7) + ((token >> 3) & 1)


def window_views(windows: torch.Tensor, num_kv_heads: int, head_dim: int, sink: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Writable views of bf16 window pages ``[num_pages, page_elems]``: keys and values, each
    ``[num_pages, E, Hkv, d]`` (keys first in every page, values stored transposed,
    ``[Hkv, d, E]``). ``E``: the most entries that fit and divide ``sink``, so the sink fills
    pages of its own."""
    fit = windows.shape[1] // (2 * num_kv_heads * head_dim)
    per_page = max(e for e in range(1, fit + 1) if sink % e == 0)
    n = per_page * num_kv_heads * head_dim
    return (windows[:, :n].view(-1, per_page, num_kv_heads, head_dim),
            windows[:, n: 2 * n].view(-1, num_kv_heads, head_dim, per_page).permute(0, 3, 1, 2))


def ring_index(window_pages: torch.Tensor, rings: torch.Tensor, entries: torch.Tensor, per_page: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(page, slot)`` of each ring entry, ``window_pages[ring, entry // E]`` and ``entry % E``,
    on ``window_pages``' device (where the pages are)."""
    rings, entries = rings.long().cpu(), entries.long().cpu()
    page = window_pages.long().cpu()[rings, entries // per_page]
    return page.to(window_pages.device), (entries % per_page).to(window_pages.device)


def read_ring(windows: torch.Tensor, window_pages: torch.Tensor, ring: int, entries: torch.Tensor, num_kv_heads: int,
              head_dim: int, sink: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 CPU keys and values ``[N, Hkv, d]`` of ring ``ring``'s ``entries``."""
    k_views, v_views = window_views(windows, num_kv_heads, head_dim, sink)
    page, slot = ring_index(window_pages, torch.full_like(entries, ring), entries, k_views.shape[1])
    return k_views[page, slot].float().cpu(), v_views[page, slot].float().cpu()


def rotate_keys(x: torch.Tensor, rot_k: torch.Tensor) -> torch.Tensor:
    """``x @ R_K`` in fp32 on the CPU, for keys ``[N, Hkv, d]`` (per KV head when ``rot_k`` is
    ``[Hkv, d, d]``)."""
    x, rot = x.float().cpu(), rot_k.float().cpu()
    return x @ rot if rot.dim() == 2 else torch.einsum("thi,hij->thj", x, rot)


def rotated_key_mean(key_mean: KeyMean, rot_k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """What a 2-bit key at each of ``positions`` ``[N]`` was rounded less and is read plus, in the
    key-rotated basis: ``RoPE_p(μ) @ R_K``, fp32 ``[N, Hkv, d]``."""
    return rotate_keys(key_mean.turned(positions), rot_k)
