"""Where a decode step's time goes inside vLLM: one engine in this process, distinct prompts
prefilled (and prefix-cached) first, then a profiled decode run. Prints the time per output
token, the GPU time its kernels add up to (a step far longer than its kernels waits on the
host), the kernels that take it, and the host syncs per token by the line that asks for them.

    python -m benchmarks.profile_decode --backend OSCAR --batch 32 --context 16384
    python -m benchmarks.profile_decode --backend FLASH_ATTN --batch 32 --context 16384
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time
import warnings
from pathlib import Path

import torch

from benchmarks.ab import QWEN3_8B_CONFIG, distinct_prompts, dummy_long_context

# What torch's sync debug mode says of each synchronizing call (c10/cuda's warn_or_error).
SYNC_WARNING = "called a synchronizing CUDA operation"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="OSCAR")
    p.add_argument("--model", help="model folder (default: the Qwen3-8B shape, dummy weights)")
    p.add_argument("--rotations", default="hadamard", help="OSCAR rotation path (default: %(default)s)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--steps", type=int, default=32, help="decode steps profiled (default: %(default)s)")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--trace", help="also write a Chrome trace (chrome://tracing, Perfetto) here")
    args = p.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, for the profiler
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams

    model = args.model
    if model is None:
        model = tempfile.mkdtemp(prefix="qwen3-8b-shape-")
        (Path(model) / "config.json").write_text(QWEN3_8B_CONFIG.read_text())
    max_model_len = args.context + args.steps + 64
    cfg = json.loads((Path(model) / "config.json").read_text())
    kw = dummy_long_context(cfg, max_model_len)
    if args.backend == "OSCAR":
        kw["additional_config"] = {"oscar": {"rotation_path": args.rotations}}
    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, attention_backend=args.backend,
              max_model_len=max_model_len, max_num_seqs=args.batch, seed=0, **kw)
    prompts = distinct_prompts(args.batch, args.context, int(cfg.get("vocab_size", 32000)), seed=0)
    llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)  # prefill, cached
    sp = SamplingParams(max_tokens=args.steps, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)  # every kernel variant compiled before the profile
    t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    plain = time.perf_counter() - t0  # the profiler's own CPU cost stays out of this one
    # CPU too: a step that waits on the host shows its syncs and copies among the CPU events.
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events)
    print(f"{args.backend}: batch {args.batch}, context {args.context}: {1000 * plain / args.steps:.2f} ms per "
          f"output token ({1000 * wall / args.steps:.2f} ms profiled); the kernels add up to "
          f"{gpu_us / 1000 / args.steps:.2f} ms per token "
          f"(GPU busy {100 * gpu_us / 1e6 / wall:.0f}% of the wall time)")
    print(events.table(sort_by="self_device_time_total", row_limit=args.top, max_name_column_width=80))
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=80))
    if args.trace:
        prof.export_chrome_trace(args.trace)
    # Host syncs: at each one the host's work on the next step cannot overlap the GPU's (vLLM's
    # async scheduling). One more run under torch's sync debug mode, counted by the Python line
    # that asked for the sync.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            llm.generate(prompts, sp, use_tqdm=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = sync_sites(caught)
    print(f"{args.backend}: {sum(sites.values()) / args.steps:.1f} host syncs per output token, "
          "by where they are asked:")
    for site, n in sites.most_common(args.top):
        print(f"{n:8d}  {site}")


def sync_sites(caught: list[warnings.WarningMessage]) -> collections.Counter:
    """``file:line`` of each synchronizing call torch's sync debug mode warned about.

    Matched on the warning's own text: turning the mode on warns too ("Synchronization debug mode
    is a prototype feature and does not yet detect all synchronizing operations", from inside
    ``torch.cuda.set_sync_debug_mode``), and that is no sync.
    """
    return collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught
                               if SYNC_WARNING in str(w.message))


if __name__ == "__main__":
    main()
