"""The A/B harness (benchmarks/ab) without a GPU or vLLM: its report from hand-written result files,
and its pool of GPUs with fake workers (concurrency, the timeout that ends a process group)."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HARNESS = [sys.executable, "-m", "benchmarks.ab"]  # as tests/gpu/run.sh runs it, from the repository root


@pytest.fixture(scope="module")
def ab():
    import benchmarks.ab

    return benchmarks.ab


META = {"date": "2026-01-01 00:00 UTC", "hardware": "NVIDIA H200", "command": "python benchmarks/ab_throughput.py",
        "versions": "oscar_vllm 0", "model": "Qwen3-8B shape, dummy weights", "engine_args": "{}", "gpus": 2}


def write_runs(out: Path, main: dict, sweep: dict | None = None) -> None:
    out.mkdir(exist_ok=True)
    (out / "meta.json").write_text(json.dumps(META))
    for name, r in main.items():
        (out / f"run_{name}.json").write_text(json.dumps({"config": name, **r}))
    for (seqs, name), r in (sweep or {}).items():
        (out / f"run_{name}_seqs{seqs}.json").write_text(json.dumps({"config": name, "sweep_max_num_seqs": seqs, **r}))


def run(kv, tpot, first_pass_s, out_tok_s):
    return {"kv_cache_tokens": kv, "max_num_seqs": 1024, "engine_args": {"max_model_len": 131137},
            "decode": {"requests": 32, "context": 16384, "output_len": 256, "decode_tok_s": 1000.0, "tpot_ms": tpot},
            "capacity": {"requests": 32, "prompt_len": 100000, "output_len": 256, "first_pass_s": first_pass_s,
                         "seconds": 32 * 256 / out_tok_s, "output_tok_s": out_tok_s}}


MAIN = {"FLASH_ATTN": run(500_000, 20.0, 300.0, 100.0), "OSCAR": run(4_000_000, 10.0, 250.0, 800.0),
        "fp8": {"error": "RuntimeError: boom"}}


def table_row(text: str, label: str) -> list[str]:
    """The cells of the markdown row whose first cell starts with ``label``."""
    rows = [line for line in text.splitlines() if line.startswith(f"| {label}")]
    assert len(rows) == 1, (label, rows)
    return [c.strip() for c in rows[0].strip("|").split("|")][1:]


def test_report_ratios_failures_and_plot(ab, tmp_path):
    write_runs(tmp_path, MAIN)
    text = ab.report(tmp_path)
    assert text == (tmp_path / "ab.md").read_text()
    assert table_row(text, "metric") == ["OSCAR", "FLASH_ATTN", "fp8"]  # the order of CONFIGS
    assert table_row(text, "KV cache capacity") == ["4,000,000 (8.00x)", "500,000", "failed"]
    assert table_row(text, "time per output token") == ["10.0 (2.00x)", "20.0", "failed"]  # lower is better
    assert table_row(text, "capacity, first pass (s)") == ["250.0 (1.20x)", "300.0", "failed"]
    assert table_row(text, "capacity, follow-up output tok/s: the same 32 prompts, 256 out")[:2] == \
        ["800.0 (8.00x)", "100.0"]
    assert "prefill tok/s" not in text  # no run has that scenario
    assert "\n**fp8 failed:** `RuntimeError: boom`" in text
    assert "2 configurations at a time, one GPU each" in text
    assert "KV cache capacity by max_num_seqs" not in text
    csv = (tmp_path / "ab.csv").read_text().splitlines()
    assert '"KV cache capacity (tokens)",OSCAR,4000000,8.0' in csv
    assert '"time per output token (ms), same run",FLASH_ATTN,20.0,1.0' in csv
    assert not any(",fp8," in line for line in csv)
    assert (tmp_path / "ab.png").read_bytes()[:4] == b"\x89PNG"


def test_report_capacity_by_max_num_seqs(ab, tmp_path):
    sweep = {(32, "FLASH_ATTN"): {"kv_cache_tokens": 600_000, "max_num_seqs": 32},
             (32, "OSCAR"): {"kv_cache_tokens": 4_200_000, "max_num_seqs": 32},
             (256, "FLASH_ATTN"): {"kv_cache_tokens": 550_000, "max_num_seqs": 256},
             (256, "OSCAR"): {"kv_cache_tokens": 4_400_000, "max_num_seqs": 256},
             (256, "fp8"): {"error": "timed out after 1800 s"}}
    write_runs(tmp_path, MAIN, sweep)
    text = ab.report(tmp_path)
    # The main table is the main runs' alone.
    assert table_row(text, "KV cache capacity (tokens)") == ["4,000,000 (8.00x)", "500,000", "failed"]
    section = text[text.index("**KV cache capacity by max_num_seqs**"):]
    # No heading but the title: pages that splice the file (less its title) give the headings.
    assert not [line for line in text.splitlines()[1:] if line.startswith("#")]
    assert table_row(section, "max_num_seqs") == ["OSCAR", "FLASH_ATTN", "fp8"]
    labels = [line.split("|")[1].strip() for line in section.splitlines() if line.startswith("| ") and "(" in line]
    assert labels == ["1024 (main run, CUDA graphs)", "32 (enforce_eager)", "256 (enforce_eager)"]
    assert table_row(section, "1024 (main run") == ["4,000,000 (8.00x)", "500,000", "failed"]
    assert table_row(section, "32 (enforce_eager)") == ["4,200,000 (7.00x)", "600,000", ""]
    assert table_row(section, "256 (enforce_eager)") == ["4,400,000 (8.00x)", "550,000", "failed"]
    assert "\n**fp8 (max_num_seqs=256) failed:** `timed out after 1800 s`" in text
    assert '"KV cache capacity (tokens), max_num_seqs 32 (enforce_eager)",OSCAR,4200000,7.0' in \
        (tmp_path / "ab.csv").read_text().splitlines()


def test_report_sweep_alone(ab, tmp_path):
    write_runs(tmp_path, {}, {(32, "FLASH_ATTN"): {"kv_cache_tokens": 600_000},
                              (32, "OSCAR"): {"kv_cache_tokens": 3_000_000}})
    text = ab.report(tmp_path)
    assert "| metric |" not in text and "(main run" not in text
    assert table_row(text, "max_num_seqs") == ["OSCAR", "FLASH_ATTN"]
    assert table_row(text, "32 (enforce_eager)") == ["3,000,000 (5.00x)", "600,000"]
    assert (tmp_path / "ab.png").stat().st_size > 0


def test_gpu_slots(ab):
    assert ab.gpu_slots(2, None) == ["0", "1"]
    assert ab.gpu_slots(1, "3,5") == ["3"]  # the parent's own CUDA_VISIBLE_DEVICES, in its order
    assert ab.gpu_slots(2, "GPU-a, GPU-b") == ["GPU-a", "GPU-b"]
    with pytest.raises(ValueError):
        ab.gpu_slots(3, "3,5")


def test_nothing_to_run_is_an_error():
    proc = subprocess.run([*HARNESS, "--scenarios", "none"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2 and "nothing to run" in proc.stderr


# A fake worker: argv = result path, seconds to sleep before and after writing its result,
# whether to leave a grandchild behind.
FAKE_WORKER = """
import json, os, subprocess, sys, time
result, sleep, linger, grandchild = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "1"
t0 = time.time()
if grandchild:  # like vLLM's engine core: a child in the worker's process group
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    open(result + ".child", "w").write(str(child.pid))
for i in range(30):
    print(f"line {i:02d}", flush=True)
time.sleep(sleep)
json.dump({"config": os.path.basename(result), "gpu": os.environ["CUDA_VISIBLE_DEVICES"], "start": t0,
           "end": time.time()}, open(result, "w"))
