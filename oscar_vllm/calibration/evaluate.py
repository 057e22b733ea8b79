"""Fidelity evaluation: what 2-bit KV costs a real model, against a BF16 cache.

    oscar-evaluate                              # SmolLM2-135M-Instruct, embedded corpus
    python -m oscar_vllm.calibration.evaluate --context 4096 --eval-tokens 131072 --device cuda
    python -m oscar_vllm.calibration.evaluate --contexts 1024,2048,4096,8192 --eval-tokens 16384   # the curve

Every method runs the whole model with its attention reading a simulated cache exactly as
decode sees it (:mod:`oscar_vllm.core.mixed_cache`): token ``t`` reads BF16 keys/values for
the first ``--sink`` positions and its last ``--recent``, quantized ones in between, in
the rotated space. Reported per method, against the BF16 cache on the evaluation text:
perplexity, ΔPPL, mean KL(BF16 ‖ method) per token and top-1 agreement. Writes
``fidelity.md``, ``fidelity.json`` and ``fidelity.png`` into ``--output-dir`` (default
``runs/fidelity``, which git ignores; the committed ``results/fidelity`` is regenerated
with ``bash benchmarks/main_job.sh``). With ``--contexts``, every method at each context on
the same tokens, as ``curve.md``, ``curve.json`` and ``curve.png`` (ΔPPL, KL and top-1 against
the context, one line per method).
Rotations are calibrated in the same run on calibration text that never overlaps the
evaluation text, unless ``--rotations`` gives a folder.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm.auto import tqdm

from oscar_vllm import __version__
from oscar_vllm.calibration import corpus
from oscar_vllm.calibration.calibrate import DTYPES, capture_stats, full_windows, rotations_from_stats
from oscar_vllm.calibration.fit import fit_clip_ratios
from oscar_vllm.calibration.models import (
    LoadedModel,
    MixedCacheHook,
    add_model_arguments,
    attention_hooks,
    load_model,
    rope_tables,
)
from oscar_vllm.core.errors import DEBUG_FLAG, DEBUG_HELP, OscarError, cli
from oscar_vllm.core.key_mean import SERVED_BLOCK, SERVED_PAIRS, KeyMean, block_average, served_pairs
from oscar_vllm.core.mixed_cache import LayerCacheSpec, RowQuantizer
from oscar_vllm.core.quant import REFERENCE_CLIP_RATIO_K, REFERENCE_CLIP_RATIO_V
from oscar_vllm.core.rotation_io import OscarRotations, hadamard_rotation_sets, load_rotations
from oscar_vllm.core.settings import OscarSettings

logger = logging.getLogger(__name__)

REFERENCE = "bf16"
POSITION_BIN = 128
# A user's run never writes over the committed results/fidelity (the README's table source).
DEFAULT_OUTPUT_DIR = Path("runs/fidelity")


@dataclass(frozen=True)
class Method:
    """One row of the table: how every layer's K and V are cached."""

    name: str
    rotation: str  # a key of the rotation variants, or "none"
    quant: str  # RowQuantizer kind
    clip: str = "reference"  # "reference" | "fitted" | "none"
    windows: bool = True
    scale_dtype: torch.dtype = torch.float16
    logit_correction: float = 0.0  # see LayerCacheSpec: quantized keys' logits less λ/2 their rounding variance
    key_mean: bool = False  # keys rounded less the rotation file's mean before RoPE (core.key_mean)
    key_mean_pairs: int = 0  # > 0: each KV head's mean on its that many strongest RoPE pairs (as served: 16)
    key_mean_block: int = 0  # > 0: one mean per block of this many positions, block_average (as served: 64)

    def describe(self) -> dict:
        return {
            "rotation": self.rotation,
            "quantizer": self.quant,
            "clip": self.clip if self.quant == "int2" else "-",
            "windows": "yes" if self.windows else "no",
            "scale/zero": {torch.float16: "fp16", torch.float32: "fp32", torch.bfloat16: "bf16"}[self.scale_dtype]
            if self.quant != "bf16" else "-",
        }


METHODS = [
    Method("bf16", "none", "bf16"),
    Method("int4", "none", "int4", windows=False),
    Method("naive-int2", "none", "naive_int2"),
    Method("hadamard-int2", "hadamard", "int2"),
    Method("hadamard-int2-fit", "hadamard", "int2", clip="fitted"),
    Method("oscar-int2-nowin", "oscar", "int2", windows=False),
    Method("oscar-int2", "oscar", "int2"),
    Method("oscar-int2-fp32", "oscar", "int2", scale_dtype=torch.float32),
    Method("oscar-int2-fit", "oscar", "int2", clip="fitted"),
    Method("oscar-int2-perhead", "oscar-perhead", "int2"),
    Method("oscar-int2-softmax", "oscar-softmax", "int2"),
    # What the backend serves by default: the file's fitted clips, quantized logits corrected for
    # their rounding variance at λ 0.5 (docs/quality.md).
    Method("oscar-int2-fit-debiased-half", "oscar", "int2", clip="fitted", logit_correction=0.5),
    # What it serves with key_mean "auto" where the rotations have key means: keys rounded less
    # their block's mean (16 RoPE pairs a head), no logit correction.
    Method("oscar-int2-fit-key-mean", "oscar", "int2", clip="fitted", key_mean=True, key_mean_pairs=SERVED_PAIRS,
           key_mean_block=SERVED_BLOCK),
]
# Not in the default table (the README's main job): other strengths of the logit correction
# (docs/quality.md) and the per-position key means.
EXTRA_METHODS = [
    Method("oscar-int2-fit-debiased", "oscar", "int2", clip="fitted", logit_correction=1.0),
    Method("oscar-int2-debiased-half", "oscar", "int2", logit_correction=0.5),
    Method("oscar-int2-fit-debiased-half-key-mean", "oscar", "int2", clip="fitted", logit_correction=0.5,
           key_mean=True),
    # The mean turned to each key's own position (a product a key in a read), on each head's 16
    # strongest pairs: at λ 0 and 0.25 (docs/quality.md).
    Method("oscar-int2-fit-key-mean16", "oscar", "int2", clip="fitted", key_mean=True, key_mean_pairs=16),
    Method("oscar-int2-fit-debiased-quarter-key-mean16", "oscar", "int2", clip="fitted", logit_correction=0.25,
           key_mean=True, key_mean_pairs=16),
]
METHODS_BY_NAME = {m.name: m for m in METHODS + EXTRA_METHODS}


