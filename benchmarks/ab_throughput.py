"""A/B throughput of vLLM engines side by side: OSCAR against vLLM's own KV caches, each
configuration in its own process, every prompt distinct (a shared prompt would be served
from the prefix cache and L2 and flatter everyone).

    python benchmarks/ab_throughput.py --out results/ab                     # Qwen3-8B shape, dummy weights
    python benchmarks/ab_throughput.py --model /path/to/model --configs OSCAR FLASH_ATTN fp8
    python benchmarks/ab_throughput.py --gpus 2 --scenarios none --max-num-seqs-sweep 32 256
    python benchmarks/ab_throughput.py --report results/ab                  # tables and plots again

Configurations (``--configs``): ``OSCAR`` (``attention_backend="OSCAR"``), ``FLASH_ATTN`` (BF16,
vLLM's default), ``fp8`` (``kv_cache_dtype="fp8"``), ``int4`` (``int4_per_token_head``),
``turboquant`` (``turboquant_4bit_nc``; needs vLLM's FlashAttention 2 build). A configuration
that fails to start is reported with its error, not dropped. ``--gpus N`` runs up to N
configurations at once, one GPU each (``CUDA_VISIBLE_DEVICES``); each worker logs to
``OUT/log_<config>.txt``.

Scenarios (``--scenarios``, ``none`` for the sweep alone; sizes are options):
  prefill   N distinct prompts of L tokens, one output token: prefill tokens/s
  decode    the same prompts again (prefix-cached) for K output tokens: decode tokens/s and
            time per output token, the one-token rerun subtracted
  long      one prompt of --long-prompt tokens: prefill tokens/s of a single long request
  short     S concurrent requests of 1K prompt / 1K output (memory not binding): output tokens/s
  capacity  C requests of ~100K tokens in two passes. The first (one output token) is their
            prefill, which dominates a single pass in every configuration; it leaves the contexts
            in the prefix cache only as far as the KV cache holds them. The second sends the
            same prompts for --capacity-output-len tokens, a multi-turn follow-up on long
            documents: a cache that holds all C contexts decodes them at once, BF16 must
            re-prefill the ones it evicted and runs them a few at a time. Reported: the
            second pass's seconds and output tokens/s, and the first pass's seconds.
KV capacity (tokens) is read from every engine. ``--engine-args '{"max_num_seqs": 32}'`` sets
vLLM engine arguments for all configurations (default: vLLM's own defaults).
``--max-num-seqs-sweep 32 256`` also starts every configuration once per value with that
``max_num_seqs`` (and ``enforce_eager=True``, to start fast), reads its KV capacity and stops:
the table "KV cache capacity by max_num_seqs".
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

CONFIGS = {
    "OSCAR": {"attention_backend": "OSCAR"},
    "FLASH_ATTN": {"attention_backend": "FLASH_ATTN"},
    "fp8": {"kv_cache_dtype": "fp8"},
    "int4": {"kv_cache_dtype": "int4_per_token_head"},
    "turboquant": {"kv_cache_dtype": "turboquant_4bit_nc"},
}
SCENARIOS = ["prefill", "decode", "long", "short", "capacity"]
BASELINE = "FLASH_ATTN"
# The Qwen3-8B architecture (its config.json), for runs with dummy weights.
QWEN3_8B_CONFIG = Path(__file__).parent / "configs" / "qwen3-8b.json"


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
    """``n`` prompts of ``length`` random token ids, different from the first token on."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(length)]} for _ in range(n)]


def model_len(args, scenarios) -> int:
    """The longest request ``scenarios`` send, plus a margin."""
    return 64 + max([args.prompt_len + args.output_len, 2048 + 1024]
                    + ([args.long_prompt + 1] if "long" in scenarios else [])
                    + ([args.capacity_len + args.capacity_output_len] if "capacity" in scenarios else []))


def stub(name: str, seqs: int | None) -> dict:
    """What identifies a result file (``report`` reads the configuration from it, not the file name)."""
    return {"config": name, **({"sweep_max_num_seqs": seqs} if seqs else {})}