time.sleep(linger)
"""


def fake_job(ab, tmp_path: Path, name: str, sleep: float, linger: float = 0, grandchild: bool = False):
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER)
    result = tmp_path / f"run_{name}.json"
    return ab.Job(name, [sys.executable, str(script), str(result), str(sleep), str(linger), str(int(grandchild))],
                  result, {"config": name})


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


def test_pool_runs_one_job_per_gpu_at_a_time(ab, tmp_path, capsys):
    jobs = [fake_job(ab, tmp_path, n, t) for n, t in (("a", 0.5), ("b", 2.5), ("c", 0.5))]
    ab.run_pool(jobs, ["4", "7"], timeout=60, poll_s=0.05)
    a, b, c = (json.loads(j.result.read_text()) for j in jobs)
    assert a["start"] < b["end"] and b["start"] < a["end"], "the first two did not run at once"
    assert (a["gpu"], b["gpu"]) == ("4", "7")
    assert c["gpu"] == "4" and a["end"] <= c["start"] < b["end"], "the third did not take the first free GPU"
    out = capsys.readouterr().out
    assert "start a on GPU 4" in out and "start b on GPU 7" in out
    assert out.count(" s, ok") == 3 and "last lines" not in out
    assert all(j.log.read_text().startswith("line 00") for j in jobs)


def test_pool_timeout_ends_the_process_group(ab, tmp_path, capsys):
    slow = fake_job(ab, tmp_path, "slow", 120, grandchild=True)
    after = fake_job(ab, tmp_path, "after", 0)
    t0 = time.monotonic()
    ab.run_pool([slow, after], ["0"], timeout=1, poll_s=0.05)
    assert time.monotonic() - t0 < 30
    assert json.loads(slow.result.read_text()) == {"config": "slow", "error": "timed out after 1 s"}
    child = int(Path(str(slow.result) + ".child").read_text())
    assert not alive(child), "the worker's child outlived the timeout"
    assert json.loads(after.result.read_text())["gpu"] == "0"  # the GPU was given back
    out = capsys.readouterr().out
    assert "end slow on GPU 0: 1 s, failed: timed out after 1 s" in out
    tail = out[out.index("--- last lines of"):]
    assert "line 29" in tail and "line 09" not in tail  # the last 20 lines of its log


def test_pool_timeout_keeps_a_written_result(ab, tmp_path, capsys):
    """A worker whose engine hangs in its shutdown after the result is written: ended, its result kept."""
    job = fake_job(ab, tmp_path, "hangs", 0, linger=120, grandchild=True)
    ab.run_pool([job], ["0"], timeout=1, poll_s=0.05)
    assert json.loads(job.result.read_text())["gpu"] == "0"
    assert not alive(int(Path(str(job.result) + ".child").read_text()))
    assert "end hangs on GPU 0: 1 s, ok" in capsys.readouterr().out


def test_pool_deadline_skips_what_does_not_fit_and_ends_what_runs_past_it(ab, tmp_path, capsys, monkeypatch):
    """A GPU call's limit: the run must end, report included, before it. A job whose estimate does
    not fit the time left is not started (a stale result of it goes); one running into the
    deadline's reserve is ended with its process group."""
    monkeypatch.setattr(ab.pool, "DEADLINE_RESERVE_S", 1)
    fits = fake_job(ab, tmp_path, "fits", 0)
    fits.estimate_s = 1
    too_long = fake_job(ab, tmp_path, "too_long", 0)
    too_long.estimate_s = 100
    too_long.result.write_text(json.dumps({"config": "too_long", "kv_cache_tokens": 1}))  # from an earlier run
    overruns = fake_job(ab, tmp_path, "overruns", 120, grandchild=True)
    overruns.estimate_s = 0.5
    t0 = time.monotonic()
    skipped = ab.run_pool([fits, too_long, overruns], ["0"], timeout=60, poll_s=0.05, deadline_s=4)
    assert time.monotonic() - t0 < 10
    assert skipped == [too_long] and not too_long.result.exists()
    assert json.loads(fits.result.read_text())["gpu"] == "0"
    err = json.loads(overruns.result.read_text())["error"]
    assert err.startswith("timed out after ") and float(err.split()[3]) <= 3
    assert not alive(int(Path(str(overruns.result) + ".child").read_text()))
    out = capsys.readouterr().out
    assert "not started too_long: " in out and "estimate 100 s x 1.25" in out


def test_resume_hint_names_the_configurations_left_out(ab, tmp_path):
    left = [ab.Job(n, [], tmp_path / f"run_{n}.json", ab.stub(n, seqs)) for n, seqs in
            (("fp8", None), ("FLASH_ATTN", None), ("fp8", 32))]
    hint = ab.resume_hint(left, tmp_path / "plan.json", tmp_path)
    assert f"--configs FLASH_ATTN fp8 --plan {tmp_path / 'plan.json'} --out OUT2" in hint
    assert f"--report {tmp_path} OUT2" in hint
    assert ab.resume_hint([], tmp_path / "plan.json", tmp_path) == ""


def test_decode_without_a_prefill_scenario_is_estimated_with_its_own_prefill(ab):
    """It prefills its prompts first (32 x 16K: 22-24 s a configuration on the H200, 2026-12-04,
    where the estimate without the prefill was 7-8 s)."""
    caps = ab.Caps(800_000, {"OSCAR": 7.0, "FLASH_ATTN": 1.0}, 2560, 1024)
    decode = {"requests": 32, "context": 16384, "output_len": 256}
    alone = ab.scenario_s("decode", "FLASH_ATTN", {"decode": decode}, caps)
    after = ab.scenario_s("decode", "FLASH_ATTN", {"decode": decode, "prefill": {"requests": 32, "prompt_len": 16384}},
                          caps)
    assert alone - after == pytest.approx(32 * ab.prefill_s(16384)) and 14 < alone - after < 18


