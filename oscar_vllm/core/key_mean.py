"""Keys less their mean before 2-bit rounding: the reference cache's, and the serving setting
``key_mean`` "on"'s (the Triton and Gluon kernels take it as ``KEY_MEAN``; docs/kernels.md).

Most of a key's length is a mean the model gives every key before RoPE: in SmolLM2's layers it
holds 60-89% of the keys' energy past the sink (``docs/quality.md``). Rounding a key row to four
levels spends them on that mean. RoPE turns it with the position, so no one vector taken off after
RoPE removes it (a mean over the first 2K positions leaves more than it removes at 8K), but it can
be taken off exactly at every position: the cache rounds ``k_p - RoPE_p(μ)`` and a read adds
``RoPE_p(μ)`` back. The page keeps its bytes; a layer keeps ``d`` numbers per KV head, and a
kernel reading a 2-bit key adds the query's product with ``RoPE_p(μ)`` to its logit.

RoPE here is the rotate-half form of Llama, Qwen and vLLM's ``is_neox_style``, with the model's
own ``cos``/``sin`` table (scaling included), so nothing about a model's RoPE is computed here.
Depends on torch only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` turned by RoPE at the positions of ``cos``/``sin`` (broadcast against ``x``)."""
    return x * cos + rotate_half(x) * sin


def unrope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`rope` at the same positions."""
    return x * cos - rotate_half(x) * sin


@dataclass(frozen=True)
class KeyMean:
    """One layer's mean key before RoPE, and the model's RoPE table to turn it with.

    ``mean`` ``[Hkv, d]``; ``cos``/``sin`` ``[P, d]`` for positions ``0 .. P-1`` (the halves
    repeated, as transformers' rotary embeddings return them)."""

    mean: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    def __post_init__(self) -> None:
        if self.mean.dim() != 2 or self.cos.shape != self.sin.shape or self.cos.shape[-1] != self.mean.shape[-1]:
            raise ValueError(f"a key mean [Hkv, d] and RoPE tables [P, d] are needed, got {tuple(self.mean.shape)}, "
                             f"{tuple(self.cos.shape)} and {tuple(self.sin.shape)}")

    @classmethod
    def from_cos_sin_cache(cls, mean: torch.Tensor, cos_sin_cache: torch.Tensor) -> "KeyMean":
        """With vLLM's table, ``[P, d]``: the ``d/2`` cosines then the ``d/2`` sines of each
        position (``RotaryEmbedding.cos_sin_cache``, rotate-half form)."""
        cos, sin = cos_sin_cache.float().chunk(2, dim=-1)
        return cls(mean, torch.cat([cos, cos], -1), torch.cat([sin, sin], -1))

    def at(self, num_positions: int) -> torch.Tensor:
        """``[T, Hkv, d]`` fp32: the mean as RoPE leaves it at positions ``0 .. T-1``."""
        return self.turned(torch.arange(num_positions))

    def turned(self, positions: torch.Tensor) -> torch.Tensor:
        """``[N, Hkv, d]`` fp32: the mean as RoPE leaves it at ``positions`` ``[N]``."""
        positions = positions.long().cpu()
        if positions.numel() and int(positions.max()) >= self.cos.shape[0]:
            raise ValueError(f"the RoPE table covers {self.cos.shape[0]} positions, position {int(positions.max())} "
                             "asked for")
        cos, sin = (t.cpu()[positions][:, None].float() for t in (self.cos, self.sin))
        return rope(self.mean.float().cpu()[None], cos, sin)


def pre_rope_mean(keys: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, skip: int) -> torch.Tensor:
    """The mean pre-RoPE key of each KV head, ``[Hkv, d]`` fp64, over sequences of post-RoPE keys
    ``[T, Hkv, d]`` (each from position 0), leaving out each sequence's first ``skip`` positions
    (the sink: kept in BF16, and unlike the rest)."""
    total, count = None, 0
    for k in keys:
        t = k.shape[0]
        if t > cos.shape[0]:
            raise ValueError(f"a sequence of {t} keys, the RoPE table covers {cos.shape[0]} positions")
        pre = unrope(k.double(), cos[:t, None].double(), sin[:t, None].double())[skip:]
        total = pre.sum(0) if total is None else total + pre.sum(0)
        count += pre.shape[0]
    if not count:
        raise ValueError(f"no keys past the first {skip} positions to average")
    return total / count


def strongest_pairs(mean: torch.Tensor, count: int, shared: bool = False) -> torch.Tensor:
    """``mean`` ``[Hkv, d]`` on each KV head's ``count`` RoPE pairs (dims ``i`` and ``i + d/2``)
    of most energy, zero on the others: a read then adds only those pairs' terms. ``shared``: the
    same pairs for every KV head, those of most energy over all of them (one table of those pairs'
    cos/sin serves the whole layer)."""
    half = mean.shape[-1] // 2
    if not 0 < count <= half:
        raise ValueError(f"{count} pairs asked for of {half}")
    energy = mean[..., :half].square() + mean[..., half:].square()
    if shared:
        energy = energy.sum(0, keepdim=True).expand_as(energy)
    keep = torch.zeros_like(energy, dtype=torch.bool).scatter_(-1, energy.topk(count, dim=-1).indices, True)
    return mean * torch.cat([keep, keep], dim=-1)


def served_pairs(mean: torch.Tensor, count: int) -> torch.Tensor:
    """``mean`` ``[Hkv, d]`` on each KV head's ``count`` strongest pairs as ``key_mean`` serves it
    (``strongest_pairs``), all of them where a head has no more than ``count``; ``count`` 0: all."""
    return strongest_pairs(mean, min(count, mean.shape[-1] // 2)) if count else mean
