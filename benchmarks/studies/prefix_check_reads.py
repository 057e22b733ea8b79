"""The vLLM prefix check at small prefill chunks, replayed in the reference cache (CPU, SmolLM2).

``tests/gpu/e2e_vllm.py prefix --chunk 256`` sends 207 prompts at once (23 windows of a shared
512-token prefix plus held-out text, each cut at 9 lengths) through vLLM with prefix caching on
and off, and scores each prompt's last position. What each of those positions reads in BF16
depends on the request's hit and on the chunks the scheduler cut its prompt into, which depend
on everything else in the batch. This runs vLLM's own scheduler on the CPU (no model; a
SmolLM2-shaped OSCAR engine config, the plugin's window-page hooks installed, every request
finishing its prefill with one sampled token and its second token a step later, as in the check)
to get every request's hit and chunks, then scores the same positions in the reference cache
(``oscar_vllm.core.mixed_cache``): each position of a prompt reads the keys past the sink in
BF16 from its chunk's ring on (the ring holds only what the request computed itself), and a
cached position's keys are what the request that wrote its block computed.

    python -m benchmarks.studies.prefix_check_reads --out results/windows/prefix_check_reads  # ~19 min a configuration
    python -m benchmarks.studies.prefix_check_reads --check-windows 156 --windows 40 --out DIR  # a larger check
    python -m benchmarks.studies.prefix_check_reads --report OLD/prefix_check_reads.json --out DIR  # report again

Writes ``prefix_check_reads.{md,json}`` into ``--out``: each configuration's perplexity at the
prompts' last positions, its gap to caching off, that gap's standard error (paired over the
same tokens) and one token's spread, which say how far apart two runs of the vLLM check can land
by chance and how many tokens a check needs to decide a gap. The same forward passes also score
every position that each configuration's request computes a ring past its hit (what vLLM cannot
score with prefix caching on, since it never reads the cache for prompt logprobs): the gap
there, over many more tokens, with its standard error over the windows.
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from csrc_triton.paged_layout import BLOCK_SIZE
from oscar_vllm.calibration import corpus
from oscar_vllm.calibration.evaluate import (
    CACHED_PREFIX_CUTS,
    CACHED_PREFIX_WINDOWS,
    add_served_arguments,
    cached_prefix_workload,
    environment,
    load_served,
    report_header,
    save_report,
)
from oscar_vllm.calibration.models import MixedCacheHook, attention_hooks
from oscar_vllm.core.settings import OscarSettings

RECENT = OscarSettings.recent_size  # the plugin's default recent window, the check's
# vLLM's enable_prefix_caching, the rings a hit leaves to be computed again (the plugin: one), and
# whether a hit copies the ring an ended request left instead (hit_ring "reuse"). Two rings: the
# tokens the last position reads in BF16 were themselves computed with a ring of BF16 before them,
# as in an uncached prefill, where with one ring the first of them read the cached prefix in 2-bit
# right up to themselves (what the third row measures).
CONFIGS = {"caching off": (False, 1, False), "caching on": (True, 1, False),
           "caching on, two rings recomputed": (True, 2, False), "caching on, rings reused": (True, 1, True)}


def schedule_check(windows: list[list[int]], chunk: int, caching: bool, work: Path, recent: int = RECENT,
                   rings: int = 1, reuse_rings: bool = False) -> list[dict]:
    """Every scored request of the check as vLLM's scheduler serves it: ``{"len", "chunks":
    [(first token, tokens), ...], "ring": (lo, hi) or None}`` in the check's order (the first chunk
    starts at its hit; ``ring``: the positions of the ring it copied from an ended request). Runs on
    the CPU: vLLM's ``Scheduler`` with the OSCAR hooks, fed one sampled token per request whose
    prefill a step completes; a hit stops ``rings`` rings short of the cached blocks (the plugin: 1),
    or with ``reuse_rings`` copies an ended request's ring where one serves it."""
    # vLLM's scheduler with the OSCAR hooks, on the CPU
    from benchmarks.vllm_cpu import oscar_scheduler_on_cpu, serve_on_cpu

    oscar = {"recent_size": recent, "hit_ring": "reuse" if reuse_rings else "recompute"}
    with oscar_scheduler_on_cpu(work, chunk, caching, oscar) as (scheduler, pages):
        pages.ring_blocks *= rings
        shared = windows[0][:512]
        serve_on_cpu(scheduler, [shared + [shared[0]]], "shared")  # the check caches the shared prefix first
        scored = serve_on_cpu(scheduler, [w[:512 + c] for w in windows for c in CACHED_PREFIX_CUTS], "cut")
    return [{**r, "ring": r["ring"] and r["ring"][:2]} for r in scored]