def oscar_window_blocks(vllm_config) -> int:
    """KV cache blocks one running request's OSCAR windows take (as the engine's scheduler counts)."""
    from types import SimpleNamespace

    from oscar_vllm.settings import OscarSettings
    from oscar_vllm.vllm_hooks import window_pages_of_group

    model = vllm_config.model_config
    spec = SimpleNamespace(block_size=vllm_config.cache_config.block_size, head_size=model.get_head_size(),
                           num_kv_heads=model.get_num_kv_heads(vllm_config.parallel_config))
    sink, recent, _ = window_pages_of_group(spec, OscarSettings.from_vllm_config(vllm_config))
    return sink + recent


def run_worker(args) -> dict:
    """One engine, every scenario (or, with ``--sweep-seqs``, its KV capacity alone), one JSON result."""
    from vllm import LLM, SamplingParams

    cfg = json.loads((Path(args.model) / "config.json").read_text()) if Path(args.model).is_dir() else {}
    vocab = int(cfg.get("vocab_size", 32000))
    has_weights = Path(args.model).is_dir() and any(Path(args.model).glob("*.safetensors"))
    kw = dict(CONFIGS[args.worker])
    if args.worker == "OSCAR":
        kw["additional_config"] = {"oscar": {"rotation_path": args.rotations}}
    kw.update(json.loads(args.engine_args))
    kw.setdefault("jit_monitor_verbose", True)  # log every kernel compiled while serving, not each name once
    # A sweep run alone (--scenarios none) sizes max_model_len for every scenario, as the default run does.
    kw.setdefault("max_model_len", model_len(args, args.scenarios or SCENARIOS))
    if args.sweep_seqs:
        kw.update(max_num_seqs=args.sweep_seqs, enforce_eager=True)  # no CUDA graphs to capture: starts fast
    if not has_weights:
        kw.update(load_format="dummy")
        kw = {**dummy_long_context(cfg, kw["max_model_len"]), **kw}
    result = {**stub(args.worker, args.sweep_seqs),
              "engine_args": {k: v for k, v in kw.items() if k != "additional_config"}}
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
        return result

    spans = result["spans"] = {}  # scenario -> [[start, end]] wall-clock seconds of its timed calls

    def timed(prompts, max_tokens, scenario):
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
        t, wall = time.perf_counter(), time.time()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        spans.setdefault(scenario, []).append([wall, time.time()])
        return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)

    llm.generate(distinct_prompts(2, 512, vocab, 99), SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    if not args.no_warmup:
        warm_up(llm, args, vocab)
    if "prefill" in args.scenarios or "decode" in args.scenarios:
        prompts = distinct_prompts(args.num_prompts, args.prompt_len, vocab, 1)
        s, _ = timed(prompts, 1, "prefill")
        result["prefill"] = {"requests": args.num_prompts, "prompt_len": args.prompt_len, "seconds": round(s, 3),
                             "prefill_tok_s": round(args.num_prompts * args.prompt_len / s, 1)}
        if "decode" in args.scenarios:
            s1, _ = timed(prompts, 1, "decode")  # prefix-cached: what the decode run pays before decoding
            sk, n = timed(prompts, args.output_len, "decode")
            steps = args.output_len - 1
            result["decode"] = {"requests": args.num_prompts, "context": args.prompt_len,
                                "output_len": args.output_len, "seconds": round(sk - s1, 3),
                                "decode_tok_s": round(args.num_prompts * steps / (sk - s1), 1),
                                "tpot_ms": round(1000 * (sk - s1) / steps, 3), "outputs": n}
    if "long" in args.scenarios:
        s, _ = timed(distinct_prompts(1, args.long_prompt, vocab, 2), 1, "long")
        result["long"] = {"prompt_len": args.long_prompt, "seconds": round(s, 3),
                          "prefill_tok_s": round(args.long_prompt / s, 1)}
    if "short" in args.scenarios:
        prompts = distinct_prompts(args.short_requests, 1024, vocab, 3)
        s, n = timed(prompts, 1024, "short")
        result["short"] = {"requests": args.short_requests, "prompt_len": 1024, "output_len": 1024,
                           "seconds": round(s, 3), "output_tok_s": round(n / s, 1)}
    if "capacity" in args.scenarios:
        c, k = args.capacity_requests, args.capacity_output_len
        prompts = distinct_prompts(c, args.capacity_len, vocab, 4)
        s1, _ = timed(prompts, 1, "capacity")  # the prefill; what of it the KV cache holds stays prefix-cached
        s, n = timed(prompts, k, "capacity")  # the follow-up (see the module docstring)
        result["capacity"] = {"requests": c, "prompt_len": args.capacity_len, "output_len": k,
                              "first_pass_s": round(s1, 3), "seconds": round(s, 3),
                              "output_tok_s": round(c * k / s, 1), "outputs": n}
    return result


def warm_up(llm, args, vocab: int) -> None:
    """Each scenario once, small and untimed, so that kernels compiled for its batch shapes
    (Triton specializes on sizes) are compiled before the timed calls: a one-time cost a
    serving user pays once, not per request."""
    from vllm import SamplingParams

    def run(n: int, length: int, out: int) -> None:
        prompts = distinct_prompts(n, length, vocab, 1000 + n + length)
        for max_tokens in (1, out):  # prefill, then the prefix-cached rerun that decodes
            llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)

    chunk = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    if {"prefill", "decode"} & set(args.scenarios):
        run(2, args.prompt_len, 8)
    if "long" in args.scenarios:
        run(1, min(args.long_prompt, 2 * chunk + 1), 1)  # chunks over a cached prefix, one request
    if "short" in args.scenarios:
        run(4, 1024, 16)
    if "capacity" in args.scenarios:
        run(2, min(args.capacity_len, 2 * chunk + 1), 8)