def test_a_run_on_an_earlier_plan_runs_its_scenarios(ab, tmp_path):
    """The resume hint's command names no scenarios: it runs what the plan sized, in run order."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"sizes": {"long": {"prompt_len": 131072}, "decode": {"requests": 32}}}))
    assert ab.parse_args(["--configs", "fp8", "--plan", str(plan)]).scenarios == ["decode", "long"]
    assert ab.parse_args(["--plan", str(plan), "--scenarios", "long"]).scenarios == ["long"]
    assert ab.parse_args([]).scenarios == list(ab.expand_scenarios(["issue18"]))


def test_pool_without_a_deadline_starts_everything(ab, tmp_path):
    job = fake_job(ab, tmp_path, "big", 0)
    job.estimate_s = 1e9
    assert ab.run_pool([job], ["0"], timeout=60, poll_s=0.05) == [] and job.result.exists()


def test_pool_worker_without_result(ab, tmp_path, capsys):
    result = tmp_path / "run_OSCAR_seqs32.json"
    result.write_text(json.dumps({"config": "OSCAR", "kv_cache_tokens": 1}))  # stale, from an earlier run
    job = ab.Job("OSCAR max_num_seqs=32", [sys.executable, "-c", "print('CUDA error'); raise SystemExit(3)"],
                 result, {"config": "OSCAR", "sweep_max_num_seqs": 32})
    assert job.log == tmp_path / "log_OSCAR_seqs32.txt"
    ab.run_pool([job], ["0"], timeout=60, poll_s=0.05)
    assert json.loads(result.read_text()) == {
        "config": "OSCAR", "sweep_max_num_seqs": 32,
        "error": "the worker exited with status 3 and no result (see log_OSCAR_seqs32.txt)"}
    assert "CUDA error" in capsys.readouterr().out


def test_jit_compiles_inside_a_timed_call_are_named(ab, tmp_path):
    t0 = time.mktime(time.strptime("2026-11-30 15:50:00", "%Y-%m-%d %H:%M:%S"))
    result = {"decode": {"tpot_ms": 1.0, "decode_tok_s": 9.0, "requests": 32, "context": 16384},
              "prefill": {"prefill_tok_s": 1.0, "requests": 32, "prompt_len": 16384},
              "spans": {"prefill": [[t0 - 45, t0 - 5]], "decode": [[t0 - 4, t0 - 3], [t0 - 2, t0 + 12]]}}
    log = ("(EngineCore pid=1) WARNING 11-30 15:49:20 [jit_monitor.py:135] Triton kernel JIT compilation during "
           "inference: _oscar_write_kernel. This causes a latency spike\n"
           "(EngineCore pid=1) WARNING 11-30 15:50:08 [jit_monitor.py:135] Triton kernel JIT compilation during "
           "inference: _oscar_attention_kernel. This causes a latency spike\n"
           "(EngineCore pid=1) WARNING 11-30 15:51:00 [jit_monitor.py:135] Triton kernel JIT compilation during "
           "inference: _late_kernel. This causes a latency spike\n")
    out = ab.mark_jit_compiles(result, log, 2026)
    assert out["prefill"]["jit_compiles"] == ["_oscar_write_kernel"]
    assert out["decode"]["jit_compiles"] == ["_oscar_attention_kernel"]
    (tmp_path / "meta.json").write_text(json.dumps(META))
    (tmp_path / "run_OSCAR.json").write_text(json.dumps({"config": "OSCAR", **out}))
    assert "OSCAR prefill: _oscar_write_kernel; OSCAR decode: _oscar_attention_kernel." in ab.report(tmp_path)


# --- the plan: sizes scaled to a time budget -------------------------------------------------

QWEN3_8B = json.loads((REPO / "benchmarks" / "configs" / "qwen3-8b.json").read_text())
BF16_KV = 812_160  # the FLASH_ATTN engine's on the H200 (results/windows/ab)


def plan_for(ab, argv: list[str], bf16: int = BF16_KV, max_num_seqs: int = 1024) -> dict:
    args = ab.parse_args(argv)
    return ab.make_plan(ab.parent_plan(args, QWEN3_8B)["inputs"], bf16, "test", max_num_seqs)


def test_kv_capacity_estimate_and_ratios(ab):
    # The Qwen3-8B shape on an H200 at vLLM's defaults: the engine gave 812,160 BF16 tokens.
    assert abs(ab.estimate_bf16_kv_tokens(QWEN3_8B, 139.8, 0.92) / BF16_KV - 1) < 0.01
    ratios = ab.kv_vs_bf16(QWEN3_8B)
    assert ratios["FLASH_ATTN"] == 1 and ratios["fp8"] == 2
    assert ratios["OSCAR"] == pytest.approx(512 / 72) and ratios["int4"] == pytest.approx(512 / 136)
    assert ab.oscar_window_tokens(QWEN3_8B) == 40 * 64  # the engine logs 40 blocks of 64 per request


def test_the_estimate_takes_the_gpus_memory_or_the_given(ab):
    """Without FLASH_ATTN in the run, BF16's capacity is estimated from the GPU's memory (an H100
    has about half an H200's), by NVML; on a machine NVML finds no GPU on, from an H200's."""
    args = ab.parse_args(["--configs", "OSCAR", "--scenarios", "decode"])
    plan = ab.parent_plan(args, QWEN3_8B)
    found = ab.gpu_memory_gib()
    if found is None:
        assert "no GPU found: an H200's" in plan["bf16_kv_source"]
        assert plan["bf16_kv_tokens"] == ab.estimate_bf16_kv_tokens(QWEN3_8B, ab.H200_GIB, 0.92)
    else:
        assert "this GPU's" in plan["bf16_kv_source"]
        assert plan["bf16_kv_tokens"] == ab.estimate_bf16_kv_tokens(QWEN3_8B, found, 0.92)
    given = ab.parent_plan(ab.parse_args(["--configs", "OSCAR", "--scenarios", "decode", "--gpu-mem-gib", "79.6"]),
                           QWEN3_8B)
    assert "79.6 GiB (given by --gpu-mem-gib)" in given["bf16_kv_source"]
    assert 0.45 < given["bf16_kv_tokens"] / ab.estimate_bf16_kv_tokens(QWEN3_8B, ab.H200_GIB, 0.92) < 0.55


def test_the_planned_gpu_is_the_first_visible_one(ab):
    """NVML counts every GPU of the machine: the plan sizes the run from the first device
    CUDA_VISIBLE_DEVICES names, by index or by UUID (schedulers often give UUIDs), never GPU 0
    in its place; a first entry that is neither hides every GPU from CUDA, so none is planned for
    (the plan then says no GPU was found)."""
    assert ab.first_visible_gpu(None) == 0 and ab.first_visible_gpu("") == 0
    assert ab.first_visible_gpu("3,1") == 3 and ab.first_visible_gpu(" 2 ") == 2
    uuid = "GPU-5f6a0c1e-2b3d-4e5f-8a9b-0c1d2e3f4a5b"
    assert ab.first_visible_gpu(f"{uuid},GPU-other") == uuid
    mig = "MIG-0b1c2d3e-aaaa-bbbb-cccc-0123456789ab"
    assert ab.first_visible_gpu(mig) == mig
    assert ab.first_visible_gpu("-1") is None and ab.first_visible_gpu("-1,0") is None
    assert ab.first_visible_gpu("nvidia0") is None


def test_parse_args_presets_and_order(ab):
    args = ab.parse_args(["--configs", "OSCAR", "fp8", "FLASH_ATTN", "--scenarios", "memory-bound", "latency"])
    assert args.configs == ["FLASH_ATTN", "OSCAR", "fp8"]  # FLASH_ATTN first: it sizes a budgeted run
    assert args.scenarios == ["latency", "reasoning", "overflow", "capacity"]  # the order they run in
    assert ab.parse_args([]).scenarios == ab.SCENARIOS  # issue18, the default: all
    assert ab.parse_args([]).configs == ["FLASH_ATTN", "OSCAR", "fp8", "int4"]  # turboquant when named
    assert ab.parse_args(["--scenarios", "none"]).scenarios == []
    with pytest.raises(SystemExit):
        ab.parse_args(["--scenarios", "nonsense"])


def test_without_a_budget_the_options_sizes_run(ab):
    plan = plan_for(ab, ["--overflow-requests", "100", "--latency-contexts", "2048", "512"])
    assert plan["scale"] == 1 and plan["fits"]
    assert plan["sizes"]["overflow"] == {"requests": 100, "prompt_len": 8192, "output_len": 8192}
    assert plan["sizes"]["latency"] == {"contexts": [512, 2048], "output_len": 256}
    assert plan["sizes"]["reasoning"] == {"requests": 256, "prompt_len": 1024, "output_len": 4096}
    assert plan["sizes"]["capacity"] == {"requests": 32, "prompt_len": 100000, "output_len": 256}
    assert plan["max_model_len"] == 64 + 131072 + 1  # long's prompt and its token
    assert plan_for(ab, [])["max_model_len"] == 64 + 131072 + 256  # latency's 128K context and its output


def assert_bounds(ab, plan: dict, bf16: int, factor: float = 1.25) -> None:
    """Overflow needs more KV than factor x fp8's cache (2 x BF16's) and fits 90% of OSCAR's with
    its windows; capacity's prompts more than factor x BF16's; floors kept."""
    z = plan["sizes"]
    need = ab.kv_need(z["overflow"])
    assert need >= min(128 * 16384, factor * 2 * bf16)
    window = ab.oscar_window_tokens(QWEN3_8B)
    assert z["overflow"]["requests"] * (z["overflow"]["prompt_len"] + z["overflow"]["output_len"] + window) \
        <= 0.9 * bf16 * 512 / 72
    assert z["overflow"]["requests"] <= plan["max_num_seqs"]
    assert z["capacity"]["requests"] * z["capacity"]["prompt_len"] >= min(32 * 100000, factor * bf16)
    assert z["latency"]["contexts"] == [1024, 8192, 32768, 131072]  # the rows' contexts never shrink
    assert z["long"]["prompt_len"] == 131072 and z["prefill"]["prompt_len"] == z["fresh"]["prompt_len"] == 16384
    assert z["prefill"]["requests"] == z["decode"]["requests"] >= 8 and z["fresh"]["requests"] >= 8
    assert z["short"]["requests"] >= 32 and z["short"]["output_len"] >= 256
    assert z["reasoning"]["requests"] >= 64 and z["reasoning"]["output_len"] >= 1024
    assert z["ttft"]["prompt_len"] == 16384 and z["ttft"]["long_len"] == 131072 and z["ttft"]["suffix_len"] == 64
    assert ab.TTFT_MIN_REQUESTS <= z["ttft"]["requests"] and z["ttft"]["requests"] * (16384 + 128) <= 0.9 * bf16
    for s in z.values():
        for k in ("prompt_len", "output_len"):
            assert k not in s or s[k] % 64 == 0 or s[k] in (100000,), (k, s)


@pytest.mark.parametrize("bf16", [400_000, BF16_KV, 1_200_000])
def test_budget_scales_down_and_overflow_still_overflows(ab, bf16):
    configs = ["--configs", "OSCAR", "FLASH_ATTN", "fp8", "int4"]
    full = plan_for(ab, configs, bf16)
    previous = None
    for budget in (2000, 1000, 600, 400, 250):
        plan = plan_for(ab, configs + ["--budget-s", str(budget)], bf16)
        assert_bounds(ab, plan, bf16)
        totals = [e["total"] for e in plan["estimate_s"].values()]
        if plan["fits"]:
            assert sum(totals) <= budget * 4  # one GPU: the four share 4 x the budget
        if previous:  # a smaller budget never runs more
            for name, z in plan["sizes"].items():
                for k, v in z.items():
                    if isinstance(v, int) and name != "overflow":
                        assert v <= previous["sizes"][name][k], (budget, name, k)
            assert plan["scale"] <= previous["scale"]
        previous = plan
    assert plan["sizes"] != full["sizes"] and plan["scale"] < 1


def test_budget_too_small_runs_the_floors_and_says_so(ab):
    plan = plan_for(ab, ["--budget-s", "60"])
    assert not plan["fits"]
    z = plan["sizes"]
    assert z["short"] == {"requests": 32, "prompt_len": 1024, "output_len": 256}
    assert z["reasoning"] == {"requests": 64, "prompt_len": 1024, "output_len": 1024}
    assert z["latency"]["output_len"] == z["decode"]["output_len"] == z["fresh"]["output_len"] == 64
    assert z["overflow"]["prompt_len"] == z["overflow"]["output_len"] == 1024
    assert_bounds(ab, plan, BF16_KV)
    assert "DOES NOT FIT" in ab.plan_text(plan)


def test_budget_per_gpu_queue(ab):
    """With a GPU each, a configuration has the budget to itself; with one GPU they share it."""
    assert ab.wall_s([100, 50, 80, 20], 1) == 250
    assert ab.wall_s([100, 50, 80, 20], 2) == 130  # 100 | 50 + 80, then 20 on the first free
    argv = ["--configs", "OSCAR", "FLASH_ATTN", "fp8", "int4", "--budget-s", "480"]
    one, four = plan_for(ab, argv), plan_for(ab, argv + ["--gpus", "4"])
    assert one["fits"] and sum(e["total"] for e in one["estimate_s"].values()) <= 4 * 480
    assert four["fits"] and max(e["total"] for e in four["estimate_s"].values()) <= 480
    assert one["wall_s"] > 3 * four["wall_s"]


def test_defaults_that_do_not_overflow_are_noted(ab):
    plan = plan_for(ab, ["--budget-s", "400"], bf16=2_000_000)  # fp8 would hold 4M tokens
    assert ab.kv_need(plan["sizes"]["overflow"]) >= 128 * 16384  # shorter requests, never less KV
    assert any(n.startswith("overflow:") and "do not run out" in n for n in plan["notes"])
    assert not any(n.startswith("capacity:") for n in plan["notes"])  # 3.2M tokens of prompts > 2M
    plan = plan_for(ab, [], bf16=4_000_000)
    assert any(n.startswith("capacity:") and "nothing to evict" in n for n in plan["notes"])


def test_an_earlier_plans_sizes_run_again(ab, tmp_path):
    first = ab.parse_args(["--configs", "OSCAR", "FLASH_ATTN", "fp8", "--budget-s", "300"])
    plan = ab.parent_plan(first, QWEN3_8B)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    second = ab.parse_args(["--configs", "FLASH_ATTN", "int4", "--plan", str(tmp_path / "plan.json")])
    again = ab.parent_plan(second, QWEN3_8B)
    assert again["fixed"] and again["sizes"] == plan["sizes"] and list(again["estimate_s"]) == ["FLASH_ATTN", "int4"]
    assert not ab.needs_bf16_capacity(again)  # nothing to size again: the sizes are the first run's
    lacking = ab.parse_args(["--configs", "int4", "--scenarios", "long", "--plan", str(tmp_path / "plan.json")])
    plan["sizes"].pop("long")
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(SystemExit, match="no sizes for long"):
        ab.parent_plan(lacking, QWEN3_8B)


def test_a_worker_waits_for_the_baseline_to_size_the_plan(ab, tmp_path):
    import threading

    plan = ab.parent_plan(ab.parse_args(["--budget-s", "300"]), QWEN3_8B)
    assert ab.needs_bf16_capacity(plan)
    path, baseline = tmp_path / "plan.json", tmp_path / "run_FLASH_ATTN.json"
    path.write_text(json.dumps(plan))
    sized = {**plan, "sized_by_engine": True, "bf16_kv_tokens": 1}
    threading.Timer(0.3, lambda: path.write_text(json.dumps(sized))).start()
    assert ab.sized_plan(path, baseline, poll_s=0.05, wait_s=30)["bf16_kv_tokens"] == 1
    path.write_text(json.dumps(plan))
    baseline.write_text(json.dumps({"config": "FLASH_ATTN", "error": "boom"}))  # ended without sizing it
    assert ab.sized_plan(path, baseline, poll_s=0.05)["bf16_kv_tokens"] == plan["bf16_kv_tokens"]


def test_dry_run_prints_the_plan(ab, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "argv", ["ab_throughput.py", "--dry-run", "--configs", "OSCAR", "FLASH_ATTN",
                                      "--budget-s", "260", "--out", str(tmp_path / "ab")])
    ab.main()
    out = capsys.readouterr().out
    assert not (tmp_path / "ab").exists()  # nothing started, nothing written
    head = next(line for line in out.splitlines() if line.strip().startswith("sizes"))
    assert head.split()[-2:] == ["FLASH_ATTN", "OSCAR"]
    for name in ab.SCENARIOS:
        assert any(line.startswith(name) for line in out.splitlines()), name
    assert "budget: 260 s per configuration" in out and "invocation: ~" in out


# --- what a worker measures, without an engine ------------------------------------------------

def test_engine_counters_and_their_stats(ab):
    from types import SimpleNamespace as NS

    metrics = [NS(name="vllm:num_preemptions", value=7, labels={}),
               NS(name="vllm:generation_tokens", value=9000, labels={}),
               NS(name="vllm:iteration_tokens_total", count=100, sum=0, labels={}),
               NS(name="vllm:prompt_tokens_by_source", value=5000, labels={"source": "local_compute"}),
               NS(name="vllm:prompt_tokens_by_source", value=800, labels={"source": "local_cache_hit"})]
    llm = NS(llm_engine=NS(log_stats=True), get_metrics=lambda: metrics)
    assert ab.engine_counters(llm) == {"preemptions": 7, "output_tokens": 9000, "steps": 100,
                                       "prompt_tokens_computed": 5000}
    assert ab.engine_counters(NS(llm_engine=NS(log_stats=False))) is None
    call = ab.Call(2.0, 9000, [], {"preemptions": 7, "output_tokens": 9000, "steps": 100, "prompt_tokens_computed": 5})
    assert call.engine_stats() == {"mean_running": 90.0, "preemptions": 7, "prompt_tokens_computed": 5}
    assert ab.Call(1.0, 1, [], None).engine_stats() == {}


def test_latency_times_the_decode_phase_and_reuses_the_long_prompt(ab):
    from types import SimpleNamespace as NS

    sent = []

    def timed(prompts, max_tokens, scenario):
        sent.append(prompts[0]["prompt_token_ids"])
        ctx = len(prompts[0]["prompt_token_ids"])
        m = NS(scheduled_ts=10.0, first_token_ts=10.0 + ctx / 1000, last_token_ts=10.0 + ctx / 1000 + 0.005 * 63,
               first_token_latency=0.25 + ctx / 1000)  # a quarter of a second in the queue
        return ab.Call(1.0, 64, [NS(metrics=m, outputs=[NS(token_ids=[0] * 64)], num_cached_tokens=0)], None)

    sizes = {"long": {"prompt_len": 2048}, "latency": {"contexts": [512, 2048], "output_len": 64}}
    result = {}
    ab.scenarios._latency(timed, sizes, 32000, result)
    rows = result["latency"]["per_context"]
    assert [r["context"] for r in rows] == [512, 2048]
    assert all(r["tpot_ms"] == pytest.approx(5.0) for r in rows)  # the prefill (first_token_s) is not in it
    assert rows[1]["first_token_s"] == pytest.approx(2.048)
    assert rows[1]["ttft_s"] == pytest.approx(2.298)  # from its arrival: the wait in the queue too
    assert sent[1] == ab.distinct_prompts(1, 2048, 32000, ab.SEEDS["long"])[0]["prompt_token_ids"]
    assert sent[0][:100] != sent[1][:100]  # distinct prompts otherwise


def test_decode_step_is_each_requests_first_to_last_token_averaged(ab):
    from types import SimpleNamespace as NS

    def request(first, last, n):
        return NS(metrics=NS(first_token_ts=first, last_token_ts=last), outputs=[NS(token_ids=[0] * n)])

    # A request admitted a step later decodes as fast: its own span counts, not the call's.
    assert ab.decode_step_s([request(1.0, 1.7, 8), request(1.1, 1.8, 8)]) == pytest.approx(0.1)
    assert ab.decode_step_s([request(1.0, 1.7, 8), request(2.0, 2.0, 1)]) == pytest.approx(0.1)
    with pytest.raises(RuntimeError, match="per-request times"):
        ab.decode_step_s([NS(metrics=None, outputs=[NS(token_ids=[0, 0])])])
    with pytest.raises(RuntimeError, match="two output tokens"):
        ab.decode_step_s([request(1.0, 1.0, 1)])


def test_a_partial_result_keeps_its_scenarios_on_timeout(ab, tmp_path, capsys):
    result = tmp_path / "run_FLASH_ATTN.json"
    script = ("import json, sys, time; json.dump({'config': 'FLASH_ATTN', 'short': {'output_tok_s': 1.0}, "
              "'running': 'overflow'}, open(sys.argv[1], 'w')); time.sleep(120)")
    job = ab.Job("FLASH_ATTN", [sys.executable, "-c", script, str(result)], result, {"config": "FLASH_ATTN"})
    ab.run_pool([job], ["0"], timeout=1.5, poll_s=0.05)
    r = json.loads(result.read_text())
    assert r["short"] == {"output_tok_s": 1.0} and "running" not in r
    assert r["error"] == "timed out after 1.5 s in overflow"
    assert "failed: timed out after 1.5 s in overflow" in capsys.readouterr().out


def test_report_names_a_run_ended_from_outside_the_harness(ab, tmp_path):
    """A worker's result still ``running`` a scenario (the harness itself was killed, so nobody
    finished the file) is a failure in that scenario; what it measured before stands."""
    write_runs(tmp_path, {"FLASH_ATTN": run(500_000, 20.0, 300.0, 100.0),
                          "int4": {"kv_cache_tokens": 1_900_000, "max_num_seqs": 1024, "running": "prefill"}})
    text = ab.report(tmp_path)
    assert table_row(text, "KV cache capacity")[1] == "1,900,000 (3.80x)"
    assert table_row(text, "time per output token")[1] == "failed"
    assert "\n**int4 failed:** `ended from outside in prefill, before a result (see log_int4.txt)`" in text


# --- the report of issue 18's workloads -------------------------------------------------------

def issue18_run(kv, scale, window=0):
    """A hand-made result with every scenario; ``scale`` multiplies throughputs (times divide);
    ``window``: KV tokens each running request's OSCAR windows take."""
    sizes = {"requests": 8, "prompt_len": 16384, "output_len": 64}
    return {"kv_cache_tokens": kv, "kv_tokens_all_running": kv - 1024 * window,
            "max_num_seqs": 1024, "worker_s": 300.0,
            "latency": {"requests": 1, "output_len": 64, "contexts": [1024, 131072],
                        "per_context": [{"context": 1024, "tpot_ms": 6.0 / scale},
                                        {"context": 131072, "tpot_ms": 12.0 / scale}]},
            "short": {"requests": 32, "prompt_len": 1024, "output_len": 256, "output_tok_s": 4000.0 * scale},
            "prefill": {"requests": 8, "prompt_len": 16384, "prefill_tok_s": 30000.0 * scale},
            "decode": {"requests": 8, "context": 16384, "output_len": 64, "decode_tok_s": 400.0 * scale,
                       "tpot_ms": 20.0 / scale},
            "fresh": {**sizes, "seconds": 10.0 / scale, "output_tok_s": 50.0 * scale},
            "reasoning": {"requests": 64, "prompt_len": 1024, "output_len": 1024, "output_tok_s": 3000.0 * scale,
                          "mean_running": 64.0, "preemptions": 0},
            "overflow": {"requests": 992, "prompt_len": 1024, "output_len": 1024, "output_tok_s": 9000.0 * scale,
                         "mean_running": 400.0 * scale, "preemptions": int(300 / scale)},
            "capacity": {"requests": 32, "prompt_len": 31744, "output_len": 64, "first_pass_s": 40.0,
                         "output_tok_s": 30.0 * scale, "prompt_tokens_computed": int(900_000 / scale)},
            "long": {"prompt_len": 131072, "prefill_tok_s": 12000.0 * scale}}


