"""A/B throughput of vLLM engines side by side: OSCAR against vLLM's own KV caches, each
configuration in its own process, every prompt distinct (a shared prompt would be served
from the prefix cache and L2 and flatter everyone).

    python benchmarks/ab_throughput.py --out results/ab                     # Qwen3-8B shape, dummy weights
    python benchmarks/ab_throughput.py --configs OSCAR FLASH_ATTN fp8 int4 --budget-s 130 --dry-run
    python benchmarks/ab_throughput.py --model /path/to/model --configs OSCAR FLASH_ATTN fp8
    python benchmarks/ab_throughput.py --gpus 2 --scenarios none --max-num-seqs-sweep 32 256
    python benchmarks/ab_throughput.py --report results/ab                  # tables and plots again
    python benchmarks/ab_throughput.py --report results/ab1 results/ab2     # two runs in one table

Configurations (``--configs``): ``OSCAR`` (``attention_backend="OSCAR"``), ``FLASH_ATTN`` (BF16,
vLLM's default), ``fp8`` (``kv_cache_dtype="fp8"``), ``int4`` (``int4_per_token_head``),
``turboquant`` (``turboquant_4bit_nc``; needs vLLM's FlashAttention 2 build, so only when named).
A configuration that fails to start is reported with its error, not dropped; one that fails or
times out later keeps the scenarios it finished. ``--gpus N`` runs up to N configurations at
once, one GPU each (``CUDA_VISIBLE_DEVICES``); each worker logs to ``OUT/log_<config>.txt``.

Scenarios (``--scenarios``; presets ``issue18`` (all, the default), ``fits`` (the first six),
``memory-bound`` (the last three), ``none`` for the sweep alone; run in this order; sizes are options):
  prefill   N distinct prompts of L tokens, one output token: prefill tokens/s
  decode    the same prompts again (prefix-cached) for K output tokens: decode tokens/s and
            time per output token, the one-token rerun subtracted
  long      one prompt of --long-prompt tokens: prefill tokens/s of a single long request
  latency   one request at a time, a distinct prompt per context (1K, 8K, 32K, 128K), a few
            hundred output tokens: time per output token of the decode phase alone (from the
            request's own first- and last-token times, so no prefill in it). The context as
            long as --long-prompt reuses the long scenario's prompt, prefix-cached: its prefill
            is not paid twice
  short     S fresh requests of 1K prompt / 1K output (memory not binding): output tokens/s
  fresh     N fresh requests of L tokens, prefill and 256 output tokens: output tokens/s and seconds
  reasoning 256 fresh requests of 1K in, 4K out (long outputs, many users): output tokens/s
  overflow  128 fresh requests of 8K in, 8K out, more than BF16's and fp8's KV caches hold:
            they queue and preempt, OSCAR's holds them all. Output tokens/s, the requests
            decoding at once (output tokens per engine step) and vLLM's preemption count
  capacity  C requests of ~100K tokens in two passes. The first (one output token) is their
            prefill, which dominates a single pass in every configuration; it leaves the contexts
            in the prefix cache only as far as the KV cache holds them. The second sends the
            same prompts for --capacity-output-len tokens, a multi-turn follow-up on long
            documents: a cache that holds all C contexts decodes them at once, BF16 must
            re-prefill the ones it evicted (with LRU eviction and the same order, all of them)
            and runs them a few at a time. Reported: the second pass's seconds and output
            tokens/s, and the first pass's seconds.
KV capacity (tokens) is read from every engine. ``--engine-args '{"max_num_seqs": 32}'`` sets
vLLM engine arguments for all configurations (default: vLLM's own defaults, with the engine's
statistics on as ``vllm serve`` has them: per-request times and the preemption counter).
``--max-num-seqs-sweep 32 256`` also starts every configuration once per value with that
``max_num_seqs`` (and ``enforce_eager=True``, to start fast), reads its KV capacity and stops:
the table "KV cache capacity by max_num_seqs".

Time budget: ``--budget-s S`` scales every scenario down by one factor (requests and output
tokens, and overflow's and capacity's lengths; the contexts the rows name stay) until the run's
estimated wall-clock, engine starts included, is at most S seconds per configuration of the
longest queue of a GPU (with one GPU: S x the configurations; they share the time, as their engine
starts and speeds differ). No scenario goes below the size where its
comparison stops meaning anything (the floors in ``scaled_sizes``): ``overflow`` keeps needing
more KV than ``--overflow-factor`` times the largest cache of ``--overflow-configs`` (BF16's and
fp8's) and less than OSCAR's holds; ``capacity`` more than that factor times BF16's. Those bounds
come from the FLASH_ATTN engine's own KV capacity: it runs first and sizes the run
(``OUT/plan.json``); the others run what it wrote (a worker beside it on another GPU waits for
that). ``--dry-run`` prints the plan (sizes, estimated seconds per configuration and scenario)
without starting anything; ``--plan OUT/plan.json`` runs an earlier plan's sizes again (a run
split over two invocations, merged by ``--report DIR DIR``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

CONFIGS = {
    "OSCAR": {"attention_backend": "OSCAR"},
    "FLASH_ATTN": {"attention_backend": "FLASH_ATTN"},
    "fp8": {"kv_cache_dtype": "fp8"},
    "int4": {"kv_cache_dtype": "int4_per_token_head"},
    "turboquant": {"kv_cache_dtype": "turboquant_4bit_nc"},
}
# The order they run in: the prefix-cached ones first (decode reruns prefill's prompts, latency's
# longest context is long's prompt), the memory-bound ones last (they evict everything).
SCENARIOS = ["prefill", "decode", "long", "latency", "short", "fresh", "reasoning", "overflow", "capacity"]
PRESETS = {"issue18": SCENARIOS, "fits": SCENARIOS[:6], "memory-bound": SCENARIOS[6:]}
BASELINE = "FLASH_ATTN"
# The Qwen3-8B architecture (its config.json), for runs with dummy weights.
QWEN3_8B_CONFIG = Path(__file__).parent / "configs" / "qwen3-8b.json"


HADAMARD_KEY_MEANS = "hadamard-key-means"  # --rotations: Hadamard rotations and seeded key means


def hadamard_key_mean_rotations(cfg: dict, folder: Path) -> Path:
    """A rotation folder for timing ``key_mean`` on a model without calibration (dummy weights):
    the Hadamard rotations and, for every layer, fixed-seed N(0, 1) means ``[Hkv, d]``. What a
    kernel does per key does not depend on the numbers, only on there being a mean to read."""
    import torch

    from oscar_vllm.core.rotation_io import ModelShape, OscarRotations, hadamard_rotation_sets, save_rotations

    shape = ModelShape.from_hf_config(cfg)
    gen = torch.Generator().manual_seed(0)
    means = {i: torch.randn(shape.num_kv_heads, shape.head_dim, generator=gen) for i in range(shape.num_layers)}
    key, value = hadamard_rotation_sets(list(range(shape.num_layers)), shape.head_dim)
    return save_rotations(OscarRotations(key, value, model="synthetic key means for timing", key_means=means), folder)


def oscar_key_mean(environ) -> str:
    """The ``key_mean`` setting an OSCAR engine started with ``environ`` serves with."""
    from oscar_vllm.core.settings import OscarSettings

    return OscarSettings.from_sources({}, environ).key_mean


def oscar_environment(environ=os.environ) -> dict[str, str]:
    """The OSCAR settings this run's environment sets (``OSCAR_HIT_RING`` and the like), which
    every OSCAR engine it starts reads: a report names them, as it names the engine arguments."""
    from dataclasses import fields

    from oscar_vllm.core.settings import OscarSettings

    names = (OscarSettings.env_name(f.name) for f in fields(OscarSettings))
    return {n: environ[n] for n in names if environ.get(n)}


def _version(pkg: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return "not installed"


def dummy_long_context(cfg: dict, max_model_len: int) -> dict:
    """Engine arguments for dummy weights past the config's ``max_position_embeddings``: such
    positions are fine, but the rotary table is sized by it, and past it RoPE indexes out of
    bounds (a device-side assert)."""
    if max_model_len > int(cfg.get("max_position_embeddings", 1 << 30)):
        return {"hf_overrides": {"max_position_embeddings": max_model_len}}
    return {}


def distinct_prompts(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    """``n`` prompts of ``length`` random token ids, different from the first token on. Two calls
    with the same seed share a prefix: every scenario has its own seed."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(length)]} for _ in range(n)]


SEEDS = {"prefill": 1, "long": 2, "short": 3, "capacity": 4, "fresh": 6, "reasoning": 7, "overflow": 8}
LATENCY_SEED = 100  # + the context's index


def stub(name: str, seqs: int | None) -> dict:
    """What identifies a result file (``report`` reads the configuration from it, not the file name)."""
    return {"config": name, **({"sweep_max_num_seqs": seqs} if seqs else {})}


def tok(n: int) -> str:
    """A token count as a label shows it: 16K for 16384, 100,000 otherwise."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else f"{n:,}"


# --- what each scenario sends, and the time budget -------------------------------------------

def full_sizes(args) -> dict:
    """Every scenario's sizes as the options give them (``--budget-s`` scales them down)."""
    return {
        "prefill": {"requests": args.num_prompts, "prompt_len": args.prompt_len},
        "decode": {"requests": args.num_prompts, "context": args.prompt_len, "output_len": args.output_len},
        "long": {"prompt_len": args.long_prompt},
        "latency": {"contexts": sorted(args.latency_contexts), "output_len": args.latency_output_len},
        "short": {"requests": args.short_requests, "prompt_len": 1024, "output_len": args.short_output_len},
        "fresh": {"requests": args.fresh_requests, "prompt_len": args.fresh_len, "output_len": args.fresh_output_len},
        "reasoning": {"requests": args.reasoning_requests, "prompt_len": args.reasoning_prompt_len,
                      "output_len": args.reasoning_output_len},
        "overflow": {"requests": args.overflow_requests, "prompt_len": args.overflow_prompt_len,
                     "output_len": args.overflow_output_len},
        "capacity": {"requests": args.capacity_requests, "prompt_len": args.capacity_len,
                     "output_len": args.capacity_output_len},
    }


def kv_need(sizes: dict) -> int:
    """KV tokens the requests of a scenario hold when all run at once."""
    return sizes["requests"] * (sizes["prompt_len"] + sizes.get("output_len", 0))