def layer_specs(method: Method, rotations: dict[str, OscarRotations], layer_ids: list[int],
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[int, LayerCacheSpec]:
    """Each layer's cache under ``method``; ``rope``: the model's RoPE table ``(cos, sin)`` over
    the positions scored, which a method with key means turns them with."""
    rot = rotations.get(method.rotation)
    if method.key_mean and (rot is None or rot.key_means is None or rope is None):
        raise ValueError(f"{method.name} needs rotations with key means (oscar-calibrate writes them) and the "
                         "model's RoPE table")
    specs = {}
    for i in layer_ids:
        if method.quant == "int2":
            if method.clip == "fitted":
                if rot.clip_ratios_k is None:
                    raise ValueError(f"{method.name} needs fitted clip ratios; the rotations have none")
                ck, cv = rot.clip_ratio("key", i), rot.clip_ratio("value", i)
            else:
                ck, cv = REFERENCE_CLIP_RATIO_K, REFERENCE_CLIP_RATIO_V
        else:
            ck = cv = 0.0
        specs[i] = LayerCacheSpec(
            rot.key.rotations[i] if rot else None,
            rot.value.rotations[i] if rot else None,
            RowQuantizer(method.quant, ck, None, method.scale_dtype),
            RowQuantizer(method.quant, cv, None, method.scale_dtype),
            method.logit_correction,
            method_key_mean(method, rot.key_means[i], rope) if method.key_mean else None,
        )
    return specs


def method_key_mean(method: Method, mean: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> KeyMean:
    """A layer's key mean as ``method`` reads it: per block (``block_average``) or per position, on
    each head's ``key_mean_pairs`` strongest pairs (0: all)."""
    block = method.key_mean_block
    served = served_pairs(block_average(mean, *rope, block) if block else mean, method.key_mean_pairs)
    return KeyMean(served, *rope, block=block)


def served_method(rotations: OscarRotations, dense_prefill: bool = False,
                  settings: OscarSettings | None = None) -> Method:
    """The method the backend serves ``rotations`` with under ``settings`` (default: the
    defaults): the file's fitted clip ratios where it has them, else the reference's; FP16 scales;
    keys less their block's mean where ``key_mean`` asks and the file has key means; the logit
    correction that goes with it, which every INT2 read takes but a 16-bit model's prompt chunks
    over a cached prefix (``dense_prefill``: they run on FlashAttention, which takes no correction;
    docs/kernels.md)."""
    settings = settings or OscarSettings()
    clip = "fitted" if rotations.clip_ratios_k else "reference"
    key_mean = rotations.key_means is not None and settings.key_mean != "off"
    correction = 0.0 if dense_prefill else settings.logit_correction_for(key_mean=key_mean)
    block = SERVED_BLOCK if key_mean else 0
    for m in METHODS + EXTRA_METHODS:
        if (m.rotation, m.quant, m.clip, m.windows, m.scale_dtype, m.logit_correction, m.key_mean,
                m.key_mean_block) == ("oscar", "int2", clip, True, torch.float16, correction, key_mean, block):
            return m
    raise LookupError(f"no method in METHODS_BY_NAME serves clip {clip!r} with logit correction {correction}"
                      f"{' and key means' if key_mean else ''}")


def served_specs(rotations: OscarRotations, num_layers: int, dense_prefill: bool = False,
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                 settings: OscarSettings | None = None) -> tuple[Method, dict[int, LayerCacheSpec]]:
    """The reference cache as the backend serves ``rotations`` (``served_method``); ``rope``: the
    model's RoPE table, which a served key mean is turned with."""
    method = served_method(rotations, dense_prefill, settings)
    return method, layer_specs(method, {"oscar": rotations}, list(range(num_layers)), rope)


def add_served_arguments(parser: argparse.ArgumentParser, out: str, device: bool = True) -> None:
    """``--rotations``, ``--dtype``, ``--out`` (default ``out``) and, with ``device``, ``--device``:
    what the benchmarks that read SmolLM2 through the reference cache as served take."""
    parser.add_argument("--rotations", type=Path, default=Path("tests/data/smollm2_rotations"))
    if device:
        parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--out", type=Path, default=Path(out))


def load_served(args: argparse.Namespace,
                dense_prefill: bool = False) -> tuple[LoadedModel, Method, dict[int, LayerCacheSpec]]:
    """SmolLM2 and the reference cache as the backend serves ``args.rotations``
    (``add_served_arguments``'s options; on the CPU without ``--device``; ``served_method``)."""
    loaded = load_model(None, None, getattr(args, "device", "cpu"), DTYPES[args.dtype])
    rope = rope_tables(loaded, loaded.model.config.max_position_embeddings)
    method, specs = served_specs(load_rotations(args.rotations, loaded.shape), loaded.shape.num_layers, dense_prefill,
                                 rope)
    return loaded, method, specs


@dataclass
class Score:
    """Running sums over predicted tokens for one method."""

    nll: float = 0.0
    kl: float = 0.0
    top1: int = 0
    tokens: int = 0
    kl_by_pos: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    n_by_pos: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))

    def add(self, logp: torch.Tensor, ref_logp: torch.Tensor, targets: torch.Tensor) -> None:
        """logp, ref_logp: f32 ``[T, V]`` log-probs for positions predicting ``targets [T]``."""
        self.nll -= logp.gather(-1, targets[:, None]).sum().item()
        kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).double().cpu()
        self.kl += kl.sum().item()
        self.top1 += (logp.argmax(-1) == ref_logp.argmax(-1)).sum().item()
        self.tokens += targets.numel()
        bins = torch.arange(kl.numel()) // POSITION_BIN
        if self.kl_by_pos.numel() == 0:  # every window has the same length
            self.kl_by_pos = torch.zeros(int(bins[-1]) + 1, dtype=torch.float64)
            self.n_by_pos = torch.zeros_like(self.kl_by_pos)
        self.kl_by_pos.index_add_(0, bins, kl)
        self.n_by_pos.index_add_(0, bins, torch.ones_like(kl))

    def summary(self, ref: "Score") -> dict:
        ppl, ref_ppl = math.exp(self.nll / self.tokens), math.exp(ref.nll / ref.tokens)
        return {
            "ppl": ppl,
            "delta_ppl": ppl - ref_ppl,
            "delta_ppl_pct": 100 * (ppl / ref_ppl - 1),
            "kl": self.kl / self.tokens,
            "top1": self.top1 / self.tokens,
            "tokens": self.tokens,
            "kl_by_position": (self.kl_by_pos / self.n_by_pos.clamp(min=1)).tolist(),
        }


