"""The plan of an A/B run: every scenario's sizes, and the seconds each configuration is
estimated to take. The KV capacities bound the memory-bound scenarios (BF16's estimated from the
GPU's memory less the weights, until the FLASH_ATTN engine reads its own); a cost model fitted to
H200 runs gives the seconds; ``--budget-s`` scales the sizes down, never below their floors,
until the estimate fits."""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .scenarios import BASELINE, SCENARIOS, decode_prefills_itself, tok, ttft_long_source


# --- the sizes the options give, and what bounds them ---------------------------------------

def full_sizes(args) -> dict:
    """Every scenario's sizes as the options give them (``--budget-s`` scales them down)."""
    return {
        "prefill": {"requests": args.num_prompts, "prompt_len": args.prompt_len},
        "decode": {"requests": args.num_prompts, "context": args.prompt_len, "output_len": args.output_len},
        "long": {"prompt_len": args.long_prompt},
        "latency": {"contexts": sorted(args.latency_contexts), "output_len": args.latency_output_len},
        "ttft": {"requests": _given(args.ttft_requests, args.num_prompts),
                 "prompt_len": _given(args.ttft_prompt_len, args.prompt_len), "suffix_len": args.ttft_suffix_len,
                 "long_len": _given(args.ttft_long_len, args.long_prompt)},
        "short": {"requests": args.short_requests, "prompt_len": 1024, "output_len": args.short_output_len},
        "fresh": {"requests": args.fresh_requests, "prompt_len": args.fresh_len, "output_len": args.fresh_output_len},
        "reasoning": {"requests": args.reasoning_requests, "prompt_len": args.reasoning_prompt_len,
                      "output_len": args.reasoning_output_len},
        "overflow": {"requests": args.overflow_requests, "prompt_len": args.overflow_prompt_len,
                     "output_len": args.overflow_output_len},
        "capacity": {"requests": args.capacity_requests, "prompt_len": args.capacity_len,
                     "output_len": args.capacity_output_len},
    }


def _given(value, default):
    """An option whose default is another option's: ``value`` unless it was not given."""
    return default if value is None else value


def kv_need(sizes: dict) -> int:
    """KV tokens the requests of a scenario hold when all run at once."""
    return sizes["requests"] * (sizes["prompt_len"] + sizes.get("output_len", 0))


def max_model_len(full: dict, scenarios: list[str]) -> int:
    """The longest request ``scenarios`` send at their full sizes, plus a margin: the same for every
    configuration and every budget (a sweep run alone sizes it for every scenario)."""
    longest = {"prefill": lambda s: s["prompt_len"], "decode": lambda s: s["context"] + s["output_len"],
               "long": lambda s: s["prompt_len"] + 1, "latency": lambda s: max(s["contexts"]) + s["output_len"],
               "ttft": lambda s: max(s["prompt_len"] + s["suffix_len"], s["long_len"]) + 1}
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


# OSCAR's prefix hit (hit_ring "recompute", the default) ends its recent window (256 tokens,
# OscarSettings.recent_size) before the prompt's end and its ring (256 more) before that: it
# computes the last 512 tokens of a new turn's prompt, the new ones among them, again
# (oscar_vllm/serving/window_pages.py). A ttft prompt has at least 4 blocks of 64 before those, so
# that its hit serves something from OSCAR's cache, and the hit is the batch of at least 4 requests.
OSCAR_HIT_RECOMPUTED = 512
TTFT_MIN_PROMPT = OSCAR_HIT_RECOMPUTED + 4 * 64
TTFT_MIN_REQUESTS = 4


