"""benchmarks/ab_throughput.py without a GPU or vLLM: its report from hand-written result files,
and its pool of GPUs with fake workers (concurrency, the timeout that ends a process group)."""
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "ab_throughput.py"


@pytest.fixture(scope="module")
def ab():
    spec = importlib.util.spec_from_file_location("ab_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


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
    proc = subprocess.run([sys.executable, str(SCRIPT), "--scenarios", "none"], capture_output=True, text=True)
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