@dataclass(frozen=True)
class CacheConfig:
    """How one scored run caches every layer: per-layer specs, and the BF16 windows."""

    specs: dict[int, LayerCacheSpec]
    sink: int = 64
    recent: int = 256


@torch.no_grad()
def score_windows(
    loaded: LoadedModel,
    eval_ids: torch.Tensor,
    context: int,
    configs: dict[str, CacheConfig],
    prefill_chunk: int = 0,
    desc: str = "evaluating",
) -> dict[str, Score]:
    """Run every config on consecutive ``context``-token windows of ``eval_ids``: the scores of
    each against the first config (the reference), window by window so that the reference's
    log-probs are computed once per window."""
    windows = full_windows(eval_ids, context)
    if not windows:
        raise ValueError(f"{eval_ids.numel()} evaluation tokens make no window of {context}")
    scores = {name: Score() for name in configs}
    device = next(loaded.model.parameters()).device
    bar = tqdm(total=len(windows) * len(configs), desc=desc, unit="run")
    for window in windows:
        ids = window[None].to(device)
        targets = ids[0, 1:]
        ref_logp = None
        for name, c in configs.items():
            with attention_hooks(loaded.model, lambda i: MixedCacheHook(c.specs[i], c.sink, c.recent, prefill_chunk)):
                logits = loaded.model(ids, use_cache=False).logits[0, :-1]
            logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
            del logits
            if ref_logp is None:
                ref_logp = logp
            scores[name].add(logp, ref_logp, targets)
            bar.set_postfix_str(name)
            bar.update()
    bar.close()
    return scores


def evaluate(
    loaded: LoadedModel,
    eval_ids: torch.Tensor,
    context: int,
    methods: list[Method],
    rotations: dict[str, OscarRotations],
    sink: int = 64,
    recent: int = 256,
    prefill_chunk: int = 0,
) -> dict[str, dict]:
    """Score every method on consecutive ``context``-token windows of ``eval_ids``; with
    ``prefill_chunk``, each window's cache as a server that prefills it in such chunks holds it."""
    if methods[0].name != REFERENCE:
        methods = [METHODS_BY_NAME[REFERENCE]] + [m for m in methods if m.name != REFERENCE]
    layer_ids = list(range(loaded.shape.num_layers))
    rope = rope_tables(loaded, context) if any(m.key_mean for m in methods) else None
    configs = {
        m.name: CacheConfig(layer_specs(m, rotations, layer_ids, rope), *((sink, recent) if m.windows else (0, 0)))
        for m in methods
    }
    scores = score_windows(loaded, eval_ids, context, configs, prefill_chunk)
    ref = scores[REFERENCE]
    return {m.name: {**m.describe(), **scores[m.name].summary(ref)} for m in methods}


