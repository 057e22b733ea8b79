"""What the kernel benchmarks share: model shapes, realistic paged caches (every request its
own blocks, in shuffled order), timing under CUDA graphs over enough copies of the data that
nothing is served from L2, the copy bandwidth of the same run, and the report files."""
from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import platform
import shlex
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType

import torch
import triton

from csrc_triton.paged_layout import (
    BLOCK_SIZE,
    BatchLayout,
    MixedCache,
    cache_page_elems,
    int2_cache_shape,
    window_pages_per_ring,
)
from oscar_vllm.reference.paged import layout_views

L2_BYTES = 60 << 20  # H200; reads are spread over 4x this before a buffer is read again


@dataclass(frozen=True)
class Shape:
    """One GPU's share of a model's attention (its tensor-parallel shard)."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int


SHAPES = {
    "qwen3-8b": Shape("Qwen3-8B", 32, 8, 128),
    "qwen2.5-7b": Shape("Qwen2.5-7B", 28, 4, 128),
    "llama3-70b-tp8": Shape("Llama-3-70B / TP8", 8, 1, 128),
    "llama3-70b-tp4": Shape("Llama-3-70B / TP4", 16, 2, 128),
    "smollm2": Shape("SmolLM2-135M", 9, 3, 64),
}


def invocation() -> list[str]:
    """How this process was started, as it runs again from the repository root: ``python -m
    benchmarks.kernel_bench.NAME`` for a module run with ``-m``, else the script's path."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        return ["python", "-m", spec.name.removesuffix(".__main__")]
    return [Path(sys.argv[0]).as_posix()]


def environment(command: str | None = None) -> dict:
    """Date, hardware (the GPU, else the CPU: compile-only benchmarks run without one), the
    command and versions, for a report header."""
    try:
        from importlib.metadata import version

        vllm = version("vllm")
    except Exception:  # noqa: BLE001  (vLLM is optional for the OSCAR kernels)
        vllm = "not installed"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        hardware = f"{props.name}, {props.multi_processor_count} SMs"
    else:
        hardware = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores"
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "hardware": hardware,
        "command": command or shlex.join([*invocation(), *sys.argv[1:]]),
        "versions": f"torch {torch.__version__}, triton {triton.__version__}, vllm {vllm}, "
                    f"python {platform.python_version()}",
    }


def copy_bandwidth_gbs(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy, bytes read plus bytes written per second (GB/s)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=20, rep=200, return_mode="median")
    return 2 * (nbytes // 2) / ms / 1e6


def time_calls(calls: list, rep_ms: int = 60) -> float:
    """Median ms of one call, the calls captured back to back in one CUDA graph (launch gaps
    as vLLM's decode graphs have them, and each call on its own data)."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    ms = triton.testing.do_bench(graph.replay, warmup=10, rep=rep_ms, return_mode="median")
    return ms / len(calls)


def timed_in_turn(calls: dict[str, list], rounds: int, rep_ms: int = 60) -> dict[str, float]:
    """Each entry's ms (``time_calls`` of its list of calls), taken in turn ``rounds`` times and the
    fastest kept: a drift of the GPU's clock over the run favours none of them."""
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, group in calls.items():
            times[name].append(time_calls(group, rep_ms))
    return {name: min(ms) for name, ms in times.items()}


def load_baseline(path: str, stem: str, needs: str) -> ModuleType:
    """An earlier ``csrc_triton/{stem}.py`` (``git show REV:csrc_triton/{stem}.py > OLD.py``) as a
    module of its own, ``{stem}_baseline``. It imports the rest of this tree (``paged_layout``: its
    launch tables too), so the two differ only where the file does. Refused by name where the file
    is missing or has no ``needs``."""
    if not Path(path).is_file():
        raise SystemExit(f"--baseline {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"{stem}_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, needs, None)):
        raise SystemExit(f"--baseline {path}: no {needs} in it")
    return module


def copies_for(nbytes: int, most: int = 8) -> int:
    """How many copies of a working set keep each read out of L2."""
    return max(1, min(most, math.ceil(4 * L2_BYTES / max(nbytes, 1))))


