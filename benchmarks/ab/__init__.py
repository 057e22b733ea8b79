"""The A/B harness: vLLM engines side by side, OSCAR against vLLM's own KV caches, one process per
configuration, every prompt distinct. Run from the repository root:

    python -m benchmarks.ab --help

Its parts:
- ``scenarios``: the configurations, what each scenario sends, and how a worker times it;
- ``plan``: a run's sizes and estimated seconds (KV capacities, an H200 cost model, ``--budget-s``);
- ``worker``: one configuration's process: its engine, every scenario, its result file;
- ``pool``: the workers, one per GPU at a time, each process group ended by a timeout or a deadline;
- ``report``: ``ab.md``, ``ab.csv`` and ``ab.png`` from the result files of one run or several;
- ``cli``: the options (its docstring is ``--help``), the run's set-up and its jobs (``__main__``).

The names imported here are the harness's interface (what its tests and ``profile_decode`` use);
constants a test changes are changed in their own module (``pool.DEADLINE_RESERVE_S``)."""
from .cli import (COMMAND, HADAMARD_KEY_MEANS, hadamard_key_mean_rotations, main, model_config, oscar_environment,
                  oscar_key_mean, parse_args, parser, resume_hint)
from .plan import (H200_GIB, OSCAR_HIT_RECOMPUTED, TTFT_MIN_PROMPT, TTFT_MIN_REQUESTS, Caps, estimate_bf16_kv_tokens,
                   first_visible_gpu, full_sizes, gpu_memory_gib, hit_cached_tokens, kv_need, kv_vs_bf16, make_plan,
                   needs_bf16_capacity, oscar_window_tokens, parent_plan, plan_text, prefill_s, scenario_s,
                   sized_plan, wall_s)
from .pool import Job, gpu_slots, mark_jit_compiles, run_pool
from .report import METRICS, report
from .scenarios import (BASELINE, CONFIGS, MEMORY_BOUND, PRESET_ALIASES, PRESETS, QWEN3_8B_CONFIG, SCENARIOS, SEEDS,
                        Call, decode_step_s, distinct_prompts, dummy_long_context, engine_counters, expand_scenarios,
                        first_token_s, ttft_long_source, ttft_prompts)
from .worker import run_worker, stub, worker_main

__all__ = [
    "BASELINE", "COMMAND", "CONFIGS", "H200_GIB", "HADAMARD_KEY_MEANS", "MEMORY_BOUND", "METRICS",
    "OSCAR_HIT_RECOMPUTED", "PRESETS", "PRESET_ALIASES", "QWEN3_8B_CONFIG", "SCENARIOS", "SEEDS", "TTFT_MIN_PROMPT",
    "TTFT_MIN_REQUESTS", "Call", "Caps", "Job", "decode_step_s", "distinct_prompts", "dummy_long_context",
    "engine_counters", "estimate_bf16_kv_tokens", "expand_scenarios", "first_token_s", "first_visible_gpu",
    "full_sizes", "gpu_memory_gib", "gpu_slots", "hadamard_key_mean_rotations", "hit_cached_tokens", "kv_need",
    "kv_vs_bf16", "main", "make_plan", "mark_jit_compiles", "model_config", "needs_bf16_capacity",
    "oscar_environment", "oscar_key_mean", "oscar_window_tokens", "parent_plan", "parse_args", "parser", "plan_text",
    "prefill_s", "report", "resume_hint", "run_pool", "run_worker", "scenario_s", "sized_plan", "stub",
    "ttft_long_source", "ttft_prompts", "wall_s", "worker_main",
]