def curve_tokens(eval_tokens: int, contexts: Sequence[int]) -> int:
    """The most tokens, up to ``eval_tokens``, that are whole windows of every context: so that
    every context scores the same tokens."""
    lcm = math.lcm(*contexts)
    return eval_tokens // lcm * lcm


def evaluate_contexts(
    loaded: LoadedModel,
    eval_ids: torch.Tensor,
    contexts: Sequence[int],
    methods: list[Method],
    rotations: dict[str, OscarRotations],
    sink: int = 64,
    recent: int = 256,
    prefill_chunk: int = 0,
) -> dict[int, dict[str, dict]]:
    """:func:`evaluate` at each context, on the same tokens (``curve_tokens`` of ``eval_ids``):
    ``{context: {method: row}}``."""
    n = curve_tokens(eval_ids.numel(), contexts)
    if n == 0:
        raise ValueError(f"{eval_ids.numel()} evaluation tokens make no whole windows of every context "
                         f"{list(contexts)}")
    return {c: evaluate(loaded, eval_ids[:n], c, methods, rotations, sink, recent, prefill_chunk) for c in contexts}


# ---------------------------------------------------------------------------- cached prefix

# The prefix-caching workload of ``tests/gpu/e2e_vllm.py prefix``, from held-out token ids: 16
# chats of one 1,536-token system prompt and a distinct 200-token question each, then one shared
# 512-token prefix that starts each of 23 windows (``--windows`` there) of 1,536 distinct tokens
# more. Each window is scored at 9 cuts (207 tokens): the prompt is the window up to ``prefix + cut``.
_SYSTEM, _CHATS, _QUESTION = 1536, 16, 200
_PREFIX, _WINDOW = 512, 1536
CACHED_PREFIX_WINDOWS = 23
CACHED_PREFIX_CUTS = tuple(range(300, _WINDOW, 150))


def cached_prefix_tokens(windows: int = CACHED_PREFIX_WINDOWS) -> int:
    """The token ids the workload of ``windows`` windows takes."""
    return _SYSTEM + _CHATS * _QUESTION + _PREFIX + windows * _WINDOW


CACHED_PREFIX_TOKENS = cached_prefix_tokens()


def cached_prefix_workload(ids: Sequence[int], windows: int = CACHED_PREFIX_WINDOWS
                           ) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """``(chats, shared prefix, windows)`` as token lists (see ``CACHED_PREFIX_TOKENS``)."""
    need = cached_prefix_tokens(windows)
    if len(ids) < need:
        raise ValueError(f"the cached-prefix workload of {windows} windows needs {need} tokens, got {len(ids)}")
    ids = [int(t) for t in ids[:need]]
    system, rest = ids[:_SYSTEM], ids[_SYSTEM:]
    chats = [system + rest[i * _QUESTION:(i + 1) * _QUESTION] for i in range(_CHATS)]
    shared, rest = rest[_CHATS * _QUESTION:][:_PREFIX], rest[_CHATS * _QUESTION + _PREFIX:]
    return chats, shared, [shared + rest[i * _WINDOW:(i + 1) * _WINDOW] for i in range(windows)]


