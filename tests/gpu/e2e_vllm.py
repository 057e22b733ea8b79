"""End-to-end checks of the OSCAR backend inside vLLM 0.26.0, on a GPU.

Each subcommand starts one vLLM engine (run them as separate processes: a process keeps
its GPU memory) and prints one JSON line with what it measured, prefixed ``RESULT``.

  prepare   SmolLM2-135M-Instruct as a plain HF folder; a Qwen3-8B-shaped folder (config +
            SmolLM2's tokenizer) for dummy-weight runs
  ppl       perplexity of SmolLM2 on the evaluation text, chunked prefill of 256 tokens,
            plus greedy text; with --decode-every N also of tokens each predicted by a decode step
  compare-ppl  two ppl runs' RESULT lines (their logs): each perplexity both report within a relative
            tolerance, or exit 1 (no GPU)
  qwen3     LLM(attention_backend=...) on the Qwen3-8B shape: generates, KV capacity
  decode    decode tokens/s at batch 1/32 and context 8K/32K (Qwen3-8B shape)
  serve     `oscar-vllm serve` on the Qwen3-8B shape, answered through the openai client
  preempt   window pages under preemption (a KV cache too small for the batch) and aborts, SmolLM2:
            outputs as a roomy cache gives them, and every page back in the pool at the end
  prefix    prefix caching on against off on SmolLM2 (one engine each, in subprocesses): a shared
            system prompt across requests sent together (first chunks mixed with cache hits),
            the same after a cache reset, and perplexity after a cached shared prefix (of the token
            the prompt's last position predicts, and of the one the decode step after it predicts)
  chunked   prompt logprobs through chunked prefill (chunks 256 and 8192), sent together and
            one request at a time, SmolLM2
  startup   one engine started inside this process, one token: its start time, or, if it stalls,
            every thread's stack (where a start hangs), SmolLM2
  report    the RESULT lines of prefix, preempt and chunked logs as a markdown table (no GPU)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# The Qwen3-8B architecture (its config.json), for runs with dummy weights.
QWEN3_8B_CONFIG = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "qwen3-8b.json"


def result(**kw) -> None:
    """One JSON line with what a check measured, and where and when (date, hardware, command,
    versions: the same header the fidelity reports carry)."""
    from oscar_vllm.calibration.evaluate import environment

    print("RESULT " + json.dumps({**kw, **environment("tests/gpu/e2e_vllm.py")}), flush=True)


def oscar_config(rotations: str) -> dict:
    """The rotations only: every other setting from OSCAR_* variables or its default, so that
    `OSCAR_RECENT_SIZE=320 ...` runs what it says (the JSON would win over the variable)."""
    return {"oscar": {"rotation_path": rotations}}


def oscar_settings_in_use() -> dict:
    """The OSCAR settings an engine of ``oscar_config`` serves, besides its rotations: the rest from
    OSCAR_* variables (such as OSCAR_PREFILL_READ) or their defaults, as the engines read them."""
    from dataclasses import asdict

    from oscar_vllm.core.settings import OscarSettings

    return {k: v for k, v in asdict(OscarSettings.from_sources(oscar_config(""))).items() if k != "rotation_path"}


def cmd_prepare(args) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from oscar_vllm.calibration.models import smollm2_gguf_path

    out = Path(args.work)
    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(out / "smollm2")
    tok.save_pretrained(out / "smollm2")
    qwen = out / "qwen3-8b-shape"
    qwen.mkdir(parents=True, exist_ok=True)
    (qwen / "config.json").write_text(QWEN3_8B_CONFIG.read_text())
    tok.save_pretrained(qwen)
    result(check="prepare", smollm2=str(out / "smollm2"), qwen3=str(qwen))


def eval_windows(model_dir: str, tokens: int, context: int):
    from transformers import AutoTokenizer

    from oscar_vllm.calibration import corpus
    from oscar_vllm.calibration.calibrate import full_windows

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = corpus.tokenize(tok, corpus.evaluation_text())[:tokens]
    return [w.tolist() for w in full_windows(ids, context)], tok


def decode_cuts(windows: list[list[int]], every: int, first: int = 300) -> list[tuple[list[int], int]]:
    """``(window, end)`` of each request the decode-step score sends: the window's prompt up to ``end``
    (every ``every`` positions from ``first``, two tokens before the window's end)."""
    return [(w, end) for w in windows for end in range(first, len(w) - 1, every)]


def decode_step_nll(llm, windows: list[list[int]], every: int) -> list[float]:
    """Each cut's NLL of the token a decode step predicts: the request's first token is forced to the
    text's next (``allowed_token_ids``; its raw logprobs are taken before that applies), so its
    second comes from a decode step over the cache (the decode write, then the decode kernel)."""
    from vllm import SamplingParams

    cuts = decode_cuts(windows, every)
    params = [SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, allowed_token_ids=[w[end]],
                             logprob_token_ids=[w[end], w[end + 1]]) for w, end in cuts]
    outs = llm.generate([{"prompt_token_ids": w[:end]} for w, end in cuts], params, use_tqdm=False)
    return [-o.outputs[0].logprobs[1][w[end + 1]].logprob for (w, end), o in zip(cuts, outs)]