# --- the pool of GPUs: one worker process (group) per GPU at a time -------------------------

@dataclass
class Job:
    label: str  # for the progress lines
    cmd: list[str]
    result: Path  # run_<...>.json; its log is log_<...>.txt beside it
    stub: dict  # written with an error when the worker leaves no result

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
    A result written before the timeout stands: only the engine's shutdown hung."""
    if not job.result.exists():
        error = timed_out or f"the worker exited with status {returncode} and no result (see {job.log.name})"
        job.result.write_text(json.dumps({**job.stub, "error": error}))
    result = json.loads(job.result.read_text())
    if job.log.exists() and "spans" in result:
        result = mark_jit_compiles(result, job.log.read_text(errors="replace"), time.localtime().tm_year)
        job.result.write_text(json.dumps(result, indent=1))
    error = result.get("error")
    print(f"end {job.label} on GPU {gpu}: {seconds:.0f} s, " + (f"failed: {error}" if error else "ok"), flush=True)
    if error:
        tail = job.log.read_text(errors="replace").splitlines()[-20:]
        print(f"--- last lines of {job.log}:\n" + "\n".join(tail) + "\n---", flush=True)


def run_pool(jobs: list[Job], gpus: list[str], timeout: float, poll_s: float = 0.5) -> None:
    """Run ``jobs`` in order, at most one per GPU of ``gpus`` at a time, each ended (with its
    process group) after ``timeout`` seconds. Every job leaves its result file."""
    queue, free, running = list(jobs), list(gpus), {}  # running: process -> (job, gpu, start)
    try:
        while queue or running:
            while queue and free:
                job, gpu = queue.pop(0), free.pop(0)
                running[_start(job, gpu)] = (job, gpu, time.monotonic())
            time.sleep(poll_s)
            for proc, (job, gpu, t0) in list(running.items()):
                done = proc.poll() is not None
                late = not done and time.monotonic() - t0 > timeout
                if not (done or late):
                    continue
                _end_group(proc.pid)  # on exit too: whatever the worker left behind
                proc.wait()
                del running[proc]
                free.append(gpu)
                _finish(job, gpu, time.monotonic() - t0, proc.returncode,
                        f"timed out after {timeout:g} s" if late else None)
    finally:  # an interrupt or an error here: no engine outlives the parent
        for proc in running:
            _end_group(proc.pid)