@torch.no_grad()
def cached_prefix_reads(
    loaded: LoadedModel,
    windows: list[list[int]],
    prefix_len: int,
    oscar: dict[int, LayerCacheSpec],
    sink: int = 64,
    recent: int = 256,
    cuts: Sequence[int] = CACHED_PREFIX_CUTS,
    chunk: int = 256,
    block: int = 64,
) -> dict[str, dict[str, list[float]]]:
    """NLL of the tokens ``tests/gpu/e2e_vllm.py prefix`` scores, as the reference cache reads them
    each way vLLM can serve a window cut at ``end = prefix_len + cut``:

    - ``bf16``: a BF16 cache.
    - ``one_chunk``: OSCAR, the prompt prefilled in one chunk (prefix caching off): every key
      is read in BF16.
    - ``chunked``: OSCAR, the prompt prefilled in chunks of ``chunk`` tokens (caching off): a
      chunk reads itself, the sink and the ring of ``recent - 1`` keys before it in BF16.
    - ``hit``: OSCAR, the chunk after a prefix-cache hit on the shared prefix: the sink and the
      chunk in BF16, the rest of the prefix quantized (a hit brings no recent window).
    - ``hit_chunked``: the same hit, the rest of the prompt in chunks of ``chunk``: the first
      reads as ``hit`` does, later ones also find the ring before them (the prefix itself as
      ``chunked`` computed it).
    - ``deep_hit``: OSCAR, the prompt after the deepest hit the scheduler allows (vLLM's block of
      ``block`` tokens; the hit ends at least ``recent`` tokens before the prompt's end), as one
      chunk, with no ring before it: how the hits on each other's prompts in vLLM's check read.
    - ``deep_hit_ring``: the same hit as the scheduler now trims it, ``recent`` tokens (whole blocks)
      shorter, those computed again: one chunk from there (``oscar_vllm.serving.window_pages``).
    - ``deep_hit_ring_chunked``: that hit, the rest in chunks of ``chunk``, each with its ring (of
      what the request computed itself).
    - ``decode``: OSCAR, each position as a decode step reads the cache: the sink and the last
      ``recent`` keys in BF16, the rest quantized.

    The ``deep_hit`` reads take every position as the last of a prompt of its own (its hit, its
    chunks): exact for that position, and close for the keys of the positions before it, which in
    vLLM come from the chunk of the one prompt.

    Returns ``{read: {"cut": [...], "after": [...]}}``: per window and cut, the NLL of the token at
    ``end`` (the prompt's last position predicts it) and of the token after it (predicted from
    position ``end``, a decode step once the token at ``end`` is sampled)."""
    total = len(windows[0])
    ends = torch.tensor([prefix_len + c for c in cuts])
    if any(len(w) != total for w in windows) or int(ends.max()) + 2 > total:
        raise ValueError(f"windows must share one length above {int(ends.max()) + 1} tokens")
    bf16 = layer_specs(METHODS_BY_NAME[REFERENCE], {}, list(oscar))
    positions = torch.arange(total)
    in_prefix = positions < prefix_len

    def after_hit(size: int) -> torch.Tensor:
        """Where each position's BF16 keys (past the sink) begin when the prompt is prefilled in
        chunks of ``size``, the prefix uncached and the rest after a hit on it: its chunk, less the
        ring before it; after the hit the ring holds only what the request computed itself."""
        start = torch.where(in_prefix, positions // size * size, prefix_len + (positions - prefix_len) // size * size)
        with_ring = (start - recent + 1).clamp(min=0)
        return torch.where(in_prefix, with_ring, with_ring.clamp(min=prefix_len))

    everything_bf16 = torch.zeros(total, dtype=torch.long)
    one_chunk_hit, chunked_hit = after_hit(total), after_hit(chunk)
    # A prompt ending after position p: its deepest hit, and that hit less its ring (whole blocks).
    # The shared prefix itself was prefilled uncached, as the request that cached it.
    deepest = torch.where(in_prefix, 0, ((positions + 1 - recent).clamp(min=0) // block * block).clamp(min=prefix_len))
    trimmed = torch.where(in_prefix, 0, (deepest - -(-recent // block) * block).clamp(min=0))
    grid = trimmed + (positions - trimmed) // chunk * chunk
    ring_from = torch.maximum(grid - recent + 1, trimmed)  # the ring holds only what it computed
    reads = {
        "bf16": lambda i: MixedCacheHook(bf16[i], 0, 0),
        "one_chunk": lambda i: MixedCacheHook(oscar[i], sink, recent, chunk_starts=everything_bf16),
        "chunked": lambda i: MixedCacheHook(oscar[i], sink, recent, prefill_chunk=chunk),
        "hit": lambda i: MixedCacheHook(oscar[i], sink, 0, chunk_starts=one_chunk_hit),
        "hit_chunked": lambda i: MixedCacheHook(oscar[i], sink, 0, chunk_starts=chunked_hit),
        "deep_hit": lambda i: MixedCacheHook(oscar[i], sink, 0, chunk_starts=deepest),
        "deep_hit_ring": lambda i: MixedCacheHook(oscar[i], sink, 0, chunk_starts=trimmed),
        "deep_hit_ring_chunked": lambda i: MixedCacheHook(oscar[i], sink, 0, chunk_starts=ring_from),
        "decode": lambda i: MixedCacheHook(oscar[i], sink, recent),
    }
    device = next(loaded.model.parameters()).device
    nll = {read: {"cut": [], "after": []} for read in reads}
    for window in tqdm(windows, desc="cached-prefix reads", unit="window"):
        ids = torch.tensor(window[: int(ends.max()) + 2], device=device)
        for read, make_hook in reads.items():
            with attention_hooks(loaded.model, make_hook):
                logits = loaded.model(ids[None, :-1], use_cache=False).logits[0]
            for name, pos in (("cut", ends - 1), ("after", ends)):
                logp = torch.log_softmax(logits[pos.to(device)].float(), dim=-1)
                nll[read][name] += (-logp.gather(-1, ids[pos + 1, None])[:, 0]).tolist()
    return nll


# ---------------------------------------------------------------------------- reporting


def environment(prog: str = "oscar-evaluate") -> dict:
    """Date, hardware, the command line and versions, for a report header."""
    if torch.cuda.is_available():
        hardware = torch.cuda.get_device_name(0)
    else:
        cpu = platform.processor() or platform.machine()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        hardware = f"{cpu}, {torch.get_num_threads()} threads"
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "hardware": hardware,
        "command": f"{prog} {shlex.join(sys.argv[1:])}".strip(),
        "versions": f"oscar_vllm {__version__}, torch {torch.__version__}, "
        f"transformers {__import__('transformers').__version__}, python {platform.python_version()}",
    }


def report_header(meta: dict) -> list[str]:
    """The lines a reference-cache report opens with: when, where and what ran (``environment``
    plus the run's ``model`` and ``dtype``)."""
    return [f"- date: {meta['date']}; hardware: {meta['hardware']}; model: {meta['model']} ({meta['dtype']})",
            f"- command: `{meta['command']}`",
            f"- {meta['versions']}"]


def save_report(out_dir: Path, stem: str, data: dict, text: str, indent: int | None = None) -> None:
    """``STEM.json`` (``data``) and ``STEM.md`` (``text``) into ``out_dir``, and the text printed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(data, indent=indent) + "\n")
    (out_dir / f"{stem}.md").write_text(text)
    print(text)


def markdown_table(results: dict[str, dict]) -> str:
    cols = ["method", "rotation", "quantizer", "clip", "scale/zero", "windows", "PPL", "ΔPPL", "KL", "top-1"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['rotation']} | {r['quantizer']} | {r['clip']} | {r['scale/zero']} | {r['windows']} "
            f"| {r['ppl']:.3f} | {r['delta_ppl']:+.3f} ({r['delta_ppl_pct']:+.2f}%) | {r['kl']:.4f} "
            f"| {100 * r['top1']:.2f}% |"
        )
    return "\n".join(lines)


def write_report(results: dict, meta: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "fidelity.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    header = [
        f"# KV-cache fidelity: {meta['model']}",
        "",
        f"- date: {meta['date']}",
        f"- hardware: {meta['hardware']}",
        f"- command: `{meta['command']}`",
        f"- {meta['versions']}",
        f"- evaluation: {meta['eval_tokens']} tokens in windows of {meta['context']} from {meta['eval_corpus']}; "
        f"sink {meta['sink']}, recent {meta['recent']}",
        f"- calibration: {meta['calibration']}",
        "",
        "KL is the mean KL(BF16 ‖ method) per predicted token (nats); top-1 is agreement with",
        "the BF16 cache's argmax. ΔPPL is against the bf16 row.",
        "",
        "",
    ]
    (out_dir / "fidelity.md").write_text("\n".join(header) + markdown_table(results) + "\n")
    plot(results, meta, out_dir / "fidelity.png")
    return out_dir


def plot(results: dict, meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in results if n != REFERENCE]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    kls = [results[n]["kl"] for n in names]
    colors = ["tab:green" if n.startswith("oscar") else "tab:gray" for n in names]
    ax1.barh(names, kls, color=colors)
    ax1.set_xscale("log")
    ax1.invert_yaxis()
    ax1.set_xlabel("mean KL(BF16 ‖ method) per token, nats (log)")
    ax1.set_title(f"{meta['model']}: {meta['eval_tokens']} tokens, context {meta['context']}")
    for y, (n, kl) in enumerate(zip(names, kls)):
        ax1.text(kl, y, f" {kl:.3g} | PPL {results[n]['ppl']:.2f}", va="center", fontsize=8)
    for n in names:
        curve = results[n]["kl_by_position"]
        x = [(i + 0.5) * POSITION_BIN for i in range(len(curve))]
        ax2.plot(x, curve, label=n, lw=1.5 if n.startswith("oscar") else 1)
    ax2.axvline(meta["sink"] + meta["recent"], color="k", ls=":", lw=0.8)
    ax2.set_yscale("log")
    ax2.set_xlabel("position in context (tokens); dotted: sink + recent")
    ax2.set_ylabel("mean KL per token")
    ax2.set_title("where the error comes from")
    ax2.legend(fontsize=7, ncol=2)
    fig.suptitle(f"{meta['date']}, {meta['hardware']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


CURVE_METRICS = (  # (key, column title, format)
    ("delta_ppl_pct", "ΔPPL", lambda x: f"{x:+.2f}%"),
    ("kl", "KL", lambda x: f"{x:.4f}"),
    ("top1", "top-1", lambda x: f"{100 * x:.2f}%"),
)


def curve_markdown(curves: dict[int, dict[str, dict]]) -> str:
    """One table per metric: a row per method, a column per context."""
    contexts = sorted(curves)
    methods = list(curves[contexts[0]])
    out = []
    for key, title, fmt in CURVE_METRICS:
        out += [f"**{title}**", "", "| method | " + " | ".join(f"{c:,}" for c in contexts) + " |",
                "|---|" + "---|" * len(contexts)]
        out += [f"| {m} | " + " | ".join(fmt(curves[c][m][key]) for c in contexts) + " |" for m in methods]
        out.append("")
    return "\n".join(out).rstrip("\n")


def write_curve_report(curves: dict[int, dict[str, dict]], meta: dict, out_dir: Path) -> Path:
    """``curve.{json,md,png}``: every method's ΔPPL, KL and top-1 against the context."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "curve.json").write_text(
        json.dumps({"meta": meta, "contexts": {str(c): r for c, r in curves.items()}}, indent=1) + "\n")
    header = [
        f"# KV-cache fidelity against the context: {meta['model']}",
        "",
        f"- date: {meta['date']}",
        f"- hardware: {meta['hardware']}",
        f"- command: `{meta['command']}`",
        f"- {meta['versions']}",
        f"- evaluation: the same {meta['eval_tokens']} tokens at every context, in windows of that many tokens, "
        f"from {meta['eval_corpus']}; sink {meta['sink']}, recent {meta['recent']}",
        f"- calibration: {meta['calibration']}",
        "",
        "ΔPPL is against the bf16 cache at the same context; KL is the mean KL(BF16 ‖ method) per predicted",
        "token (nats); top-1 is agreement with the BF16 cache's argmax.",
        "",
        "",
    ]
    (out_dir / "curve.md").write_text("\n".join(header) + curve_markdown(curves) + "\n")
    plot_curve(curves, meta, out_dir / "curve.png")
    return out_dir


def plot_curve(curves: dict[int, dict[str, dict]], meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted(curves)
    methods = [m for m in curves[contexts[0]] if m != REFERENCE]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    for ax, (key, title, _) in zip(axes, CURVE_METRICS):
        for m in methods:
            y = [curves[c][m][key] * (100 if key == "top1" else 1) for c in contexts]
            ax.plot(contexts, y, marker="o", label=m, lw=1.8 if m.startswith("oscar") else 1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [f"{c // 1024}K" if c % 1024 == 0 else str(c) for c in contexts])
        ax.set_xlabel("context (tokens)")
        ax.set_title({"delta_ppl_pct": "ΔPPL vs BF16 cache (%)", "kl": "mean KL per token (nats)",
                      "top1": "top-1 agreement (%)"}[key])
        if key != "top1":
            ax.set_yscale("symlog" if key == "delta_ppl_pct" else "log",
                          **({"linthresh": 1} if key == "delta_ppl_pct" else {}))
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{meta['model']}, the same {meta['eval_tokens']} tokens at each context; "
                 f"{meta['date']}, {meta['hardware']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------- CLI


def rotation_variants(
    loaded: LoadedModel, methods: list[Method], calib_ids: torch.Tensor, heldout_ids: torch.Tensor, seq_len: int,
    info: dict, key_mean_skip: int = OscarSettings.sink_size,
) -> dict[str, OscarRotations]:
    """Calibrate, from one capture, every rotation variant the methods need.

    Every variant gets clip ratios fitted on the held-out tokens, the data-free Hadamard
    one included, so that "fitted" rows compare rotations under the same clip fit; the OSCAR
    ones key means where a method reads them (their first ``key_mean_skip`` positions left out).
    """
    wanted = {m.rotation for m in methods} - {"none"}
    if not wanted:
        return {}
    softmax = "oscar-softmax" in wanted
    stats = capture_stats(loaded, calib_ids, seq_len, softmax, "calibration") if wanted - {"hadamard"} else None
    heldout = capture_stats(loaded, heldout_ids, seq_len, softmax, "held-out")
    variants: dict[str, OscarRotations] = {}
    if "hadamard" in wanted:
        k, v = hadamard_rotation_sets(list(range(loaded.shape.num_layers)), loaded.shape.head_dim)
        ck, cv, report = fit_clip_ratios(k, v, heldout)
        variants["hadamard"] = OscarRotations(k, v, ck, cv, calibration={"clip_fit": report})
    for name, per_head, weights in (
        ("oscar", False, "proxy"),
        ("oscar-perhead", True, "proxy"),
        ("oscar-softmax", False, "softmax"),
    ):
        if name in wanted:
            skip = key_mean_skip if any(m.key_mean and m.rotation == name for m in methods) else None
            variants[name] = rotations_from_stats(loaded, stats, heldout, per_head, weights, calibration_info=info,
                                                  key_mean_skip=skip)
    return variants


def run_meta(loaded: LoadedModel, args: argparse.Namespace, calibration: str, t0: float, eval_tokens: int,
             **contexts) -> dict:
    """What a report says of its run: the environment, the model, the tokens, ``contexts`` (``context=``
    or ``contexts=``), the windows, the dtype, the calibration and the seconds it took."""
    return {
        **environment(),
        "model": loaded.name,
        "eval_tokens": eval_tokens,
        "eval_corpus": corpus.EVALUATION_NAME,
        **contexts,
        "sink": args.sink,
        "recent": args.recent,
        "prefill_chunk": args.prefill_chunk,
        "dtype": args.dtype,
        "calibration": calibration,
        "seconds": round(time.time() - t0),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oscar-evaluate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--rotations", type=Path,
                        help="evaluate this rotation folder as 'oscar' instead of calibrating in the run "
                             "(default: calibrate in the run)")
    parser.add_argument("--methods", default=",".join(m.name for m in METHODS),
                        help=f"comma-separated subset of: {', '.join(METHODS_BY_NAME)} "
                             f"(default: all but {', '.join(m.name for m in EXTRA_METHODS)})")
    parser.add_argument("--context", type=int, default=2048,
                        help="tokens per evaluation window, and per calibration sequence (default: %(default)s)")
    parser.add_argument("--contexts",
                        help="comma-separated contexts, e.g. 1024,2048,4096,8192: score every method at each, on the "
                             "same tokens (whole windows of every context), and write curve.{md,json,png} instead of "
                             "fidelity.*; --context then sets only the calibration sequences (default: one context)")
    parser.add_argument("--eval-tokens", type=int, default=4096,
                        help="evaluation tokens, cut to whole windows (default: %(default)s)")
    parser.add_argument("--calib-tokens", type=int, default=8192,
                        help="calibration tokens for the rotations (default: %(default)s)")
    parser.add_argument("--heldout-tokens", type=int, default=2048,
                        help="clip-fit tokens, after the calibration ones (default: %(default)s)")
    parser.add_argument("--sink", type=int, default=64, help="first tokens kept in BF16 (default: %(default)s)")
    parser.add_argument("--recent", type=int, default=256, help="last tokens kept in BF16 (default: %(default)s)")
    parser.add_argument("--prefill-chunk", type=int, default=0,
                        help="score each window as a server prefilling it in chunks of this many tokens holds it "
                             "(own chunk BF16, the prefix's window as the chunk found it); 0: every token "
                             "as decode sees it (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default: %(default)s)")
    parser.add_argument("--dtype", choices=sorted(DTYPES),
                        help="model compute dtype (default: float64 on a CPU, where float32 results depend on the "
                             "CPU's instruction set; float32 on a GPU)")
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR,
                        help="where fidelity.{md,json,png} go (default: %(default)s, ignored by git)")
    parser.add_argument(DEBUG_FLAG, action="store_true", help=DEBUG_HELP)
    return parser


def parse_contexts(text: str) -> list[int]:
    """``"1024,2048"`` -> ``[1024, 2048]``, sorted; a named error for anything else."""
    try:
        contexts = sorted({int(c) for c in text.split(",")})
    except ValueError:
        raise OscarError("--contexts must be comma-separated token counts, e.g. 1024,2048,4096, "
                         f"got {text!r}") from None
    if contexts[0] < 2:
        raise OscarError(f"--contexts must be at least 2 tokens each, got {text!r}")
    return contexts


@cli
def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    unknown = [n for n in args.methods.split(",") if n not in METHODS_BY_NAME]
    if unknown:
        raise OscarError(f"unknown methods {unknown}; choose from {', '.join(METHODS_BY_NAME)}")
    methods = [METHODS_BY_NAME[n] for n in args.methods.split(",")]
    contexts = parse_contexts(args.contexts) if args.contexts else None
    if contexts is None and args.eval_tokens < args.context:
        raise OscarError(f"--eval-tokens {args.eval_tokens} is less than one window of --context {args.context}")
    if contexts is not None and curve_tokens(args.eval_tokens, contexts) == 0:
        raise OscarError(f"--eval-tokens {args.eval_tokens} makes no whole windows of every context of --contexts "
                         f"{args.contexts} (at least {math.lcm(*contexts)} are needed)")
    if args.rotations is not None and not args.rotations.is_dir():
        load_rotations(args.rotations)  # says why (missing, not a folder) before the model loads
    t0 = time.time()
    eval_text = corpus.evaluation_text()  # before the model loads, so a missing corpus fails at once
    args.dtype = args.dtype or ("float64" if args.device == "cpu" else "float32")
    loaded = load_model(args.model_path, args.gguf_file, args.device, DTYPES[args.dtype])
    eval_ids = corpus.tokenize(loaded.tokenizer, eval_text)
    if eval_ids.numel() < args.eval_tokens:
        raise OscarError(f"the evaluation text has {eval_ids.numel()} tokens, "
                         f"fewer than --eval-tokens {args.eval_tokens}")
    eval_ids = eval_ids[: args.eval_tokens]

    if args.rotations:
        rot = load_rotations(args.rotations, loaded.shape)
        k, v = hadamard_rotation_sets(list(range(loaded.shape.num_layers)), loaded.shape.head_dim)
        rotations = {"oscar": rot, "hadamard": OscarRotations(k, v)}
        usable = [
            m for m in methods
            if m.rotation in ("none", "hadamard", "oscar")
            and (m.clip != "fitted" or rotations[m.rotation].clip_ratios_k)
            and (not m.key_mean or rot.key_means is not None)
        ]
        skipped = [m.name for m in methods if m not in usable]
        if skipped:
            logger.info("skipping %s: they need a calibration in this run (drop --rotations) or rotations with "
                        "what they read (fitted clip ratios, key means: oscar-calibrate writes both)",
                        ", ".join(skipped))
        methods = usable
        calibration = f"rotations from {args.rotations}"
    else:
        calib_ids = corpus.tokenize(loaded.tokenizer, corpus.calibration_text())
        need = args.calib_tokens + args.heldout_tokens
        if calib_ids.numel() < need:
            raise OscarError(f"the calibration text has {calib_ids.numel()} tokens, fewer than {need}")
        info = {"corpus": corpus.CALIBRATION_NAME, "seq_len": args.context}
        rotations = rotation_variants(
            loaded, methods, calib_ids[: args.calib_tokens], calib_ids[args.calib_tokens : need], args.context, info,
            key_mean_skip=args.sink,
        )
        calibration = (
            f"{args.calib_tokens} tokens for the rotations, {args.heldout_tokens} more for the clip fit, "
            f"from {corpus.CALIBRATION_NAME}"
        )
    if contexts is not None:
        curves = evaluate_contexts(loaded, eval_ids, contexts, methods, rotations, args.sink, args.recent,
                                   args.prefill_chunk)
        meta = run_meta(loaded, args, calibration, t0, curve_tokens(args.eval_tokens, contexts), contexts=contexts)
        out = write_curve_report(curves, meta, args.output_dir)
        print(curve_markdown(curves))
        logger.info("wrote %s/curve.{md,json,png} in %.0f s", out, time.time() - t0)
        return
    results = evaluate(loaded, eval_ids, args.context, methods, rotations, args.sink, args.recent,
                       args.prefill_chunk)
    meta = run_meta(loaded, args, calibration, t0, args.eval_tokens // args.context * args.context,
                    context=args.context)
    out = write_report(results, meta, args.output_dir)
    print(markdown_table(results))
    logger.info("wrote %s/fidelity.{md,json,png} in %.0f s", out, time.time() - t0)


if __name__ == "__main__":
    main()