def decode_kernels_in_use(settings: dict | None, dtype: str) -> dict:
    """The GPU (NVML: no CUDA context in this process) and the decode kernels its OSCAR layers take
    with ``settings`` (``oscar_vllm.serving.gpu``): SmolLM2's shape is one the Gluon kernel serves,
    in 16-bit ``dtype``s."""
    from oscar_vllm.serving.gpu import OscarGpuError, decode_kernel_for, first_visible_gpu

    try:
        name, capability = first_visible_gpu()
    except OscarGpuError:  # NVML cannot name it: the perplexity stands without
        return {"gpu": None, "capability": None, "decode_kernels": None}
    kernels = None if settings is None else decode_kernel_for(capability, settings["decode_kernel"])
    if dtype == "float32" and kernels:
        kernels = "triton"
    return {"gpu": name, "capability": list(capability), "decode_kernels": kernels}


def cmd_ppl(args) -> None:
    import math

    from vllm import LLM, SamplingParams

    windows, tok = eval_windows(args.model, args.tokens, args.context)
    kw = dict(additional_config=oscar_config(args.rotations)) if args.backend == "OSCAR" else {}
    llm = LLM(args.model, attention_backend=args.backend, dtype=args.dtype, enforce_eager=args.eager,
              max_model_len=args.context + 64, max_num_batched_tokens=args.chunk, max_num_seqs=8,
              enable_prefix_caching=False, gpu_memory_utilization=0.5, seed=0, **kw)
    t0 = time.time()
    outs = llm.generate([{"prompt_token_ids": w} for w in windows],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nll, n = 0.0, 0
    for w, o in zip(windows, outs):
        for pos, lp in enumerate(o.prompt_logprobs[1:], start=1):
            nll -= lp[w[pos]].logprob
            n += 1
    prompt = windows[0][:600]
    greedy = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=48, temperature=0),
                          use_tqdm=False)[0].outputs[0]
    settings = oscar_settings_in_use() if args.backend == "OSCAR" else None
    decode = {}
    if args.decode_every:
        steps = decode_step_nll(llm, windows, args.decode_every)
        decode = dict(decode_tokens_scored=len(steps), decode_ppl=math.exp(sum(steps) / len(steps)))
    result(check="ppl", backend=args.backend, settings=settings, dtype=args.dtype, eager=args.eager,
           chunk=args.chunk, context=args.context, tokens_scored=n, ppl=math.exp(nll / n), **decode,
           **decode_kernels_in_use(settings, args.dtype), seconds=round(time.time() - t0, 1),
           greedy_ids=greedy.token_ids, greedy_text=tok.decode(greedy.token_ids))


def results_of(log: str | Path, check: str) -> list[dict]:
    """The RESULT lines of ``check`` in a log, in order."""
    rows = [json.loads(line[len("RESULT "):]) for line in Path(log).read_text().splitlines()
            if line.startswith("RESULT ")]
    return [r for r in rows if r.get("check") == check]


PPL_KEYS = ("ppl", "decode_ppl")


def ppl_differences(a: dict, b: dict, tolerance: float, second_kernels: str | None = None) -> tuple[dict, list[str]]:
    """Each perplexity two ppl results both report: its relative difference ``|b - a| / a``, and what
    is wrong (a difference over ``tolerance``, no perplexity in common, other text scored, the second
    run on other decode kernels than ``second_kernels`` where given)."""
    diffs = {k: abs(b[k] - a[k]) / a[k] for k in PPL_KEYS if k in a and k in b}
    problems = [f"{k} {a[k]:.4f} against {b[k]:.4f}: {100 * d:.3f}% apart, more than {100 * tolerance:g}%"
                for k, d in diffs.items() if d > tolerance]
    if not diffs:
        problems.append("no perplexity reported by both runs")
    for k in ("tokens_scored", "decode_tokens_scored", "context", "chunk", "dtype"):
        if a.get(k) != b.get(k):
            problems.append(f"{k} differs: {a.get(k)} against {b.get(k)}")
    if second_kernels and b.get("decode_kernels") != second_kernels:
        problems.append(f"the second run's decode kernels are {b.get('decode_kernels')}, not {second_kernels}")
    return diffs, problems


def cmd_compare_ppl(args) -> None:
    """The last ppl RESULT of each log, compared: exit 1 where they differ by more than ``--tolerance``."""
    a, b = (results_of(log, "ppl") for log in (args.first, args.second))
    if not a or not b:
        raise SystemExit(f"no ppl RESULT line in {args.first if not a else args.second}")
    a, b = a[-1], b[-1]
    diffs, problems = ppl_differences(a, b, args.tolerance, args.second_kernels)
    result(check="ppl_match", tolerance=args.tolerance, first=args.first, second=args.second,
           decode_kernels=[a.get("decode_kernels"), b.get("decode_kernels")],
           **{f"{k}_pair": [a[k], b[k]] for k in diffs}, relative=diffs, passed=not problems, problems=problems)
    if problems:
        raise SystemExit(1)