def test_report_has_every_issue18_workload(ab, tmp_path):
    runs = {"FLASH_ATTN": issue18_run(812_160, 1.0), "OSCAR": issue18_run(5_766_272, 2.0, 2560),
            "fp8": issue18_run(1_624_320, 1.25), "int4": {"error": "RuntimeError: no kernel"}}
    write_runs(tmp_path, runs)
    plan = plan_for(ab, ["--budget-s", "130", "--configs", "OSCAR", "FLASH_ATTN", "fp8", "int4"])
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    text = ab.report(tmp_path)
    assert table_row(text, "metric") == ["OSCAR", "FLASH_ATTN", "fp8", "int4"]
    labels = [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ")][1:]
    assert labels == [
        "KV cache capacity (tokens)", "KV tokens left with all max_num_seqs requests running",
        "batch 1: time per output token (ms), 1K context, 64 out",
        "batch 1: time per output token (ms), 128K context, 64 out",
        "output tok/s, 32 x (1K in, 256 out), fresh",
        "decode tok/s, 8 x 16K context, prefix-cached", "time per output token (ms), same run",
        "fresh: output tok/s, 8 x 16K, prefill + 64 out", "fresh: seconds, same run",
        "reasoning: output tok/s, 64 x (1K in, 1K out), fresh", "reasoning: requests decoding at once (mean)",
        "reasoning: preemptions",
        "overflow: output tok/s, 992 x (1K in, 1K out), fresh", "overflow: requests decoding at once (mean)",
        "overflow: preemptions",
        "capacity, first pass (s): prefill of 32 x ~31K, 1 token out",
        "capacity, follow-up output tok/s: the same 32 prompts, 64 out each",
        "capacity, follow-up: prompt tokens computed again",
        "prefill tok/s, 8 x 16K distinct prompts", "prefill tok/s, 1 x 128K prompt"]
    # Times: FLASH_ATTN's over this one's; throughputs: this one's over FLASH_ATTN's.
    assert table_row(text, "batch 1: time per output token (ms), 128K") == ["6.0 (2.00x)", "12.0", "9.6 (1.25x)",
                                                                            "failed"]
    assert table_row(text, "overflow: output tok/s") == ["18,000.0 (2.00x)", "9,000.0", "11,250.0 (1.25x)", "failed"]
    assert table_row(text, "fresh: seconds") == ["5.0 (2.00x)", "10.0", "8.0 (1.25x)", "failed"]
    assert table_row(text, "overflow: preemptions") == ["150", "300", "240", "failed"]  # counts: no ratio
    assert "\n**int4 failed:** `RuntimeError: no kernel`" in text
    # What ran: the plan's scaling and the KV the memory-bound scenarios need against each cache.
    assert f"- sizes: the defaults scaled by {plan['scale']} to fit --budget-s 130 per configuration" in text
    assert "overflow to need over 1.25x the largest KV cache of FLASH_ATTN and fp8 and capacity over 1.25x" in text
    assert "overflow 2,031,616 (OSCAR 0.79, FLASH_ATTN 2.50, fp8 1.25)" in text
    assert "Seconds per configuration, engine start to exit (the plan's estimate): OSCAR 300 (" in text
    # Spliced into another document, it adds nothing to that document's outline.
    assert [line for line in text.splitlines() if line.startswith("#")] == [text.splitlines()[0]]
    csv = (tmp_path / "ab.csv").read_text().splitlines()
    assert '"overflow: preemptions",OSCAR,150,' in csv
    assert (tmp_path / "ab.png").read_bytes()[:4] == b"\x89PNG"


def test_report_merges_two_runs_of_one_plan(ab, tmp_path):
    first, second = tmp_path / "ab1", tmp_path / "ab2"
    write_runs(first, {"FLASH_ATTN": issue18_run(812_160, 1.0), "OSCAR": issue18_run(5_766_272, 2.0)})
    other = issue18_run(812_160, 0.5)  # the second run's baseline was half as fast
    write_runs(second, {"FLASH_ATTN": other, "int4": issue18_run(3_000_000, 0.75)})
    text = ab.report(first, second)
    assert table_row(text, "metric") == ["OSCAR", "FLASH_ATTN", "FLASH_ATTN (run 2)", "int4"]
    # int4 against its own run's FLASH_ATTN: 0.75 / 0.5
    short = table_row(text, "output tok/s, 32 x (1K in, 256 out)")
    assert short == ["8,000.0 (2.00x)", "4,000.0", "2,000.0", "3,000.0 (1.50x)"]
    assert "- run 1 (OSCAR, FLASH_ATTN): " in text and "- run 2 (FLASH_ATTN, int4): " in text
    assert (first / "ab.md").read_text() == text and not (second / "ab.md").exists()


def test_a_report_names_the_oscar_settings_its_environment_set(ab, tmp_path):
    """An OSCAR engine reads OSCAR_* settings from the environment: the run records them and its
    report names them, beside the engine arguments (a run with OSCAR_HIT_RING=reuse said so only
    in its operator's notes)."""
    env = ab.oscar_environment({"OSCAR_HIT_RING": "reuse", "OSCAR_SINK_SIZE": "", "OSCAR_CORPUS_DIR": "/c",
                                "HOME": "/h"})
    assert env == {"OSCAR_HIT_RING": "reuse"}, "settings only, and only those set"
    first, second = tmp_path / "ab1", tmp_path / "ab2"
    write_runs(first, {"FLASH_ATTN": issue18_run(812_160, 1.0)})
    write_runs(second, {"OSCAR": issue18_run(5_766_272, 2.0)})
    (second / "meta.json").write_text(json.dumps({**META, "oscar_env": env}))
    text = ab.report(first, second)
    lines = text.splitlines()
    at = lines.index('- OSCAR settings from the environment: {"OSCAR_HIT_RING": "reuse"}')
    assert lines[at - 1].startswith("- run 2 (OSCAR): "), "under the run that set it"
    assert text.count("OSCAR settings from the environment") == 1
    assert "from the environment" not in ab.report(first)


def test_report_takes_an_earlier_runs_baseline_of_the_same_sizes(ab, tmp_path):
    """A run split over invocations (a GPU call's time limit): a run without FLASH_ATTN takes the
    ratios of an earlier run's, marked, where its plan's sizes and engine arguments are the same."""
    def plan(short_requests):
        return {"inputs": {"budget_s": None}, "fixed": True, "estimate_s": {},
                "sizes": {"short": {"requests": short_requests, "prompt_len": 1024, "output_len": 256},
                          "decode": {"requests": 8, "context": 16384, "output_len": 64}}}

    runs = [tmp_path / f"ab{i}" for i in (1, 2, 3)]
    write_runs(runs[0], {"FLASH_ATTN": issue18_run(812_160, 1.0)})
    write_runs(runs[1], {"OSCAR": issue18_run(5_766_272, 2.0)})
    write_runs(runs[2], {"fp8": issue18_run(1_624_320, 1.5)})
    for run_dir, short_requests in zip(runs, (32, 32, 64)):  # run 3's short scenario ran other sizes
        (run_dir / "plan.json").write_text(json.dumps(plan(short_requests)))
    text = ab.report(*runs)
    assert table_row(text, "output tok/s, 32 x (1K in, 256 out)") == ["8,000.0 (2.00x†)", "4,000.0", "6,000.0"]
    assert table_row(text, "decode tok/s")[0::2] == ["800.0 (2.00x†)", "600.0 (1.50x†)"]
    # the plans have no prefill sizes: the prefill of the decode scenario's prompts, the same in each
    assert table_row(text, "prefill tok/s, 8 x 16K")[0::2] == ["60,000.0 (2.00x†)", "45,000.0 (1.50x†)"]
    assert table_row(text, "KV cache capacity")[2] == "1,624,320 (2.00x†)"
    assert "† against the FLASH_ATTN of an earlier run with the same sizes" in text
    meta = json.loads((runs[1] / "meta.json").read_text())
    (runs[1] / "meta.json").write_text(json.dumps({**meta, "engine_args": '{"max_num_seqs": 8}'}))
    text = ab.report(*runs)
    assert table_row(text, "output tok/s, 32 x (1K in, 256 out)")[0] == "8,000.0"  # other engine arguments
    assert table_row(text, "decode tok/s")[2] == "600.0 (1.50x†)"


def test_report_names_sizes_that_differ(ab, tmp_path):
    runs = {"FLASH_ATTN": issue18_run(812_160, 1.0), "OSCAR": issue18_run(5_766_272, 2.0)}
    runs["OSCAR"]["short"]["requests"] = 64
    write_runs(tmp_path, runs)
    assert "**short: sizes differ between configurations**" in ab.report(tmp_path)


# --- a worker end to end, with a stand-in for vLLM's LLM (no engine on the CPU) ----------------

class StandInLLM:
    """What the worker uses of ``vllm.LLM``: the engine's config, ``generate`` (every request
    decodes 5 ms per token after 10 ms of prefill, its first token 20 ms after its arrival; the
    prompts it was sent kept in ``sent``) and the Prometheus counters. ``fail_at``: output
    lengths whose ``generate`` raises."""
    kv_tokens, fail_at, instances = 812_160, (), []

    def __init__(self, model, **kw):
        from types import SimpleNamespace as NS

        self.kw, self.counts, self.sent = kw, {"gen": 0, "steps": 0}, []
        blocks = self.kv_tokens * (2 if kw.get("kv_cache_dtype") == "fp8" else 1) // 16
        self.llm_engine = NS(log_stats=not kw.get("disable_log_stats", True), vllm_config=NS(
            cache_config=NS(num_gpu_blocks=blocks, block_size=16),
            scheduler_config=NS(max_num_seqs=1024, max_num_batched_tokens=16384)))
        StandInLLM.instances.append(self)

    def generate(self, prompts, sp, use_tqdm=True):
        from types import SimpleNamespace as NS

        k = sp.max_tokens
        if k in self.fail_at:
            raise RuntimeError(f"out of memory at {k}")
        self.counts["gen"] += len(prompts) * k
        self.counts["steps"] += k
        self.sent += [p["prompt_token_ids"] for p in prompts]
        m = NS(scheduled_ts=1.0, first_token_ts=1.01, last_token_ts=1.01 + 0.005 * (k - 1), first_token_latency=0.02)
        return [NS(outputs=[NS(token_ids=[7] * k)], metrics=m, num_cached_tokens=0) for _ in prompts]

    def get_metrics(self):
        from types import SimpleNamespace as NS

        return [NS(name="vllm:generation_tokens", value=self.counts["gen"], labels={}),
                NS(name="vllm:iteration_tokens_total", count=self.counts["steps"], labels={}),
                NS(name="vllm:num_preemptions", value=0, labels={})]


TINY = ["--num-prompts", "2", "--prompt-len", "64", "--output-len", "8", "--long-prompt", "256",
        "--latency-contexts", "64", "256", "--latency-output-len", "9", "--short-requests", "2",
        "--short-output-len", "8", "--fresh-requests", "2", "--fresh-len", "64", "--fresh-output-len", "8",
        "--reasoning-requests", "2", "--reasoning-output-len", "16", "--overflow-requests", "3",
        "--overflow-prompt-len", "64", "--overflow-output-len", "12", "--capacity-requests", "2",
        "--capacity-len", "128", "--capacity-output-len", "8"]


@pytest.fixture
def stand_in_vllm(monkeypatch):
    import types

    fake = types.ModuleType("vllm")
    fake.LLM = StandInLLM

    def sampling(max_tokens, **kw):
        return types.SimpleNamespace(max_tokens=max_tokens, **kw)

    fake.SamplingParams = sampling
    monkeypatch.setitem(sys.modules, "vllm", fake)
    StandInLLM.instances, StandInLLM.fail_at = [], ()
    return StandInLLM


def run_worker_main(ab, tmp_path, config: str, argv: list[str]) -> dict:
    model = tmp_path / "qwen3-8b-shape"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(QWEN3_8B))
    plan_path = tmp_path / "plan.json"
    if not plan_path.exists():
        plan_path.write_text(json.dumps(ab.parent_plan(ab.parse_args(argv), QWEN3_8B)))
    result = tmp_path / f"run_{config}.json"
    ab.worker_main(ab.parse_args(argv + ["--model", str(model), "--worker", config, "--result", str(result),
                                         "--plan", str(plan_path)]))
    return json.loads(result.read_text())


