"""Reference attention over OSCAR's mixed-precision KV cache, in plain PyTorch.

This is the cache exactly as decode reads it: a query at position ``t`` sees, for every
key position ``s <= t``, the BF16 copy when ``s < sink`` or ``t - s < recent`` and the
quantized copy otherwise, everything in the rotated space (``k' = k R_K``,
``q' = q R_K``, ``v' = v R_V``; the output is rotated back with ``R_Vᵀ``). A prefill chunk
reads its own keys in BF16 and the prefix as cached when it starts (``chunk_starts``). The Triton
kernels of the vLLM backend are tested against it, and the fidelity evaluation runs a
whole model through it. Depends on torch only.

Layout: one sequence, vLLM style: ``q [Tq, Hq, d]``, ``k``/``v`` ``[Tk, Hkv, d]``; the
queries are the last ``Tq`` positions of the ``Tk`` (a prefill chunk or a decode step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from oscar_vllm.core.quant import fake_quantize_int2, fake_quantize_int4, fake_quantize_naive_int2
from oscar_vllm.core.rotation import apply_rotation

QUANT_KINDS = ("bf16", "int4", "naive_int2", "int2")


@dataclass(frozen=True)
class RowQuantizer:
    """How K or V rows are stored outside the BF16 windows."""

    kind: str = "int2"
    clip_ratio: float = 0.0
    group_size: int | None = None
    param_dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        if self.kind not in QUANT_KINDS:
            raise ValueError(f"quantizer kind must be one of {QUANT_KINDS}, got {self.kind!r}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "int2":
            return fake_quantize_int2(x, self.clip_ratio, self.group_size, self.param_dtype)
        if self.kind == "int4":
            return fake_quantize_int4(x, self.group_size, self.param_dtype)
        if self.kind == "naive_int2":
            return fake_quantize_naive_int2(x, self.param_dtype)
        return x.to(torch.bfloat16).float()


@dataclass(frozen=True)
class LayerCacheSpec:
    """One attention layer's cache: rotations (None = identity) and row quantizers."""

    key_rotation: torch.Tensor | None
    value_rotation: torch.Tensor | None
    key_quant: RowQuantizer
    value_quant: RowQuantizer


def high_precision_mask(
    query_pos: torch.Tensor, key_pos: torch.Tensor, sink: int, recent: int,
    chunk_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[Tq, Tk]`` bool: True where the query reads the BF16 copy of the key.

    ``chunk_start`` ``[Tq]``: where the prefill chunk of each query begins (default: the query
    itself, i.e. decode). A chunk reads its own keys in BF16 and the cached prefix as it stands
    when the chunk starts: the sink, and the ``recent`` keys before the chunk.
    """
    if chunk_start is None:
        return (key_pos[None, :] < sink) | (query_pos[:, None] - key_pos[None, :] < recent)
    return ((key_pos[None, :] < sink) | (key_pos[None, :] >= chunk_start[:, None])
            | (chunk_start[:, None] - key_pos[None, :] < recent))


def mixed_cache_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: LayerCacheSpec,
    sink: int,
    recent: int,
    scale: float | None = None,
    window_dtype: torch.dtype = torch.bfloat16,
    block_q: int = 512,
    chunk_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` over the mixed cache built from ``k``, ``v``: ``[Tq, Hq, d]``, fp32
    (fp64 for fp64 inputs, so that a float64 evaluation sums nothing in fp32).

    ``chunk_starts`` ``[Tq]``: the position where each query's prefill chunk begins (see
    ``high_precision_mask``); default: every query is a decode step.
    """
    tq, hq, d = q.shape
    tk, hkv, _ = k.shape
    if hq % hkv or tq > tk:
        raise ValueError(f"bad shapes q {tuple(q.shape)}, k {tuple(k.shape)}")
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32

    def rotate(x: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
        return x.to(compute) if r is None else apply_rotation(x.to(compute), r.to(x.device))

    kr, vr = rotate(k, layer.key_rotation), rotate(v, layer.value_rotation)
    # [Hkv, g, Tq, d]: the g query heads of KV head h share its keys and values.
    qr = rotate(q, layer.key_rotation).reshape(tq, hkv, g, d).permute(1, 2, 0, 3)
    k_hi, v_hi = (x.to(window_dtype).to(compute).transpose(0, 1) for x in (kr, vr))
    k_lo, v_lo = (quant(x).to(compute).transpose(0, 1) for quant, x in ((layer.key_quant, kr), (layer.value_quant, vr)))

    out = torch.empty(hkv, g, tq, d, dtype=compute, device=q.device)
    key_pos = torch.arange(tk, device=q.device)
    for t0 in range(0, tq, block_q):
        t1 = min(tq, t0 + block_q)
        query_pos = key_pos[tk - tq + t0 : tk - tq + t1]
        end = int(query_pos[-1]) + 1  # causal: later keys are never read
        starts = None if chunk_starts is None else chunk_starts[t0:t1].to(q.device)
        hi = high_precision_mask(query_pos, key_pos[:end], sink, recent, starts)
        causal = key_pos[None, :end] <= query_pos[:, None]
        qb = qr[:, :, t0:t1]
        s = torch.where(
            hi,
            qb @ k_hi[:, None, :end].transpose(-1, -2),
            qb @ k_lo[:, None, :end].transpose(-1, -2),
        )
        p = torch.softmax((s * scale).masked_fill(~causal, float("-inf")), dim=-1)
        p_hi = p * hi
        out[:, :, t0:t1] = p_hi @ v_hi[:, None, :end] + (p - p_hi) @ v_lo[:, None, :end]
    out = out.permute(2, 0, 1, 3).reshape(tq, hq, d)
    if layer.value_rotation is not None:
        out = apply_rotation(out, layer.value_rotation.to(out.device).transpose(-1, -2))
    return out
