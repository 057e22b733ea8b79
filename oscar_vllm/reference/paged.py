"""The paged INT2 layout of ``csrc_triton/paged_layout.py`` as PyTorch views, for the twins."""
from __future__ import annotations

import torch

from csrc_triton.paged_layout import BLOCK_SIZE, PARAM_BYTES


def head_dim_of(cache: torch.Tensor) -> int:
    return 2 * (cache.shape[-1] // BLOCK_SIZE - PARAM_BYTES)


def layout_views(cache: torch.Tensor, param_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Writable views of a uint8 ``[num_blocks, Hkv, region]`` cache.

    ``k_codes`` ``[num_blocks, Hkv, BLOCK_SIZE, d/4]`` (token-major), ``v_codes``
    ``[num_blocks, Hkv, d/4, BLOCK_SIZE]`` (dim-major) and ``params``
    ``[num_blocks, Hkv, 4, BLOCK_SIZE]`` (K scale, K min, V scale, V min) in ``param_dtype``.
    """
    nb, hkv, _ = cache.shape
    q = head_dim_of(cache) // 4
    codes = BLOCK_SIZE * q
    k_codes = cache[:, :, :codes].view(nb, hkv, BLOCK_SIZE, q)
    v_codes = cache[:, :, codes: 2 * codes].view(nb, hkv, q, BLOCK_SIZE)
    params = cache[:, :, 2 * codes:].view(param_dtype).view(nb, hkv, 4, BLOCK_SIZE)
    return k_codes, v_codes, params