STALL_DUMP = """import faulthandler, os, sys
faulthandler.dump_traceback_later(int(os.environ["OSCAR_STALL_DUMP_S"]), exit=True, file=sys.stderr)
"""


def cmd_startup(args) -> None:
    """One engine and one greedy token: how long the start takes. If it stalls past --stall-s,
    every thread's stack goes to stderr and the process exits, so a hung start says where it
    hangs: the engine in this process, or with --multiprocess in its own engine process as vLLM
    runs it by default (a ``sitecustomize`` on PYTHONPATH arms the dump in every Python process)."""
    import faulthandler
    import tempfile

    if args.multiprocess:
        hook = Path(tempfile.mkdtemp(prefix="oscar-stall-"))
        (hook / "sitecustomize.py").write_text(STALL_DUMP)
        os.environ["PYTHONPATH"] = os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])
        os.environ["OSCAR_STALL_DUMP_S"] = str(args.stall_s)
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    faulthandler.dump_traceback_later(args.stall_s + 30 * args.multiprocess, exit=True)
    from vllm import LLM, SamplingParams

    kw = dict(additional_config=oscar_config(args.rotations)) if args.backend == "OSCAR" else {}
    t0 = time.time()
    llm = LLM(args.model, attention_backend=args.backend, enforce_eager=args.eager, max_model_len=4096,
              gpu_memory_utilization=0.5, seed=0, **kw)
    start_s = time.time() - t0
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], SamplingParams(max_tokens=1, temperature=0),
                       use_tqdm=False)[0].outputs[0]
    faulthandler.cancel_dump_traceback_later()
    result(check="startup", backend=args.backend, eager=args.eager, multiprocess=args.multiprocess,
           start_s=round(start_s, 1), kv_tokens=engine_kv_tokens(llm), token=out.token_ids[0])


def engine_kv_tokens(llm) -> int | None:
    cfg = llm.llm_engine.vllm_config.cache_config
    blocks = getattr(cfg, "num_gpu_blocks", None)
    return None if blocks is None else blocks * cfg.block_size


def cmd_qwen3(args) -> None:
    from vllm import LLM, SamplingParams

    kw = dict(additional_config=oscar_config(args.rotations)) if args.backend == "OSCAR" else {}
    llm = LLM(args.model, load_format="dummy", skip_tokenizer_init=True, attention_backend=args.backend,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.eager, seed=0, **kw)
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 30000 + 100 for j in range(300 + 97 * i)]} for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)
    result(check="qwen3", backend=args.backend, kv_cache_tokens=engine_kv_tokens(llm),
           max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization,
           generated=[len(o.outputs[0].token_ids) for o in outs], first_ids=outs[0].outputs[0].token_ids[:8])