# --- the report -----------------------------------------------------------------------------

METRICS = [  # (scenario, field, label, higher is better)
    (None, "kv_cache_tokens", "KV cache capacity (tokens)", True),
    (None, "kv_tokens_all_running", "KV tokens left with all max_num_seqs requests running", True),
    ("prefill", "prefill_tok_s", "prefill tok/s, {requests} x {prompt_len} distinct prompts", True),
    ("decode", "decode_tok_s", "decode tok/s, {requests} x {context} context, prefix-cached", True),
    ("decode", "tpot_ms", "time per output token (ms), same run", False),
    ("long", "prefill_tok_s", "prefill tok/s, 1 x {prompt_len} prompt", True),
    ("short", "output_tok_s", "output tok/s, {requests} x (1K in, 1K out)", True),
    ("capacity", "first_pass_s", "capacity, first pass (s): prefill of {requests} x ~{prompt_len}, 1 token out", False),
    ("capacity", "output_tok_s",
     "capacity, follow-up output tok/s: the same {requests} prompts, {output_len} out each", True),
]


def _line(label: str, cols: list[str], runs: dict, values: dict, b, higher: bool, csv: list, plot_rows: list | None,
          metric: str | None = None) -> str:
    """One table line: each configuration's value and its ratio to the baseline's ``b``; the same
    into ``csv`` and (if given) ``plot_rows`` under ``metric`` (default: ``label``)."""
    metric, cells = metric or label, []
    for c in cols:
        v = values.get(c)
        if "error" in runs.get(c, {}):
            cells.append("failed")
        elif v is None:
            cells.append("")
        else:
            ratio = (v / b if higher else b / v) if b and v else None
            cells.append(f"{v:,}" + (f" ({ratio:.2f}x)" if ratio and c != BASELINE else ""))
            csv.append(f"\"{metric}\",{c},{v},{'' if ratio is None else round(ratio, 4)}")
            if ratio and plot_rows is not None:
                plot_rows.append((metric, c, ratio))
    return f"| {label} | " + " | ".join(cells) + " |"


