"""Keys less their mean before 2-bit rounding: the reference cache's, and the serving setting
``key_mean`` "on"'s (the Triton and Gluon kernels take it as ``KEY_MEAN``; docs/kernels.md).

Most of a key's length is a mean the model gives every key before RoPE: in SmolLM2's layers it
holds 60-89% of the keys' energy past the sink (``docs/quality.md``). Rounding a key row to four
levels spends them on that mean. RoPE turns it with the position, so no one vector taken off after
RoPE removes it (a mean over the first 2K positions leaves more than it removes at 8K). Taken off
per block of positions it costs a read almost nothing: the cache rounds each key of a block less
one vector, the mean averaged over the block's positions (``block_average``, turned to the block's
first position), and a read adds the query's product with that vector, one number per block and
query, to the block's logits. The page keeps its bytes; a layer keeps ``d`` numbers per KV head.
(Taken off exactly at each position, ``k_p - RoPE_p(μ)``, a read adds a product per key.)

RoPE here is the rotate-half form of Llama, Qwen and vLLM's ``is_neox_style``, with the model's
own ``cos``/``sin`` table (scaling included), so nothing about a model's RoPE is computed here.
Depends on torch only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# What the backend serves: each KV head's mean on its 16 strongest RoPE pairs, one vector per cache
# block of 64 positions (the kernels' csrc_triton.paged_layout.KEY_MEAN_PAIRS and BLOCK_SIZE).
SERVED_PAIRS = 16
SERVED_BLOCK = 64


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
    repeated, as transformers' rotary embeddings return them).

    ``block`` > 0: the mean is one vector per ``block`` positions, ``mean`` turned to the block's
    first position (``mean`` then being ``block_average`` of the mean before RoPE). A read adds
    the same vector to every key of a block, so its logit is one number per block and query."""

    mean: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    block: int = 0

    def __post_init__(self) -> None:
        if self.mean.dim() != 2 or self.cos.shape != self.sin.shape or self.cos.shape[-1] != self.mean.shape[-1]:
            raise ValueError(f"a key mean [Hkv, d] and RoPE tables [P, d] are needed, got {tuple(self.mean.shape)}, "
                             f"{tuple(self.cos.shape)} and {tuple(self.sin.shape)}")

    @classmethod
    def from_cos_sin_cache(cls, mean: torch.Tensor, cos_sin_cache: torch.Tensor, block: int = 0) -> "KeyMean":
        """With vLLM's table, ``[P, d]``: the ``d/2`` cosines then the ``d/2`` sines of each
        position (``RotaryEmbedding.cos_sin_cache``, rotate-half form)."""
        cos, sin = cos_sin_cache.float().chunk(2, dim=-1)
        return cls(mean, torch.cat([cos, cos], -1), torch.cat([sin, sin], -1), block)

    def at(self, num_positions: int) -> torch.Tensor:
        """``[T, Hkv, d]`` fp32: the mean as RoPE leaves it at positions ``0 .. T-1``."""
        return self.turned(torch.arange(num_positions))

    def turned(self, positions: torch.Tensor) -> torch.Tensor:
        """``[N, Hkv, d]`` fp32: the mean as RoPE leaves it at ``positions`` ``[N]``."""
        positions = positions.long().cpu()
        if positions.numel() and int(positions.max()) >= self.cos.shape[0]:
            raise ValueError(f"the RoPE table covers {self.cos.shape[0]} positions, position {int(positions.max())} "
                             "asked for")
        if self.block:
            positions = positions - positions % self.block
        cos, sin = (t.cpu()[positions][:, None].float() for t in (self.cos, self.sin))
        return rope(self.mean.float().cpu()[None], cos, sin)


def block_average(mean: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, block: int) -> torch.Tensor:
    """``[Hkv, d]``: the mean over a block's positions ``t = 0 .. block-1`` of ``mean`` turned to
    ``t``. RoPE is linear in its table, so that is ``mean`` turned by the table's average row; turned
    on to position ``p0`` it is the average of the mean over positions ``p0 .. p0+block-1``: of all
    vectors a block's keys share, the nearest to their means (least squares). A pair whose angle
    turns little over a block keeps its length, one that turns a full circle or more averages to
    nearly nothing. Each pair's rows are divided by its scale (``cos`` at position 0: 1, or YaRN's
    magnitude), so that turning the result by the table's row at ``p0`` applies that scale once."""
    if not 0 < block <= cos.shape[0]:
        raise ValueError(f"a block of {block} positions, the RoPE table covers {cos.shape[0]}")
    c, s = cos[:block].double(), sin[:block].double()
    scale = c[0]
    if not bool((scale.abs() > 0).all()):
        raise ValueError("the RoPE table's first row must hold each pair's scale (cos 0 times it): a zero was found")
    return rope(mean.double(), c.mean(0) / scale, s.mean(0) / scale).to(mean.dtype)


def served_block_mean(mean: torch.Tensor, cos_sin_cache: torch.Tensor, block: int, pairs: int) -> torch.Tensor:
    """What the kernels serve of a layer's mean key before RoPE ``mean`` ``[Hkv, d]``: its
    ``block_average`` under vLLM's table ``[P, d]`` (``d/2`` cosines, then ``d/2`` sines), on each
    head's ``pairs`` strongest RoPE pairs (``served_pairs``: 0 keeps all)."""
    cos, sin = cos_sin_cache.float().chunk(2, dim=-1)
    average = block_average(mean.float().cpu(), torch.cat([cos, cos], -1).cpu(), torch.cat([sin, sin], -1).cpu(),
                            block)
    return served_pairs(average, pairs).to(mean.device)


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