def hit_cached_tokens(config: str, prompt_len: int, suffix_len: int) -> int:
    """Prompt tokens the prefix cache serves a new turn of ``suffix_len`` tokens on a cached prompt
    of ``prompt_len``: its whole blocks of 64, OSCAR's less what its hit computes again."""
    cached = 64 * (prompt_len // 64)
    return max(0, min(cached, prompt_len + suffix_len - OSCAR_HIT_RECOMPUTED)) if config == "OSCAR" else cached


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
    if name == "ttft":
        n, length, suffix = z["requests"], z["prompt_len"], z["suffix_len"]
        hits = (n + 1) * prefill_s(length + suffix, cached=hit_cached_tokens(config, length, suffix))
        return n * prefill_s(length) + hits + (0 if ttft_long_source(sizes) else prefill_s(z["long_len"]))
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
    64 x (1K, 1K) reasoning, 1K in and 1K out for overflow, 4 requests for ttft (its lengths stay:
    a time to first token is the prompt's; see ``ttft_sizes``). ``overflow`` holds at least
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
        elif name == "ttft":
            s = ttft_sizes(z, sc(z["requests"], TTFT_MIN_REQUESTS), caps, notes)
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


def ttft_sizes(z: dict, requests: int, caps: Caps, notes: list) -> dict:
    """``ttft`` with ``requests`` (its scaled count), at most as many as leave every prompt and
    its new turn in the smallest KV cache, BF16's, with a tenth to spare: its hits must find the
    prompts it sent first, so it is bounded at any scale, at full size too (by BF16's whichever
    configurations run: a plan's sizes are the same for all, so its runs merge). Notes a bound the
    sizes miss: fewer than ``TTFT_MIN_REQUESTS`` prompts held, a prompt shorter than
    ``TTFT_MIN_PROMPT``."""
    per_request = 64 * math.ceil((z["prompt_len"] + z["suffix_len"] + 1) / 64)
    held = int(0.9 * caps.tokens(BASELINE)) // per_request
    n = max(1, min(requests, held))
    if n < requests:
        notes.append(f"ttft: {n} requests, not {requests}: {requests} x ({tok(z['prompt_len'])} + {z['suffix_len']}) "
                     f"would not all stay in 90% of BF16's KV cache ({caps.tokens(BASELINE):,} tokens) until "
                     "their hits" + (f" (below its floor of {TTFT_MIN_REQUESTS})" if n < TTFT_MIN_REQUESTS else ""))
    if z["prompt_len"] < TTFT_MIN_PROMPT:
        notes.append(f"ttft: prompts of {z['prompt_len']:,} tokens: OSCAR's hit computes the last "
                     f"{OSCAR_HIT_RECOMPUTED} again, so less than 4 blocks of each come from its cache")
    return {**z, "requests": n}


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


def sizes_text(name: str, sizes: dict) -> str:
    z = sizes[name]
    if name == "ttft":
        source = ttft_long_source(sizes)
        return (f"{z['requests']} x {tok(z['prompt_len'])} then + {z['suffix_len']} new, 1 out; 1 x "
                f"{tok(z['long_len'])}" + (f" ({source}'s)" if source else ""))
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
    w = max(len(sizes_text(s, plan["sizes"])) for s in scenarios) if scenarios else 10
    head = f"{'':10} {'sizes':{w}} " + " ".join(f"{c:>10}" for c in configs)

    def seconds(key: str) -> str:
        return " ".join(f"{est[c][key]:>10.0f}" for c in configs)

    lines += ["", "estimated seconds (a cost model fitted to earlier H200 runs; the run records the real ones):",
              head]
    for s in scenarios:
        lines.append(f"{s:10} {sizes_text(s, plan['sizes']):{w}} " + seconds(s))
    lines.append(f"{'start':10} {'engine start, imports, shutdown':{w}} " + seconds("start"))
    lines.append(f"{'total':10} {'':{w}} " + seconds("total"))
    gpus = inp.get("gpus", 1)
    lines += ["", f"invocation: ~{plan['wall_s']} s ({plan['wall_s'] / 60:.1f} min) on {gpus} GPU{'s' * (gpus > 1)}, "
              f"in this order, {PARENT_S} s of it the run's own set-up and report"]
    lines += [f"note: {n}" for n in plan["notes"]]
    return "\n".join(lines)


def needs_bf16_capacity(plan: dict) -> bool:
    """Whether the plan's sizes hang on BF16's KV capacity, which only the engine knows exactly."""
    return (not plan["fixed"] and not plan.get("sized_by_engine") and bool(plan["inputs"].get("budget_s"))
            and bool({"overflow", "capacity", "ttft"} & set(plan["sizes"])))


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
