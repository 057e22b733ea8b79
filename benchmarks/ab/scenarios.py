"""The engines and the workloads of the A/B harness: each configuration's engine arguments,
each scenario's prompts (every one distinct, a seed per scenario) and the calls that time it
inside a worker, the counters read from vLLM around a call, and the small untimed run before each.
The sizes come from the plan (``plan.py``); the module docstring of ``cli.py`` says what each
scenario measures."""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass
from pathlib import Path


CONFIGS = {
    "OSCAR": {"attention_backend": "OSCAR"},
    "FLASH_ATTN": {"attention_backend": "FLASH_ATTN"},
    "fp8": {"kv_cache_dtype": "fp8"},
    "int4": {"kv_cache_dtype": "int4_per_token_head"},
    "turboquant": {"kv_cache_dtype": "turboquant_4bit_nc"},
}
# The order they run in: the prefix-cached ones first (decode reruns prefill's prompts, latency's
# longest context is long's prompt), then ttft (its prefix hits are its own prompts', and after
# latency its batch cannot evict long's prompt before latency reads it), the memory-bound ones
# last (they evict everything).
SCENARIOS = ["prefill", "decode", "long", "latency", "ttft", "short", "fresh", "reasoning", "overflow", "capacity"]
MEMORY_BOUND = ("reasoning", "overflow", "capacity")
PRESETS = {"all": SCENARIOS, "fits": [s for s in SCENARIOS if s not in MEMORY_BOUND],
           "memory-bound": list(MEMORY_BOUND)}
PRESET_ALIASES = {"issue18": "all"}  # earlier names of presets, still accepted ("all": issue 18's workloads)
BASELINE = "FLASH_ATTN"
# The Qwen3-8B architecture (its config.json), for runs with dummy weights.
QWEN3_8B_CONFIG = Path(__file__).parents[1] / "configs" / "qwen3-8b.json"


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


# ttft takes 9 to 11 (its prompts, the hit's suffixes, the one user's suffix: ttft_prompts) and 12.
SEEDS = {"prefill": 1, "long": 2, "short": 3, "capacity": 4, "fresh": 6, "reasoning": 7, "overflow": 8, "ttft": 9,
         "ttft_long": 12}
LATENCY_SEED = 100  # + the context's index
TTFT_WARM_UP_SEED = 1_000_000  # apart from every timed prompt's seed and the other warm-ups' (1000 + a size)


