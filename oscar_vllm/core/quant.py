"""Reference KV-cache quantizers in plain PyTorch: OSCAR's INT2 and the baselines.

Every function works on rows: ``x`` has shape ``[..., head_dim]`` and each leading index
is one (token, KV head) row. Nothing here loops over tokens; the Triton kernels in
``csrc_triton/`` are tested against these functions.

The OSCAR INT2 quantizer, as the reference implements it (``docs``: OSCAR.md section 5):

1. clip each row at the ``int(ratio * d)``-th smallest ``|x|``;
2. asymmetric min-max per group: ``scale = max(max - min, 1e-8) / 3``,
   ``zero = -min / scale``, ``code = floor(x / scale + zero + 0.5)`` clamped to [0, 3];
3. pack four codes per byte, "quartered": byte ``j`` holds dims ``j, j + d/4, j + d/2,
   j + 3d/4`` in bits [1:0], [3:2], [5:4], [7:6].

One deliberate difference in what is *stored*: the reference keeps ``zero`` and
dequantizes ``(code - zero) * scale``; we keep ``bias = min`` and dequantize
``code * scale + bias``. It is the same number (``-zero * scale == min``), the codes are
identical, but a 16-bit ``min`` keeps its relative precision where a 16-bit ``zero``
loses absolute precision and overflows to inf for near-constant rows (``zero`` ~
``|min| / 1e-8``). With fp32 parameters the two agree to float rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

REFERENCE_CLIP_RATIO_K = 0.96
REFERENCE_CLIP_RATIO_V = 0.92
SCALE_EPS = 1e-8

PARAM_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def param_dtype_from_name(name: str) -> torch.dtype:
    try:
        return PARAM_DTYPES[name]
    except KeyError:
        raise ValueError(f"scale dtype must be one of {sorted(PARAM_DTYPES)}, got {name!r}") from None


def clip_index(clip_ratio: float, head_dim: int) -> int:
    """Sorted-|x| index of the clip threshold, or -1 when clipping is off (ratio <= 0)."""
    if clip_ratio <= 0.0:
        return -1
    return min(max(int(clip_ratio * head_dim), 0), head_dim - 1)


def clip_rows(x: torch.Tensor, clip_ratio: "float | Sequence[float]") -> torch.Tensor:
    """Clamp each row to +-(the ``clip_index``-th smallest |x| of that row).

    ``clip_ratio``: one ratio for every row, or one per head for rows ``[..., H, d]`` (a sequence
    of ``H`` ratios: KV heads fitted each to its own distribution).
    """
    d = x.shape[-1]
    if isinstance(clip_ratio, (int, float)):
        idx = clip_index(clip_ratio, d)
        if idx < 0:
            return x
        # kthvalue is 1-based: the (idx+1)-th smallest is sort(|x|)[idx].
        thr = torch.kthvalue(x.abs(), idx + 1, dim=-1, keepdim=True).values
        return torch.minimum(torch.maximum(x, -thr), thr)
    ratios = [float(r) for r in clip_ratio]
    if x.dim() < 2 or len(ratios) != x.shape[-2]:
        raise ValueError(f"{len(ratios)} per-head clip ratios for rows of shape {tuple(x.shape)} ([..., heads, d])")
    idx = torch.tensor([clip_index(r, d) for r in ratios], device=x.device)
    thr = x.abs().sort(dim=-1).values.gather(-1, idx.clamp(min=0)[:, None].expand(*x.shape[:-1], 1))
    thr = torch.where(idx[:, None] < 0, torch.inf, thr)  # a head with clipping off
    return torch.minimum(torch.maximum(x, -thr), thr)


def _check_group_size(head_dim: int, group_size: int | None) -> int:
    group_size = head_dim if group_size is None else group_size
    if group_size <= 0 or head_dim % group_size:
        raise ValueError(f"group size {group_size} must divide head_dim {head_dim}")
    return group_size


def minmax_quantize(
    x: torch.Tensor, bits: int, group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min-max codes with the reference's rounding.

    Returns ``codes`` uint8 ``[..., d]`` in ``[0, 2**bits - 1]`` and fp32 ``scale``,
    ``bias`` ``[..., d // group_size]`` such that ``x ~ codes * scale + bias``.
    """
    d = x.shape[-1]
    gs = _check_group_size(d, group_size)
    max_code = (1 << bits) - 1
    g = x.float().reshape(*x.shape[:-1], d // gs, gs)
    lo = g.amin(dim=-1, keepdim=True)
    hi = g.amax(dim=-1, keepdim=True)
    scale = (hi - lo).clamp(min=SCALE_EPS) / max_code
    zero = -lo / scale
    codes = torch.floor(g / scale + zero + 0.5).clamp_(0, max_code).to(torch.uint8)
    return codes.reshape(x.shape), scale.squeeze(-1), lo.squeeze(-1)


def minmax_dequantize(
    codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """Inverse of :func:`minmax_quantize` (fp32); the group size follows from the shapes."""
    d = codes.shape[-1]
    groups = scale.shape[-1]
    c = codes.float().reshape(*codes.shape[:-1], groups, d // groups)
    out = c * scale.float().unsqueeze(-1) + bias.float().unsqueeze(-1)
    return out.reshape(codes.shape)


def pack_int2(codes: torch.Tensor) -> torch.Tensor:
    """Quartered packing: ``[..., d]`` codes in [0, 3] -> ``[..., d/4]`` uint8."""
    d = codes.shape[-1]
    if d % 4:
        raise ValueError(f"head_dim must be a multiple of 4 to pack INT2, got {d}")
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], 4, d // 4)
    return c[..., 0, :] | (c[..., 1, :] << 2) | (c[..., 2, :] << 4) | (c[..., 3, :] << 6)


def unpack_int2(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int2`: ``[..., d/4]`` uint8 -> ``[..., d]`` uint8 codes."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-2) >> shifts[:, None]) & 3
    return codes.reshape(*packed.shape[:-1], 4 * packed.shape[-1])


@dataclass(frozen=True)
class Int2Rows:
    """Packed INT2 rows as the cache stores them.

    packed: uint8 ``[..., d/4]``; scale, bias: ``param_dtype`` ``[..., d // group_size]``.
    """

    packed: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor


def quantize_int2(
    x: torch.Tensor,
    clip_ratio: "float | Sequence[float]",
    group_size: int | None = None,
    param_dtype: torch.dtype = torch.float16,
) -> Int2Rows:
    """OSCAR INT2: per-row clip (one ratio, or one per head), per-group asymmetric min-max,
    quartered packing."""
    codes, scale, bias = minmax_quantize(clip_rows(x.float(), clip_ratio), 2, group_size)
    return Int2Rows(pack_int2(codes), scale.to(param_dtype), bias.to(param_dtype))


def dequantize_int2(q: Int2Rows) -> torch.Tensor:
    return minmax_dequantize(unpack_int2(q.packed), q.scale, q.bias)


def fake_quantize_int2(
    x: torch.Tensor,
    clip_ratio: "float | Sequence[float]",
    group_size: int | None = None,
    param_dtype: torch.dtype = torch.float16,
) -> torch.Tensor:
    """What the INT2 cache gives back for ``x`` (fp32)."""
    return dequantize_int2(quantize_int2(x, clip_ratio, group_size, param_dtype))


def fake_quantize_int4(
    x: torch.Tensor, group_size: int | None = None, param_dtype: torch.dtype = torch.float16
) -> torch.Tensor:
    """Per-token (per row) asymmetric INT4 min-max, no rotation, no clip (fp32 out)."""
    codes, scale, bias = minmax_quantize(x, 4, group_size)
    return minmax_dequantize(codes, scale.to(param_dtype), bias.to(param_dtype))


def fake_quantize_naive_int2(
    x: torch.Tensor, param_dtype: torch.dtype = torch.float16
) -> torch.Tensor:
    """Naive INT2: per-row symmetric, levels ``{-1.5, -0.5, 0.5, 1.5} * amax / 1.5``."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / 1.5).clamp(min=SCALE_EPS)
    scale = scale.to(param_dtype).float()
    codes = torch.floor(xf / scale + 2.0).clamp(0, 3)
    return (codes - 1.5) * scale