def test_worker_runs_every_scenario_and_the_baseline_sizes_the_plan(ab, tmp_path, stand_in_vllm):
    argv = TINY + ["--budget-s", "100000"]
    base = run_worker_main(ab, tmp_path, "FLASH_ATTN", argv)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["sized_by_engine"] and plan["bf16_kv_source"] == "read from the FLASH_ATTN engine"
    assert base["plan"]["bf16_kv_tokens"] == 812_160 and "error" not in base and "running" not in base
    kw = stand_in_vllm.instances[0].kw
    assert kw["disable_log_stats"] is False and kw["load_format"] == "dummy"
    assert kw["max_model_len"] == plan["max_model_len"]
    assert set(ab.SCENARIOS) <= set(base) and set(base["scenario_wall_s"]) == set(ab.SCENARIOS) - {"decode"}
    assert [r["context"] for r in base["latency"]["per_context"]] == [64, 256]
    assert base["latency"]["per_context"][0]["tpot_ms"] == pytest.approx(5.0)
    assert base["overflow"] == {**plan["sizes"]["overflow"], **{k: base["overflow"][k] for k in
                                ("seconds", "output_tok_s")}, "outputs": 36, "mean_running": 3.0, "preemptions": 0,
                                "prompt_tokens_computed": 0}
    assert base["capacity"]["outputs"] == 16 and base["decode"]["outputs"] == 16
    # Every request decodes 5 ms a token after its first: the decode step, not the call's time over tokens.
    assert base["decode"]["tpot_ms"] == pytest.approx(5.0) and base["decode"]["decode_tok_s"] == pytest.approx(400.0)
    assert base["decode"]["hit_s"] >= 0
    fp8 = run_worker_main(ab, tmp_path, "fp8", argv)  # runs the plan the baseline wrote
    assert fp8["plan"] == base["plan"] and fp8["kv_cache_tokens"] == 2 * 812_160
    assert fp8["overflow"]["requests"] == base["overflow"]["requests"]