def max_model_len(full: dict, scenarios: list[str]) -> int:
    """The longest request ``scenarios`` send at their full sizes, plus a margin: the same for every
    configuration and every budget (a sweep run alone sizes it for every scenario)."""
    longest = {"prefill": lambda s: s["prompt_len"], "decode": lambda s: s["context"] + s["output_len"],
               "long": lambda s: s["prompt_len"] + 1, "latency": lambda s: max(s["contexts"]) + s["output_len"]}
    return 64 + max([2048 + 1024] + [longest.get(n, lambda s: s["prompt_len"] + s["output_len"])(full[n])
                                     for n in (scenarios or SCENARIOS)])


@dataclass
class Caps:
    """What bounds a plan: the KV caches (tokens, BF16's and each configuration's relative to it),
    OSCAR's BF16 windows per running request (tokens of its pool) and vLLM's max_num_seqs."""
    bf16: int
    kv_vs_bf16: dict
    window: int
    max_num_seqs: int

    def tokens(self, config: str) -> int:
        return int(self.bf16 * self.kv_vs_bf16[config])

    def per_request(self, config: str) -> int:
        return self.window if config == "OSCAR" else 0


def kv_vs_bf16(cfg: dict) -> dict:
    """KV tokens each configuration holds in the memory of one BF16 token (bytes per token and
    KV head: BF16 2 x 2d, fp8 2d, int4 d plus two fp32 scales, OSCAR its INT2 slot; turboquant
    4-bit as vLLM's preset table gives it)."""
    from csrc_triton.paged_layout import int2_slot_bytes

    d = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    bf16 = 2 * 2 * d
    return {"OSCAR": bf16 / int2_slot_bytes(d), "FLASH_ATTN": 1.0, "fp8": 2.0, "int4": bf16 / (d + 8),
            "turboquant": 3.8}


def oscar_window_tokens(cfg: dict) -> int:
    """Tokens of the KV pool one running request's BF16 windows take (OSCAR's default sink and
    recent window; the engine logs and reports the exact figure)."""
    from csrc_triton.paged_layout import BLOCK_SIZE, window_pages_per_request
    from oscar_vllm.core.settings import OscarSettings

    s = OscarSettings()
    d = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    pages, _ = window_pages_per_request(s.sink_size, s.recent_size, int(cfg["num_key_value_heads"]), d)
    return pages * BLOCK_SIZE