def bf16_from(scored: list[dict], cuts: int, chunk: int, recent: int = RECENT) -> list[torch.Tensor]:
    """For each scored request, where each of its positions reads keys past the sink in BF16
    from (``[len]``): its chunk's start less the ring, never below the request's hit (the ring
    holds only what the request computed), or below the first position of a ring it copied. A
    position under the hit reads as the request that wrote its block did: the earliest request of
    the same window that computed the whole block, else the one that cached the shared prefix
    (chunks of ``chunk`` from 0)."""
    def reads(request: dict, p: int) -> int:
        ring = request.get("ring")
        floor = ring[0] if ring else request["chunks"][0][0]
        start = next(a for a, n in request["chunks"] if a <= p < a + n)
        return max(start - recent + 1, floor)

    out = []
    for w in range(len(scored) // cuts):
        window = scored[w * cuts:(w + 1) * cuts]
        for k, request in enumerate(window):
            hit, starts = request["chunks"][0][0], torch.empty(request["len"], dtype=torch.long)
            for p in range(request["len"]):
                if p >= hit:
                    starts[p] = reads(request, p)
                    continue
                writer = next((q for q in window[:k] if q["chunks"][0][0] <= p < q["len"] // BLOCK_SIZE * BLOCK_SIZE),
                              None)
                starts[p] = max(p // chunk * chunk - recent + 1, 0) if writer is None else reads(writer, p)
            out.append(starts)
    return out


def paired_gap(nll: list[float], base: list[float]) -> tuple[float, float, float]:
    """Mean NLL difference over the same tokens, its standard error, and the spread (SD) of one
    token's difference."""
    diff = torch.tensor(nll) - torch.tensor(base)
    sd = diff.std().item()
    return diff.mean().item(), sd / math.sqrt(len(diff)), sd


def report(result: dict, meta: dict) -> str:
    off = result["caching off"]["nll"]
    rows = []
    for name, r in result.items():
        gap, se, sd = paired_gap(r["nll"], off)
        rows.append(f"| {name} | {r['mean_hit']:.0f} | {r['ppl']:.3f} | {100 * gap:+.2f}% | {100 * se:.2f}% "
                    f"| {100 * sd:.1f}% |")
    tail = []
    if all("tail_nll" in r for r in result.values()):
        tail = ["Every position that each configuration's request computes a ring past its hit (read as the "
                "last position is, at other offsets; SE over the windows, whose prompts share positions):", "",
                "| configuration | positions | gap | SE |", "|---|---|---|---|"]
        per_window = len(CACHED_PREFIX_CUTS)
        for name, r in result.items():
            diff = torch.tensor(r["tail_nll"]) - torch.tensor(result["caching off"]["tail_nll"])
            windows = diff.view(-1, per_window).mean(1)
            se = windows.std().item() / math.sqrt(len(windows)) if len(windows) > 1 else float("nan")
            tail.append(f"| {name} | {r['tail_tokens']:,} | {100 * windows.mean().item():+.2f}% | {100 * se:.2f}% |")
        tail.append("")
    rings = []
    against = {"caching on, two rings recomputed": "Two rings recomputed against one (the plugin's)",
               "caching on, rings reused": "Rings reused against one recomputed (the plugin's default)"}
    for name, label in against.items():
        if {"caching on", name} <= result.keys():
            gap, se, sd = paired_gap(result[name]["nll"], result["caching on"]["nll"])
            rings += [f"{label}, paired over the same tokens: {100 * gap:+.2f}% ± {100 * se:.2f}% "
                      f"(per-token SD {100 * sd:.1f}%).", ""]
    check_windows = meta.get("check_windows", CACHED_PREFIX_WINDOWS)  # older runs: the 23-window check
    return "\n".join([
        "# The vLLM prefix check at small chunks, in the reference cache", "",
        *report_header(meta),
        f"- rotations: {meta['rotations']} ({meta['method']}); sink 64, recent 256; prefill chunks of {meta['chunk']}",
        f"- the check's first {meta['windows']} windows of {check_windows} ({meta['tokens']} of its "
        f"{check_windows * len(CACHED_PREFIX_CUTS)} scored tokens), hits and chunks from vLLM's "
        "scheduler run on the CPU with the OSCAR hooks",
        "- gap: mean NLL difference to caching off over the same tokens (about the perplexity ratio less 1); "
        "SE: its standard error; SD: the spread of one token's difference (what any change of schedule moves "
        "a token's NLL by)", "",
        "| configuration | mean hit (tokens) | perplexity, prompt's last position | gap | SE | SD per token |",
        "|---|---|---|---|---|---|", *rows, "", *rings, *tail])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_served_arguments(p, "runs/prefix_check_reads", device=False)  # vLLM's scheduler runs on the CPU
    p.add_argument("--check-windows", type=int, default=CACHED_PREFIX_WINDOWS,
                   help="the check's windows, as its --windows (default: %(default)s)")
    p.add_argument("--windows", type=int, help="the check's first windows to score (default: all)")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk, vLLM's max_num_batched_tokens (default: 256)")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                   help="configurations to score ('caching off' always)")
    p.add_argument("--report", type=Path, metavar="JSON",
                   help="write the report of an earlier run's prefix_check_reads.json into --out, scoring nothing")
    args = p.parse_args()
    args.configs = ["caching off", *(c for c in args.configs if c != "caching off")]
    if args.report:
        data = json.loads(args.report.read_text())
        save_report(args.out, "prefix_check_reads", data, report(data["result"], data["meta"]))
        return

    loaded, method, oscar = load_served(args, dense_prefill=True)  # prompt chunks of a 16-bit model
    _, _, windows = cached_prefix_workload(corpus.tokenize(loaded.tokenizer, corpus.evaluation_text()).tolist(),
                                           args.check_windows)
    args.windows = min(args.windows or args.check_windows, args.check_windows)
    cuts = len(CACHED_PREFIX_CUTS)
    schedules = {}
    for name in args.configs:
        caching, rings, reuse = CONFIGS[name]
        with tempfile.TemporaryDirectory() as work:  # the model's config.json, for vLLM's engine config
            scored = schedule_check(windows, args.chunk, caching, Path(work), rings=rings, reuse_rings=reuse)
        schedules[name] = scored[:args.windows * cuts]
    # Every position a prompt's request computes in every configuration, a ring past its latest hit:
    # read as the prompt's last position is (a BF16 ring its own request computed), at other offsets.
    tail_from = [max(s[i]["chunks"][0][0] for s in schedules.values()) + RECENT
                 for i in range(args.windows * cuts)]
    result = {}
    for name, scored in schedules.items():
        nll, tail = [], []
        for i, starts in enumerate(tqdm(bf16_from(scored, cuts, args.chunk), desc=name, unit="prompt")):
            ids = torch.tensor(windows[i // cuts][:len(starts) + 1])
            with torch.no_grad(), attention_hooks(loaded.model, lambda layer: MixedCacheHook(
                    oscar[layer], 64, 0, chunk_starts=starts)):
                logits = loaded.model(ids[None, :-1], use_cache=False).logits[0]
            token_nll = -torch.log_softmax(logits[tail_from[i]:].float(), -1).gather(
                -1, ids[tail_from[i] + 1:, None])[:, 0]
            nll.append(token_nll[-1].item())
            tail.append(token_nll.mean().item())
        result[name] = {"nll": nll, "ppl": math.exp(sum(nll) / len(nll)), "tail_nll": tail,
                        "tail_tokens": sum(r["len"] - t for r, t in zip(scored, tail_from)),
                        "mean_hit": sum(r["chunks"][0][0] for r in scored) / len(scored)}
    meta = {**environment("python -m benchmarks.studies.prefix_check_reads"), "model": loaded.name, "dtype": args.dtype,
            "rotations": str(args.rotations), "method": method.name, "chunk": args.chunk, "windows": args.windows,
            "check_windows": args.check_windows, "tokens": args.windows * cuts}
    save_report(args.out, "prefix_check_reads", {"meta": meta, "result": result}, report(result, meta))


if __name__ == "__main__":
    main()
