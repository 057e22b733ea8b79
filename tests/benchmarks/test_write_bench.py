"""benchmarks/kernel_bench/oscar_write.py's comparison with an earlier write (``--baseline``): what
it loads, how it takes turns and how it tells two writes' caches apart. The timing itself needs a GPU."""
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks.kernel_bench import common
from benchmarks.kernel_bench import oscar_write as bench
from csrc_triton import oscar_write, paged_layout

REPO = Path(__file__).resolve().parents[2]


def test_a_baseline_is_a_module_of_its_own_on_this_trees_layout(tmp_path):
    old = tmp_path / "old_oscar_write.py"
    shutil.copy(REPO / "csrc_triton" / "oscar_write.py", old)
    base = bench.load_baseline(str(old), "oscar_write", "oscar_write")
    assert base.__name__ == "oscar_write_baseline" and base.__file__ == str(old)
    assert base.oscar_write is not oscar_write.oscar_write
    assert base._oscar_write_kernel is not oscar_write._oscar_write_kernel
    assert base.WRITE_LAUNCH is paged_layout.WRITE_LAUNCH  # the launch table is this tree's


def test_a_baseline_that_is_missing_or_no_write_is_refused_by_name(tmp_path):
    with pytest.raises(SystemExit, match="no such file"):
        bench.load_baseline(str(tmp_path / "missing.py"), "oscar_write", "oscar_write")
    (tmp_path / "other.py").write_text("x = 1\n")
    with pytest.raises(SystemExit, match="no oscar_write in it"):
        bench.load_baseline(str(tmp_path / "other.py"), "oscar_write", "oscar_write")


def test_versions_are_timed_in_turn_and_the_fastest_kept(monkeypatch):
    times = iter([3.0, 5.0, 2.0, 6.0])
    order = []
    monkeypatch.setattr(common, "time_calls", lambda calls, rep_ms: (order.append(calls[0]), next(times))[1])
    assert common.timed_in_turn({"oscar_ms": ["now"], "baseline_oscar_ms": ["then"]}, 2) == \
        {"oscar_ms": 2.0, "baseline_oscar_ms": 5.0}
    assert order == ["now", "then", "now", "then"]


def test_bytes_differing_counts_pages_and_windows_from_zeroed_caches():
    cache = SimpleNamespace(pages=torch.full((2, 8), 7, dtype=torch.uint8),
                            windows=torch.full((3, 4), float("nan"), dtype=torch.bfloat16))

    def write(byte, value):
        def call():
            cache.pages[0, :4] = byte
            cache.windows[1, 0] = value
        return call

    assert bench.bytes_differing(cache, write(5, 1.0), write(5, 1.0)) == 0
    assert bench.bytes_differing(cache, write(5, 1.0), write(6, 1.0)) == 4
    assert bench.bytes_differing(cache, write(5, 1.0), write(5, 1.5)) == 1  # bf16 0x3f80 and 0x3fc0
    assert bench.bytes_differing(cache, write(5, 1.0), lambda: None) == 4 + 2  # one that writes nothing


def test_the_command_line_takes_a_baseline():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-m", "benchmarks.kernel_bench.oscar_write", "--help"], capture_output=True,
                         text=True, env=env, cwd=REPO, check=True).stdout
    assert "--baseline BASELINE" in out
    assert "--rotation {ieee,tf32x3}" in out
