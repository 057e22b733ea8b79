"""benchmarks/studies/window_capacity.py: the capacity table comes from the engines' own log lines."""
import json
from pathlib import Path

import pytest

from benchmarks.studies import window_capacity

REPO = Path(__file__).resolve().parents[2]


def test_recorded_run_reproduces_its_table():
    run = REPO / "results" / "windows"
    c = window_capacity.parse((run / "engine_OSCAR.log").read_text(), (run / "engine_FLASH_ATTN.log").read_text())
    assert c == {**json.loads((run / "capacity.json").read_text()),
                 "running": {int(k): v for k, v in json.loads((run / "capacity.json").read_text())["running"].items()}}
    # The scheduler's arithmetic: what is left is the pool less the windows of those running.
    for n, left in c["running"].items():
        assert left == (c["pool_blocks"] - 1 - n * c["window_blocks"]) * 64
    assert (run / "capacity.md").read_text() == window_capacity.table(c, json.loads((run / "meta.json").read_text()))


def test_logs_without_the_lines_are_refused():
    with pytest.raises(SystemExit, match="lack"):
        window_capacity.parse("GPU KV cache size: 10 tokens", "GPU KV cache size: 10 tokens")
