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

from oscar_vllm.core.key_mean import KeyMean
from oscar_vllm.core.quant import (
    SCALE_EPS,
    fake_quantize_int2,
    fake_quantize_int4,
    fake_quantize_naive_int2,
    minmax_quantize,
    quantize_int2,
)
from oscar_vllm.core.rotation import apply_rotation

QUANT_KINDS = ("bf16", "int4", "naive_int2", "int2")


@dataclass(frozen=True)
class RowQuantizer:
    """How K or V rows are stored outside the BF16 windows."""

    kind: str = "int2"
    clip_ratio: float | tuple[float, ...] = 0.0  # INT2: one ratio, or one per KV head
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

    def rounding_variance(self, x: torch.Tensor) -> torch.Tensor:
        """Per group, the variance of what rounding adds to each element, ``scale² / 12`` (uniform
        over a step): fp32 ``[..., groups]``, from the scale the cache stores (0 for bf16)."""
        if self.kind == "int2":
            scale = quantize_int2(x, self.clip_ratio, self.group_size, self.param_dtype).scale
        elif self.kind == "int4":
            scale = minmax_quantize(x, 4, self.group_size)[1].to(self.param_dtype)
        elif self.kind == "naive_int2":
            scale = (x.float().abs().amax(dim=-1, keepdim=True) / 1.5).clamp(min=SCALE_EPS).to(self.param_dtype)
        else:
            return torch.zeros(*x.shape[:-1], 1, device=x.device)
        return scale.float().square() / 12


@dataclass(frozen=True)
class LayerCacheSpec:
    """One attention layer's cache: rotations (None = identity) and row quantizers.

    ``logit_correction`` (λ): a quantized key's logit is lowered by λ/2 times its expected
    rounding variance, ``scale_attn² · Σ_groups ‖q_g‖² · s_g² / 12`` (``s_g`` the key's stored scales).
    Rounding noise ε in a logit inflates its softmax weight by ``E[exp(ε)] = exp(σ²/2)`` on average,
    so without it the quantized part of a long context draws more attention than it should; λ = 1
    removes that bias for uniform rounding noise. It costs no bytes: the kernels have ``s_g`` and ``q``.

    ``key_mean``: keys are quantized less their mean as RoPE turns it at their position, which is
    added back after (``oscar_vllm.core.key_mean``); the keys of a call are positions ``0 .. Tk-1``.
    """

    key_rotation: torch.Tensor | None
    value_rotation: torch.Tensor | None
    key_quant: RowQuantizer
    value_quant: RowQuantizer
    logit_correction: float = 0.0
    key_mean: KeyMean | None = None