def test_worker_keeps_what_it_finished_when_a_scenario_fails(ab, tmp_path, stand_in_vllm):
    stand_in_vllm.fail_at = (12,)  # overflow's output length
    r = run_worker_main(ab, tmp_path, "FLASH_ATTN", TINY)
    assert r["error"] == "RuntimeError: out of memory at 12 (in overflow)"
    assert "reasoning" in r and "overflow" not in r and "capacity" not in r and "running" not in r
    write_runs(tmp_path, {})
    text = ab.report(tmp_path)
    assert table_row(text, "reasoning: output tok/s")[0] not in ("", "failed")
    assert "overflow: output tok/s" not in text  # no run has it
    assert "**FLASH_ATTN failed:** `RuntimeError: out of memory at 12 (in overflow)`" in text


def test_report_merges_a_split_by_scenario(ab, tmp_path):
    """Run 1: every configuration, the scenarios that fit; run 2: two of them, the memory-bound ones."""
    first, second = tmp_path / "ab1", tmp_path / "ab2"
    fits = {"short", "latency", "decode", "prefill", "fresh", "long"}

    def only(r, keep):
        return {k: v for k, v in r.items() if k not in ab.SCENARIOS or k in keep}

    write_runs(first, {"FLASH_ATTN": only(issue18_run(812_160, 1.0), fits),
                       "OSCAR": only(issue18_run(5_766_272, 2.0, 2560), fits),
                       "fp8": only(issue18_run(1_624_320, 1.25), fits)})
    write_runs(second, {"FLASH_ATTN": only(issue18_run(812_160, 0.5), ab.MEMORY_BOUND),
                        "OSCAR": only(issue18_run(5_766_272, 2.0, 2560), ab.MEMORY_BOUND)})
    text = ab.report(first, second)
    assert table_row(text, "metric") == ["OSCAR", "FLASH_ATTN", "fp8"]
    assert table_row(text, "output tok/s, 32 x (1K in")[:2] == ["8,000.0 (2.00x)", "4,000.0"]  # run 1
    assert table_row(text, "overflow: output tok/s") == ["18,000.0 (4.00x)", "4,500.0", ""]  # run 2's baseline
    assert "Seconds per configuration" in text and "run 2 OSCAR 300" in text


