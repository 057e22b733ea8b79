"""The examples as a user meets them on this machine: each prints its usage with --help, refuses
arguments it does not know, and the vLLM ones say in one line that they need a GPU."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = ["offline_llm.py", "serve_and_query.sh", "ab_benchmark.sh", "calibrate_and_inspect.sh",
            "generate_with_int2_cache.py"]
# The vLLM examples, with the arguments of their shortest real run.
NEEDS_GPU = {"offline_llm.py": ["--model", "some-model"], "serve_and_query.sh": ["--model", "some-model"],
             "ab_benchmark.sh": []}


def run_example(name: str, *args: str) -> subprocess.CompletedProcess:
    """The example as its usage line says to run it, with this interpreter first on PATH."""
    cmd = [sys.executable if name.endswith(".py") else "bash", str(REPO / "examples" / name), *args]
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)


def test_every_example_is_tested():
    assert sorted(p.name for p in (REPO / "examples").iterdir()) == sorted(EXAMPLES)


@pytest.mark.parametrize("name", EXAMPLES)
def test_help_prints_the_usage(name):
    proc = run_example(name, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage:") and f"examples/{name}" in proc.stdout, proc.stdout[:500]
    assert proc.stderr == ""


@pytest.mark.parametrize("name", EXAMPLES)
def test_an_unknown_argument_is_refused(name):
    proc = run_example(name, *NEEDS_GPU.get(name, []), "--no-such-option")
    assert proc.returncode == 2
    assert "usage:" in proc.stderr and "--no-such-option" in proc.stderr, proc.stderr[-2000:]


def test_calibrate_and_inspect_writes_nothing_for_help():
    run_example("calibrate_and_inspect.sh", "--help")
    assert not (REPO / "--help").exists() and not (REPO / "-h").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the path a machine without a GPU takes")
@pytest.mark.parametrize("name", NEEDS_GPU)
def test_without_a_gpu_one_line_and_a_failing_status(name, tmp_path):
    proc = run_example(name, *NEEDS_GPU[name])
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "needs a CUDA GPU" in proc.stderr and "nothing was run" in proc.stderr, \
        proc.stderr[-2000:]