def decode_plan(contexts: list[int], batches: list[int], new_tokens: int, kv_tokens: int | None, seed: int = 0):
    """``(context, batch, prompts)`` for each decode measurement: ``batch`` prompts of ``context``
    random ids, distinct from the first token on (one shared prompt would let every request read
    the same blocks, from L2 for the most part, which flatters the BF16 cache most), and
    ``prompts`` None where they and their new tokens do not fit the engine's ``kv_tokens``."""
    import random

    rng = random.Random(seed)
    plan = []
    for ctx in contexts:
        for batch in batches:
            fits = kv_tokens is None or batch * (ctx + new_tokens) <= kv_tokens
            # Drawn whether they fit or not, so each shape gets the same prompts on every backend.
            prompts = [{"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(ctx)]} for _ in range(batch)]
            plan.append((ctx, batch, prompts if fits else None))
    return plan


def cmd_decode(args) -> None:
    from vllm import LLM, SamplingParams

    kw = dict(additional_config=oscar_config(args.rotations)) if args.backend == "OSCAR" else {}
    max_ctx = max(args.contexts)
    llm = LLM(args.model, load_format="dummy", skip_tokenizer_init=True, attention_backend=args.backend,
              max_model_len=max_ctx + args.new_tokens + 16, max_num_seqs=max(args.batches),
              gpu_memory_utilization=0.9, seed=0, **kw)
    kv_tokens = engine_kv_tokens(llm)
    for ctx, batch, reqs in decode_plan(args.contexts, args.batches, args.new_tokens, kv_tokens):
        common = dict(check="decode", backend=args.backend, context=ctx, batch=batch, new_tokens=args.new_tokens,
                      prompts="distinct", kv_cache_tokens=kv_tokens)
        if reqs is None:
            result(**common, seconds=None, tokens_per_s=None, kv_tokens_needed=batch * (ctx + args.new_tokens))
            continue
        # Prefilled once (prefix caching keeps them), so the timed call decodes, as after a cached prompt.
        llm.generate(reqs, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate(reqs, SamplingParams(max_tokens=args.new_tokens, ignore_eos=True), use_tqdm=False)
        dt = time.perf_counter() - t0
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        result(**common, seconds=round(dt, 4), tokens_per_s=round(n / dt, 1))


def cmd_serve(args) -> None:
    import openai

    port = 8011
    env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0")
    server = subprocess.Popen(
        [sys.executable, "-m", "oscar_vllm.serving.serve", "serve", args.model, "--load-format", "dummy",
         "--oscar-rotation-path", args.rotations,
         "--oscar-sink-size", "64", "--oscar-recent-size", "256", "--max-model-len", "4096", "--max-num-seqs", "16",
         "--gpu-memory-utilization", "0.5", "--enforce-eager", "--port", str(port)],
        env=env, stdout=sys.stdout, stderr=sys.stderr)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    try:
        deadline = time.time() + 400
        while True:
            try:
                models = client.models.list()
                break
            except openai.APIConnectionError:
                if server.poll() is not None or time.time() > deadline:
                    raise SystemExit("the server did not come up")
                time.sleep(3)
        done = client.completions.create(model=args.model, prompt="The quick brown fox", max_tokens=16, temperature=0)
        chat = client.chat.completions.create(model=args.model, max_tokens=16,
                                              messages=[{"role": "user", "content": "Say hello."}])
        result(check="serve", models=[m.id for m in models.data], completion_tokens=done.usage.completion_tokens,
               completion=done.choices[0].text, chat_tokens=chat.usage.completion_tokens,
               chat=chat.choices[0].message.content)
    finally:
        server.terminate()
        server.wait(timeout=60)


def prefix_workload(model_dir: str, windows: int | None = None):
    """``oscar_vllm.calibration.evaluate.cached_prefix_workload`` on the evaluation text: 16 chats on a 1,536-token
    system prompt, and ``windows`` (default: the prefix check's) windows of one shared 512-token prefix plus
    1,536 distinct tokens."""
    from oscar_vllm.calibration.evaluate import CACHED_PREFIX_WINDOWS, cached_prefix_tokens, cached_prefix_workload

    windows = windows or CACHED_PREFIX_WINDOWS
    ids, _ = eval_windows(model_dir, cached_prefix_tokens(windows), 64)
    return cached_prefix_workload([t for w in ids for t in w], windows)


def prefix_run(args) -> dict:
    """One engine (caching on or off): greedy outputs with logprobs, and next-token NLL of
    held-out text after a shared cached prefix."""
    from vllm import LLM, SamplingParams

    from oscar_vllm.calibration.evaluate import CACHED_PREFIX_CUTS

    chats, shared, windows = prefix_workload(args.model, args.windows)
    kw = dict(additional_config=oscar_config(args.rotations)) if args.backend == "OSCAR" else {}
    llm = LLM(args.model, attention_backend=args.backend, dtype="bfloat16", enforce_eager=True,
              max_model_len=4096, max_num_batched_tokens=args.chunk, max_num_seqs=32, max_logprobs=-1,
              enable_prefix_caching=args.caching == "on", gpu_memory_utilization=args.gpu_memory_utilization, seed=0,
              **kw)
    Path(args.out).with_suffix(".ready").touch()  # its KV cache is allocated: a second engine may start
    greedy = SamplingParams(max_tokens=32, temperature=0, logprobs=5, ignore_eos=True)

    def outputs(reqs):
        outs = llm.generate([{"prompt_token_ids": r} for r in reqs], greedy, use_tqdm=False)
        return [{"ids": o.outputs[0].token_ids, "cached": o.num_cached_tokens or 0,
                 "logprobs": [{str(k): v.logprob for k, v in lp.items()} for lp in o.outputs[0].logprobs]}
                for o in outs]

    first = outputs(chats)  # sent together: the first request's chunks and the others' hits mix
    again = outputs(chats)  # every request a hit on the whole system prompt
    llm.reset_prefix_cache()
    after_reset = outputs(chats)
    llm.generate([{"prompt_token_ids": shared + [shared[0]]}], SamplingParams(max_tokens=1), use_tqdm=False)
    # vLLM never reads the prefix cache for a request that asks for prompt logprobs, so each cut is
    # a request that generates the text's next two tokens: the first is forced (allowed_token_ids;
    # raw logprobs are taken before it applies), so the second is a decode step over the cache.
    cuts = [(w, len(shared) + c) for w in windows for c in CACHED_PREFIX_CUTS]
    params = [SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, allowed_token_ids=[w[end]],
                             logprob_token_ids=[w[end], w[end + 1]]) for w, end in cuts]
    scored = llm.generate([{"prompt_token_ids": w[:end]} for w, end in cuts], params, use_tqdm=False)
    nll = [-o.outputs[0].logprobs[0][w[end]].logprob for (w, end), o in zip(cuts, scored)]
    nll_after = [-o.outputs[0].logprobs[1][w[end + 1]].logprob for (w, end), o in zip(cuts, scored)]
    return {"first": first, "again": again, "after_reset": after_reset, "nll": nll, "nll_after": nll_after,
            "cached_tokens": sum(o.num_cached_tokens or 0 for o in scored), "chunk": args.chunk}


def first_mismatch(a: dict, b: dict) -> dict | None:
    """vLLM's ``check_logprobs_close`` on one pair: equal ids, or at the first differing token
    each side's token is among the other's top logprobs (floating point may flip a near tie)."""
    for i, (x, y) in enumerate(zip(a["ids"], b["ids"])):
        if x != y:
            close = str(x) in b["logprobs"][i] and str(y) in a["logprobs"][i]
            return {"index": i, "close": close}
    return None


# How much worse the decode step after a cached prefix may score than without caching: its
# windows are the same, but the prompt's keys past the hit come from a chunk that read the
# prefix's middle in 2-bit, not in BF16 as one chunk over the whole prompt does.
DECODE_PPL_TOLERANCE = 1.01
# How much worse the prompt's last position may score with its prefix cached than without (issue
# 19): a hit leaves the ring before the first uncached token to be computed again, so the chunk
# after the hit reads the tokens just before it in BF16, as a chunk of an uncached prefill does.
PROMPT_PPL_TOLERANCE = 1.01


def paired_se(a: list[float], b: list[float]) -> float:
    """The standard error of the mean of ``b - a`` (per-token NLLs of the same tokens)."""
    d = [y - x for x, y in zip(a, b)]
    mean = sum(d) / len(d)
    return (sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d)) ** 0.5


def cmd_prefix(args) -> None:
    import math

    if args.caching:
        Path(args.out).write_text(json.dumps(prefix_run(args)))
        return
    # The two engines share nothing but the GPU: side by side (each with under half its memory) the
    # check takes the time of the longer one, caching off, whose chunks of 256 over the 1,404 prompts
    # of 156 windows keep an engine busy for over 5 minutes (H200, 2026-12-03). The second starts once
    # the first has its KV cache: vLLM sizes its cache from the GPU's free memory during its start, so
    # another engine allocating then would be counted as its own use.
    outs = {c: Path(f"/tmp/oscar-prefix-{args.backend}-{args.chunk}-{c}.json") for c in ("off", "on")}
    share = 0.4 if args.side_by_side else 0.5
    procs = {}
    for caching, out in outs.items():
        ready = out.with_suffix(".ready")
        ready.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "prefix", "--model", args.model, "--rotations", args.rotations,
               "--backend", args.backend, "--chunk", str(args.chunk), "--gpu-memory-utilization", str(share),
               "--caching", caching, "--out", str(out), *(["--windows", str(args.windows)] if args.windows else [])]
        procs[caching] = subprocess.Popen(cmd)
        # The next engine starts once this one holds its KV cache (side by side) or has exited.
        while procs[caching].poll() is None and not (args.side_by_side and ready.exists()):
            time.sleep(1)
    failed = [c for c, proc in procs.items() if proc.wait() != 0]
    if failed:
        raise SystemExit(f"prefix: the caching {' and '.join(failed)} engine failed")
    runs = {c: json.loads(out.read_text()) for c, out in outs.items()}
    off, on = runs["off"], runs["on"]
    report = {}
    for name in ("first", "again", "after_reset"):
        diffs = [first_mismatch(a, b) for a, b in zip(off["first"], on[name])]
        report[name] = {"equal": sum(d is None for d in diffs),
                        "close": sum(d is not None and d["close"] for d in diffs),
                        "far": sum(d is not None and not d["close"] for d in diffs), "requests": len(diffs),
                        "cached_tokens": sum(o["cached"] for o in on[name])}
    ppl = {k: math.exp(sum(r["nll"]) / len(r["nll"])) for k, r in runs.items()}
    ppl_after = {k: math.exp(sum(r["nll_after"]) / len(r["nll_after"])) for k, r in runs.items()}
    # The gaps' standard errors, paired over the same tokens: how far a rerun may land by chance.
    se = {key: paired_se(off[key], on[key]) for key in ("nll", "nll_after")}
    from oscar_vllm.core.settings import OscarSettings

    read = OscarSettings.from_sources({}).prefill_read if args.backend == "OSCAR" else None
    result(check="prefix", backend=args.backend, chunk=args.chunk, prefill_read=read, outputs=report,
           ppl_caching_off=ppl["off"],
           ppl_caching_on=ppl["on"], decode_ppl_caching_off=ppl_after["off"], decode_ppl_caching_on=ppl_after["on"],
           gap_se=se["nll"], decode_gap_se=se["nll_after"],
           tokens_scored=len(on["nll"]), cached_tokens_on=on["cached_tokens"], cached_tokens_off=off["cached_tokens"])
    if report["again"]["cached_tokens"] == 0 or off["cached_tokens"]:
        raise SystemExit("prefix: the rerun hit no cached prefix, or caching off hit one")
    if not all(math.isfinite(p) for p in (*ppl.values(), *ppl_after.values())):
        raise SystemExit("prefix: NaN logprobs")
    failed = []
    for what, got, limit, err in (("the prompt's last position", ppl, PROMPT_PPL_TOLERANCE, se["nll"]),
                                  ("the decode step after it", ppl_after, DECODE_PPL_TOLERANCE, se["nll_after"])):
        gap = got["on"] / got["off"] - 1
        ok = got["on"] <= limit * got["off"]
        print(f"prefix, chunk {args.chunk}: {what}: perplexity {got['on']:.3f} with caching, {got['off']:.3f} "
              f"without ({100 * gap:+.2f}% ± {100 * err:.2f}% SE, limit +{100 * (limit - 1):.0f}%): "
              f"{'ok' if ok else 'FAILED'}", flush=True)
        if not ok:
            failed.append(f"{what} {100 * gap:+.2f}%")
    if failed:
        raise SystemExit(f"prefix: with caching, {' and '.join(failed)} against caching off (limit +1%)")