def high_precision_mask(
    query_pos: torch.Tensor, key_pos: torch.Tensor, sink: int, recent: "int | torch.Tensor",
    chunk_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[Tq, Tk]`` bool: True where the query reads the BF16 copy of the key.

    ``chunk_start`` ``[Tq]``: where the prefill chunk of each query begins (default: the query
    itself, i.e. decode). A chunk reads its own keys in BF16 and the cached prefix as it stands
    when the chunk starts: the sink, and the ``recent`` keys before the chunk. ``recent``: one
    window, or one per query ``[Tq]`` (a window that grows with the sequence).
    """
    if isinstance(recent, torch.Tensor):
        recent = recent.to(query_pos.device)[:, None]
    if chunk_start is None:
        return (key_pos[None, :] < sink) | (query_pos[:, None] - key_pos[None, :] < recent)
    return ((key_pos[None, :] < sink) | (key_pos[None, :] >= chunk_start[:, None])
            | (chunk_start[:, None] - key_pos[None, :] < recent))


def _attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked attention of ``q [H, L, d]`` over ``k``/``v`` ``[H, S, d]``: ``(out, lse)``.

    On the CPU through PyTorch's fused flash kernel (it returns the log-sum-exp), elsewhere as
    plain matrix products."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None], k[None], v[None], 0.0, False, scale=scale)[:2]
        return out[0], lse[0]
    s = (q @ k.transpose(-1, -2)) * scale
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse[..., None]) @ v, lse


def mixed_cache_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: LayerCacheSpec,
    sink: int,
    recent: "int | torch.Tensor",
    scale: float | None = None,
    window_dtype: torch.dtype = torch.bfloat16,
    block_q: int = 512,
    chunk_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` over the mixed cache built from ``k``, ``v``: ``[Tq, Hq, d]``, fp32
    (fp64 for fp64 inputs, so that a float64 evaluation sums nothing in fp32).

    ``chunk_starts`` ``[Tq]``: the position where each query's prefill chunk begins (see
    ``high_precision_mask``); default: every query is a decode step. ``recent``: the recent
    window, or one per query ``[Tq]``.

    Per block of queries the keys split in two: those past the sink that every query of the block
    reads quantized (the far past, most of a long context) go through one unmasked attention; the
    sink and the rest (windows, chunk, causal edge) through an explicit masked one; the two merge by
    log-sum-exp. Same numbers as one masked softmax over all keys, at the cost of plain attention.
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
    # [Hkv, Tq, g, d]: the g query heads of KV head h share its keys and values, so a block of
    # queries is one [Hkv, block * g, d] batch.
    qr = rotate(q, layer.key_rotation).reshape(tq, hkv, g, d).transpose(0, 1).contiguous()
    k_hi, v_hi = (x.to(window_dtype).to(compute).transpose(0, 1).contiguous() for x in (kr, vr))
    # What 2-bit rounding sees of a key: the key, or the key less its mean at its position
    k_mean = None if layer.key_mean is None else rotate(layer.key_mean.at(tk), layer.key_rotation)
    k_rounded = kr if k_mean is None else kr - k_mean
    k_lo = layer.key_quant(k_rounded)
    k_lo = (k_lo if k_mean is None else k_lo + k_mean).to(compute).transpose(0, 1).contiguous()
    v_lo = layer.value_quant(vr).to(compute).transpose(0, 1).contiguous()
    q_lo = qr
    if layer.logit_correction:
        # One more dimension per key group: q_g's squared norm against -λ/2 · scale_attn · var_g,
        # so that q·k̂ - λ/2 · scale_attn · Σ_g ‖q_g‖² var_g is one dot product (scaled once after).
        var = layer.key_quant.rounding_variance(k_rounded).to(compute).transpose(0, 1)  # [Hkv, Tk, G]
        groups = var.shape[-1]
        q_norms = qr.reshape(hkv, tq, g, groups, d // groups).square().sum(-1)  # [Hkv, Tq, g, G]
        q_lo = torch.cat([qr, q_norms], dim=-1)
        k_lo = torch.cat([k_lo, -0.5 * layer.logit_correction * scale * var], dim=-1)
        v_lo = torch.cat([v_lo, v_lo.new_zeros(hkv, tk, groups)], dim=-1)  # the fused kernel wants equal dims

    out = torch.empty(hkv, tq, g, d, dtype=compute, device=q.device)
    key_pos = torch.arange(tk, device=q.device)
    for t0 in range(0, tq, block_q):
        t1 = min(tq, t0 + block_q)
        query_pos = key_pos[tk - tq + t0 : tk - tq + t1]
        end = int(query_pos[-1]) + 1  # causal: later keys are never read
        starts = None if chunk_starts is None else chunk_starts[t0:t1].to(q.device)
        block_recent = recent[t0:t1].to(q.device) if isinstance(recent, torch.Tensor) else recent
        # Keys in [sink, far) are quantized for every query of the block and precede all of them.
        if starts is None:
            lo_end = query_pos - block_recent + 1
        else:
            lo_end = starts - (block_recent.clamp(min=1) if isinstance(block_recent, torch.Tensor)
                               else max(block_recent, 1)) + 1
        far = max(sink, min(int(lo_end.min()) if isinstance(lo_end, torch.Tensor) else lo_end, int(query_pos[0]) + 1))
        near = torch.cat([key_pos[: min(sink, end)], key_pos[far:end]])
        hi = high_precision_mask(query_pos, near, sink, block_recent, starts)[None, :, None]  # [1, b, 1, n]
        causal = (near[None, :] <= query_pos[:, None])[None, :, None]
        qb = qr[:, t0:t1].reshape(hkv, (t1 - t0) * g, d)
        qb_lo = q_lo[:, t0:t1].reshape(hkv, (t1 - t0) * g, q_lo.shape[-1])
        shape = (hkv, t1 - t0, g, near.numel())

        def near_rows(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x[:, : min(sink, end)], x[:, far:end]], dim=1)

        kh, kl = near_rows(k_hi), near_rows(k_lo)
        s = torch.where(hi, (qb @ kh.transpose(-1, -2)).view(shape), (qb_lo @ kl.transpose(-1, -2)).view(shape))
        s = (s * scale).masked_fill_(~causal, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # -inf for a query that reads all its keys in the far part
        p = torch.exp(s - lse.clamp(min=torch.finfo(s.dtype).min)[..., None])
        p_hi = p * hi
        rows = (hkv, (t1 - t0) * g, near.numel())
        o = (p_hi.reshape(rows) @ near_rows(v_hi) + (p - p_hi).reshape(rows) @ near_rows(v_lo)[..., :d]).view(
            hkv, t1 - t0, g, d)
        if far > sink:
            o_far, lse_far = _attend_with_lse(qb_lo, k_lo[:, sink:far], v_lo[:, sink:far], scale)
            o_far, lse_far = o_far[..., :d].reshape(o.shape), lse_far.view(lse.shape)
            both = torch.logaddexp(lse, lse_far)
            o = o * torch.exp(lse - both)[..., None] + o_far * torch.exp(lse_far - both)[..., None]
        out[:, t0:t1] = o
    out = out.transpose(0, 1).reshape(tq, hq, d)
    if layer.value_rotation is not None:
        out = apply_rotation(out, layer.value_rotation.to(out.device).transpose(-1, -2))
    return out