def tok(n: int) -> str:
    """A token count as a label shows it: 16K for 16384, 100,000 otherwise."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else f"{n:,}"


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


def first_token_s(request) -> float:
    """Seconds from a request's arrival (``generate`` adding it) to its first token, as vLLM's
    time-to-first-token metric counts them: its wait in the queue and its prefill, what a user
    waits for (``first_token_ts - scheduled_ts`` would leave the wait out)."""
    m = request.metrics
    if m is None:
        raise RuntimeError("timing first tokens needs vLLM's per-request times: leave disable_log_stats off")
    if not m.first_token_latency > 0:
        raise RuntimeError("vLLM recorded no first-token latency for the request")
    return m.first_token_latency


def _long(timed, sizes, vocab, result) -> None:
    length = sizes["long"]["prompt_len"]
    call = timed(distinct_prompts(1, length, vocab, SEEDS["long"]), 1, "long")
    result["long"] = {"prompt_len": length, "seconds": round(call.seconds, 3),
                      "prefill_tok_s": round(length / call.seconds, 1),
                      "ttft_s": round(first_token_s(call.results[0]), 3)}


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
                     "ttft_s": round(first_token_s(call.results[0]), 3),
                     "cached_tokens": call.results[0].num_cached_tokens,
                     "outputs": len(call.results[0].outputs[0].token_ids)})
    result["latency"] = {"requests": 1, "output_len": k, "contexts": z["contexts"], "per_context": rows}


def ttft_prompts(z: dict, vocab: int, seed: int = SEEDS["ttft"]) -> dict[str, list[dict]]:
    """The ttft scenario's prompts: ``fresh``, ``requests`` distinct prompts of ``prompt_len``;
    ``hit``, each of them followed by a distinct suffix of ``suffix_len`` (a chat turn on it: all
    of the fresh prompt is its cached prefix, the suffix new); ``one_user``, the first of them with
    another suffix. Seeds ``seed`` to ``seed + 2``, one per part, so that no suffix starts like
    another and a hit shares no block with any prompt but its own."""
    fresh = distinct_prompts(z["requests"], z["prompt_len"], vocab, seed)
    hit_suffixes = distinct_prompts(z["requests"], z["suffix_len"], vocab, seed + 1)
    user_suffix = distinct_prompts(1, z["suffix_len"], vocab, seed + 2)[0]

    def turn(prompt: dict, suffix: dict) -> dict:
        return {"prompt_token_ids": prompt["prompt_token_ids"] + suffix["prompt_token_ids"]}

    return {"fresh": fresh, "hit": [turn(p, x) for p, x in zip(fresh, hit_suffixes)],
            "one_user": [turn(fresh[0], user_suffix)]}


def ttft_long_source(sizes: dict) -> str | None:
    """The scenario of the plan, run before ttft, whose call already timed a fresh prompt of ttft's
    ``long_len`` at batch 1: ``long``, else ``latency`` at that context (a fresh prompt when long
    is not that length: it is long's prompt, prefix-cached, only when long is). ttft's long part
    reads that request's time to first token instead of paying the same prefill again (11 s at
    128K on the H200): the same measurement, one request alone arriving at an idle engine with
    nothing of it cached (the 255 tokens latency decodes after its first do not change it). None:
    ttft sends its own."""
    n = sizes["ttft"]["long_len"]
    if sizes.get("long", {}).get("prompt_len") == n:
        return "long"
    if n in sizes.get("latency", {}).get("contexts", []):
        return "latency"
    return None


def _p90(values: list[float]) -> float:
    """The nearest-rank 90th percentile: the smallest value at least 90% of them do not exceed."""
    return sorted(values)[math.ceil(0.9 * len(values)) - 1]


def _first_tokens(part: str, call: Call) -> dict:
    """One ttft call's figures under ``part``: its requests' median and p90 time to first token,
    its seconds and the prompt tokens the prefix cache served a request (the median)."""
    times = [first_token_s(r) for r in call.results]
    return {f"{part}_ttft_median_s": round(statistics.median(times), 3), f"{part}_ttft_p90_s": round(_p90(times), 3),
            f"{part}_s": round(call.seconds, 3),
            f"{part}_cached_tokens": statistics.median_low([r.num_cached_tokens or 0 for r in call.results])}


def _ttft(timed, sizes, vocab, result) -> None:
    z = sizes["ttft"]
    prompts = ttft_prompts(z, vocab)
    fresh = timed(prompts["fresh"], 1, "ttft")  # every prompt's own prefill, all sent at once
    hit = timed(prompts["hit"], 1, "ttft")  # a new turn on each: its prefix hit, then the suffix
    user = timed(prompts["one_user"], 1, "ttft")  # a new turn on one, alone
    out = {**z, **_first_tokens("fresh", fresh), **_first_tokens("hit", hit),
           "one_user_ttft_s": round(first_token_s(user.results[0]), 3),
           "one_user_cached_tokens": user.results[0].num_cached_tokens or 0}
    source = ttft_long_source(sizes)
    if source == "long":
        seconds = result["long"]["ttft_s"]
    elif source == "latency":
        seconds = next(r["ttft_s"] for r in result["latency"]["per_context"] if r["context"] == z["long_len"])
    else:
        long = timed(distinct_prompts(1, z["long_len"], vocab, SEEDS["ttft_long"]), 1, "ttft")
        seconds = first_token_s(long.results[0])
    result["ttft"] = {**out, "long_ttft_s": round(seconds, 3), "long_prefill_tok_s": round(z["long_len"] / seconds, 1),
                      "long_from": source or "ttft"}


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
                 "ttft": _ttft, "short": _fresh_batch("short"), "fresh": _fresh_batch("fresh"),
                 "reasoning": _fresh_batch("reasoning"), "overflow": _fresh_batch("overflow"), "capacity": _capacity}


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
    elif name == "ttft":
        # Its fresh batch, the batch of hits with a new suffix each, and a hit alone; the long
        # prompt as long's warm-up has it, where ttft sends its own.
        for part in ttft_prompts({**z, "requests": 2}, vocab, TTFT_WARM_UP_SEED).values():
            llm.generate(part, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
        if not ttft_long_source(sizes):
            run(1, min(z["long_len"], 2 * chunk + 1), 1)
    elif name == "short":
        run(4, 1024, 16)
    elif name in ("reasoning", "overflow"):
        run(8, min(z["prompt_len"], 2048), 16)
    elif name == "capacity":
        run(2, min(z["prompt_len"], 2 * chunk + 1), 8)


def expand_scenarios(names: list[str]) -> list[str]:
    """``--scenarios`` with the presets expanded and ``none`` dropped, in the order they run."""
    wanted = {s for n in names for s in PRESETS.get(PRESET_ALIASES.get(n, n), [n]) if s != "none"}
    return [s for s in SCENARIOS if s in wanted]