def test_hadamard_key_mean_rotations_load_as_the_backend_reads_them(ab, tmp_path):
    """``--rotations hadamard-key-means``: a folder that ``key_mean`` 'on' accepts for the model's
    shape (a mean a layer, ``[Hkv, d]``), the same numbers every run."""
    import torch

    from oscar_vllm.core.rotation_io import ModelShape, load_rotations

    cfg = json.loads(ab.QWEN3_8B_CONFIG.read_text())
    folder = ab.hadamard_key_mean_rotations(cfg, tmp_path / "a")
    shape = ModelShape.from_hf_config(cfg)
    rot = load_rotations(folder, shape)
    assert sorted(rot.key_means) == list(range(36))
    assert {tuple(m.shape) for m in rot.key_means.values()} == {(8, 128)}
    assert rot.key.objective == "hadamard" and rot.key_means[0].std() > 0.5
    again = load_rotations(ab.hadamard_key_mean_rotations(cfg, tmp_path / "b"), shape)
    assert all(torch.equal(rot.key_means[i], again.key_means[i]) for i in range(36))


def test_hadamard_key_means_with_key_mean_off_are_refused(tmp_path, ab):
    """Means that OSCAR would not read (``key_mean`` off, the default) would time the run without
    them; ``auto`` and ``on`` read them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OSCAR_")}
    proc = subprocess.run([*HARNESS, "--rotations", "hadamard-key-means", "--scenarios", "decode",
                           "--configs", "OSCAR", "--out", str(tmp_path / "ab")], capture_output=True, text=True,
                          env={**env, "OSCAR_KEY_MEAN": "off"}, cwd=REPO)
    assert proc.returncode == 2 and "key_mean off (the default) serves without" in proc.stderr
    assert not (tmp_path / "ab").exists(), "refused before anything is written"
    assert ab.oscar_key_mean(env) == "off" and ab.oscar_key_mean({"OSCAR_KEY_MEAN": "auto"}) == "auto"
    default = subprocess.run([*HARNESS, "--rotations", "hadamard-key-means", "--scenarios", "decode", "--configs",
                              "OSCAR", "--out", str(tmp_path / "ab")], capture_output=True, text=True, env=env,
                             cwd=REPO)
    assert default.returncode == 2 and "set OSCAR_KEY_MEAN=auto" in default.stderr


# --- ttft: time to first token, fresh, on a prefix hit, alone and long (issue 53) --------------

TTFT_ARGV = ["--scenarios", "ttft", "latency", "--configs", "OSCAR", "FLASH_ATTN", "fp8", "int4"]


def test_ttft_runs_after_latency_and_a_plan_runs_its_scenarios(ab, tmp_path):
    """Named in any order, latency runs first (ttft's long part reads its 128K request); ``fits``
    has ttft, ``memory-bound`` not; a run on an earlier plan runs the scenarios that plan sized."""
    assert ab.parse_args(TTFT_ARGV).scenarios == ["latency", "ttft"]
    assert ab.parse_args(["--scenarios", "ttft"]).scenarios == ["ttft"]
    assert "ttft" in ab.expand_scenarios(["fits"]) and "ttft" not in ab.expand_scenarios(["memory-bound"])
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"sizes": {"ttft": {"requests": 4}}}))
    assert ab.parse_args(["--plan", str(plan)]).scenarios == ["ttft"]


def test_ttft_sizes_under_a_budget_keep_their_floors_and_stay_in_bf16s_cache(ab):
    full = plan_for(ab, TTFT_ARGV)
    assert full["sizes"]["ttft"] == {"requests": 32, "prompt_len": 16384, "suffix_len": 64, "long_len": 131072}
    assert full["max_model_len"] == 64 + 131072 + 256  # latency's 128K context and its output
    # Scaled by the budget: fewer requests, down to the floor; the lengths TTFT depends on stay.
    mid, tight = plan_for(ab, TTFT_ARGV + ["--budget-s", "140"]), plan_for(ab, TTFT_ARGV + ["--budget-s", "60"])
    assert mid["fits"] and ab.TTFT_MIN_REQUESTS < mid["sizes"]["ttft"]["requests"] < 32
    assert not tight["fits"] and tight["sizes"]["ttft"] == {**full["sizes"]["ttft"], "requests": ab.TTFT_MIN_REQUESTS}
    assert ab.needs_bf16_capacity(mid), "its requests hang on BF16's cache: the FLASH_ATTN engine sizes them"
    # A BF16 cache of 300K tokens holds 16 prompts and their turns (16,512 tokens each) in 90% of it.
    small = plan_for(ab, TTFT_ARGV, bf16=300_000)
    assert small["sizes"]["ttft"]["requests"] == 16
    assert any(n.startswith("ttft: 16 requests, not 32:") for n in small["notes"])
    assert not any(n.startswith("ttft") for n in full["notes"])
    short = plan_for(ab, TTFT_ARGV + ["--ttft-prompt-len", str(ab.TTFT_MIN_PROMPT - 64)])
    assert any(n.startswith("ttft: prompts of 704 tokens: OSCAR's hit computes the last 512") for n in short["notes"])
    assert not any("prompts of" in n for n in plan_for(ab, TTFT_ARGV + ["--ttft-prompt-len", "768"])["notes"])


def test_ttft_estimate_pays_the_long_prefill_once(ab):
    """latency's 128K context (or long's prompt) is ttft's long part: the plan does not count its
    prefill twice; OSCAR's hit computes its last 512 tokens again (hit_ring recompute)."""
    from oscar_vllm.core.settings import OscarSettings

    assert ab.OSCAR_HIT_RECOMPUTED == 2 * OscarSettings().recent_size  # its recent window and its ring
    assert ab.hit_cached_tokens("OSCAR", 16384, 64) == 16384 + 64 - 512 and ab.hit_cached_tokens("fp8", 16384, 64) \
        == 16384
    caps = ab.Caps(BF16_KV, {"OSCAR": 7.0, "FLASH_ATTN": 1.0}, 2560, 1024)
    ttft = {"requests": 8, "prompt_len": 16384, "suffix_len": 64, "long_len": 131072}
    alone = ab.scenario_s("ttft", "FLASH_ATTN", {"ttft": ttft}, caps)
    for other in ({"long": {"prompt_len": 131072}}, {"latency": {"contexts": [1024, 131072], "output_len": 64}}):
        assert alone - ab.scenario_s("ttft", "FLASH_ATTN", {"ttft": ttft, **other}, caps) == \
            pytest.approx(ab.prefill_s(131072))
    assert ab.scenario_s("ttft", "OSCAR", {"ttft": ttft}, caps) > alone


def test_dry_run_prints_the_ttft_plan(ab, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "argv", [ab.COMMAND, "--dry-run", *TTFT_ARGV, "--out", str(tmp_path / "ab")])
    ab.main()
    lines = capsys.readouterr().out.splitlines()
    assert not (tmp_path / "ab").exists()
    row = next(line for line in lines if line.startswith("ttft "))
    assert "32 x 16K then + 64 new, 1 out; 1 x 128K (latency's)" in row and len(row.split()) >= 4 + 4
    assert [line.split()[0] for line in lines if line.startswith(("latency ", "ttft "))] == ["latency", "ttft"]