def report(out: Path) -> str:
    """``ab.md`` / ``ab.csv`` / ``ab.png`` from the per-configuration JSON files in ``out``."""
    runs, sweep = {}, {}  # config -> result; (max_num_seqs, config) -> result of the sweep
    for p in sorted(out.glob("run_*.json")):
        r = json.loads(p.read_text())
        if r.get("sweep_max_num_seqs"):
            sweep[(r["sweep_max_num_seqs"], r["config"])] = r
        else:
            runs[r["config"]] = r
    meta = json.loads((out / "meta.json").read_text())
    names = [c for c in CONFIGS if c in runs]
    lines = [f"# A/B throughput: {meta['model']}", "",
             f"- date: {meta['date']}; hardware: {meta['hardware']}", f"- command: `{meta['command']}`",
             f"- {meta['versions']}", f"- engine arguments: {meta['engine_args']} (else vLLM's defaults)",
             "- every request has its own prompt; ratios are against FLASH_ATTN (BF16) in the same run"]
    if meta.get("gpus", 1) > 1:
        lines.append(f"- {meta['gpus']} configurations at a time, one GPU each (sharing the host's CPUs)")
    csv, plot_rows = ["metric,config,value,ratio_vs_bf16"], []
    if names:
        lines += ["", "| metric | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for scen, field, label, higher in METRICS:
        got = {n: (runs[n].get(scen) or {}) if scen else runs[n] for n in names}
        if not any(field in g for g in got.values()):
            continue
        label = label.format(**next(g for g in got.values() if field in g)) if scen else label
        values = {n: g.get(field) for n, g in got.items()}
        lines.append(_line(label, names, runs, values, values.get(BASELINE), higher, csv, plot_rows))
    compiled = [f"{n} {scen}: {', '.join(r[scen]['jit_compiles'])}" for n, r in runs.items()
                for scen in SCENARIOS if isinstance(r.get(scen), dict) and r[scen].get("jit_compiles")]
    if compiled:
        lines += ["", "Triton kernels vLLM logged compiling inside a timed call (their compile time is in that "
                  "scenario's numbers): " + "; ".join(compiled) + "."]
    failed = [(n, runs[n]) for n in names if "error" in runs[n]]
    if sweep:
        rows = {}  # label -> config -> result
        if runs:  # the main runs, at the max_num_seqs vLLM chose (or --engine-args set)
            seqs = "/".join(map(str, sorted({r["max_num_seqs"] for r in runs.values() if "max_num_seqs" in r})))
            eager = any(r.get("engine_args", {}).get("enforce_eager") for r in runs.values())
            rows[f"{seqs or '?'} (main run, {'eager' if eager else 'CUDA graphs'})"] = runs
        for v in sorted({v for v, _ in sweep}):
            rows[f"{v} (enforce_eager)"] = row = {c: sweep[v, c] for c in CONFIGS if (v, c) in sweep}
            failed += [(f"{c} (max_num_seqs={v})", r) for c, r in row.items() if "error" in r]
        cols = [c for c in CONFIGS if any(c in row for row in rows.values())]
        # A bold label, not a heading: the file is spliced into pages whose headings frame it.
        lines += ["", "**KV cache capacity by max_num_seqs**", "",
                  "KV cache tokens of engines started with that max_num_seqs and enforce_eager=True (to start "
                  "fast), then stopped (\"main run\": the scenarios' engines); ratios against FLASH_ATTN "
                  "in the same row", "",
                  "| max_num_seqs | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
        for label, row in rows.items():
            values = {c: r.get("kv_cache_tokens") for c, r in row.items()}
            lines.append(_line(label, cols, row, values, values.get(BASELINE), True, csv,
                               None if row is runs else plot_rows,  # the main table plots that one
                               metric=f"KV cache capacity (tokens), max_num_seqs {label}"))
        if any("kv_tokens_all_running" in r for row in rows.values() for r in row.values()):
            lines += ["", "OSCAR's BF16 windows are blocks of that pool, taken per running request; with all "
                      "max_num_seqs requests running, this much is left for KV tokens:", "",
                      "| max_num_seqs | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
            for label, row in rows.items():
                values = {c: r.get("kv_tokens_all_running") for c, r in row.items()}
                lines.append(_line(label, cols, row, values, values.get(BASELINE), True, csv, None,
                                   metric=f"KV tokens left with all running, max_num_seqs {label}"))
    for n, r in failed:
        lines.append(f"\n**{n} failed:** `{r['error']}`")
    text = "\n".join(lines) + "\n"
    (out / "ab.md").write_text(text)
    (out / "ab.csv").write_text("\n".join(csv) + "\n")
    _plot(plot_rows, out / "ab.png", meta)
    return text


def _plot(rows, path: Path, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r[0] for r in rows))
    names = list(dict.fromkeys(r[1] for r in rows))
    if not labels:
        return
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(labels) * max(1, len(names)) / 2 + 2))
    h = 0.8 / len(names)
    for i, n in enumerate(names):
        vals = [next((r[2] for r in rows if r[0] == lab and r[1] == n), 0) for lab in labels]
        ax.barh([j + i * h for j in range(len(labels))], vals, height=h, label=n)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks([j + 0.4 - h / 2 for j in range(len(labels))], labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ratio to FLASH_ATTN (BF16), higher is better")
    ax.set_title(f"{meta['model']}, {meta['hardware']}, {meta['date']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[1:]))
    p.add_argument("--model", default=None, help="model id or folder (default: a Qwen3-8B-shaped config, dummy weights)")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--scenarios", nargs="*", default=SCENARIOS, choices=[*SCENARIOS, "none"],
                   help="none (or no value): only the --max-num-seqs-sweep")
    p.add_argument("--rotations", default="hadamard",
                   help="OSCAR rotation path (default: hadamard; speed does not depend on the rotation values)")
    p.add_argument("--engine-args", default="{}", help="JSON of vLLM engine arguments for every configuration")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=16384)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--long-prompt", type=int, default=131072)
    p.add_argument("--short-requests", type=int, default=64)
    p.add_argument("--capacity-requests", type=int, default=32)
    p.add_argument("--capacity-len", type=int, default=100000)
    p.add_argument("--capacity-output-len", type=int, default=256, help="output tokens of the capacity follow-up")
    p.add_argument("--no-warmup", action="store_true",
                   help="time each scenario cold (default: each runs once, small and untimed, first)")
    p.add_argument("--max-num-seqs-sweep", type=int, nargs="*", default=[], metavar="N",
                   help="also start each configuration with max_num_seqs=N (eager) and read only its KV capacity")
    p.add_argument("--gpus", type=int, default=1, help="configurations run at once, one GPU each (default 1)")
    p.add_argument("--out", default="results/ab")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per configuration (and per sweep run)")
    p.add_argument("--report", metavar="DIR", help="only rebuild the tables and plot from DIR")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--sweep-seqs", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.scenarios = [s for s in args.scenarios if s != "none"]
    if args.report:
        print(report(Path(args.report)))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        try:
            res = run_worker(args)
        except Exception as e:  # noqa: BLE001  (the table says why a configuration failed)
            traceback.print_exc()  # into its log, whose tail the parent prints
            res = {**stub(args.worker, args.sweep_seqs), "error": f"{type(e).__name__}: {str(e)[:400]}"}
        tmp = Path(args.result + ".tmp")  # then renamed: a worker killed while writing leaves no half file
        tmp.write_text(json.dumps(res, indent=1))
        tmp.replace(args.result)
        return
    if not args.scenarios and not args.max_num_seqs_sweep:
        p.error("nothing to run: no --scenarios and no --max-num-seqs-sweep")
    if args.model is None:
        args.model = str(out / "qwen3-8b-shape")
        Path(args.model).mkdir(exist_ok=True)
        (Path(args.model) / "config.json").write_text(QWEN3_8B_CONFIG.read_text())
    import torch

    if torch.cuda.is_available() and args.gpus > torch.cuda.device_count():
        p.error(f"--gpus {args.gpus}, but {torch.cuda.device_count()} GPUs are visible")
    try:
        gpus = gpu_slots(args.gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    except ValueError as e:
        p.error(str(e))
    # In a child process: a CUDA context left in this one would take GPU memory from a worker.
    env = json.loads(subprocess.run(
        [sys.executable, "-c", "import json; from oscar_vllm.evaluate import environment; "
         "print(json.dumps(environment('python benchmarks/ab_throughput.py')))"],
        capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
    env["command"] = f"python benchmarks/ab_throughput.py {shlex.join(sys.argv[1:])}".strip()
    env["versions"] += "".join(f", {pkg} {_version(pkg)}" for pkg in ("vllm", "triton"))
    model_name = "Qwen3-8B shape, dummy weights" if args.model.endswith("qwen3-8b-shape") else args.model
    (out / "meta.json").write_text(json.dumps({**env, "model": model_name, "engine_args": args.engine_args,
                                               "gpus": len(gpus)}))
    # Workers get this command line (less the configurations) and the model folder, which they
    # must not write again while another worker reads it.
    passed = [a for a in sys.argv[1:] if a not in ("--configs", *CONFIGS)]
    jobs = []
    for seqs in ([None] if args.scenarios else []) + args.max_num_seqs_sweep:  # None: the scenarios
        for name in args.configs:
            dest = out / (f"run_{name}.json" if seqs is None else f"run_{name}_seqs{seqs}.json")
            cmd = [sys.executable, __file__, *passed, "--model", args.model, "--worker", name, "--result", str(dest)]
            label = name if seqs is None else f"{name} max_num_seqs={seqs}"
            jobs.append(Job(label, cmd + (["--sweep-seqs", str(seqs)] if seqs else []), dest, stub(name, seqs)))
    run_pool(jobs, gpus, args.timeout)
    print(report(out))


if __name__ == "__main__":
    main()
