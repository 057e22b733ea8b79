"""benchmarks/kernel_bench/ncu_summary.py on Nsight Compute's own text reports (the H200's, committed
in results/kernels/ncu_batch1/): every launch found, its metrics read with their units, runs told
apart by their labels, and what bounds a kernel named from its medians."""
import sys
from pathlib import Path

import pytest

from benchmarks.kernel_bench import ncu_summary

ROOT = Path(__file__).resolve().parents[2]
NCU = ROOT / "results" / "kernels" / "ncu_batch1"
SOL = "GPU Speed Of Light Throughput"


def test_every_launch_of_a_report_is_read_with_its_metrics():
    launches = ncu_summary.parse((NCU / "ncu_decode.txt").read_text())
    assert [x.kernel for x in launches] == ["_oscar_decode_kernel", "_merge_splits_kernel"] * 5
    decode = launches[0]
    assert decode.grid == (1, 8, 128) and decode.block == (32, 1, 1)
    assert decode.value(SOL, "Duration") == pytest.approx(14.21)
    assert decode.value(SOL, "DRAM Throughput") == pytest.approx(2.73)
    assert decode.value(SOL, "Elapsed Cycles") == 20251  # thousands separators
    assert decode.value("Launch Statistics", "Registers Per Thread") == 174
    assert decode.value("Occupancy", "Achieved Occupancy") == pytest.approx(7.91)
    assert decode.metrics[("Launch Statistics", "Cluster Scheduling Policy")] == ("", "PolicySpread")
    # The rules' prose between the tables ("OPT  Est. Local Speedup: 31.82%") is no metric.
    assert not any("Speedup" in name for _, name in decode.metrics)
    assert launches[1].value(SOL, "Duration") == pytest.approx(4.16)


def test_runs_are_told_apart_by_their_labels_and_summarized_by_medians():
    text = ("=== write tokens 1 ===\n" + (NCU / "ncu_write.txt").read_text()
            + "=== decode batch 1 context 1024 ===\n" + (NCU / "ncu_decode.txt").read_text())
    rows = ncu_summary.summarize(ncu_summary.parse(text))
    assert [(r["label"], r["kernel"], r["launches"]) for r in rows] == [
        ("write tokens 1", "_oscar_write_decode_kernel", 4),
        ("decode batch 1 context 1024", "_oscar_decode_kernel", 5),
        ("decode batch 1 context 1024", "_merge_splits_kernel", 5)]
    decode = rows[1]
    durations = sorted(x.value(SOL, "Duration") for x in ncu_summary.parse((NCU / "ncu_decode.txt").read_text())[::2])
    assert len(durations) == 5 and decode["us"] == pytest.approx(durations[2])
    assert decode["grid"] == "1x8x128" and decode["registers"] == 174
    assert decode["bound by"].startswith("latency (")  # 3% of DRAM's peak at batch 1
    table = ncu_summary.markdown(rows)
    assert "| write tokens 1 | _oscar_write_decode_kernel | 4 | 1x8x1 | 256x1x1 |" in table
    assert "DRAM GB/s" not in table  # a section these runs did not ask for leaves no empty column


def test_a_unit_near_its_peak_is_what_bounds_a_kernel():
    assert ncu_summary.bound({"DRAM %": 88.0, "L2 %": 61.0, "SM %": 20.0}) == "DRAM"
    assert ncu_summary.bound({"DRAM %": 30.0, "L2 %": 40.0, "SM %": 75.0}) == "SM"
    assert ncu_summary.bound({"DRAM %": 59.0, "achieved %": 20.0, "cycles/issue": 12.5}) == (
        "latency (20% occupancy, 12.5 cycles between a warp's instructions)")


def test_durations_in_any_unit_read_as_microseconds():
    launch = ncu_summary.Launch("", "k", (1, 1, 1), (32, 1, 1))
    for unit, value, us in [("ns", 950.0, 0.95), ("us", 14.2, 14.2), ("ms", 1.5, 1500.0), ("usecond", 3.0, 3.0)]:
        launch.metrics[(SOL, "Duration")] = (unit, value)
        assert launch.value(SOL, "Duration") == pytest.approx(us)
    launch.metrics[("Memory Workload Analysis", "Memory Throughput")] = ("Tbyte/s", 2.9)
    assert launch.value("Memory Workload Analysis", "Memory Throughput") == pytest.approx(2900)


def test_a_file_with_no_reports_is_refused_by_name(tmp_path, monkeypatch, capsys):
    empty = tmp_path / "ncu.txt"
    empty.write_text("==PROF== Connected to process 1\n==ERR== no kernels were profiled\n")
    monkeypatch.setattr(sys, "argv", ["ncu_summary.py", str(empty)])
    with pytest.raises(SystemExit, match="ncu.txt: no kernel reports of Nsight Compute in it"):
        ncu_summary.main()
