"""The startup check runs in the process that starts the engine, before vLLM forks the engine
process from it: what it leaves behind there is inherited."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from benchmarks.vllm_cpu import SMOLLM2_CONFIG  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CHILD_SECONDS = 60


def test_the_engine_process_forked_after_the_check_can_run_torch(tmp_path):
    """vLLM forks its engine process from the one that built the config (CUDA is not initialized
    there). torch's OpenMP thread pool does not survive a fork: had the check left one, the
    engine process's first parallel CPU op would wait forever. The H200's OSCAR engine starts
    stalled so (after "Using V2 Model Runner") while the check left one."""
    (tmp_path / "smollm2").mkdir()
    (tmp_path / "smollm2" / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    rotations = REPO / "tests" / "data" / "smollm2_rotations"
    code = textwrap.dedent(f"""
        import os, signal, time
        import torch
        torch.set_num_threads(2)  # a pool to leave behind, on any machine
        from benchmarks.vllm_cpu import vllm_configs_on_cpu
        with vllm_configs_on_cpu() as engine_args:
            engine_args(model={str(tmp_path / "smollm2")!r}, attention_backend="OSCAR", skip_tokenizer_init=True,
                        max_model_len=2048, additional_config={{"oscar": {{
                            "rotation_path": {str(rotations)!r}}}}}).create_engine_config()
        pid = os.fork()
        if pid == 0:
            torch.zeros(1 << 24).add_(1)
            torch.ones(1024, 1024, dtype=torch.float64) @ torch.ones(1024, 1024, dtype=torch.float64)
            os._exit(0)
        deadline = time.monotonic() + {CHILD_SECONDS}
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                print("child exit", os.waitstatus_to_exitcode(status))
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
            print("child hung")
    """)
    # Prepended, not replaced: on the GPU machine PYTHONPATH also carries the plugin's entry points.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert proc.stdout.strip().splitlines()[-1:] == ["child exit 0"], proc.stdout[-1000:] + proc.stderr[-3000:]
