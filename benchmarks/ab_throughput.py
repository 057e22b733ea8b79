"""A/B throughput of vLLM engines side by side: OSCAR against vLLM's own KV caches, each
configuration in its own process, every prompt distinct (a shared prompt would be served
from the prefix cache and L2 and flatter everyone).

    python benchmarks/ab_throughput.py --out results/ab                     # Qwen3-8B shape, dummy weights
    python benchmarks/ab_throughput.py --model /path/to/model --configs OSCAR FLASH_ATTN fp8
    python benchmarks/ab_throughput.py --report results/ab                  # tables and plots again

Configurations (``--configs``): ``OSCAR`` (``attention_backend="OSCAR"``), ``FLASH_ATTN`` (BF16,
vLLM's default), ``fp8`` (``kv_cache_dtype="fp8"``), ``int4`` (``int4_per_token_head``),
``turboquant`` (``turboquant_4bit_nc``; needs vLLM's FlashAttention 2 build). A configuration
that fails to start is reported with its error, not dropped.

Scenarios (``--scenarios``; sizes are options):
  prefill   N distinct prompts of L tokens, one output token: prefill tokens/s
  decode    the same prompts again (prefix-cached) for K output tokens: decode tokens/s and
            time per output token, the one-token rerun subtracted
  long      one prompt of --long-prompt tokens: prefill tokens/s of a single long request
  short     S concurrent requests of 1K prompt / 1K output (memory not binding): output tokens/s
  capacity  C concurrent requests of ~100K tokens, K output tokens each: output tokens/s where
            BF16 can hold only a few at once
KV capacity (tokens) is read from every engine. ``--engine-args '{"max_num_seqs": 32}'`` sets
vLLM engine arguments for all configurations (default: vLLM's own defaults).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {
    "OSCAR": {"attention_backend": "OSCAR"},
    "FLASH_ATTN": {"attention_backend": "FLASH_ATTN"},
    "fp8": {"kv_cache_dtype": "fp8"},
    "int4": {"kv_cache_dtype": "int4_per_token_head"},
    "turboquant": {"kv_cache_dtype": "turboquant_4bit_nc"},
}
BASELINE = "FLASH_ATTN"
# The Qwen3-8B architecture (its config.json), for runs with dummy weights.
QWEN3_8B_CONFIG = Path(__file__).parent / "configs" / "qwen3-8b.json"


def distinct_prompts(n: int, length: int, vocab: int, seed: int) -> list[dict]:
    """``n`` prompts of ``length`` random token ids, different from the first token on."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(length)]} for _ in range(n)]


