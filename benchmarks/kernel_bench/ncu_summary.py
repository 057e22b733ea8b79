"""One table from Nsight Compute's text reports: a row per kernel and labelled run, the median of
its profiled launches, and what bounds it. Reads what ``ncu --section ...`` prints (the ``ncu``
stage of ``tests/gpu/run.sh`` writes all its runs into one file, each after a line
``=== LABEL ===``), so a profile of many shapes reads as one table.

    python -m benchmarks.kernel_bench.ncu_summary OUT/ncu.txt [--out OUT/ncu.md]
"""
from __future__ import annotations

import argparse
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

LABEL = re.compile(r"^=== (.+) ===\s*$")
KERNEL = re.compile(r"^  (\S+) \((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\), Context ")
SECTION = re.compile(r"^    Section: (.+?)\s*$")
DASHES = re.compile(r"^    -[- ]+$")

# (column, section, metric): the section tells apart metrics of one name (the speed of light's
# "Memory Throughput" is a percentage, the memory workload's a rate).
COLUMNS = [
    ("us", "GPU Speed Of Light Throughput", "Duration"),
    ("DRAM %", "GPU Speed Of Light Throughput", "DRAM Throughput"),
    ("DRAM GB/s", "Memory Workload Analysis", "Memory Throughput"),
    ("L2 %", "GPU Speed Of Light Throughput", "L2 Cache Throughput"),
    ("SM %", "GPU Speed Of Light Throughput", "Compute (SM) Throughput"),
    ("cycles/issue", "Warp State Statistics", "Warp Cycles Per Issued Instruction"),
    ("no eligible %", "Scheduler Statistics", "No Eligible"),
    ("registers", "Launch Statistics", "Registers Per Thread"),
    ("waves/SM", "Launch Statistics", "Waves Per SM"),
    ("occupancy %", "Occupancy", "Theoretical Occupancy"),
    ("achieved %", "Occupancy", "Achieved Occupancy"),
]
# A unit-scaled duration: ncu prints nanoseconds, microseconds or milliseconds as it sees fit.
TO_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
TO_GBPS = {"byte/s": 1e-9, "Kbyte/s": 1e-6, "Mbyte/s": 1e-3, "Gbyte/s": 1.0, "Tbyte/s": 1e3}
BOUND_PCT = 60  # a unit at this share of its peak or more is what bounds the kernel


@dataclass
class Launch:
    """One profiled launch: ``metrics[(section, metric)] = (unit, value)``."""
    label: str
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    metrics: dict[tuple[str, str], tuple[str, float | str]] = field(default_factory=dict)

    def value(self, section: str, metric: str) -> float | None:
        unit, v = self.metrics.get((section, metric), ("", None))
        if not isinstance(v, float):
            return None
        if metric == "Duration":
            return v * TO_US[unit] if unit in TO_US else None
        if section == "Memory Workload Analysis" and metric == "Memory Throughput":
            return v * TO_GBPS[unit] if unit in TO_GBPS else None
        return v


def number(text: str) -> float | str:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def parse(text: str) -> list[Launch]:
    """Every launch report in ``text``, labelled by the last ``=== LABEL ===`` line before it
    (ncu prints a process's reports when it exits, so they follow its own label)."""
    launches: list[Launch] = []
    label, section, dashes = "", None, 0
    for line in text.splitlines():
        if m := LABEL.match(line):
            label, section = m.group(1), None
        elif m := KERNEL.match(line):
            dims = [int(x) for x in m.groups()[1:]]
            launches.append(Launch(label, m.group(1), tuple(dims[:3]), tuple(dims[3:])))
            section = None
        elif launches and (m := SECTION.match(line)):
            section, dashes = m.group(1), 0
        elif section and DASHES.match(line):
            dashes += 1  # a table: dashes, header, dashes, metrics, dashes
            if dashes == 3:
                section = None
        elif section and dashes == 2:
            cells = re.split(r"\s{2,}", line.strip())
            if len(cells) in (2, 3):
                unit = cells[1] if len(cells) == 3 else ""
                launches[-1].metrics[(section, cells[0])] = (unit, number(cells[-1]))
    return launches


def bound(row: dict) -> str:
    """What limits a kernel, from its medians: a unit at BOUND_PCT% of its peak or more, else
    latency (few warps to issue from, or long waits between a warp's instructions)."""
    units = {"DRAM": row.get("DRAM %"), "L2": row.get("L2 %"), "SM": row.get("SM %")}
    busy = {k: v for k, v in units.items() if v is not None and v >= BOUND_PCT}
    if busy:
        return max(busy, key=busy.get)
    parts = []
    if row.get("achieved %") is not None:
        parts.append(f"{row['achieved %']:.0f}% occupancy")
    if row.get("cycles/issue") is not None:
        parts.append(f"{row['cycles/issue']:.1f} cycles between a warp's instructions")
    return "latency" + (f" ({', '.join(parts)})" if parts else "")


def summarize(launches: list[Launch]) -> list[dict]:
    """A row per (label, kernel) in the order first seen: the medians of its launches."""
    groups: dict[tuple[str, str], list[Launch]] = {}
    for launch in launches:
        groups.setdefault((launch.label, launch.kernel), []).append(launch)
    rows = []
    for (label, kernel), group in groups.items():
        row = {"label": label, "kernel": kernel, "launches": len(group),
               "grid": "x".join(map(str, group[0].grid)), "block": "x".join(map(str, group[0].block))}
        for column, section, metric in COLUMNS:
            values = [v for v in (g.value(section, metric) for g in group) if v is not None]
            row[column] = statistics.median(values) if values else None
        row["bound by"] = bound(row)
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    columns = ["label", "kernel", "launches", "grid", "block"] + [c for c, _, _ in COLUMNS] + ["bound by"]
    columns = [c for c in columns if any(r.get(c) is not None for r in rows)]

    def cell(v) -> str:
        if v is None:
            return ""
        if isinstance(v, float) and v.is_integer():
            return f"{int(v):,}"
        if isinstance(v, float):
            return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", help="ncu's text output (several runs, each after a '=== LABEL ===' line)")
    p.add_argument("--out", help="write the table here too (markdown)")
    args = p.parse_args()
    launches = parse(Path(args.report).read_text(errors="replace"))
    if not launches:
        raise SystemExit(f"{args.report}: no kernel reports of Nsight Compute in it")
    table = (f"Nsight Compute, `{Path(args.report).name}`: the median of each kernel's profiled launches "
             f"(ncu holds the clocks at base, so durations run longer than the benchmarks'); 'bound by': a unit "
             f"at {BOUND_PCT}% of its peak or more, else latency.\n\n" + markdown(summarize(launches)))
    print(table, end="")
    if args.out:
        Path(args.out).write_text(table)


if __name__ == "__main__":
    main()