def preempt_run(args) -> dict:
    """One in-process engine (its scheduler inspectable): 16 requests, 4 aborted after a few steps
    and 4 new ones sent in their place, run to the end."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    chats, _, windows = prefix_workload(args.model)
    flat = [t for w in windows for t in w]
    prompts = [flat[i * 700: i * 700 + 450 + 17 * i] for i in range(20)]
    kw = dict(additional_config=oscar_config(args.rotations)) if args.backend == "OSCAR" else {}
    if args.kv_blocks:
        kw["num_gpu_blocks_override"] = args.kv_blocks
    llm = LLM(args.model, attention_backend=args.backend, dtype="bfloat16", enforce_eager=True, max_model_len=2048,
              max_num_seqs=16, gpu_memory_utilization=0.3, seed=0, **kw)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    pages = getattr(scheduler, "oscar_window_pages", None)
    free_start = pool.get_num_free_blocks()
    preempted, peak_pages = [0], [0]
    original = scheduler._preempt_request

    def count_preemption(*a, **k):
        preempted[0] += 1
        return original(*a, **k)

    scheduler._preempt_request = count_preemption
    params = SamplingParams(max_tokens=160, temperature=0, logprobs=5, ignore_eos=True)
    for i in range(16):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompts[i]}, params)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = {"ids": o.outputs[0].token_ids, "logprobs": [
                    {str(k): v.logprob for k, v in lp.items()} for lp in o.outputs[0].logprobs]}
        steps += 1
        if pages is not None:
            peak_pages[0] = max(peak_pages[0], pages.pages_in_use)
        if steps == 6:  # abort four mid-flight; four new requests take their rows and pages
            engine.abort_request([f"r{i}" for i in range(4)])
            for i in range(16, 20):
                engine.add_request(f"r{i}", {"prompt_token_ids": prompts[i]}, params)
    return {"outputs": done, "preemptions": preempted[0], "free_start": free_start,
            "free_end": pool.get_num_free_blocks(), "pages_at_end": None if pages is None else pages.pages_in_use,
            "peak_pages": peak_pages[0], "pages_per_request": None if pages is None else pages.pages_per_request,
            "kv_blocks": scheduler.kv_cache_config.num_blocks}


def cmd_preempt(args) -> None:
    if args.kv_blocks is not None and args.out:
        Path(args.out).write_text(json.dumps(preempt_run(args)))
        return
    runs = {}
    for name, blocks in (("roomy", 0), ("tight", args.tight_blocks)):
        out = Path(f"/tmp/oscar-preempt-{name}.json")
        subprocess.run([sys.executable, __file__, "preempt", "--model", args.model, "--rotations", args.rotations,
                        "--backend", args.backend, "--kv-blocks", str(blocks), "--out", str(out)], check=True)
        runs[name] = json.loads(out.read_text())
    roomy, tight = runs["roomy"], runs["tight"]
    diffs = {r: first_mismatch(roomy["outputs"][r], o) for r, o in tight["outputs"].items()}
    result(check="preempt", backend=args.backend, tight_kv_blocks=tight["kv_blocks"],
           preemptions_tight=tight["preemptions"], preemptions_roomy=roomy["preemptions"],
           requests=len(diffs), equal=sum(d is None for d in diffs.values()),
           close=sum(d is not None and d["close"] for d in diffs.values()),
           far=sum(d is not None and not d["close"] for d in diffs.values()),
           pages_at_end=tight["pages_at_end"], peak_pages=tight["peak_pages"],
           pages_per_request=tight["pages_per_request"],
           free_blocks_start_end=[tight["free_start"], tight["free_end"]])
    if tight["preemptions"] == 0 or tight["free_start"] != tight["free_end"] or tight["pages_at_end"]:
        raise SystemExit("preempt: no preemption, or blocks or window pages not all back at the end")


def chunked_run(args) -> dict:
    """One engine, prefix caching off: the prompt logprobs of 8 held-out windows of 1,800 tokens
    sent together, then one at a time (so the last chunk of each, 8 tokens, runs alone); then
    16 chats generating, whose last prompt chunk meets the next one's first chunk in a step and
    is sampled (prompt logprobs never score that position)."""
    import math

    from vllm import LLM, SamplingParams

    chats, _, windows = prefix_workload(args.model)
    prompts = [w[:1800] for w in windows[:8]]
    kw = dict(additional_config=oscar_config(args.rotations)) if args.backend == "OSCAR" else {}
    llm = LLM(args.model, attention_backend=args.backend, dtype="bfloat16", enforce_eager=True, max_model_len=4096,
              max_num_batched_tokens=args.chunk, max_num_seqs=32, enable_prefix_caching=False,
              gpu_memory_utilization=0.4, seed=0, **kw)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def nll(outs) -> list[list[float]]:
        return [[-d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:])] for p, o in zip(prompts, outs)]

    together = nll(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    alone = nll([llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts])
    greedy = SamplingParams(max_tokens=8, temperature=0, logprobs=1, ignore_eos=True)
    sampled = [lp[t].logprob for o in llm.generate([{"prompt_token_ids": c} for c in chats], greedy, use_tqdm=False)
               for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
    return {"together": together, "alone": alone, "nan": sum(math.isnan(x) for r in together + alone for x in r),
            "sampled_nan": sum(math.isnan(x) for x in sampled), "sampled": len(sampled)}


def cmd_chunked(args) -> None:
    import math

    if args.out:
        Path(args.out).write_text(json.dumps(chunked_run(args)))
        return
    runs = {}
    for chunk in (256, 8192):
        out = Path(f"/tmp/oscar-chunked-{args.backend}-{chunk}.json")
        subprocess.run([sys.executable, __file__, "chunked", "--model", args.model, "--rotations", args.rotations,
                        "--backend", args.backend, "--chunk", str(chunk), "--out", str(out)], check=True)
        runs[chunk] = json.loads(out.read_text())

    def mean(rows) -> float:
        return sum(x for r in rows for x in r) / sum(len(r) for r in rows)

    from oscar_vllm.core.settings import OscarSettings

    small = runs[256]
    gap = mean(small["alone"]) - mean(small["together"])
    chunk_gap = mean(small["together"]) - mean(runs[8192]["together"])
    sampled_nan = small["sampled_nan"] + runs[8192]["sampled_nan"]
    # OSCAR_PREFILL_READ=decode: a prompt reads the same keys in 2 bits wherever its chunks end.
    read = OscarSettings.from_sources({}).prefill_read if args.backend == "OSCAR" else None
    result(check="chunked", backend=args.backend, prefill_read=read, nan=small["nan"] + runs[8192]["nan"],
           sampled_nan=sampled_nan, nll_gap_chunk256_chunk8192=chunk_gap,
           sampled=small["sampled"] + runs[8192]["sampled"],
           nll_chunk256_together=mean(small["together"]), nll_chunk256_alone=mean(small["alone"]),
           nll_chunk8192=mean(runs[8192]["together"]),
           max_token_nll_gap_together_alone=max(abs(a - b) for ra, rb in zip(small["together"], small["alone"])
                                                for a, b in zip(ra, rb)))
    # A batch changes the floating-point order, so single tokens may move; the mean may not.
    if small["nan"] + runs[8192]["nan"] or sampled_nan or not math.isfinite(gap) or abs(gap) > 0.01:
        raise SystemExit("chunked: NaN prompt or sampled logprobs, or one request's chunks alone score differently "
                         "from the same chunks in a batch")
    if read == "decode" and abs(chunk_gap) > 0.005:
        raise SystemExit(f"chunked: with the decode read, chunks of 256 and 8192 score {chunk_gap:+.4f} nats apart")


def cmd_report(args) -> None:
    """The prefix, preempt and chunked results of ``args.logs`` as markdown (for the README)."""
    rows = [json.loads(line[len("RESULT "):]) for log in args.logs for line in Path(log).read_text().splitlines()
            if line.startswith("RESULT ")]
    lines = ["# Prefix caching, preemption and chunked prefill through vLLM", ""]
    seen = set()
    for r in rows:
        key = (r["check"], r.get("chunk"), r["date"])
        if key in seen:  # run.sh's logs may repeat a line
            continue
        seen.add(key)
        head = f"- `{r['command']}`, {r['date']}, {r['hardware']}, {r['backend']}"
        if r["check"] == "prefix":
            o = r["outputs"]
            cells = "; ".join(f"{name.replace('_', ' ')}: {o[name]['equal']} equal, {o[name]['close']} close, "
                              f"{o[name]['far']} far ({o[name]['cached_tokens']:,} cached tokens)"
                              for name in ("first", "again", "after_reset"))
            lines.append(f"{head}: caching on against off, {o['first']['requests']} chats on a shared system "
                         f"prompt, {cells}; next-token perplexity after a cached prefix {r['ppl_caching_on']:.3f} "
                         f"on, {r['ppl_caching_off']:.3f} off" + (
                             f", at the decode step after it {r['decode_ppl_caching_on']:.3f} on, "
                             f"{r['decode_ppl_caching_off']:.3f} off" if "decode_ppl_caching_on" in r else "") +
                         (f"; gaps' standard errors {100 * r['gap_se']:.2f}% and {100 * r['decode_gap_se']:.2f}%"
                          if "gap_se" in r else "") +
                         f" ({r['tokens_scored']} tokens, {r['cached_tokens_on']:,} cached)")
        elif r["check"] == "preempt":
            lines.append(f"{head}: {r['tight_kv_blocks']}-block cache against a roomy one, {r['preemptions_tight']} "
                         f"preemptions, {r['requests']} requests {r['equal']} equal, {r['close']} close, {r['far']} "
                         f"far; free blocks at start and end {r['free_blocks_start_end']}, window pages held at the "
                         f"end {r['pages_at_end']}")
        elif r["check"] == "chunked":
            sampled = f", NaN sampled logprobs {r['sampled_nan']} of {r['sampled']}" if "sampled" in r else ""
            lines.append(f"{head}: NaN prompt logprobs {r['nan']}{sampled}; mean NLL chunk 256 together "
                         f"{r['nll_chunk256_together']:.4f}, alone {r['nll_chunk256_alone']:.4f}, chunk 8192 "
                         f"{r['nll_chunk8192']:.4f}")
    Path(args.out).write_text("\n".join(lines) + "\n")


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("prepare")
    s.add_argument("--work", required=True)
    s = sub.add_parser("report")
    s.add_argument("logs", nargs="+")
    s.add_argument("--out", required=True)
    s = sub.add_parser("compare-ppl")
    s.add_argument("first", help="a log with a ppl RESULT line")
    s.add_argument("second", help="another, held against the first")
    s.add_argument("--tolerance", type=float, default=0.001, help="largest relative difference (default: 0.1%%)")
    s.add_argument("--second-kernels", choices=("gluon", "triton"),
                   help="the decode kernels the second run must have taken (default: either)")
    for name in ("ppl", "qwen3", "decode", "serve", "prefix", "preempt", "chunked", "startup"):
        s = sub.add_parser(name)
        s.add_argument("--model", required=True)
        s.add_argument("--rotations", default="")
        s.add_argument("--backend", default="OSCAR")
        s.add_argument("--eager", action="store_true")
    sp = sub.choices["ppl"]
    sp.add_argument("--dtype", default="float32")
    sp.add_argument("--chunk", type=int, default=256)
    sp.add_argument("--context", type=int, default=2048)
    sp.add_argument("--tokens", type=int, default=16384)
    sp.add_argument("--decode-every", type=int, default=0,
                    help="also score the token a decode step predicts, at every N-th position of each window")
    sq = sub.choices["qwen3"]
    sq.add_argument("--max-model-len", type=int, default=8192)
    sq.add_argument("--max-num-seqs", type=int, default=64)
    sq.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    sd = sub.choices["decode"]
    sd.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    sd.add_argument("--batches", type=int, nargs="+", default=[1, 16, 32])
    sd.add_argument("--new-tokens", type=int, default=128)
    sx = sub.choices["prefix"]
    sx.add_argument("--chunk", type=int, default=8192)
    sx.add_argument("--windows", type=int,
                    help="windows of the shared prefix, 9 scored prompts each (default: the check's, "
                         "CACHED_PREFIX_WINDOWS; up to 175 in the evaluation text; about 156 decide a 1%% gap at "
                         "two standard errors, docs/backend.md)")
    sx.add_argument("--side-by-side", action="store_true", help="run the caching off and on engines at once")
    sx.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="(internal)")
    sx.add_argument("--caching", choices=("on", "off"), help="run one engine and write --out (internal)")
    sx.add_argument("--out")
    st = sub.choices["startup"]
    st.add_argument("--stall-s", type=int, default=150, help="dump every thread's stack and exit if not done by then")
    st.add_argument("--multiprocess", action="store_true", help="the engine in its own process, as vLLM's default")
    sc = sub.choices["chunked"]
    sc.add_argument("--chunk", type=int, default=256)
    sc.add_argument("--out", help="run one engine with --chunk and write here (internal)")
    se = sub.choices["preempt"]
    se.add_argument("--tight-blocks", type=int, default=99,
                    help="KV blocks of the tight run: two requests and their window pages, 2-3 blocks to spare")
    se.add_argument("--kv-blocks", type=int, help="run one engine with this many blocks (0: vLLM's) (internal)")
    se.add_argument("--out")
    args = p.parse_args()
    globals()[f"cmd_{args.cmd.replace('-', '_')}"](args)


if __name__ == "__main__":
    main()
