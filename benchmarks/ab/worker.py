"""One configuration's process (``--worker``): its engine, then every scenario of the plan,
its result file written after each (``--result``), so that a failure or a timeout keeps what it
finished. The FLASH_ATTN worker, which runs first, sizes a budgeted plan with its engine's own
KV capacity; the others run what it wrote."""
from __future__ import annotations

import json
import time
import traceback
from pathlib import Path

from .plan import make_plan, needs_bf16_capacity, sized_plan
from .scenarios import (BASELINE, CONFIGS, SCENARIO_RUNS, SCENARIOS, Call, decode_prefills_itself, distinct_prompts,
                        dummy_long_context, engine_counters, warm_up)


def stub(name: str, seqs: int | None) -> dict:
    """What identifies a result file (``report`` reads the configuration from it, not the file name)."""
    return {"config": name, **({"sweep_max_num_seqs": seqs} if seqs else {})}


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