def estimate_bf16_kv_tokens(cfg: dict, gpu_mem_gib: float, utilization: float) -> int:
    """BF16 KV tokens vLLM would give: ``utilization`` of the GPU's memory less the weights
    (Llama/Qwen-style layers) and the profile's activation peak, over the bytes of one token's
    keys and values. Within 1% of the engine on the H200 for the Qwen3-8B shape; only the dry run
    and a run without FLASH_ATTN use it."""
    h, inter, layers = int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg["num_hidden_layers"])
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    d = int(cfg.get("head_dim") or h // heads)
    per_layer = 2 * h * heads * d + 2 * h * kv_heads * d + 3 * h * inter
    params = layers * per_layer + int(cfg["vocab_size"]) * h * (1 if cfg.get("tie_word_embeddings") else 2)
    free = (gpu_mem_gib * utilization - ACTIVATION_GIB) * 2**30 - 2 * params
    return int(free // (layers * kv_heads * d * 2 * 2))


# The engine's log of 2026-12-01 (results/windows/engine_*.log, one H200, Qwen3-8B shape): 139.8 GiB,
# vLLM 0.26's gpu_memory_utilization 0.92, weights 15.27 GiB, KV 111.53 GiB: 1.83 GiB besides.
H200_GIB = 139.8
ACTIVATION_GIB = 1.8


def first_visible_gpu(cuda_visible_devices: str | None) -> int | str | None:
    """The engine's device as NVML names it: CUDA_VISIBLE_DEVICES' first entry, an index or a
    ``GPU-``/``MIG-`` UUID; GPU 0 when the variable is unset or empty; None when its first entry is
    neither (``-1``, the usual way to hide every GPU: CUDA then sees none). NVML numbers GPUs in
    PCI order, CUDA by default fastest first; on a machine of one GPU model their memory is the same."""
    first = (cuda_visible_devices or "").split(",")[0].strip()
    if not first:
        return 0
    if first.isdigit():
        return int(first)
    if first.startswith(("GPU-", "MIG-")):
        return first
    return None


def gpu_memory_gib() -> float | None:
    """The first visible GPU's memory (NVML, as the engine's device; the parent creates no CUDA
    context), or None where NVML finds none (a dry run on a machine without a GPU)."""
    import pynvml

    device = first_visible_gpu(os.environ.get("CUDA_VISIBLE_DEVICES"))
    if device is None:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        handle = (pynvml.nvmlDeviceGetHandleByIndex(device) if isinstance(device, int)
                  else pynvml.nvmlDeviceGetHandleByUUID(device))
        return pynvml.nvmlDeviceGetMemoryInfo(handle).total / 2**30
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


# A cost model for the plan, fitted to the H200 runs of 2026-12-01 (results/ab, results/windows/ab;
# Qwen3-8B shape): prefill of 32 x 16K at 33K tok/s and of 1 x 128K at 11.9K tok/s give
# 1/44.5K s per token plus 4.7e-10 s per token squared (attention); a decode step costs the
# larger of a fixed time (weights, launches) and the batch's tokens at the prefill rate
# (GEMMs compute-bound), plus a time per context token of the batch (the KV read): FLASH_ATTN
# 5.3 ms at batch 1 and 22.5 ms at 32 x 16K, OSCAR 7.0 and 18.6 ms. fp8 reads half BF16's bytes
# (1.25x at 32 x 16K in issue 18); int4 and turboquant not yet measured: BF16's and slower.
PREFILL_S_PER_TOKEN = 1 / 44_500
PREFILL_S_PER_TOKEN2 = 4.7e-10
STEP_S = {"OSCAR": (6.7e-3, 2.27e-8), "FLASH_ATTN": (5.0e-3, 3.34e-8), "fp8": (5.0e-3, 2.5e-8),
          "int4": (5.5e-3, 3.34e-8), "turboquant": (7.5e-3, 5.0e-8)}  # (fixed, per context token)
# Engine start (torch.compile cold: each configuration compiles into its own cache), about the
# median of the H200 runs of 2026-12-02 to 04 (`startup_s` in results/ab*/**/run_*.json):
# FLASH_ATTN 56-90 s, fp8 75-108, OSCAR 77-123 (its kernels' serving variants compiled in 4
# threads, Triton's cache cold), int4 72 (one run). int4 and turboquant compile their Triton
# kernels in their first calls (the first warm-ups).
STARTUP_S = {"OSCAR": 100, "FLASH_ATTN": 85, "fp8": 85, "int4": 80, "turboquant": 80}
# A worker's imports before the engine, its first call and the engine's shutdown: worker_s less
# startup_s and the scenarios' walls, 20-34 s (median 25) in the H200 runs of 2026-12-02 to 04.
PROCESS_S = 26
SWEEP_RUN_S = 30  # one eager start reading the KV capacity (7-22 s in results/ab_capacity)
SCENARIO_WARM_UP_S = 2  # each scenario's small untimed run first
PARENT_S = 15  # the run's own set-up (versions, hardware) and report


def prefill_s(length: int, cached: int = 0) -> float:
    return (length - cached) * PREFILL_S_PER_TOKEN + PREFILL_S_PER_TOKEN2 * (length**2 - cached**2)


def step_s(config: str, batch: int, context_tokens: float) -> float:
    fixed, per_token = STEP_S[config]
    return max(fixed, batch * PREFILL_S_PER_TOKEN) + per_token * context_tokens


def batch_s(config: str, caps: Caps, n: int, prompt: int, out: int, cached: int = 0) -> float:
    """``n`` requests of ``prompt`` + ``out`` tokens, at most as many at once as the KV cache and
    max_num_seqs allow (vLLM queues or preempts the rest: modelled as waves)."""
    at_once = max(1, min(n, caps.max_num_seqs, caps.tokens(config) // (prompt + out + caps.per_request(config))))
    total, left = n * prefill_s(prompt, cached), n
    while left > 0:
        m = min(at_once, left)
        total += out * step_s(config, m, m * (prompt + out / 2))
        left -= m
    return total


def scenario_s(name: str, config: str, sizes: dict, caps: Caps) -> float:
    """Estimated seconds of one scenario's timed calls in one configuration."""
    z = sizes[name]
    if name == "prefill":
        return z["requests"] * prefill_s(z["prompt_len"])
    if name == "decode":
        first = z["requests"] * prefill_s(z["context"]) if decode_prefills_itself(sizes) else 0
        return first + batch_s(config, caps, z["requests"], z["context"], z["output_len"], cached=z["context"])
    if name == "long":
        return prefill_s(z["prompt_len"])
    if name == "latency":
        reused = sizes["long"]["prompt_len"] if "long" in sizes else None
        return sum((0 if ctx == reused else prefill_s(ctx)) + z["output_len"] * step_s(config, 1, ctx)
                   for ctx in z["contexts"])
    if name == "capacity":
        first = z["requests"] * prefill_s(z["prompt_len"])
        held = z["requests"] * (z["prompt_len"] + caps.per_request(config)) <= caps.tokens(config)
        return first + batch_s(config, caps, z["requests"], z["prompt_len"], z["output_len"],
                               cached=z["prompt_len"] if held else 0)
    return batch_s(config, caps, z["requests"], z["prompt_len"], z["output_len"])


def startup_s(config: str) -> float:
    return STARTUP_S[config] + PROCESS_S


def scaled_sizes(full: dict, f: float, caps: Caps, overflow_configs: list[str], factor: float) -> tuple[dict, list]:
    """``full`` scaled by ``f`` (request counts and output lengths, and overflow's and capacity's
    prompts; the contexts a row names stay), each size kept at or above its floor, lengths in
    whole blocks of 64, and the notes of any bound the defaults themselves miss.
    Floors: 8 requests of 16K (prefill, decode, fresh), 64 output tokens, 32 x (1K, 256) short,
    64 x (1K, 1K) reasoning, 1K in and 1K out for overflow. ``overflow`` holds at least
    ``factor`` x the largest KV cache of ``overflow_configs`` (shorter requests, more of them)
    and no more than 90% of OSCAR's with its windows, within max_num_seqs; ``capacity`` more than
    ``factor`` x BF16's (shorter documents, as many)."""
    def sc(v: int, floor: int, g: float = f, step: int = 1) -> int:
        """``v`` scaled by ``g``, in multiples of ``step``, not below ``floor`` (nor above ``v``, as given)."""
        return v if g >= 1 else min(v, max(min(v, floor), step * round(v * g / step)))

    def sl(v: int, floor: int, g: float = f) -> int:  # a length: whole KV blocks of 64
        return sc(v, floor, g, 64)

    out, notes = {}, []
    for name, z in full.items():
        if name in ("prefill", "decode", "fresh"):
            s = {**z, "requests": sc(z["requests"], 8)}
            if "output_len" in z:
                s["output_len"] = sl(z["output_len"], 64)
        elif name == "latency":
            s = {**z, "output_len": sl(z["output_len"], 64)}
        elif name == "short":
            s = {**z, "requests": sc(z["requests"], 32), "output_len": sl(z["output_len"], 256)}
        elif name == "reasoning":
            s = {**z, "requests": sc(z["requests"], 64), "output_len": sl(z["output_len"], 1024)}
        elif name == "overflow":
            s = overflow_sizes(z, f, caps, overflow_configs, factor, sl, notes)
        elif name == "capacity":
            need = min(kv_need({**z, "output_len": 0}), math.ceil(factor * caps.tokens(BASELINE)))
            s = {**z, "prompt_len": max(sl(z["prompt_len"], 1024), 64 * math.ceil(need / z["requests"] / 64)),
                 "output_len": sl(z["output_len"], 64)}
            if z["requests"] * z["prompt_len"] <= caps.tokens(BASELINE):
                notes.append(f"capacity: {z['requests']} x {tok(z['prompt_len'])} fits BF16's KV cache "
                             f"({caps.tokens(BASELINE):,} tokens): nothing to evict")
        else:
            s = dict(z)
        out[name] = s
    return out, notes


def overflow_sizes(z: dict, f: float, caps: Caps, overflow_configs: list[str], factor: float, sl, notes: list) -> dict:
    """``overflow`` at scale ``f`` (see ``scaled_sizes``; ``sl`` scales a length)."""
    largest = max([caps.tokens(c) for c in overflow_configs] or [caps.tokens(BASELINE)])
    need = min(kv_need(z), math.ceil(factor * largest))
    holds = 0.9 * caps.tokens("OSCAR")
    g = f
    while True:  # lengths scaled by g (from f up to 1) until the requests that need makes fit
        p, o = sl(z["prompt_len"], 1024, g), sl(z["output_len"], 1024, g)
        n = max(round(z["requests"] * g), math.ceil(need / (p + o)))
        if g >= 1 or (n <= caps.max_num_seqs and n * (p + o + caps.window) <= holds):
            break
        g = min(1.0, g * 1.05)
    if g >= 1:
        p, o, n = z["prompt_len"], z["output_len"], z["requests"]
    if kv_need(z) <= largest:
        notes.append(f"overflow: {n} x ({tok(p)} + {tok(o)}) = {kv_need(z):,} KV tokens fit the largest cache of "
                     f"{', '.join(overflow_configs)} ({largest:,}): they do not run out")
    if n * (p + o + caps.window) > holds:
        notes.append(f"overflow: {n} x ({tok(p)} + {tok(o)}) with OSCAR's windows needs more than 90% of OSCAR's "
                     f"KV cache ({caps.tokens('OSCAR'):,} tokens)")
    return {"requests": n, "prompt_len": p, "output_len": o}


def wall_s(totals: list[float], gpus: int) -> float:
    """Wall-clock of jobs taking ``totals`` seconds run in that order on ``gpus`` GPUs, each on the first free one."""
    free = [0.0] * max(1, gpus)
    for t in totals:
        free[free.index(min(free))] += t
    return max(free)


def within_budget(est: dict, budget: float, gpus: int) -> bool:
    """Whether the run's estimated wall-clock is at most ``budget`` per configuration in the
    longest queue of a GPU: the configurations of one GPU share their time (their engine starts
    and speeds differ)."""
    return wall_s([e["total"] for e in est.values()], gpus) <= budget * math.ceil(len(est) / max(1, gpus))


def make_plan(inputs: dict, bf16_kv_tokens: int, source: str, max_num_seqs: int, fixed: dict | None = None) -> dict:
    """Sizes for every scenario and the estimated seconds of each configuration: ``inputs``'
    full sizes, or with a budget the largest scale factor (steps of 3%) at which the estimate
    fits it (``within_budget``; the smallest sizes, marked as over budget, where none does); or
    ``fixed`` sizes (an earlier plan's). A pure function of its arguments: the parent plans with
    an estimated BF16 KV capacity, the FLASH_ATTN worker again with its engine's."""
    caps = Caps(bf16_kv_tokens, inputs["kv_vs_bf16"], inputs["window_tokens"], max_num_seqs)
    configs, budget, gpus = inputs["configs"], inputs.get("budget_s"), inputs.get("gpus", 1)
    scenarios = [s for s in SCENARIOS if s in inputs["scenarios"]]

    def plan_at(f: float) -> tuple[dict, dict, list]:
        if fixed:
            sizes, notes = fixed, []
        else:
            sizes, notes = scaled_sizes(inputs["full"], f, caps, inputs["overflow_configs"], inputs["overflow_factor"])
            sizes = {n: sizes[n] for n in scenarios}
        est = {}
        for c in configs:
            est[c] = {n: round(scenario_s(n, c, sizes, caps) + SCENARIO_WARM_UP_S, 1) for n in scenarios}
            est[c]["start"] = startup_s(c)
            est[c]["total"] = round(sum(est[c].values()), 1)
        return sizes, est, notes

    scale, (sizes, est, notes) = 1.0, plan_at(1.0)
    if budget and not fixed:
        for k in range(1, 160):
            if within_budget(est, budget, gpus):
                break
            smaller = plan_at(0.97**k)
            if smaller[0] != sizes:  # the factor named is the largest that gives these sizes
                scale, (sizes, est, notes) = 0.97**k, smaller
    return {"inputs": inputs, "bf16_kv_tokens": bf16_kv_tokens, "bf16_kv_source": source,
            "max_num_seqs": max_num_seqs, "scale": round(scale, 3), "fixed": bool(fixed),
            "fits": not budget or within_budget(est, budget, gpus), "sizes": sizes, "estimate_s": est,
            "wall_s": round(wall_s([e["total"] for e in est.values()], gpus) + PARENT_S),
            "notes": notes, "max_model_len": max_model_len(inputs["full"], scenarios)}


def sizes_text(name: str, z: dict) -> str:
    if name == "latency":
        return f"1 x ({', '.join(tok(c) for c in z['contexts'])}) context, {z['output_len']} out each"
    if name == "long":
        return f"1 x {tok(z['prompt_len'])}"
    if name == "prefill":
        return f"{z['requests']} x {tok(z['prompt_len'])}, 1 out"
    if name == "decode":
        return f"{z['requests']} x {tok(z['context'])} cached, {z['output_len']} out"
    need = f", {kv_need(z) / 1e6:.2f}M KV tokens" if name in ("reasoning", "overflow", "capacity") else ""
    return f"{z['requests']} x ({tok(z['prompt_len'])} in, {tok(z['output_len'])} out){need}"


def plan_text(plan: dict) -> str:
    """The plan as the dry run prints it."""
    inp, est = plan["inputs"], plan["estimate_s"]
    configs = list(est)
    scenarios = [s for s in SCENARIOS if s in plan["sizes"]]
    lines = [f"BF16 KV cache: {plan['bf16_kv_tokens']:,} tokens ({plan['bf16_kv_source']}); max_num_seqs "
             f"{plan['max_num_seqs']}; KV tokens: " + ", ".join(
                 f"{c} {int(plan['bf16_kv_tokens'] * inp['kv_vs_bf16'][c]):,}" for c in configs)]
    if plan["fixed"]:
        lines.append(f"sizes: fixed by {inp.get('plan_from', 'an earlier plan')}")
    elif inp.get("budget_s"):
        lines.append(f"budget: {inp['budget_s']:g} s per configuration -> sizes x{plan['scale']} of the defaults "
                     f"(floors kept); " + ("fits" if plan["fits"] else "DOES NOT FIT even at the floors"))
    else:
        lines.append("sizes: as the options give them (no --budget-s)")
    w = max(len(sizes_text(s, plan["sizes"][s])) for s in scenarios) if scenarios else 10
    head = f"{'':10} {'sizes':{w}} " + " ".join(f"{c:>10}" for c in configs)

    def seconds(key: str) -> str:
        return " ".join(f"{est[c][key]:>10.0f}" for c in configs)

    lines += ["", "estimated seconds (a cost model fitted to earlier H200 runs; the run records the real ones):",
              head]
    for s in scenarios:
        lines.append(f"{s:10} {sizes_text(s, plan['sizes'][s]):{w}} " + seconds(s))
    lines.append(f"{'start':10} {'engine start, imports, shutdown':{w}} " + seconds("start"))
    lines.append(f"{'total':10} {'':{w}} " + seconds("total"))
    gpus = inp.get("gpus", 1)
    lines += ["", f"invocation: ~{plan['wall_s']} s ({plan['wall_s'] / 60:.1f} min) on {gpus} GPU{'s' * (gpus > 1)}, "
              f"in this order, {PARENT_S} s of it the run's own set-up and report"]
    lines += [f"note: {n}" for n in plan["notes"]]
    return "\n".join(lines)


def oscar_window_blocks(vllm_config) -> int:
    """KV cache blocks one running request's OSCAR windows take (as the engine's scheduler counts)."""
    from types import SimpleNamespace

    from oscar_vllm.core.settings import OscarSettings
    from oscar_vllm.serving.vllm_hooks import window_pages_of_group

    model = vllm_config.model_config
    spec = SimpleNamespace(block_size=vllm_config.cache_config.block_size, head_size=model.get_head_size(),
                           num_kv_heads=model.get_num_kv_heads(vllm_config.parallel_config))
    sink, recent, _ = window_pages_of_group(spec, OscarSettings.from_vllm_config(vllm_config))
    return sink + recent


def engine_counters(llm) -> dict | None:
    """vLLM's own counters (its Prometheus metrics, kept when the engine logs statistics): preempted
    requests, output tokens, engine steps that produced output, prompt tokens computed (not
    served from the prefix cache)."""
    if not llm.llm_engine.log_stats:
        return None
    counts = {"preemptions": 0, "output_tokens": 0, "steps": 0, "prompt_tokens_computed": 0}
    for m in llm.get_metrics():
        if m.name == "vllm:num_preemptions":
            counts["preemptions"] += m.value
        elif m.name == "vllm:generation_tokens":
            counts["output_tokens"] += m.value
        elif m.name == "vllm:iteration_tokens_total":  # one observation per step with output
            counts["steps"] += m.count
        elif m.name == "vllm:prompt_tokens_by_source" and m.labels.get("source") == "local_compute":
            counts["prompt_tokens_computed"] += m.value
    return counts


@dataclass
class Call:
    """One timed ``generate``: its seconds, output tokens, outputs and vLLM's counters over it."""
    seconds: float
    outputs: int
    results: list
    counters: dict | None

    def engine_stats(self) -> dict:
        """The requests decoding at once (output tokens per engine step), preemptions, prompt tokens computed."""
        c = self.counters
        if not c:
            return {}
        return {"mean_running": round(c["output_tokens"] / c["steps"], 1) if c["steps"] else None,
                "preemptions": c["preemptions"], "prompt_tokens_computed": c["prompt_tokens_computed"]}


def run_worker(args, result: dict, save) -> None:
    """One engine, every scenario (or, with ``--sweep-seqs``, its KV capacity alone), into
    ``result``; ``save(result)`` after each scenario, so that a later failure or timeout keeps it."""
    from vllm import LLM, SamplingParams

    plan_path = Path(args.plan)
    plan = json.loads(plan_path.read_text())
    cfg = json.loads((Path(args.model) / "config.json").read_text()) if Path(args.model).is_dir() else {}
    vocab = int(cfg.get("vocab_size", 32000))
    has_weights = Path(args.model).is_dir() and any(Path(args.model).glob("*.safetensors"))
    kw = dict(CONFIGS[args.worker])
    if args.worker == "OSCAR":
        kw["additional_config"] = {"oscar": {"rotation_path": args.rotations}}
    kw.update(json.loads(args.engine_args))
    kw.setdefault("jit_monitor_verbose", True)  # log every kernel compiled while serving, not each name once
    # Per-request times and vLLM's preemption counter, as `vllm serve` keeps them by default (LLM turns them off).
    kw.setdefault("disable_log_stats", False)
    kw.setdefault("max_model_len", plan["max_model_len"])
    if args.sweep_seqs:
        kw.update(max_num_seqs=args.sweep_seqs, enforce_eager=True)  # no CUDA graphs to capture: starts fast
    if not has_weights:
        kw.update(load_format="dummy")
        kw = {**dummy_long_context(cfg, kw["max_model_len"]), **kw}
    result.update(stub(args.worker, args.sweep_seqs))
    result["engine_args"] = {k: v for k, v in kw.items() if k != "additional_config"}
    t0 = time.perf_counter()
    llm = LLM(args.model, skip_tokenizer_init=True, seed=0, **kw)
    cache = llm.llm_engine.vllm_config.cache_config
    result["startup_s"] = round(time.perf_counter() - t0, 1)
    result["kv_cache_tokens"] = cache.num_gpu_blocks * cache.block_size
    result["max_num_seqs"] = llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
    # OSCAR's windows take blocks of the pool per running request: what is left with all running.
    window_blocks = oscar_window_blocks(llm.llm_engine.vllm_config) if args.worker == "OSCAR" else 0
    result["window_blocks_per_request"] = window_blocks
    result["kv_tokens_all_running"] = (cache.num_gpu_blocks - window_blocks * result["max_num_seqs"]) * cache.block_size
    if args.sweep_seqs:
        return
    if needs_bf16_capacity(plan) and args.worker == BASELINE:
        # The sizes that must overflow BF16's cache, from this engine's: the others run what this writes.
        plan = {**make_plan(plan["inputs"], result["kv_cache_tokens"], "read from the FLASH_ATTN engine",
                            result["max_num_seqs"]), "sized_by_engine": True}
        tmp = plan_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(plan, indent=1))
        tmp.replace(plan_path)
    elif needs_bf16_capacity(plan) and BASELINE in plan["inputs"]["configs"]:
        plan = sized_plan(plan_path, Path(args.result).with_name(f"run_{BASELINE}.json"))
    result["plan"] = {k: plan[k] for k in ("scale", "bf16_kv_tokens", "bf16_kv_source", "fixed")}
    sizes = plan["sizes"]
    spans = result["spans"] = {}  # scenario -> [[start, end]] wall-clock seconds of its timed calls

    def timed(prompts, max_tokens, scenario) -> Call:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
        before = engine_counters(llm)
        t, wall = time.perf_counter(), time.time()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        spans.setdefault(scenario, []).append([wall, time.time()])
        seconds, after = time.perf_counter() - t, engine_counters(llm)
        counters = {k: after[k] - before[k] for k in after} if before else None
        return Call(seconds, sum(len(o.outputs[0].token_ids) for o in outs), outs, counters)

    llm.generate(distinct_prompts(2, 512, vocab, 99), SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    wall = result["scenario_wall_s"] = {}  # each scenario with its warm-up, to compare with the plan's estimate
    for name in (s for s in SCENARIOS if s in sizes):
        if name == "decode" and not decode_prefills_itself(sizes):
            continue  # run with prefill, over its prompts
        result["running"] = name
        save(result)
        t = time.perf_counter()
        if not args.no_warmup:
            warm_up(llm, name, sizes, vocab)
        SCENARIO_RUNS[name](timed, sizes, vocab, result)
        wall[name] = round(time.perf_counter() - t, 1)
    result.pop("running", None)


def decode_prefills_itself(sizes: dict) -> bool:
    """Whether a plan's decode scenario prefills its prompts itself: the decode scenario runs in
    `_prefill_decode` after the prefill scenario's call, over its prompts, and a plan without a
    prefill scenario times that call as prefill all the same."""
    return "decode" in sizes and "prefill" not in sizes


def scenario_sizes(sizes: dict, scen: str) -> dict | None:
    """A scenario's sizes in a plan's ``sizes``; the prefill scenario's, where it has none of its
    own, are the decode scenario's prompts (one call prefills and times them, `_prefill_decode`)."""
    if scen == "prefill" and decode_prefills_itself(sizes):
        return {"requests": sizes["decode"]["requests"], "prompt_len": sizes["decode"]["context"]}
    return sizes.get(scen)


def _prefill_decode(timed, sizes, vocab, result) -> None:
    z = scenario_sizes(sizes, "prefill")
    n, length = z["requests"], z["prompt_len"]
    prompts = distinct_prompts(n, length, vocab, SEEDS["prefill"])
    call = timed(prompts, 1, "prefill")
    result["prefill"] = {"requests": n, "prompt_len": length, "seconds": round(call.seconds, 3),
                         "prefill_tok_s": round(n * length / call.seconds, 1)}
    if "decode" in sizes:
        k = sizes["decode"]["output_len"]
        # Prefix-cached: the hit's prefill (OSCAR computes its rings again unless hit_ring is reuse), one token.
        hit = timed(prompts, 1, "decode")
        sk = timed(prompts, k, "decode")
        step = decode_step_s(sk.results)
        result["decode"] = {"requests": n, "context": length, "output_len": k, "seconds": round(sk.seconds, 3),
                            "decode_tok_s": round(n / step, 1), "tpot_ms": round(1000 * step, 3),
                            "hit_s": round(hit.seconds, 3), "outputs": sk.outputs}


def decode_step_s(results) -> float:
    """Seconds a decode step takes, from each request's own token times (first to last token, so
    the prefill before the first is left out), averaged over requests that decode together.

    Until 2026-12-04 it was a call of k tokens less a call of one, each paying the prefix hit. In
    three H200 runs of OSCAR at 32 x 16K the one-token call took 1.41-1.56 s and the 128-token call
    2.80-2.83 s: the difference, and with it the decode figure, moved by 9% with the hit's time alone.
    """
    steps = []
    for r in results:
        n = len(r.outputs[0].token_ids)
        if r.metrics is None:
            raise RuntimeError("timing decode steps needs vLLM's per-request times: leave disable_log_stats off")
        if n > 1:
            steps.append((r.metrics.last_token_ts - r.metrics.first_token_ts) / (n - 1))
    if not steps:
        raise RuntimeError("timing decode steps needs at least two output tokens a request")
    return sum(steps) / len(steps)


def _long(timed, sizes, vocab, result) -> None:
    length = sizes["long"]["prompt_len"]
    s = timed(distinct_prompts(1, length, vocab, SEEDS["long"]), 1, "long").seconds
    result["long"] = {"prompt_len": length, "seconds": round(s, 3), "prefill_tok_s": round(length / s, 1)}


def _latency(timed, sizes, vocab, result) -> None:
    z, long_len = sizes["latency"], sizes.get("long", {}).get("prompt_len")
    k, rows = z["output_len"], []
    for i, ctx in enumerate(z["contexts"]):
        # The context as long as long's prompt is that prompt, prefix-cached (its prefill is long's number).
        prompt = distinct_prompts(1, ctx, vocab, SEEDS["long"] if ctx == long_len else LATENCY_SEED + i)
        call = timed(prompt, k, "latency")
        step, m = decode_step_s(call.results), call.results[0].metrics
        rows.append({"context": ctx, "tpot_ms": round(1000 * step, 3),
                     "first_token_s": round(m.first_token_ts - m.scheduled_ts, 3),
                     "cached_tokens": call.results[0].num_cached_tokens,
                     "outputs": len(call.results[0].outputs[0].token_ids)})
    result["latency"] = {"requests": 1, "output_len": k, "contexts": z["contexts"], "per_context": rows}


def _fresh_batch(name: str):
    """short, fresh, reasoning, overflow: fresh distinct prompts, all sent at once."""
    def run(timed, sizes, vocab, result) -> None:
        z = sizes[name]
        call = timed(distinct_prompts(z["requests"], z["prompt_len"], vocab, SEEDS[name]), z["output_len"], name)
        result[name] = {**z, "seconds": round(call.seconds, 3), "output_tok_s": round(call.outputs / call.seconds, 1),
                        "outputs": call.outputs, **call.engine_stats()}
    return run


def _capacity(timed, sizes, vocab, result) -> None:
    z = sizes["capacity"]
    c, k = z["requests"], z["output_len"]
    prompts = distinct_prompts(c, z["prompt_len"], vocab, SEEDS["capacity"])
    first = timed(prompts, 1, "capacity")  # the prefill; what of it the KV cache holds stays prefix-cached
    follow = timed(prompts, k, "capacity")  # the follow-up (see the module docstring)
    result["capacity"] = {**z, "first_pass_s": round(first.seconds, 3), "seconds": round(follow.seconds, 3),
                          "output_tok_s": round(c * k / follow.seconds, 1), "outputs": follow.outputs,
                          **follow.engine_stats()}


SCENARIO_RUNS = {"prefill": _prefill_decode, "decode": _prefill_decode, "long": _long, "latency": _latency,
                 "short": _fresh_batch("short"), "fresh": _fresh_batch("fresh"),
                 "reasoning": _fresh_batch("reasoning"), "overflow": _fresh_batch("overflow"), "capacity": _capacity}


def needs_bf16_capacity(plan: dict) -> bool:
    """Whether the plan's sizes hang on BF16's KV capacity, which only the engine knows exactly."""
    return (not plan["fixed"] and not plan.get("sized_by_engine") and bool(plan["inputs"].get("budget_s"))
            and bool({"overflow", "capacity"} & set(plan["sizes"])))


def sized_plan(plan_path: Path, baseline_result: Path, poll_s: float = 1.0, wait_s: float = 1800) -> dict:
    """The plan once the FLASH_ATTN worker has sized it (it runs first: at once where it has the
    only GPU, a wait while its engine starts where it runs beside this one), or as it is if that
    worker ended without (its result file says so)."""
    deadline = time.monotonic() + wait_s
    while True:
        plan = json.loads(plan_path.read_text())
        if not needs_bf16_capacity(plan) or baseline_result.exists() or time.monotonic() > deadline:
            return plan
        time.sleep(poll_s)


def warm_up(llm, name: str, sizes: dict, vocab: int) -> None:
    """The scenario once, small and untimed, so that kernels compiled for its batch shapes
    (Triton specializes on sizes) are compiled before the timed calls: a one-time cost a
    serving user pays once, not per request."""
    from vllm import SamplingParams

    def run(n: int, length: int, out: int) -> None:
        prompts = distinct_prompts(n, length, vocab, 1000 + n + length)
        for max_tokens in (1, out):  # prefill, then the prefix-cached rerun that decodes
            llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)

    chunk = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    z = sizes[name]
    if name in ("prefill", "decode", "fresh"):
        run(2, z.get("prompt_len") or z["context"], 8)
    elif name == "long":
        run(1, min(z["prompt_len"], 2 * chunk + 1), 1)  # chunks over a cached prefix, one request
    elif name == "latency":
        run(1, 1024, 16)
    elif name == "short":
        run(4, 1024, 16)
    elif name in ("reasoning", "overflow"):
        run(8, min(z["prompt_len"], 2048), 16)
    elif name == "capacity":
        run(2, min(z["prompt_len"], 2 * chunk + 1), 8)


# --- the pool of GPUs: one worker process (group) per GPU at a time -------------------------

@dataclass
class Job:
    label: str  # for the progress lines
    cmd: list[str]
    result: Path  # run_<...>.json; its log is log_<...>.txt beside it
    stub: dict  # written with an error when the worker leaves no result
    timeout: float | None = None  # seconds; None: the pool's
    estimate_s: float = 0  # the plan's seconds for it, against a deadline

    @property
    def log(self) -> Path:
        return self.result.with_name("log_" + self.result.stem.removeprefix("run_") + ".txt")


def gpu_slots(n: int, visible: str | None) -> list[str]:
    """The device ids of the first ``n`` GPUs this process may use: its own
    ``CUDA_VISIBLE_DEVICES`` if set (a worker must get one of those), else 0..n-1."""
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else [str(i) for i in range(n)]
    if n > len(ids):
        raise ValueError(f"--gpus {n}, but CUDA_VISIBLE_DEVICES={visible} names {len(ids)}")
    return ids[:n]


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies hold no GPU memory; a container's
    init may never reap them)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue
        if group == str(pgid) and state not in "ZX":
            return True
    return False


def _end_group(pgid: int, wait_s: float = 60) -> None:
    """SIGKILL the group and wait until it is gone: the next worker on this GPU needs its memory."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + wait_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)


def _start(job: Job, gpu: str) -> subprocess.Popen:
    job.result.unlink(missing_ok=True)  # a stale result must not hide a dead worker
    print(f"start {job.label} on GPU {gpu}", flush=True)
    with open(job.log, "wb") as log:  # one log per worker: parallel workers would interleave
        # Its own process group: vLLM's engine core is a child process that keeps the GPU's
        # memory until it exits, so a timeout must end the whole group. Unbuffered: a killed
        # worker's log still ends with its last lines.
        return subprocess.Popen(job.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "CUDA_VISIBLE_DEVICES": gpu, "PYTHONUNBUFFERED": "1"})


# vLLM's warning when a Triton kernel compiles while serving (its JIT monitor), with its time.
JIT_LINE = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d) \[jit_monitor\.py:\d+\] Triton kernel JIT compilation "
                      r"during inference: (\w+)")


def mark_jit_compiles(result: dict, log: str, year: int) -> dict:
    """Name, in each scenario, the kernels vLLM logged compiling inside its timed calls: their
    compile time is in that scenario's numbers. Log times are local and to the second."""
    events = [(time.mktime(time.strptime(f"{year}-{m[1]}", "%Y-%m-%d %H:%M:%S")), m[2]) for m in JIT_LINE.finditer(log)]
    for scenario, spans in (result.get("spans") or {}).items():
        hits = [name for t, name in events if any(a - 1 <= t <= b + 1 for a, b in spans)]
        if hits and isinstance(result.get(scenario), dict):
            result[scenario]["jit_compiles"] = hits
    return result


def _finish(job: Job, gpu: str, seconds: float, returncode: int, timed_out: str | None) -> None:
    """Leave a result file (the stub with the error if the worker left none) and say how it went.
    A finished result written before the timeout stands: only the engine's shutdown hung. A
    partial one (still ``running`` a scenario) keeps the scenarios it finished, with the error."""
    wrote = job.result.exists()
    if not wrote:
        error = timed_out or f"the worker exited with status {returncode} and no result (see {job.log.name})"
        job.result.write_text(json.dumps({**job.stub, "error": error}))
    result = json.loads(job.result.read_text())
    if "running" in result:
        scenario = result.pop("running")
        result["error"] = (f"{timed_out} in {scenario}" if timed_out else
                           f"the worker exited with status {returncode} in {scenario} (see {job.log.name})")
    if wrote:
        result["worker_s"] = round(seconds, 1)  # start to end, against the plan's estimate
        if job.log.exists() and "spans" in result:
            result = mark_jit_compiles(result, job.log.read_text(errors="replace"), time.localtime().tm_year)
        job.result.write_text(json.dumps(result, indent=1))
    error = result.get("error")
    print(f"end {job.label} on GPU {gpu}: {seconds:.0f} s, " + (f"failed: {error}" if error else "ok"), flush=True)
    if error:
        tail = job.log.read_text(errors="replace").splitlines()[-20:]
        print(f"--- last lines of {job.log}:\n" + "\n".join(tail) + "\n---", flush=True)


# With --deadline-s: a configuration starts only if its plan estimate, times this, fits the time
# left (the estimates ran up to 20% short on 2026-12-04, results/ab_4k), and every engine is
# ended this many seconds before the deadline, for its shutdown and the report.
DEADLINE_MARGIN = 1.25
DEADLINE_RESERVE_S = 30


def run_pool(jobs: list[Job], gpus: list[str], timeout: float, poll_s: float = 0.5,
             deadline_s: float | None = None) -> list[Job]:
    """Run ``jobs`` in order, at most one per GPU of ``gpus`` at a time, each ended (with its
    process group) after ``timeout`` seconds. With ``deadline_s``, the whole run ends within
    that many seconds: a job whose estimate does not fit the time left is not started, and one
    still running at ``deadline_s - DEADLINE_RESERVE_S`` is ended (a finished scenario's results
    stay). Every job it starts leaves its result file. Returns the jobs not started."""
    queue, free, running, skipped = list(jobs), list(gpus), {}, []  # running: process -> (job, gpu, start)
    t_run = time.monotonic()
    try:
        while queue or running:
            while queue and free:
                job, gpu = queue.pop(0), free.pop(0)
                left = None if deadline_s is None else deadline_s - DEADLINE_RESERVE_S - (time.monotonic() - t_run)
                if left is not None and DEADLINE_MARGIN * job.estimate_s > left:
                    # No result file (a stale one goes): a later run of the same plan fills it in.
                    free.insert(0, gpu)
                    skipped.append(job)
                    job.result.unlink(missing_ok=True)
                    print(f"not started {job.label}: {max(left, 0):.0f} s left of --deadline-s {deadline_s:g}, "
                          f"estimate {job.estimate_s:.0f} s x {DEADLINE_MARGIN:g}", flush=True)
                    continue
                running[_start(job, gpu)] = (job, gpu, time.monotonic())
            time.sleep(poll_s)
            for proc, (job, gpu, t0) in list(running.items()):
                done = proc.poll() is not None
                limit = job.timeout or timeout
                if deadline_s is not None:
                    limit = min(limit, round(deadline_s - DEADLINE_RESERVE_S - (t0 - t_run)))
                late = not done and time.monotonic() - t0 > limit
                if not (done or late):
                    continue
                _end_group(proc.pid)  # on exit too: whatever the worker left behind
                proc.wait()
                del running[proc]
                free.append(gpu)
                _finish(job, gpu, time.monotonic() - t0, proc.returncode,
                        f"timed out after {limit:g} s" if late else None)
    finally:  # an interrupt or an error here: no engine outlives the parent
        for proc in running:
            _end_group(proc.pid)
    return skipped


# --- the report -----------------------------------------------------------------------------

METRICS = [  # (scenario, field, label, higher is better; None: a count shown without a ratio), issue 18's order
    (None, "kv_cache_tokens", "KV cache capacity (tokens)", True),
    (None, "kv_tokens_all_running", "KV tokens left with all max_num_seqs requests running", True),
    ("latency", "tpot_ms", "batch 1: time per output token (ms), {context} context, {output_len} out", False),
    ("short", "output_tok_s", "output tok/s, {requests} x ({prompt_len} in, {output_len} out), fresh", True),
    ("decode", "decode_tok_s", "decode tok/s, {requests} x {context} context, prefix-cached", True),
    ("decode", "tpot_ms", "time per output token (ms), same run", False),
    ("decode", "hit_s", "the same prompts' prefix hit, 1 token out (s)", False),
    ("fresh", "output_tok_s", "fresh: output tok/s, {requests} x {prompt_len}, prefill + {output_len} out", True),
    ("fresh", "seconds", "fresh: seconds, same run", False),
    ("reasoning", "output_tok_s",
     "reasoning: output tok/s, {requests} x ({prompt_len} in, {output_len} out), fresh", True),
    ("reasoning", "mean_running", "reasoning: requests decoding at once (mean)", None),
    ("reasoning", "preemptions", "reasoning: preemptions", None),
    ("overflow", "output_tok_s",
     "overflow: output tok/s, {requests} x ({prompt_len} in, {output_len} out), fresh", True),
    ("overflow", "mean_running", "overflow: requests decoding at once (mean)", None),
    ("overflow", "preemptions", "overflow: preemptions", None),
    ("capacity", "first_pass_s", "capacity, first pass (s): prefill of {requests} x ~{prompt_len}, 1 token out", False),
    ("capacity", "output_tok_s",
     "capacity, follow-up output tok/s: the same {requests} prompts, {output_len} out each", True),
    ("capacity", "prompt_tokens_computed", "capacity, follow-up: prompt tokens computed again", None),
    ("prefill", "prefill_tok_s", "prefill tok/s, {requests} x {prompt_len} distinct prompts", True),
    ("long", "prefill_tok_s", "prefill tok/s, 1 x {prompt_len} prompt", True),
]
SIZE_FIELDS = ("requests", "prompt_len", "context", "contexts", "output_len")
MEMORY_BOUND = ("reasoning", "overflow", "capacity")


@dataclass
class Column:
    """One configuration in the main table: its results (``run``; merged over runs that ran
    different scenarios) and, per scenario, the FLASH_ATTN result of the run it came from
    (``bases``; None: the engine's own figures, from its first run), or of an earlier run of
    the same sizes where its own run had no FLASH_ATTN (those scenarios in ``across``)."""
    name: str
    run: dict
    bases: dict
    across: set = field(default_factory=set)


def _load(out: Path) -> tuple[dict, dict, dict, dict | None]:
    """The main runs (config -> result), the sweep ((max_num_seqs, config) -> result), meta and plan of one run."""
    runs, sweep = {}, {}
    for p in sorted(out.glob("run_*.json")):
        r = json.loads(p.read_text())
        if "running" in r and "error" not in r:
            # The harness itself was ended (a GPU call's limit) before its worker's result was
            # finished: the scenarios done stand, the one under way gets no row.
            r["error"] = f"ended from outside in {r['running']}, before a result (see log_{r['config']}.txt)"
        if r.get("sweep_max_num_seqs"):
            sweep[(r["sweep_max_num_seqs"], r["config"])] = r
        else:
            runs[r["config"]] = r
    plan = json.loads((out / "plan.json").read_text()) if (out / "plan.json").exists() else None
    return runs, sweep, json.loads((out / "meta.json").read_text()), plan


def _columns(loaded: list) -> list[Column]:
    """A column per configuration, in the order of CONFIGS, each scenario from the first run that
    has it; a configuration that runs a scenario again in a later run gets a column of that
    run's (``FLASH_ATTN (run 2)``: the baseline of run 2's ratios)."""
    cols: dict[str, Column] = {}
    for i, (runs, _, _, _) in enumerate(loaded):
        for c in (c for c in CONFIGS if c in runs):
            r, col = runs[c], cols.get(c)
            ran = [s for s in SCENARIOS if s in r]
            bases = {s: _baseline(loaded, i, s) for s in [None, *ran]}
            across = {s for s, (_, other) in bases.items() if other}
            bases = {s: b for s, (b, _) in bases.items()}
            if col and not set(ran) & set(col.run):  # other scenarios of the same configuration
                col.run.update({s: r[s] for s in ran})
                col.bases.update({s: bases[s] for s in ran})
                col.across.update(across - {None})
                if "error" in r:
                    col.run["error"] = "; ".join(filter(None, [col.run.get("error"), f"run {i + 1}: {r['error']}"]))
                continue
            name = c if not col else f"{c} (run {i + 1})"
            cols[name] = Column(name, dict(r), bases, across)
    order = list(CONFIGS)
    return sorted(cols.values(), key=lambda col: order.index(col.run["config"]))


def _baseline(loaded: list, i: int, scen: str | None) -> tuple[dict | None, bool]:
    """The FLASH_ATTN result run ``i``'s ratios in ``scen`` take (None: the engine's own figures),
    and whether it is another run's: run ``i``'s own, else the latest earlier run's that ran
    ``scen`` at the same sizes with the same engine arguments (a run split over invocations to
    fit a GPU call's time limit; each engine in its own process either way)."""
    runs, _, meta, plan = loaded[i]
    if BASELINE in runs:
        return runs[BASELINE], False
    for runs_j, _, meta_j, plan_j in reversed(loaded[:i]):
        base = runs_j.get(BASELINE)
        if not base or meta_j["engine_args"] != meta["engine_args"]:
            continue
        if scen is None or (scen in base and plan and plan_j and scenario_sizes(plan["sizes"], scen)
                            == scenario_sizes(plan_j["sizes"], scen) is not None):
            return base, True
    return None, False


def _cell(col_run: dict, v, b, higher, across: bool = False) -> tuple[str, float | None]:
    """A table cell (the value and its ratio to the baseline's ``b``, marked † if that is
    another run's) and that ratio."""
    if v is None:  # what it did not finish; the reason is under the table
        return "failed" if "error" in col_run else "", None
    if v < 0:  # OSCAR's windows for max_num_seqs requests would take more than the whole pool
        return f"{v:,} (windows over the pool)", None
    ratio = (v / b if higher else b / v) if higher is not None and b and v else None
    shown = ratio and col_run.get("config") != BASELINE
    return f"{v:,}" + (f" ({ratio:.2f}x{'†' if across else ''})" if shown else ""), ratio


def _line(label: str, cols: list[Column], values: dict, higher, csv: list, plot_rows: list | None,
          metric: str | None = None) -> str:
    """One table line: each column's value and its ratio to its own baseline's; the same into
    ``csv`` and (if given) ``plot_rows`` under ``metric`` (default: ``label``)."""
    metric, cells = metric or label, []
    for col in cols:
        v, b = values.get(col.name), values.get(f"base:{col.name}")
        text, ratio = _cell(col.run, v, b, higher, values.get(f"across:{col.name}", False))
        cells.append(text)
        if v is not None:
            csv.append(f"\"{metric}\",{col.name},{v},{'' if ratio is None else round(ratio, 4)}")
            if ratio and plot_rows is not None and col.run.get("config") != BASELINE:
                plot_rows.append((metric, col.name, ratio))
    return f"| {label} | " + " | ".join(cells) + " |"


def _label(template: str, sizes: dict) -> str:
    return template.format(**{k: tok(v) if k in ("prompt_len", "output_len", "context") else v
                              for k, v in sizes.items()})


def _main_rows(cols: list[Column]):
    """(label, values, higher) of every metric some column has, in METRICS' order: values maps a
    column's name to its value and ``base:<name>`` to its baseline's."""
    def get(run: dict | None, scen, field, ctx=None):
        g = (run or {}).get(scen) if scen else run
        if ctx is not None:
            g = next((r for r in (g or {}).get("per_context", []) if r["context"] == ctx), None)
        return (g or {}).get(field) if isinstance(g, dict) else None

    for scen, field, template, higher in METRICS:
        if scen == "latency":
            contexts = sorted({r["context"] for c in cols for r in (c.run.get("latency") or {}).get("per_context", [])})
            keys = [(ctx, {"context": ctx, "output_len": next(c.run["latency"]["output_len"] for c in cols
                                                               if c.run.get("latency"))}) for ctx in contexts]
        else:
            having = [g for g in ((c.run.get(scen) or {}) if scen else c.run for c in cols) if field in g]
            keys = [(None, having[0])] if having else []
        for ctx, sizes in keys:
            values = {}
            for c in cols:
                values[c.name] = get(c.run, scen, field, ctx)
                values[f"base:{c.name}"] = get(c.bases.get(scen), scen, field, ctx)
                values[f"across:{c.name}"] = scen in c.across
            yield (_label(template, sizes) if scen else template), values, higher


def _size_notes(cols: list[Column]) -> list[str]:
    """Where the configurations ran different sizes (ratios then compare different work), and how
    much KV the memory-bound scenarios need against each engine's cache."""
    notes = []
    for scen in SCENARIOS:
        seen = {json.dumps({k: c.run[scen][k] for k in SIZE_FIELDS if k in c.run[scen]}) for c in cols
                if isinstance(c.run.get(scen), dict)}
        if len(seen) > 1:
            notes.append(f"**{scen}: sizes differ between configurations** ({'; '.join(sorted(seen))}): "
                         "its ratios compare different work")
    need = []
    for scen in MEMORY_BOUND:
        z = next((c.run[scen] for c in cols if isinstance(c.run.get(scen), dict)), None)
        if not z:
            continue
        tokens = z["requests"] * (z["prompt_len"] + (0 if scen == "capacity" else z["output_len"]))
        shares = []
        for c in cols:
            kv, seqs = c.run.get("kv_cache_tokens"), c.run.get("max_num_seqs")
            if kv:
                window = (kv - c.run.get("kv_tokens_all_running", kv)) // seqs if seqs else 0
                shares.append(f"{c.name} {(tokens + z['requests'] * window) / kv:.2f}")
        need.append(f"{scen} {tokens:,} ({', '.join(shares)})")
    if need:
        notes.append("KV tokens the requests hold when all run at once (capacity: the prompts), as a share of "
                     "each engine's KV cache (OSCAR's with its BF16 windows; above 1 they queue or preempt): "
                     + "; ".join(need))
    return notes


def _plan_line(plan: dict | None) -> str:
    if not plan:
        return "- sizes: as the table's labels give them"
    inp = plan["inputs"]
    if plan.get("fixed"):
        how = f"the sizes of {inp.get('plan_from', 'an earlier plan')}"
    elif inp.get("budget_s"):
        how = (f"the defaults scaled by {plan['scale']} to fit --budget-s {inp['budget_s']:g} per configuration"
               + ("" if plan["fits"] else " (estimated over budget even at the floors)"))
    else:
        how = "the options' sizes, unscaled"
    bounds = [f"overflow to need over {inp['overflow_factor']:g}x the largest KV cache of "
              f"{' and '.join(inp['overflow_configs'])}"] if "overflow" in plan["sizes"] else []
    bounds += [f"capacity over {inp['overflow_factor']:g}x BF16's"] if "capacity" in plan["sizes"] else []
    bound = (f"; {' and '.join(bounds)}, BF16's KV cache being {plan['bf16_kv_tokens']:,} tokens "
             f"({plan['bf16_kv_source']})") if bounds and not plan.get("fixed") else ""
    return f"- sizes: {how}{bound}"


def report(out: Path, *more: Path) -> str:
    """``ab.md`` / ``ab.csv`` / ``ab.png`` in ``out`` from the per-configuration JSON files in
    ``out`` and ``more`` (runs of one plan split over invocations: each ratio against the
    FLASH_ATTN of its own run). Headings below the title are bold lines, so that the file splices
    into another document (benchmarks/readme_tables.py) without adding to its outline."""
    loaded = [_load(d) for d in (out, *more)]
    cols = _columns(loaded)
    runs = {c.name: c.run for c in cols}
    meta = loaded[0][2]
    lines = [f"# A/B throughput: {meta['model']}", ""]
    for i, (r, _, m, plan) in enumerate(loaded):
        if len(loaded) == 1:
            lines += [f"- date: {m['date']}; hardware: {m['hardware']}", f"- command: `{m['command']}`"]
        else:
            lines.append(f"- run {i + 1} ({', '.join(c for c in CONFIGS if c in r)}): {m['date']}; "
                         f"{m['hardware']}; `{m['command']}`")
        if i == 0 or m["versions"] != meta["versions"]:
            lines.append(f"- {m['versions']}")
        if m.get("oscar_env"):
            lines.append(f"- OSCAR settings from the environment: {json.dumps(m['oscar_env'])}")
        if m.get("gpus", 1) > 1:
            lines.append(f"- {m['gpus']} configurations at a time, one GPU each (sharing the host's CPUs)")
        if plan:
            lines.append(_plan_line(plan))
    lines += [f"- engine arguments: {meta['engine_args']} (else vLLM's defaults)",
              "- every request has its own prompt; ratios are against FLASH_ATTN (BF16) in the same run "
              "(for times: FLASH_ATTN's over this one's), higher is better"]
    csv, plot_rows = ["metric,config,value,ratio_vs_bf16"], []
    if cols:
        lines += ["", "| metric | " + " | ".join(c.name for c in cols) + " |", "|---|" + "---|" * len(cols)]
        for label, values, higher in _main_rows(cols):
            lines.append(_line(label, cols, values, higher, csv, plot_rows if higher is not None else None))
    notes = _size_notes(cols)
    if any(c.across for c in cols):
        notes.insert(0, "† against the FLASH_ATTN of an earlier run with the same sizes and engine arguments "
                     "(a run split over invocations to fit a GPU call's time limit)")
    compiled = [f"{n} {scen}: {', '.join(r[scen]['jit_compiles'])}" for n, r in runs.items()
                for scen in SCENARIOS if isinstance(r.get(scen), dict) and r[scen].get("jit_compiles")]
    if compiled:
        notes.append("Triton kernels vLLM logged compiling inside a timed call (their compile time is in that "
                     "scenario's numbers): " + "; ".join(compiled) + ".")
    timing = [f"{f'run {i + 1} ' if len(loaded) > 1 else ''}{c} {runs_i[c]['worker_s']:.0f}"
              + (f" ({plan['estimate_s'][c]['total']:.0f})" if plan and c in plan["estimate_s"] else "")
              for i, (runs_i, _, _, plan) in enumerate(loaded) for c in CONFIGS if "worker_s" in runs_i.get(c, {})]
    if timing:
        notes.append("Seconds per configuration, engine start to exit (the plan's estimate): " + ", ".join(timing))
    lines += [x for n in notes for x in ("", n)]
    failed = [(c.name, c.run) for c in cols if "error" in c.run]
    sweep = {}
    for _, run_sweep, _, _ in loaded:
        for key, r in run_sweep.items():
            sweep.setdefault(key, r)
    if sweep:
        lines += _sweep_tables(sweep, loaded[0][0], csv, plot_rows, failed)
    for n, r in failed:
        lines.append(f"\n**{n} failed:** `{r['error']}`")
    text = "\n".join(lines) + "\n"
    (out / "ab.md").write_text(text)
    (out / "ab.csv").write_text("\n".join(csv) + "\n")
    _plot(plot_rows, out / "ab.png", meta)
    return text


def _sweep_tables(sweep: dict, runs: dict, csv: list, plot_rows: list, failed: list) -> list[str]:
    """The KV capacity of engines started with each max_num_seqs of the sweep, beside the main runs'."""
    lines, rows = [], {}  # label -> config -> result
    if runs:  # the main runs, at the max_num_seqs vLLM chose (or --engine-args set)
        seqs = "/".join(map(str, sorted({r["max_num_seqs"] for r in runs.values() if "max_num_seqs" in r})))
        eager = any(r.get("engine_args", {}).get("enforce_eager") for r in runs.values())
        rows[f"{seqs or '?'} (main run, {'eager' if eager else 'CUDA graphs'})"] = runs
    for v in sorted({v for v, _ in sweep}):
        rows[f"{v} (enforce_eager)"] = row = {c: sweep[v, c] for c in CONFIGS if (v, c) in sweep}
        failed += [(f"{c} (max_num_seqs={v})", r) for c, r in row.items() if "error" in r]
    names = [c for c in CONFIGS if any(c in row for row in rows.values())]
    cols = [Column(c, {"config": c}, {}) for c in names]

    def table(field: str, metric: str, plot: bool) -> list[str]:
        out = ["| max_num_seqs | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for label, row in rows.items():
            values = {c: r.get(field) for c, r in row.items()}
            values.update({f"base:{c}": values.get(BASELINE) for c in names})
            for col in cols:
                col.run = row.get(col.name, {"config": col.name})
            out.append(_line(label, cols, values, True, csv, plot_rows if plot and row is not runs else None,
                             metric=f"{metric}, max_num_seqs {label}"))
        return out

    lines += ["", "**KV cache capacity by max_num_seqs**", "",
              "KV cache tokens of engines started with that max_num_seqs and enforce_eager=True (to start "
              "fast), then stopped (\"main run\": the scenarios' engines); ratios against FLASH_ATTN "
              "in the same row", "", *table("kv_cache_tokens", "KV cache capacity (tokens)", True)]
    if any("kv_tokens_all_running" in r for row in rows.values() for r in row.values()):
        lines += ["", "OSCAR's BF16 windows are blocks of that pool, taken per running request; with all "
                  "max_num_seqs requests running, this much is left for KV tokens:", "",
                  *table("kv_tokens_all_running", "KV tokens left with all running", False)]
    return lines


def _plot(rows, path: Path, meta: dict) -> None:
    """Horizontal bars: each workload's ratio to FLASH_ATTN, one bar per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r[0] for r in rows))
    names = list(dict.fromkeys(r[1] for r in rows))
    if not labels:
        return
    fig, ax = plt.subplots(figsize=(11, 0.3 * len(labels) * max(1, len(names)) + 2))
    h = 0.8 / len(names)
    for i, n in enumerate(names):
        vals = [next((r[2] for r in rows if r[0] == lab and r[1] == n), 0) for lab in labels]
        ax.barh([j + i * h for j in range(len(labels))], vals, height=h, label=n)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks([j + 0.4 - h / 2 for j in range(len(labels))], [textwrap.fill(lab, 48) for lab in labels],
                  fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ratio to FLASH_ATTN (BF16) of the same run or plan, higher is better")
    ax.set_title(f"{meta['model']}, {meta['hardware']}, {meta['date']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def expand_scenarios(names: list[str]) -> list[str]:
    """``--scenarios`` with the presets expanded and ``none`` dropped, in the order they run."""
    wanted = {s for n in names for s in PRESETS.get(n, [n]) if s != "none"}
    return [s for s in SCENARIOS if s in wanted]


def model_config(model: str | None) -> dict:
    """The model's config.json (the Qwen3-8B shape's without ``--model``)."""
    if model is None:
        return json.loads(QWEN3_8B_CONFIG.read_text())
    if (Path(model) / "config.json").exists():
        return json.loads((Path(model) / "config.json").read_text())
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model).to_dict()


def parent_plan(args, cfg: dict) -> dict:
    """The run's plan as the parent makes it: with an estimated BF16 KV capacity (or the one
    ``--bf16-kv-tokens`` gives), or ``--plan``'s sizes."""
    inputs = {"configs": args.configs, "scenarios": args.scenarios, "budget_s": args.budget_s, "gpus": args.gpus,
              "full": full_sizes(args),
              "overflow_configs": args.overflow_configs, "overflow_factor": args.overflow_factor,
              "kv_vs_bf16": kv_vs_bf16(cfg), "window_tokens": oscar_window_tokens(cfg)}
    engine_args = json.loads(args.engine_args)
    if args.plan:
        earlier = json.loads(Path(args.plan).read_text())
        missing = [s for s in args.scenarios if s not in earlier["sizes"]]
        if missing:
            raise SystemExit(f"--plan {args.plan} has no sizes for {', '.join(missing)}")
        inputs = {**earlier["inputs"], **{k: inputs[k] for k in ("configs", "scenarios", "budget_s", "gpus")},
                  "plan_from": args.plan}
        return make_plan(inputs, earlier["bf16_kv_tokens"], earlier["bf16_kv_source"], earlier["max_num_seqs"],
                         fixed={s: earlier["sizes"][s] for s in args.scenarios})
    if args.bf16_kv_tokens:
        bf16, source = args.bf16_kv_tokens, "given by --bf16-kv-tokens"
    else:
        util = engine_args.get("gpu_memory_utilization", 0.92)  # vLLM 0.26's default
        gib, where = args.gpu_mem_gib, "given by --gpu-mem-gib"
        if gib is None:
            found = gpu_memory_gib()
            gib, where = (found, "this GPU's") if found else (H200_GIB, "no GPU found: an H200's")
        bf16 = estimate_bf16_kv_tokens(cfg, gib, util)
        source = f"estimated from {gib:.1f} GiB ({where}) x {util} less the weights"
    plan = make_plan(inputs, bf16, source, engine_args.get("max_num_seqs", 1024))  # vLLM's default for LLM on an H200
    if needs_bf16_capacity(plan) and BASELINE in args.configs and not args.bf16_kv_tokens:
        plan["bf16_kv_source"] += "; the FLASH_ATTN engine, which runs first, sizes the run with its own"
    return plan


def worker_main(args) -> None:
    """A worker: its result, whatever happens, in ``--result`` (written whole, then renamed: a
    worker killed while writing leaves no half file)."""
    dest = Path(args.result)

    def save(res: dict) -> None:
        tmp = dest.with_suffix(".tmp")
        tmp.write_text(json.dumps(res, indent=1))
        tmp.replace(dest)

    result = {}
    try:
        run_worker(args, result, save)
    except Exception as e:  # noqa: BLE001  (the table says why a configuration failed)
        traceback.print_exc()  # into its log, whose tail the parent prints
        scenario = result.pop("running", None)
        result = {**result, **stub(args.worker, args.sweep_seqs),
                  "error": f"{type(e).__name__}: {str(e)[:400]}" + (f" (in {scenario})" if scenario else "")}
    save(result)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="model id or folder (default: a Qwen3-8B-shaped config, dummy weights)")
    p.add_argument("--configs", nargs="+", default=[c for c in CONFIGS if c != "turboquant"], choices=list(CONFIGS),
                   help="default: all but turboquant (which needs vLLM's FlashAttention 2 build)")
    p.add_argument("--scenarios", nargs="*", choices=[*SCENARIOS, *PRESETS, "none"],
                   help="scenarios or presets (default: --plan's, else issue18: all); "
                   "none (or no value): only the --max-num-seqs-sweep")
    p.add_argument("--rotations", default="hadamard",
                   help="OSCAR rotation path (default: hadamard; speed does not depend on the rotation values); "
                   f"{HADAMARD_KEY_MEANS}: Hadamard rotations with seeded key means written into --out, to time "
                   "OSCAR as served with calibrated rotations, which have key means")
    p.add_argument("--engine-args", default="{}", help="JSON of vLLM engine arguments for every configuration")
    g = p.add_argument_group("sizes (before --budget-s scales them)")
    g.add_argument("--num-prompts", type=int, default=32, help="prefill and decode: requests")
    g.add_argument("--prompt-len", type=int, default=16384, help="prefill and decode: prompt tokens")
    g.add_argument("--output-len", type=int, default=256, help="decode: output tokens")
    g.add_argument("--long-prompt", type=int, default=131072)
    g.add_argument("--latency-contexts", type=int, nargs="+", default=[1024, 8192, 32768, 131072])
    g.add_argument("--latency-output-len", type=int, default=256)
    g.add_argument("--short-requests", type=int, default=64)
    g.add_argument("--short-output-len", type=int, default=1024)
    g.add_argument("--fresh-requests", type=int, default=32)
    g.add_argument("--fresh-len", type=int, default=16384)
    g.add_argument("--fresh-output-len", type=int, default=256)
    g.add_argument("--reasoning-requests", type=int, default=256)
    g.add_argument("--reasoning-prompt-len", type=int, default=1024)
    g.add_argument("--reasoning-output-len", type=int, default=4096)
    g.add_argument("--overflow-requests", type=int, default=128)
    g.add_argument("--overflow-prompt-len", type=int, default=8192)
    g.add_argument("--overflow-output-len", type=int, default=8192)
    g.add_argument("--capacity-requests", type=int, default=32)
    g.add_argument("--capacity-len", type=int, default=100000)
    g.add_argument("--capacity-output-len", type=int, default=256, help="output tokens of the capacity follow-up")
    b = p.add_argument_group("time budget")
    b.add_argument("--budget-s", type=float,
                   help="seconds per configuration, engine start included: scale the sizes to fit")
    b.add_argument("--overflow-configs", nargs="+", default=[BASELINE, "fp8"], choices=list(CONFIGS),
                   help="whose KV caches overflow must overflow (default: FLASH_ATTN fp8, as issue 18 has it)")
    b.add_argument("--overflow-factor", type=float, default=1.25,
                   help="overflow needs this times their largest KV cache, capacity this times BF16's (default 1.25)")
    b.add_argument("--bf16-kv-tokens", type=int, help="BF16's KV capacity to plan with (default: estimated, then "
                   "read from the FLASH_ATTN engine)")
    b.add_argument("--gpu-mem-gib", type=float, help="GPU memory for that estimate (default: the first visible "
                   "GPU's, by NVML; an H200's without one)")
    b.add_argument("--plan", help="run the sizes of an earlier run's plan.json (no scaling)")
    b.add_argument("--dry-run", action="store_true", help="print the plan (sizes, estimated seconds) and stop")
    p.add_argument("--no-warmup", action="store_true",
                   help="time each scenario cold (default: each runs once, small and untimed, first)")
    p.add_argument("--max-num-seqs-sweep", type=int, nargs="*", default=[], metavar="N",
                   help="also start each configuration with max_num_seqs=N (eager) and read only its KV capacity")
    p.add_argument("--gpus", type=int, default=1, help="configurations run at once, one GPU each (default 1)")
    p.add_argument("--out", default="results/ab")
    p.add_argument("--timeout", type=int, help="seconds per configuration (and per sweep run); default 1800, "
                   "or with --budget-s 60 + 1.5 x the plan's estimate for the configuration")
    p.add_argument("--deadline-s", type=float,
                   help="end the whole run within this many seconds (a GPU call's limit): a configuration starts "
                        f"only if its plan estimate x {DEADLINE_MARGIN:g} fits the time left, and engines still "
                        f"running {DEADLINE_RESERVE_S} s before it are ended (finished scenarios stay)")
    p.add_argument("--report", metavar="DIR", nargs="+",
                   help="only rebuild the tables and plot from DIR (and further runs of its plan, merged)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--sweep-seqs", type=int, help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, with the scenario presets expanded and the configurations in the order they
    run: FLASH_ATTN first (a budgeted run takes its sizes from its KV cache)."""
    args = parser().parse_args(argv)
    if args.scenarios is None and args.plan:  # a run on an earlier plan runs what that plan sized
        sized = json.loads(Path(args.plan).read_text())["sizes"]
        args.scenarios = [s for s in SCENARIOS if s in sized]
    elif args.scenarios is None:
        args.scenarios = ["issue18"]
    args.scenarios = expand_scenarios(args.scenarios)
    args.configs = sorted(dict.fromkeys(args.configs), key=lambda c: c != BASELINE)
    return args


def main() -> None:
    args = parse_args()
    if args.report:
        print(report(*map(Path, args.report)))
        return
    if args.worker:
        worker_main(args)
        return
    if not args.scenarios and not args.max_num_seqs_sweep:
        parser().error("nothing to run: no --scenarios and no --max-num-seqs-sweep")
    cfg = model_config(args.model)
    if args.rotations == HADAMARD_KEY_MEANS and oscar_key_mean(os.environ) == "off":
        parser().error(f"--rotations {HADAMARD_KEY_MEANS} times the key means: OSCAR_KEY_MEAN=off serves without them")
    plan = parent_plan(args, cfg)
    if args.dry_run:
        print(plan_text(plan))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        args.model = str(out / "qwen3-8b-shape")
        Path(args.model).mkdir(exist_ok=True)
        (Path(args.model) / "config.json").write_text(QWEN3_8B_CONFIG.read_text())
    if args.rotations == HADAMARD_KEY_MEANS:
        args.rotations = str(hadamard_key_mean_rotations(cfg, out / "rotations_hadamard_key_means"))
    import torch

    if torch.cuda.is_available() and args.gpus > torch.cuda.device_count():
        parser().error(f"--gpus {args.gpus}, but {torch.cuda.device_count()} GPUs are visible")
    try:
        gpus = gpu_slots(args.gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    except ValueError as e:
        parser().error(str(e))
    # In a child process: a CUDA context left in this one would take GPU memory from a worker.
    env = json.loads(subprocess.run(
        [sys.executable, "-c", "import json; from oscar_vllm.calibration.evaluate import environment; "
         "print(json.dumps(environment('python benchmarks/ab_throughput.py')))"],
        capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
    env["command"] = f"python benchmarks/ab_throughput.py {shlex.join(sys.argv[1:])}".strip()
    env["versions"] += "".join(f", {pkg} {_version(pkg)}" for pkg in ("vllm", "triton"))
    model_name = "Qwen3-8B shape, dummy weights" if args.model.endswith("qwen3-8b-shape") else args.model
    (out / "meta.json").write_text(json.dumps({**env, "model": model_name, "engine_args": args.engine_args,
                                               "oscar_env": oscar_environment(), "gpus": len(gpus)}))
    plan_path = out / "plan.json"
    plan_path.write_text(json.dumps(plan, indent=1))
    print(plan_text(plan), flush=True)
    # Workers read their sizes from the plan, and the model folder, which they must not write
    # again while another worker reads it.
    common = [sys.executable, __file__, "--model", args.model, "--rotations", args.rotations,
              "--engine-args", args.engine_args, "--plan", str(plan_path)] + (["--no-warmup"] if args.no_warmup else [])
    jobs = []
    for seqs in ([None] if args.scenarios else []) + args.max_num_seqs_sweep:  # None: the scenarios
        for name in args.configs:
            dest = out / (f"run_{name}.json" if seqs is None else f"run_{name}_seqs{seqs}.json")
            cmd = common + ["--worker", name, "--result", str(dest)] + (["--sweep-seqs", str(seqs)] if seqs else [])
            # A budgeted configuration may run half as long again as the plan's estimate for it.
            limit = 60 + 1.5 * plan["estimate_s"][name]["total"] if args.budget_s and seqs is None else None
            estimate = plan["estimate_s"][name]["total"] if seqs is None else SWEEP_RUN_S
            jobs.append(Job(name if seqs is None else f"{name} max_num_seqs={seqs}", cmd, dest, stub(name, seqs),
                            None if args.timeout else limit, estimate))
    skipped = run_pool(jobs, gpus, args.timeout or 1800, deadline_s=args.deadline_s)
    print(report(out) + resume_hint(skipped, plan_path, out))


def resume_hint(skipped: list[Job], plan_path: Path, out: Path) -> str:
    """How to run the configurations a deadline left out, on the same sizes, and merge them."""
    names = [c for c in CONFIGS if any(j.stub["config"] == c for j in skipped)]
    if not names:
        return ""
    return (f"\nNot started within --deadline-s: {' '.join(names)}. On the same sizes, then one report:\n"
            f"  python benchmarks/ab_throughput.py --configs {' '.join(names)} --plan {plan_path} --out OUT2\n"
            f"  python benchmarks/ab_throughput.py --report {out} OUT2\n")


if __name__ == "__main__":
    main()
