"""The GPU scripts' CPU side: what ``tests/gpu/e2e_vllm.py`` builds before an engine starts (a
mistake there shows only on the GPU machine otherwise, after minutes of staging)."""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from oscar_vllm.calibration.evaluate import CACHED_PREFIX_CUTS, CACHED_PREFIX_WINDOWS, cached_prefix_tokens


@pytest.fixture
def e2e(monkeypatch):
    """``e2e_vllm`` with the evaluation text's tokens replaced by distinct ids (no tokenizer, no corpus)."""
    spec = importlib.util.spec_from_file_location("e2e_vllm", Path(__file__).parent / "gpu" / "e2e_vllm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    asked = []

    def eval_windows(model_dir, tokens, context):
        asked.append(tokens)
        ids = list(range(tokens + context))
        return [ids[i:i + context] for i in range(0, tokens + 1, context)], None

    monkeypatch.setattr(module, "eval_windows", eval_windows)
    module.asked = asked
    return module


@pytest.mark.parametrize("windows", [None, 156])
def test_prefix_workload_is_the_check_each_stage_asks_for(e2e, windows):
    # preempt and chunked ask without a count (the check's default), prefix with --windows.
    chats, shared, got = e2e.prefix_workload("model") if windows is None else e2e.prefix_workload("model", windows)
    n = windows or CACHED_PREFIX_WINDOWS
    assert e2e.asked == [cached_prefix_tokens(n)]
    assert len(chats) == 16 and len(got) == n and len(shared) == 512
    assert all(w[:512] == shared for w in got)
    assert len({tuple(w[512:]) for w in got}) == n, "windows past the shared prefix must be distinct text"
    # Each cut's request is the window up to it and scores its next two tokens.
    assert all(len(w) >= 512 + max(CACHED_PREFIX_CUTS) + 2 for w in got)


class FakeEngine:
    """``subprocess.Popen`` for ``e2e_vllm.py prefix``'s engines: writes the engine's result at once,
    its KV cache "allocated" (the ready file) after two polls, exits after four."""
    log = []

    def __init__(self, cmd):
        a = dict(zip(cmd[3::2], cmd[4::2]))
        self.caching, self.out, self.polls, self.exited = a["--caching"], Path(a["--out"]), 0, False
        others = [e for e in self.log if e is not self]
        self.log.append(self)
        self.started_after = [(e.caching, e.out.with_suffix(".ready").exists(), e.exited) for e in others]
        self.share, self.windows = float(a["--gpu-memory-utilization"]), a.get("--windows")
        out = {"ids": [1, 2], "cached": 0, "logprobs": [{"1": -0.1}, {"2": -0.2}]}
        hit = dict(out, cached=1536 if self.caching == "on" else 0)
        self.out.write_text(json.dumps({"first": [out] * 16, "again": [hit] * 16, "after_reset": [out] * 16,
                                        "nll": [1.0, 2.0, 1.5], "nll_after": [0.5, 0.7, 0.6], "chunk": 256,
                                        "cached_tokens": 1000 if self.caching == "on" else 0}))

    def poll(self):
        self.polls += 1
        if self.polls == 2:
            self.out.with_suffix(".ready").touch()
        self.exited = self.exited or self.polls >= 4
        return 0 if self.exited else None

    def wait(self):
        self.exited = True
        return 0


@pytest.mark.parametrize("side_by_side", [False, True])
def test_prefix_check_starts_its_second_engine_when_the_first_holds_its_cache(e2e, monkeypatch, side_by_side):
    FakeEngine.log = []
    monkeypatch.setattr(e2e, "subprocess", SimpleNamespace(Popen=FakeEngine))
    monkeypatch.setattr(e2e, "time", SimpleNamespace(sleep=lambda s: None))
    args = argparse.Namespace(caching=None, model="m", rotations="r", backend=f"FAKE{os.getpid()}", chunk=256,
                              windows=2, side_by_side=side_by_side, out=None)
    e2e.cmd_prefix(args)
    off, on = FakeEngine.log
    assert (off.caching, on.caching) == ("off", "on") and off.windows == on.windows == "2"
    if side_by_side:
        # vLLM sizes its KV cache from the free memory while it starts: the first engine's cache must be
        # in place by then, and the two shares must fit the GPU together.
        assert on.started_after == [("off", True, False)] and off.share + on.share <= 0.9
    else:
        assert on.started_after[0][2] and off.share == on.share == 0.5
    for engine in (off, on):
        engine.out.unlink()
        engine.out.with_suffix(".ready").unlink(missing_ok=True)


FAKE_PYTHON = """#!/bin/sh
# python3 for tests/gpu/run.sh: logs its arguments, fails where one is $FAIL_ON, writes what the next step copies.
echo "$*" >> "$CALLS"
for a in "$@"; do [ "$a" = "$FAIL_ON" ] && exit 3; done
prev=
for a in "$@"; do [ "$prev" = --output-dir ] && mkdir -p "$a" && echo {} > "$a/fidelity.json"; prev=$a; done
exit 0
"""


@pytest.mark.parametrize(("fail_on", "status"), [("none", 0), ("oscar_vllm.calibration.evaluate", 1), ("qwen3", 1),
                                                 ("FLASH_ATTN", 1)])
def test_run_sh_stage_fails_when_any_of_its_steps_fails(tmp_path, fail_on, status):
    # The e2e stage's OSCAR Qwen3 step once failed (its rotations missing) under an exit status of 0:
    # a stage's group reported its last step's status alone. A failing first, middle or last step
    # must fail the stage, and the steps after it must still run.
    bin_dir, work = tmp_path / "bin", tmp_path / "work"
    bin_dir.mkdir()
    (work / "smollm2").mkdir(parents=True)
    fake = bin_dir / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OSCAR_E2E_WORK=str(work), FAIL_ON=fail_on,
               CALLS=str(tmp_path / "calls"))
    env.pop("OSCAR_WHEELS", None)
    run = subprocess.run(["bash", str(Path(__file__).parent / "gpu" / "run.sh"), str(tmp_path / "out"), "e2e"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == status, run.stdout + run.stderr
    assert (tmp_path / "out" / "reference_fidelity.json").exists() == (fail_on != "oscar_vllm.calibration.evaluate")
    steps = [c for c in (tmp_path / "calls").read_text().splitlines() if "import" not in c]
    assert len(steps) == 6 and "FLASH_ATTN --dtype bfloat16" in steps[-1], steps


def test_decode_plan_gives_each_request_its_own_prompt_and_skips_what_does_not_fit(e2e):
    plan = e2e.decode_plan([512, 2048], [1, 4], new_tokens=16, kv_tokens=4 * 1024)
    assert [(c, b) for c, b, _ in plan] == [(512, 1), (512, 4), (2048, 1), (2048, 4)]
    assert plan[3][2] is None, "4 x (2,048 + 16) tokens exceed 4,096"
    prompts = [tuple(p["prompt_token_ids"]) for _, _, reqs in plan if reqs for p in reqs]
    assert [len(p) for p in prompts] == [512] * 5 + [2048]
    assert len({p[0] for p in prompts}) == len(prompts), "no two prompts may share a first block"
    assert e2e.decode_plan([512], [4], 16, None)[0][2] is not None, "an unknown capacity runs every shape"


PPL = {"check": "ppl", "backend": "OSCAR", "dtype": "bfloat16", "context": 2048, "chunk": 256, "tokens_scored": 16376,
       "decode_tokens_scored": 224, "ppl": 20.0, "decode_ppl": 25.0, "decode_kernels": "gluon"}


@pytest.mark.parametrize("second,passed,problem", [
    ({"ppl": 20.019, "decode_ppl": 24.976}, True, None),  # 0.095% each way
    ({"ppl": 20.021}, False, "ppl 20.0000 against 20.0210: 0.105% apart, more than 0.1%"),
    ({"decode_ppl": 25.03}, False, "decode_ppl 25.0000 against 25.0300: 0.120% apart"),
    ({"tokens_scored": 8188}, False, "tokens_scored differs: 16376 against 8188"),
    ({"decode_kernels": "gluon"}, False, "the second run's decode kernels are gluon, not triton"),
])
def test_two_perplexities_agree_within_the_tolerance(e2e, second, passed, problem):
    diffs, problems = e2e.ppl_differences(PPL, {**PPL, "decode_kernels": "triton", **second}, 0.001, "triton")
    assert set(diffs) == {"ppl", "decode_ppl"} and not problems == (not passed)
    assert problem is None or any(p.startswith(problem) for p in problems), problems
    assert e2e.ppl_differences({**PPL, "ppl": 20.0}, {"check": "ppl"}, 0.001)[1][0] == \
        "no perplexity reported by both runs"


def test_compare_ppl_reads_each_logs_last_ppl_result_and_fails_beyond_the_tolerance(tmp_path):
    first, second = tmp_path / "default.txt", tmp_path / "triton.txt"
    other = json.dumps({"check": "qwen3"})
    first.write_text(f"INFO engine\nRESULT {json.dumps({**PPL, 'ppl': 99.0})}\nRESULT {json.dumps(PPL)}\n")

    def compare(**changes) -> subprocess.CompletedProcess:
        second.write_text(f"RESULT {json.dumps({**PPL, 'decode_kernels': 'triton', **changes})}\nRESULT {other}\n")
        return subprocess.run([sys.executable, str(Path(__file__).parent / "gpu" / "e2e_vllm.py"), "compare-ppl",
                               str(first), str(second), "--second-kernels", "triton"], capture_output=True, text=True,
                              timeout=300)

    ok = compare(ppl=20.01)
    assert ok.returncode == 0, ok.stderr[-2000:]
    line = json.loads(next(x for x in ok.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    assert line["check"] == "ppl_match" and line["passed"] and line["decode_kernels"] == ["gluon", "triton"]
    assert line["ppl_pair"] == [20.0, 20.01] and abs(line["relative"]["ppl"] - 0.0005) < 1e-12
    bad = compare(decode_ppl=25.1)
    assert bad.returncode == 1 and '"passed": false' in bad.stdout
    second.write_text("no results\n")
    missing = subprocess.run([sys.executable, str(Path(__file__).parent / "gpu" / "e2e_vllm.py"), "compare-ppl",
                              str(first), str(second)], capture_output=True, text=True, timeout=300)
    assert missing.returncode == 1 and f"no ppl RESULT line in {second}" in missing.stderr


def test_decode_cuts_leave_each_request_two_tokens_of_its_window():
    spec = importlib.util.spec_from_file_location("e2e_vllm_cuts", Path(__file__).parent / "gpu" / "e2e_vllm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    windows = [list(range(1000)), list(range(1000, 2000))]
    cuts = module.decode_cuts(windows, 64)
    assert [end for w, end in cuts if w is windows[0]] == list(range(300, 999, 64))
    assert len(cuts) == 2 * len(range(300, 999, 64)) and all(end + 1 < len(w) for w, end in cuts)


STAGE_PYTHON = """#!/bin/sh
# python3 for tests/gpu/run.sh: logs the decode kernel it was given and its arguments, fails where one is $FAIL_ON.
echo "${OSCAR_DECODE_KERNEL:-unset} $*" >> "$CALLS"
for a in "$@"; do [ "$a" = "$FAIL_ON" ] && exit 3; done
exit 0
"""


@pytest.mark.parametrize(("fail_on", "status"), [("none", 0), ("ppl", 1), ("compare-ppl", 1)])
def test_run_sh_triton_path_stage_runs_both_paths_and_compares_them(tmp_path, fail_on, status):
    bin_dir, work = tmp_path / "bin", tmp_path / "work"
    bin_dir.mkdir()
    (work / "smollm2").mkdir(parents=True)
    fake = bin_dir / "python3"
    fake.write_text(STAGE_PYTHON)
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OSCAR_E2E_WORK=str(work), FAIL_ON=fail_on,
               CALLS=str(tmp_path / "calls"))
    env.pop("OSCAR_WHEELS", None)
    env.pop("OSCAR_DECODE_KERNEL", None)
    run = subprocess.run(["bash", str(Path(__file__).parent / "gpu" / "run.sh"), str(tmp_path / "out"), "triton_path"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == status, run.stdout + run.stderr
    steps = [c for c in (tmp_path / "calls").read_text().splitlines() if "import" not in c]
    assert len(steps) == 3, steps
    default, forced, compare = steps
    assert default.startswith("unset ") and forced.startswith("triton ")
    for step in (default, forced):
        assert " ppl " in step and "--dtype bfloat16" in step and "--decode-every 64" in step
    assert compare.split()[2:] == ["compare-ppl", str(tmp_path / "out" / "triton_path_default.txt"),
                                   str(tmp_path / "out" / "triton_path_triton.txt"), "--tolerance", "0.001",
                                   "--second-kernels", "triton"]
