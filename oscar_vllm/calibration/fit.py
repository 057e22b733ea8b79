"""Calibration math: per-layer statistics, OSCAR rotation sets, fitted clip ratios.

Fed by the capture in :mod:`oscar_vllm.calibration.calibrate` (any framework can feed it: it takes
tensors). Depends on torch only.

Shapes: ``T`` tokens, ``Hq`` query heads, ``Hkv`` KV heads, ``g = Hq/Hkv``, ``d`` head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from oscar_vllm.core.quant import (
    REFERENCE_CLIP_RATIO_K,
    REFERENCE_CLIP_RATIO_V,
    clip_index,
    fake_quantize_int2,
    minmax_dequantize,
    minmax_quantize,
)
from oscar_vllm.core.rotation import (
    apply_rotation,
    key_importance_weights,
    key_moment,
    query_moments,
    rotation_from_moment,
    value_moment,
)
from oscar_vllm.core.rotation_io import KEY, VALUE, RotationSet

VALUE_WEIGHTS = ("proxy", "softmax")
KEY_OBJECTIVE = "qqt_r_h_pbr"
VALUE_OBJECTIVES = {"proxy": "sst_r_h_pbr", "softmax": "sst_softmax_r_h_pbr"}
# Clip-ratio search: every sorted-|x| index from a quarter of the row clipped to none.
CLIP_SEARCH_MIN_FRACTION = 0.75


@dataclass
class LayerStats:
    """What calibration keeps of one layer: query moments, keys, values, score weights."""

    num_kv_heads: int
    qtq_sum: torch.Tensor | None = None  # f64 [Hkv, d, d], Σ over tokens and group heads
    query_rows: int = 0  # T·g summed over batches
    keys: list[torch.Tensor] = field(default_factory=list)  # f32 [T, Hkv, d]
    values: list[torch.Tensor] = field(default_factory=list)
    score_weights: list[torch.Tensor] = field(default_factory=list)  # f64 [T, Hkv]

    def add(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        score_weights: torch.Tensor | None = None,
    ) -> None:
        """Add one sequence: ``q [T, Hq, d]``, ``k``/``v`` ``[T, Hkv, d]`` (post-RoPE q, k)."""
        m = query_moments(q, self.num_kv_heads).cpu()
        self.qtq_sum = m if self.qtq_sum is None else self.qtq_sum + m
        self.query_rows += q.shape[0] * (q.shape[1] // self.num_kv_heads)
        self.keys.append(k.float().cpu())
        self.values.append(v.float().cpu())
        if score_weights is not None:
            self.score_weights.append(score_weights.double().cpu())

    @property
    def num_tokens(self) -> int:
        return sum(k.shape[0] for k in self.keys)

    def qtq(self) -> torch.Tensor:
        """Per KV head mean query moment ``Q_hᵀQ_h / (T·g)``: ``[Hkv, d, d]``."""
        return key_moment(self.qtq_sum, self.query_rows, per_head=True)

    def all_keys(self) -> torch.Tensor:
        return torch.cat(self.keys)

    def all_values(self) -> torch.Tensor:
        return torch.cat(self.values)

    def value_weights(self, kind: str) -> torch.Tensor:
        """Token weights of ``C_S``: the shipped proxy ``k qtq kᵀ`` or real softmax scores."""
        if kind == "proxy":
            return key_importance_weights(self.all_keys(), self.qtq())
        if kind == "softmax":
            if not self.score_weights:
                raise ValueError("softmax value weights need a capture with score weights")
            return torch.cat(self.score_weights)
        raise ValueError(f"value weights must be one of {VALUE_WEIGHTS}, got {kind!r}")


def causal_score_weights(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """``w_s = Σ_{t, heads of the group} softmax(q_t kᵀ)_s²``: f64 ``[T, Hkv]``.

    The diagonal of ``SᵀS`` for the causal softmax scores ``S``: how much each key is read.
    q ``[T, Hq, d]``, k ``[T, Hkv, d]``.
    """
    t, hq, d = q.shape
    hkv = k.shape[1]
    qh = q.float().reshape(t, hkv, hq // hkv, d).permute(1, 2, 0, 3)  # [Hkv, g, T, d]
    kh = k.float().permute(1, 0, 2)  # [Hkv, T, d]
    s = (qh @ kh[:, None].transpose(-1, -2)) * scale
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
    return p.square().sum(dim=(1, 2)).double().transpose(0, 1)


def build_rotation_sets(
    stats: dict[int, LayerStats], per_head: bool = False, value_weights: str = "proxy"
) -> tuple[RotationSet, RotationSet]:
    """OSCAR key (``C_Q``) and value (``C_S``) rotation sets from calibration statistics."""
    key_rot, key_eig, val_rot, val_eig = {}, {}, {}, {}
    for layer_id, st in sorted(stats.items()):
        r, e = rotation_from_moment(key_moment(st.qtq_sum, st.query_rows, per_head))
        key_rot[layer_id], key_eig[layer_id] = r.float(), e.float()
        c_s = value_moment(st.all_values(), st.value_weights(value_weights), per_head)
        r, e = rotation_from_moment(c_s)
        val_rot[layer_id], val_eig[layer_id] = r.float(), e.float()
    return (
        RotationSet(KEY, KEY_OBJECTIVE, key_rot, key_eig),
        RotationSet(VALUE, VALUE_OBJECTIVES[value_weights], val_rot, val_eig),
    )


def clip_candidates(head_dim: int) -> list[float]:
    """Clip ratios with distinct sorted indices; ``(i + 0.5)/d`` maps back to index ``i``."""
    lo = int(CLIP_SEARCH_MIN_FRACTION * head_dim)
    return [(i + 0.5) / head_dim for i in range(lo, head_dim)]


def best_clip_ratio(
    rows: torch.Tensor,
    error_of: Callable[[torch.Tensor], float],
    group_size: int | None,
    param_dtype: torch.dtype,
) -> tuple[float, float]:
    """The candidate clip ratio (``clip_candidates``) with the smallest ``error_of(dequant - rows)``,
    and that error: ``(ratio, error)``."""
    x = rows.float()
    sorted_abs = x.abs().sort(dim=-1).values  # one sort serves every candidate
    best = (float("inf"), 0.0)
    for ratio in clip_candidates(x.shape[-1]):
        idx = clip_index(ratio, x.shape[-1])
        thr = sorted_abs[..., idx : idx + 1]
        codes, scale, bias = minmax_quantize(torch.minimum(torch.maximum(x, -thr), thr), 2, group_size)
        deq = minmax_dequantize(codes, scale.to(param_dtype), bias.to(param_dtype))
        best = min(best, (error_of(deq.double() - rows.double()), ratio))
    return best[1], best[0]


@dataclass
class LayerErrorMeasure:
    """OSCAR's error measures for one layer on held-out tokens, in the rotated space.

    Keys: the expected squared logit error ``E[(q'·Δk')²] = Δk' (R_Kᵀ C_Q,h R_K) Δk'ᵀ``.
    Values: the score-weighted error ``Σ_t w_t ||Δv'_t||² / T`` (the weights of ``C_S``).
    """

    keys: torch.Tensor  # rotated held-out keys, f64 [T, Hkv, d]
    values: torch.Tensor  # rotated held-out values, f64 [T, Hkv, d]
    query_moment: torch.Tensor  # R_Kᵀ C_Q,h R_K per head, f64 [Hkv, d, d]
    weights: torch.Tensor  # value token weights with mean 1, f64 [T, Hkv]

    @classmethod
    def build(
        cls, st: LayerStats, key_rotation: torch.Tensor, value_rotation: torch.Tensor, value_weights: str = "proxy"
    ) -> "LayerErrorMeasure":
        rk, rv = key_rotation.double(), value_rotation.double()
        rk_heads = rk if rk.dim() == 3 else rk.expand(st.num_kv_heads, -1, -1)
        w = st.value_weights(value_weights)
        return cls(
            keys=apply_rotation(st.all_keys().double(), rk),
            values=apply_rotation(st.all_values().double(), rv),
            query_moment=rk_heads.transpose(-1, -2) @ st.qtq() @ rk_heads,
            weights=w / w.mean(dim=0, keepdim=True).clamp(min=1e-12),
        )

    def head(self, h: int) -> "LayerErrorMeasure":
        """The same measure restricted to KV head ``h`` (the layer's error is the sum over heads)."""
        return LayerErrorMeasure(self.keys[:, h:h + 1], self.values[:, h:h + 1], self.query_moment[h:h + 1],
                                 self.weights[:, h:h + 1])

    def key_error(self, delta: torch.Tensor, weights: torch.Tensor | None = None) -> float:
        """The mean over tokens; with ``weights`` ``[T, Hkv]``, each token's error weighted by them."""
        d = delta.double().transpose(0, 1)  # [Hkv, T, d]
        per_token = ((d @ self.query_moment) * d).sum(-1)  # [Hkv, T]
        if weights is not None:
            per_token = per_token * weights.double().T
        return per_token.sum().item() / delta.shape[0]

    def value_error(self, delta: torch.Tensor) -> float:
        return (self.weights * delta.double().square().sum(-1)).sum().item() / delta.shape[0]

    def errors(
        self, clip_k: float, clip_v: float, group_size: int | None = None, param_dtype: torch.dtype = torch.float16
    ) -> tuple[float, float]:
        """(key error, value error) of the INT2 cache with these clip ratios."""
        dk = fake_quantize_int2(self.keys, clip_k, group_size, param_dtype) - self.keys
        dv = fake_quantize_int2(self.values, clip_v, group_size, param_dtype) - self.values
        return self.key_error(dk), self.value_error(dv)


def fit_clip_ratios(
    key: RotationSet,
    value: RotationSet,
    heldout: dict[int, LayerStats],
    value_weights: str = "proxy",
    group_size: int | None = None,
    param_dtype: torch.dtype = torch.float16,
    per_head: bool = False,
    key_group_size: int | None = None,
) -> tuple[list, list, dict]:
    """Clip ratios minimizing :class:`LayerErrorMeasure` on held-out tokens: one per layer, or with
    ``per_head`` one per KV head of every layer (a list per layer). ``key_group_size``: the keys'
    quantization group where it differs from ``group_size``.

    Returns ``(ratios_k, ratios_v, report)``; the report compares with the reference ratios.
    """
    key_group_size = group_size if key_group_size is None else key_group_size
    ratios_k, ratios_v = [], []
    gain_k, gain_v = [], []
    for layer_id in key.layer_ids:
        em = LayerErrorMeasure.build(heldout[layer_id], key.rotations[layer_id], value.rotations[layer_id],
                                     value_weights)
        parts = [em.head(h) for h in range(em.keys.shape[1])] if per_head else [em]
        fits_k = [best_clip_ratio(m.keys, m.key_error, key_group_size, param_dtype) for m in parts]
        fits_v = [best_clip_ratio(m.values, m.value_error, group_size, param_dtype) for m in parts]
        ref_k = em.key_error(fake_quantize_int2(em.keys, REFERENCE_CLIP_RATIO_K, key_group_size, param_dtype) - em.keys)
        ref_v = em.value_error(fake_quantize_int2(em.values, REFERENCE_CLIP_RATIO_V, group_size, param_dtype)
                               - em.values)
        ratios_k.append([r for r, _ in fits_k] if per_head else fits_k[0][0])
        ratios_v.append([r for r, _ in fits_v] if per_head else fits_v[0][0])
        gain_k.append(sum(e for _, e in fits_k) / ref_k)
        gain_v.append(sum(e for _, e in fits_v) / ref_v)
    d = key.head_dim
    report = {
        "objective": "held-out logit error (keys), score-weighted value error (values)",
        "heldout_tokens": next(iter(heldout.values())).num_tokens,
        "search": f"sorted-|x| index {clip_index(clip_candidates(d)[0], d)}..{d - 1} of {d}",
        "per": "kv_head" if per_head else "layer",
        "error_vs_reference_key": sum(gain_k) / len(gain_k),
        "error_vs_reference_value": sum(gain_v) / len(gain_v),
    }
    return ratios_k, ratios_v, report