def run_worker(args) -> dict:
    """One engine, every scenario, one JSON result."""
    from vllm import LLM, SamplingParams

    cfg = json.loads((Path(args.model) / "config.json").read_text()) if Path(args.model).is_dir() else {}
    vocab = int(cfg.get("vocab_size", 32000))
    has_weights = Path(args.model).is_dir() and any(Path(args.model).glob("*.safetensors"))
    kw = dict(CONFIGS[args.worker])
    if args.worker == "OSCAR":
        kw["additional_config"] = {"oscar": {"rotation_path": args.rotations}}
    kw.update(json.loads(args.engine_args))
    need = max([args.prompt_len + args.output_len, 2048 + 1024]
               + ([args.long_prompt + 1] if "long" in args.scenarios else [])
               + ([args.capacity_len + args.output_len] if "capacity" in args.scenarios else []))
    kw.setdefault("max_model_len", need + 64)
    if kw["max_model_len"] > int(cfg.get("max_position_embeddings", 1 << 30)):
        os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"  # dummy weights: positions past training are fine
    if not has_weights:
        kw.update(load_format="dummy")
    result = {"config": args.worker, "engine_args": {k: v for k, v in kw.items() if k != "additional_config"}}
    t0 = time.perf_counter()
    llm = LLM(args.model, skip_tokenizer_init=True, seed=0, **kw)
    cache = llm.llm_engine.vllm_config.cache_config
    result["startup_s"] = round(time.perf_counter() - t0, 1)
    result["kv_cache_tokens"] = cache.num_gpu_blocks * cache.block_size
    result["max_num_seqs"] = llm.llm_engine.vllm_config.scheduler_config.max_num_seqs

    def timed(prompts, max_tokens):
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)

    llm.generate(distinct_prompts(2, 512, vocab, 99), SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    if "prefill" in args.scenarios or "decode" in args.scenarios:
        prompts = distinct_prompts(args.num_prompts, args.prompt_len, vocab, 1)
        s, _ = timed(prompts, 1)
        result["prefill"] = {"requests": args.num_prompts, "prompt_len": args.prompt_len, "seconds": round(s, 3),
                             "prefill_tok_s": round(args.num_prompts * args.prompt_len / s, 1)}
        if "decode" in args.scenarios:
            s1, _ = timed(prompts, 1)  # prefix-cached: what the decode run pays before decoding
            sk, n = timed(prompts, args.output_len)
            steps = args.output_len - 1
            result["decode"] = {"requests": args.num_prompts, "context": args.prompt_len,
                                "output_len": args.output_len, "seconds": round(sk - s1, 3),
                                "decode_tok_s": round(args.num_prompts * steps / (sk - s1), 1),
                                "tpot_ms": round(1000 * (sk - s1) / steps, 3), "outputs": n}
    if "long" in args.scenarios:
        s, _ = timed(distinct_prompts(1, args.long_prompt, vocab, 2), 1)
        result["long"] = {"prompt_len": args.long_prompt, "seconds": round(s, 3),
                          "prefill_tok_s": round(args.long_prompt / s, 1)}
    if "short" in args.scenarios:
        prompts = distinct_prompts(args.short_requests, 1024, vocab, 3)
        s, n = timed(prompts, 1024)
        result["short"] = {"requests": args.short_requests, "prompt_len": 1024, "output_len": 1024,
                           "seconds": round(s, 3), "output_tok_s": round(n / s, 1)}
    if "capacity" in args.scenarios:
        prompts = distinct_prompts(args.capacity_requests, args.capacity_len, vocab, 4)
        s, n = timed(prompts, args.output_len)
        result["capacity"] = {"requests": args.capacity_requests, "prompt_len": args.capacity_len,
                              "output_len": args.output_len, "seconds": round(s, 3), "output_tok_s": round(n / s, 1)}
    return result


METRICS = [  # (scenario, field, label, higher is better)
    (None, "kv_cache_tokens", "KV cache capacity (tokens)", True),
    ("prefill", "prefill_tok_s", "prefill tok/s, {requests} x {prompt_len} distinct prompts", True),
    ("decode", "decode_tok_s", "decode tok/s, {requests} x {context} context, prefix-cached", True),
    ("decode", "tpot_ms", "time per output token (ms), same run", False),
    ("long", "prefill_tok_s", "prefill tok/s, 1 x {prompt_len} prompt", True),
    ("short", "output_tok_s", "output tok/s, {requests} x (1K in, 1K out)", True),
    ("capacity", "output_tok_s", "output tok/s, {requests} x ~{prompt_len} context, {output_len} out each", True),
]


def report(out: Path) -> str:
    """``ab.md`` / ``ab.csv`` / ``ab.png`` from the per-configuration JSON files in ``out``."""
    runs = {json.loads(p.read_text())["config"]: json.loads(p.read_text()) for p in sorted(out.glob("run_*.json"))}
    meta = json.loads((out / "meta.json").read_text())
    names = [c for c in CONFIGS if c in runs]
    base = runs.get(BASELINE, {})
    lines = [f"# A/B throughput: {meta['model']}", "",
             f"- date: {meta['date']}; hardware: {meta['hardware']}", f"- command: `{meta['command']}`",
             f"- {meta['versions']}", f"- engine arguments: {meta['engine_args']} (else vLLM's defaults)",
             "- every request has its own prompt; ratios are against FLASH_ATTN (BF16) in the same run", "",
             "| metric | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    csv = ["metric,config,value,ratio_vs_bf16"]
    plot_rows = []
    for scen, field, label, higher in METRICS:
        got = {n: (runs[n].get(scen) or {}) if scen else runs[n] for n in names}
        if not any(field in g for g in got.values()):
            continue
        some = next(g for g in got.values() if field in g)
        label = label.format(**some) if scen else label
        b = (base.get(scen) or {}).get(field) if scen else base.get(field)
        cells = []
        for n in names:
            if "error" in runs[n]:
                cells.append("failed")
                continue
            v = got[n].get(field)
            if v is None:
                cells.append("")
                continue
            ratio = (v / b if higher else b / v) if b else None
            cells.append(f"{v:,}" + (f" ({ratio:.2f}x)" if ratio and n != BASELINE else ""))
            csv.append(f"\"{label}\",{n},{v},{'' if ratio is None else round(ratio, 4)}")
            if ratio:
                plot_rows.append((label, n, ratio))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for n in names:
        if "error" in runs[n]:
            lines.append(f"\n**{n} failed:** `{runs[n]['error']}`")
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
    p.add_argument("--scenarios", nargs="+", default=["prefill", "decode", "long", "short", "capacity"])
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
    p.add_argument("--out", default="results/ab")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per configuration")
    p.add_argument("--report", metavar="DIR", help="only rebuild the tables and plot from DIR")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.report:
        print(report(Path(args.report)))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        args.model = str(out / "qwen3-8b-shape")
        Path(args.model).mkdir(exist_ok=True)
        (Path(args.model) / "config.json").write_text(QWEN3_8B_CONFIG.read_text())
    if args.worker:
        try:
            res = run_worker(args)
        except Exception as e:  # noqa: BLE001  (the table says why a configuration failed)
            res = {"config": args.worker, "error": f"{type(e).__name__}: {str(e)[:400]}"}
        Path(args.result).write_text(json.dumps(res, indent=1))
        return
    import torch

    from oscar_vllm.evaluate import environment

    env = environment("python benchmarks/ab_throughput.py")
    env["hardware"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else env["hardware"]
    model_name = "Qwen3-8B shape, dummy weights" if args.model.endswith("qwen3-8b-shape") else args.model
    (out / "meta.json").write_text(json.dumps({**env, "model": model_name, "engine_args": args.engine_args}))
    for name in args.configs:
        dest = out / f"run_{name}.json"
        cmd = [sys.executable, __file__, "--worker", name, "--result", str(dest),
               *[a for a in sys.argv[1:] if a not in ("--configs", *CONFIGS)]]
        t0 = time.perf_counter()
        # Its own process group: vLLM's engine core is a child process that keeps the GPU's
        # memory until it exits, so a timeout must end the whole group before the next engine.
        proc = subprocess.Popen(cmd, start_new_session=True)
        try:
            proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            dest.write_text(json.dumps({"config": name, "error": f"timed out after {args.timeout} s"}))
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        if not dest.exists():
            dest.write_text(json.dumps({"config": name, "error": "the worker died (see its log)"}))
        print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    print(report(out))


if __name__ == "__main__":
    main()