def int2_bytes_read(ctx: list[int], hkv: int, d: int, sink: int, recent: int) -> int:
    """Bytes the OSCAR decode kernel reads: whole INT2 blocks of each prefix, the BF16 ring
    entries of its window (K and V), the queries and the new key and value."""
    slot = d // 2 + 8
    int2 = sum(math.ceil(c / BLOCK_SIZE) * BLOCK_SIZE * slot for c in ctx)
    ring = sum(min(sink, c) + max(0, min(recent - 1, c - sink)) for c in ctx) * 2 * d * 2
    return hkv * (int2 + ring)


@dataclass
class PagedInt2:
    """A decode or prefill batch over an INT2 cache whose windows hold what they would."""

    cache: torch.Tensor
    windows: torch.Tensor
    window_pages: torch.Tensor
    window_pos: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    cu_q: torch.Tensor
    ring_slots: torch.Tensor

    def mixed(self, sink: int, recent: int, param_dtype: torch.dtype = torch.float16) -> MixedCache:
        """The cache as the kernels take it."""
        return MixedCache(self.cache, self.windows, self.window_pages, self.window_pos, sink, recent, param_dtype)

    def batch(self, num_decodes: int = 0, max_query_len: int | None = None) -> BatchLayout:
        """The batch as the kernels take it."""
        return BatchLayout(self.block_table, self.seq_lens, self.cu_q, self.ring_slots, self.seq_lens.shape[0],
                           num_decodes, max_query_len)


def make_int2_batch(ctx: list[int], q_lens: list[int], hkv: int, d: int, sink: int, recent: int,
                    param_dtype=torch.float16, seed: int = 0, written: bool = False) -> PagedInt2:
    """Random codes with sane scales; request ``r`` has ``ctx[r]`` cached tokens (and, with
    ``written``, this step's ``q_lens[r]`` too, as decode attention finds them)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    seq = [c + n for c, n in zip(ctx, q_lens)]
    per_req = [math.ceil(s / BLOCK_SIZE) for s in seq]
    num_blocks = sum(per_req)
    cache = torch.randint(0, 256, int2_cache_shape(num_blocks, hkv, d), dtype=torch.uint8, device="cuda", generator=g)
    _, _, params = layout_views(cache, d, param_dtype)
    params[:, :, 0::2].uniform_(0.02, 0.2, generator=g)  # scales
    params[:, :, 1::2].uniform_(-0.4, -0.1, generator=g)  # mins
    perm = torch.randperm(num_blocks, device="cuda", generator=g).to(torch.int32)
    width = max(per_req)
    block_table = torch.zeros(len(ctx), width, dtype=torch.int32, device="cuda")
    at = 0
    for r, n in enumerate(per_req):
        block_table[r, :n] = perm[at: at + n]
        at += n
    w = sink + recent
    # The rings in pages as serving lays them out: serving-size pages, in the order allocated.
    page_elems = cache_page_elems(hkv, d)
    pages = window_pages_per_ring(sink, recent, page_elems, hkv, d)
    windows = torch.empty(len(ctx) * pages, page_elems, device="cuda", dtype=torch.bfloat16).normal_(generator=g)
    window_pages = torch.randperm(len(ctx) * pages, device="cuda", generator=g).to(torch.int32).view(len(ctx), pages)
    pos = torch.full((len(ctx), w), -1, dtype=torch.int32)
    for r, c in enumerate(seq if written else ctx):
        held = list(range(min(sink, c))) + list(range(max(sink, c - recent), c))
        for p in held:
            pos[r, p if p < sink else sink + (p - sink) % recent] = p
    cu = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    return PagedInt2(cache, windows, window_pages, pos.cuda(), block_table,
                     torch.tensor(seq, dtype=torch.int32, device="cuda"), cu.cuda(),
                     torch.arange(len(ctx), dtype=torch.int32, device="cuda"))


def write_reports(out_dir: Path, stem: str, rows: list[dict], env: dict, title: str, columns: list[str],
                  notes: list[str] = ()) -> None:
    """``stem``.csv (every field), .json (rows and environment) and .md (``columns``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(out_dir / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    (out_dir / f"{stem}.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    md = [f"# {title}", "", f"- date: {env['date']}; hardware: {env['hardware']}", f"- command: `{env['command']}`",
          f"- {env['versions']}", *[f"- {n}" for n in notes], "",
          "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        md.append("| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |")
    (out_dir / f"{stem}.md").write_text("\n".join(md) + "\n")


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:,.3f}" if abs(x) < 100 else f"{x:,.0f}"
    if isinstance(x, int):
        return f"{x:,}"
    return str(x)