def common_prefix(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_ttft_hits_share_exactly_their_fresh_prompt(ab):
    z = {"requests": 3, "prompt_len": 192, "suffix_len": 64, "long_len": 256}
    ids = {k: [p["prompt_token_ids"] for p in v] for k, v in ab.ttft_prompts(z, QWEN3_8B["vocab_size"]).items()}
    assert [len(p) for p in ids["fresh"]] == [192] * 3 and [len(p) for p in ids["hit"] + ids["one_user"]] == [256] * 4
    for i, hit in enumerate(ids["hit"]):
        assert [common_prefix(hit, fresh) for fresh in ids["fresh"]] == [192 if j == i else 0 for j in range(3)]
        assert [common_prefix(hit, other) for other in ids["hit"] if other is not hit] == [0, 0]
    # The one user's turn is on the first prompt, with a suffix of its own: its hit is that prompt alone.
    assert common_prefix(ids["one_user"][0], ids["fresh"][0]) == 192
    assert common_prefix(ids["one_user"][0], ids["hit"][0]) == 192
    assert ab.ttft_prompts(z, QWEN3_8B["vocab_size"]) == ab.ttft_prompts(z, QWEN3_8B["vocab_size"])  # seeded


def test_ttft_prompts_share_no_block_with_any_other_request_of_the_run(ab, tmp_path, stand_in_vllm):
    """Every scenario and warm-up of a run through the stand-in engine: no other request starts
    with a block of ttft's (its hits would find it cached), and ttft sends each of its own once."""
    r = run_worker_main(ab, tmp_path, "FLASH_ATTN", TINY + ["--ttft-long-len", "320"])  # long's is 256
    assert "error" not in r and r["ttft"]["long_from"] == "ttft"
    sizes = json.loads((tmp_path / "plan.json").read_text())["sizes"]
    vocab = QWEN3_8B["vocab_size"]
    parts = {k: [p["prompt_token_ids"] for p in v] for k, v in ab.ttft_prompts(sizes["ttft"], vocab).items()}
    parts["long"] = [ab.distinct_prompts(1, 320, vocab, ab.SEEDS["ttft_long"])[0]["prompt_token_ids"]]
    ours = [p for v in parts.values() for p in v]
    sent = stand_in_vllm.instances[0].sent
    assert [sent.count(p) for p in ours] == [1] * len(ours)
    others = {tuple(p[:64]) for p in sent if p not in ours}
    assert len(sent) - len(ours) > 20 and not any(tuple(p[:64]) in others for p in ours)
    assert len({tuple(p[:64]) for p in parts["fresh"] + parts["long"]}) == len(parts["fresh"]) + 1


def test_ttft_runner_takes_median_and_p90_from_each_requests_metrics(ab):
    from types import SimpleNamespace as NS

    sent = []

    def timed(prompts, max_tokens, scenario):
        """Request i of a call: its first token 0.5 + 0.1 i s after its arrival; a prompt longer
        than 192 tokens (a turn on a cached one) had 128 of them from the cache, the first 160."""
        sent.append((len(prompts), max_tokens, scenario))
        results = [NS(metrics=NS(first_token_latency=0.5 + 0.1 * i), outputs=[NS(token_ids=[0])],
                      num_cached_tokens=(160 if i == 0 else 128) if len(p["prompt_token_ids"]) > 192 else 0)
                   for i, p in enumerate(prompts)]
        return ab.Call(2.0 + len(sent), len(prompts), results, None)

    z = {"requests": 10, "prompt_len": 192, "suffix_len": 64, "long_len": 256}
    result = {}
    ab.scenarios._ttft(timed, {"ttft": z}, 32000, result)
    assert sent == [(10, 1, "ttft"), (10, 1, "ttft"), (1, 1, "ttft"), (1, 1, "ttft")]  # its own long prompt last
    t = result["ttft"]
    # 0.5 to 1.4 s: the median between the 5th and 6th, the p90 the 9th (nearest rank).
    assert (t["fresh_ttft_median_s"], t["fresh_ttft_p90_s"], t["fresh_s"]) == (0.95, 1.3, 3.0)
    assert (t["hit_ttft_median_s"], t["hit_ttft_p90_s"], t["hit_s"]) == (0.95, 1.3, 4.0)
    assert (t["fresh_cached_tokens"], t["hit_cached_tokens"]) == (0, 128)
    assert (t["one_user_ttft_s"], t["one_user_cached_tokens"]) == (0.5, 160)
    assert (t["long_ttft_s"], t["long_prefill_tok_s"], t["long_from"]) == (0.5, 512.0, "ttft")
    assert {k: t[k] for k in z} == z
    # long's call, or latency's at that context, is its long part: nothing more sent.
    rows = [{"context": 64, "ttft_s": 0.1}, {"context": 256, "ttft_s": 3.2}]
    for sizes, earlier in (({"long": {"prompt_len": 256}}, {"long": {"ttft_s": 3.2}}),
                           ({"latency": {"contexts": [64, 256]}}, {"latency": {"per_context": rows}})):
        sent.clear()
        ab.scenarios._ttft(timed, {"ttft": z, **sizes}, 32000, earlier)
        t = earlier["ttft"]
        assert len(sent) == 3 and (t["long_ttft_s"], t["long_prefill_tok_s"]) == (3.2, 80.0)
        assert t["long_from"] == next(iter(sizes))
    with pytest.raises(RuntimeError, match="per-request times"):
        ab.first_token_s(NS(metrics=None))
    with pytest.raises(RuntimeError, match="no first-token latency"):
        ab.first_token_s(NS(metrics=NS(first_token_latency=0.0)))


def ttft_result(scale: float, cached: int) -> dict:
    """A hand-made ttft result: times divided by ``scale``; ``cached`` prompt tokens a hit served."""
    return {"requests": 32, "prompt_len": 16384, "suffix_len": 64, "long_len": 131072,
            "fresh_ttft_median_s": 8.0 / scale, "fresh_ttft_p90_s": 14.0 / scale, "fresh_s": 16.0 / scale,
            "fresh_cached_tokens": 0, "hit_ttft_median_s": 0.4 / scale, "hit_ttft_p90_s": 0.6 / scale,
            "hit_s": 0.8 / scale, "hit_cached_tokens": cached, "one_user_ttft_s": 0.05 / scale,
            "one_user_cached_tokens": cached, "long_ttft_s": 11.0 / scale, "long_prefill_tok_s": 131072 * scale / 11.0,
            "long_from": "latency"}


def test_report_has_ttft_rows_against_flash_attn(ab, tmp_path):
    runs = {c: {**issue18_run(kv, 1.0), "ttft": ttft_result(scale, cached)} for c, kv, scale, cached in
            (("FLASH_ATTN", 812_160, 1.0, 16384), ("OSCAR", 5_766_272, 0.5, 15936), ("fp8", 1_624_320, 1.25, 16384))}
    runs["int4"] = {"error": "RuntimeError: no kernel"}
    write_runs(tmp_path, runs)
    text = ab.report(tmp_path)
    labels = [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ")]
    at = labels.index("TTFT (s), fresh: median of 32 x 16K sent at once")
    assert labels[at - 1].startswith("batch 1: time per output token (ms), 128K")  # beside issue 53's other half
    assert labels[at:at + 11] == [
        "TTFT (s), fresh: median of 32 x 16K sent at once", "TTFT (s), fresh: p90, same call",
        "TTFT fresh: the call's seconds", "TTFT (s), prefix hit: median of the same 32 prompts + 64 new tokens each",
        "TTFT (s), prefix hit: p90, same call", "TTFT prefix hit: the call's seconds",
        "TTFT prefix hit: prompt tokens the cache served (median of a request's)",
        "TTFT (s), prefix hit, one user: 1 x (16K cached + 64 new)",
        "TTFT prefix hit, one user: prompt tokens the cache served", "TTFT (s), long: 1 x 128K fresh prompt",
        "TTFT long: prefill tok/s (its prompt over its TTFT)"]
    # Times: FLASH_ATTN's over this one's (OSCAR twice as slow: 0.50x); counts: no ratio.
    assert table_row(text, "TTFT (s), fresh: median") == ["16.0 (0.50x)", "8.0", "6.4 (1.25x)", "failed"]
    assert table_row(text, "TTFT (s), prefix hit, one user") == ["0.1 (0.50x)", "0.05", "0.04 (1.25x)", "failed"]
    assert table_row(text, "TTFT prefix hit: prompt tokens") == ["15,936", "16,384", "16,384", "failed"]
    assert table_row(text, "TTFT (s), long")[:3] == ["22.0 (0.50x)", "11.0", "8.8 (1.25x)"]
    assert table_row(text, "TTFT long: prefill tok/s")[0].endswith("(0.50x)")
    csv = (tmp_path / "ab.csv").read_text().splitlines()
    assert '"TTFT (s), prefix hit: p90, same call",OSCAR,1.2,0.5' in csv
    assert '"TTFT prefix hit: prompt tokens the cache served (median of a request\'s)",OSCAR,15936,' in csv
    runs["OSCAR"]["ttft"]["suffix_len"] = 128
    write_runs(tmp_path, runs)
    assert "**ttft: sizes differ between configurations**" in ab.report(tmp_path)
