"""A/B throughput of vLLM engines side by side: OSCAR against vLLM's own KV caches, each
configuration in its own process, every prompt distinct (a shared prompt would be served
from the prefix cache and L2 and flatter everyone).

    python -m benchmarks.ab --out results/ab                     # Qwen3-8B shape, dummy weights
    python -m benchmarks.ab --configs OSCAR FLASH_ATTN fp8 int4 --budget-s 130 --dry-run
    python -m benchmarks.ab --scenarios latency ttft --configs OSCAR FLASH_ATTN fp8 int4   # first tokens, batch 1
    python -m benchmarks.ab --model /path/to/model --configs OSCAR FLASH_ATTN fp8
    python -m benchmarks.ab --gpus 2 --scenarios none --max-num-seqs-sweep 32 256
    python -m benchmarks.ab --report results/ab                  # tables and plots again
    python -m benchmarks.ab --report results/ab1 results/ab2     # two runs in one table

(from the repository root; the workers are started the same way, ``python -m benchmarks.ab --worker``).

Configurations (``--configs``): ``OSCAR`` (``attention_backend="OSCAR"``), ``FLASH_ATTN`` (BF16,
vLLM's default), ``fp8`` (``kv_cache_dtype="fp8"``), ``int4`` (``int4_per_token_head``),
``turboquant`` (``turboquant_4bit_nc``; needs vLLM's FlashAttention 2 build, so only when named).
A configuration that fails to start is reported with its error, not dropped; one that fails or
times out later keeps the scenarios it finished. ``--gpus N`` runs up to N configurations at
once, one GPU each (``CUDA_VISIBLE_DEVICES``); each worker logs to ``OUT/log_<config>.txt``.

Scenarios (``--scenarios``; presets ``all`` (the default; ``issue18``, its name before, is still
accepted), ``fits`` (all but the last three), ``memory-bound`` (the last three), ``none`` for the
sweep alone; run in this order; sizes are options):
  prefill   N distinct prompts of L tokens, one output token: prefill tokens/s
  decode    the same prompts again (prefix-cached) for K output tokens: decode tokens/s and
            time per output token, the one-token rerun subtracted
  long      one prompt of --long-prompt tokens: prefill tokens/s of a single long request
  latency   one request at a time, a distinct prompt per context (1K, 8K, 32K, 128K), a few
            hundred output tokens: time per output token of the decode phase alone (from the
            request's own first- and last-token times, so no prefill in it). The context as
            long as --long-prompt reuses the long scenario's prompt, prefix-cached: its prefill
            is not paid twice
  ttft      time to first token (TTFT: arrival to first token, vLLM's per-request metric; median
            and p90 of a batch, with the call's seconds), one output token each, in four parts:
            fresh: N distinct prompts of L tokens sent at once (default: prefill's, 32 x 16K);
            hit: a new turn on each, the same N prompts each followed by S new tokens (default
            64), sent at once: the prefix hit, with the prompt tokens the cache served a request
            (OSCAR's hit computes the last ~512 again unless OSCAR_HIT_RING=reuse); hit, one user:
            one of them with another S new tokens, alone; long: one fresh prompt of --ttft-long-len
            (default long's, 128K), alone, with its prefill tokens/s. After latency (its prompts
            would evict long's before latency reads it); N is cut to what BF16's KV cache holds
            until the hits. long's or latency's call of that length, where the plan has one, is
            its long part: the same request, not prefilled twice
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
fp8's) and less than OSCAR's holds; ``capacity`` more than that factor times BF16's; ``ttft`` keeps
4 requests, its prompts' lengths, and no more requests than BF16's cache holds. Those bounds
come from the FLASH_ATTN engine's own KV capacity: it runs first and sizes the run
(``OUT/plan.json``); the others run what it wrote (a worker beside it on another GPU waits for
that). ``--dry-run`` prints the plan (sizes, estimated seconds per configuration and scenario)
without starting anything; ``--plan OUT/plan.json`` runs an earlier plan's sizes again (a run
split over two invocations, merged by ``--report DIR DIR``).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from .plan import SWEEP_RUN_S, parent_plan, plan_text
from .pool import DEADLINE_MARGIN, DEADLINE_RESERVE_S, Job, gpu_slots, run_pool
from .report import report
from .scenarios import BASELINE, CONFIGS, PRESET_ALIASES, PRESETS, QWEN3_8B_CONFIG, SCENARIOS, expand_scenarios
from .worker import stub, worker_main


COMMAND = "python -m benchmarks.ab"  # how a run starts, as its report and its resume hint name it
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


def model_config(model: str | None) -> dict:
    """The model's config.json (the Qwen3-8B shape's without ``--model``)."""
    if model is None:
        return json.loads(QWEN3_8B_CONFIG.read_text())
    if (Path(model) / "config.json").exists():
        return json.loads((Path(model) / "config.json").read_text())
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model).to_dict()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0],
                                epilog="\n".join(__doc__.splitlines()[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="model id or folder (default: a Qwen3-8B-shaped config, dummy weights)")
    p.add_argument("--configs", nargs="+", default=[c for c in CONFIGS if c != "turboquant"], choices=list(CONFIGS),
                   help="default: all but turboquant (which needs vLLM's FlashAttention 2 build)")
    p.add_argument("--scenarios", nargs="*", choices=[*SCENARIOS, *PRESETS, *PRESET_ALIASES, "none"],
                   help="scenarios or presets (default: --plan's, else all); "
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
    g.add_argument("--ttft-requests", type=int, help="ttft: requests of its batches (default: --num-prompts)")
    g.add_argument("--ttft-prompt-len", type=int, help="ttft: prompt tokens (default: --prompt-len)")
    g.add_argument("--ttft-suffix-len", type=int, default=64, help="ttft: new tokens of a turn on a cached prompt")
    g.add_argument("--ttft-long-len", type=int, help="ttft: the long prompt's tokens (default: --long-prompt)")
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
        args.scenarios = ["all"]
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
        parser().error(f"--rotations {HADAMARD_KEY_MEANS} times the key means, which key_mean off (the default) "
                       "serves without: set OSCAR_KEY_MEAN=auto")
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
         f"print(json.dumps(environment({COMMAND!r})))"],
        capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
    env["command"] = f"{COMMAND} {shlex.join(sys.argv[1:])}".strip()
    env["versions"] += "".join(f", {pkg} {_version(pkg)}" for pkg in ("vllm", "triton"))
    model_name = "Qwen3-8B shape, dummy weights" if args.model.endswith("qwen3-8b-shape") else args.model
    (out / "meta.json").write_text(json.dumps({**env, "model": model_name, "engine_args": args.engine_args,
                                               "oscar_env": oscar_environment(), "gpus": len(gpus)}))
    plan_path = out / "plan.json"
    plan_path.write_text(json.dumps(plan, indent=1))
    print(plan_text(plan), flush=True)
    # Workers read their sizes from the plan, and the model folder, which they must not write
    # again while another worker reads it.
    common = [sys.executable, "-m", __package__, "--model", args.model, "--rotations", args.rotations,
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
            f"  {COMMAND} --configs {' '.join(names)} --plan {plan_path} --out OUT2\n"
            f"  {COMMAND} --report {out} OUT2\n")
