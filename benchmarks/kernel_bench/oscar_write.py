"""Benchmark of ``csrc_triton/oscar_write.py`` (rotate, clip, quantize, pack and store K/V and
the BF16 windows) against vLLM's BF16 cache write (``reshape_and_cache_flash``), same run.

Decode steps (one token a request, up to 256) run as the backend runs them: ``oscar_write_decode``,
which also rotates the step's queries (``oscar_ms``); beside it the path it replaces, the
prefill-side kernel plus the queries' fp32 rotation through PyTorch (``split_path_ms``).

    python -m benchmarks.kernel_bench.oscar_write --out results/kernels
    python -m benchmarks.kernel_bench.oscar_write --shapes qwen3-8b --launch table 16x8 32x8 64x16 x4 x8 x16

``--launch``: the launch choices to time, ``table`` (the kernels' own), ``TxW`` for the prefill
rows (the Triton write: T tokens a program on W warps), ``xW`` for the decode rows (the decode
write on W warps). ``--query-rows``: the decode write's query rows a program (``DECODE_WRITE_LAUNCH``'s
entries to choose from), each timed beside the others:

    python -m benchmarks.kernel_bench.oscar_write --shapes qwen3-8b --tokens 1 8 32 64 128 256 --query-rows 16 32

``--baseline OLD.py``: an earlier ``csrc_triton/oscar_write.py`` (``git show REV:csrc_triton/oscar_write.py >
OLD.py``) timed beside this tree's, same data, same run (kernel times differ between machines, as
``oscar_decode against`` has it), and the bytes its pages and windows differ by:

    python -m benchmarks.kernel_bench.oscar_write --shapes qwen3-8b --tokens 1 256 8192 16384 --baseline OLD.py

``--rotation ieee tf32x3``: the prefill rows once per way the Triton write multiplies ``k @ R``
(``oscar_write.WRITE_ROTATIONS``; the baseline, an older file, takes its own):

    python -m benchmarks.kernel_bench.oscar_write --shapes qwen3-8b --tokens 2048 8192 16384 --rotation ieee tf32x3
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from csrc_triton import oscar_write as ow
from oscar_vllm.core.quant import clip_index

from .common import (SHAPES, copy_bandwidth_gbs, environment, load_baseline, make_int2_batch, time_calls,
                     timed_in_turn, write_reports)

SINK, RECENT = 64, 256


def parse_launch(text: str) -> tuple[int | None, int | None]:
    """``table`` -> (None, None); ``32x8`` -> (32, 8); ``x8`` -> (None, 8)."""
    if text == "table":
        return None, None
    tokens, _, warps = text.partition("x")
    if not warps.isdigit() or tokens and not tokens.isdigit():
        raise SystemExit(f"--launch {text!r}: give table, TxW or xW")
    return (int(tokens) if tokens else None), int(warps)


def bytes_differing(cache, now, then) -> int:
    """Bytes of the INT2 pages and BF16 windows where ``then`` writes other than ``now``, both
    from zeroed buffers (a version that writes nothing differs too)."""
    out = []
    for call in (now, then):
        cache.pages.zero_()
        cache.windows.zero_()
        call()
        out.append(torch.cat([cache.pages.view(torch.uint8).flatten(), cache.windows.view(torch.uint8).flatten()]))
    return int((out[0] != out[1]).sum())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results/kernels")
    p.add_argument("--shapes", nargs="+", default=["qwen3-8b", "smollm2"], choices=list(SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 32, 256, 8192, 16384],
                   help="new tokens per step; one request each below 256, else 256-token chunks of 16 requests")
    p.add_argument("--launch", nargs="+", default=["table"], help="table, TxW or xW (see above)")
    p.add_argument("--query-rows", nargs="+", type=int, default=[None],
                   help="decode rows: the decode write's query rows a program (default: its launch table's)")
    p.add_argument("--baseline", help="an earlier csrc_triton/oscar_write.py to time beside this tree's")
    p.add_argument("--rotation", nargs="+", default=[ow.WRITE_ROTATION], choices=ow.WRITE_ROTATIONS,
                   help="prefill rows: how the Triton write multiplies k @ R, each timed beside the others")
    args = p.parse_args()
    base = load_baseline(args.baseline, "oscar_write", "oscar_write") if args.baseline else None
    bw = copy_bandwidth_gbs()
    env = environment()
    try:
        from vllm import _custom_ops as ops
    except Exception as e:  # noqa: BLE001
        print(f"vLLM baseline unavailable: {e}")
        ops = None
    rows = []
    for key in args.shapes:
        s = SHAPES[key]
        hkv, d = s.num_kv_heads, s.head_dim
        for t in args.tokens:
            reqs = t if t <= 256 else 16
            q_lens = [1] * t if t <= 256 else [t // reqs] * reqs
            b = make_int2_batch([1000] * len(q_lens), q_lens, hkv, d, SINK, RECENT)
            k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            rot = torch.linalg.qr(torch.randn(d, d, device="cuda"))[0]
            pos = torch.cat([torch.arange(1000, 1000 + n) for n in q_lens])
            row_of = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
            blocks = b.block_table.cpu()[row_of, pos // 64].long()
            slots = (blocks * 64 + pos % 64).cuda()
            decodes = len(q_lens) if t <= 256 else 0
            q = torch.randn(t, s.num_heads, d, device="cuda", dtype=torch.bfloat16)
            q_rot = torch.empty_like(q)
            rot_t = ow.decode_rotation(rot)

            def rotate_queries():
                return (q.float() @ rot).to(q.dtype)

            for launch, query_rows, rotation in [(la, qr, ro) for la in args.launch
                                                 for qr in (args.query_rows if decodes else [None])
                                                 for ro in ([ow.WRITE_ROTATION] if decodes else args.rotation)]:
                block_t, warps = parse_launch(launch)
                if block_t if decodes else (warps and not block_t):
                    continue  # a choice for the other kernel
                label = launch if query_rows is None else f"{launch}, {query_rows} query rows"
                label += f", {rotation}" if not decodes and len(args.rotation) > 1 else ""
                row = {"shape": s.name, "tokens": t, "requests": len(q_lens), "launch": label}
                clips = dict(clip_idx_k=clip_index(0.96, d), clip_idx_v=clip_index(0.92, d))
                cache, batch = b.mixed(SINK, RECENT), b.batch(num_decodes=decodes)
                lc = (block_t, warps) if block_t else None
                # The baseline version's write takes no rotation where it predates the choice.
                write = lambda m: lambda: m.oscar_write(  # noqa: E731
                    k, v, rot_k=rot, slot_mapping=slots, cache=cache, batch=batch, **clips, launch=lc,
                    **({"rotation": rotation} if m is ow else {}))
                write_decode = lambda m: lambda: m.oscar_write_decode(  # noqa: E731
                    k, v, q, q_rot, rot_t=rot_t, slot_mapping=slots, cache=cache, batch=batch, **clips,
                    num_warps=warps, query_rows=query_rows)
                split = lambda m: lambda: (write(m)(), rotate_queries())  # noqa: E731
                versions = {"": ow} | ({"baseline_": base} if base else {})
                calls = {}
                for prefix, m in versions.items():
                    if decodes and hasattr(m, "oscar_write_decode"):
                        calls[f"{prefix}oscar_ms"] = write_decode(m)
                        calls[f"{prefix}split_path_ms"] = split(m)
                    elif not decodes:
                        calls[f"{prefix}oscar_ms"] = write(m)
                row |= timed_in_turn({name: [call] for name, call in calls.items()}, 2 if base else 1)
                if base and "baseline_oscar_ms" in row:
                    row["baseline_ms"] = row.pop("baseline_oscar_ms")
                    row["vs_baseline"] = row["oscar_ms"] / row["baseline_ms"]
                    row["baseline_bytes_differ"] = bytes_differing(cache, calls["oscar_ms"],
                                                                   calls["baseline_oscar_ms"])
                # Reads K and V (bf16), writes the INT2 slots and, for window positions, bf16 ring rows.
                ring_rows = sum(min(n, RECENT) for n in q_lens)
                nbytes = t * hkv * (4 * d + d // 2 + 8) + ring_rows * hkv * 4 * d
                row["oscar_GBps"] = nbytes / row["oscar_ms"] / 1e6
                row["oscar_pct_copy"] = 100 * row["oscar_GBps"] / bw
                rows.append(row)
                print(row, flush=True)
            if ops is not None:
                kc = torch.empty(math.ceil(t / 16) + 1, 16, hkv, d, device="cuda", dtype=torch.bfloat16)
                vc = torch.empty_like(kc)
                flat = torch.arange(t, device="cuda")
                scale = torch.ones((), device="cuda")
                vllm_ms = time_calls([lambda: ops.reshape_and_cache_flash(k, v, kc, vc, flat, "auto", scale, scale)])
                for row in rows:
                    if row["shape"] == s.name and row["tokens"] == t:
                        row["vllm_bf16_ms"] = vllm_ms
                        row["vs_vllm"] = row["oscar_ms"] / vllm_ms
    against = ["baseline_ms", "vs_baseline", "baseline_split_path_ms", "baseline_bytes_differ"] if base else []
    write_reports(Path(args.out), "write_vs_baseline" if base else "write", rows, env,
                  "Cache write: OSCAR quantize-on-write against vLLM BF16"
                  + (" and an earlier version of the write" if base else ""),
                  ["shape", "tokens", "requests", "launch", "oscar_ms", "split_path_ms", *against, "vllm_bf16_ms",
                   "vs_vllm", "oscar_GBps", "oscar_pct_copy"],
                  [f"copy bandwidth in this run: {bw:,.0f} GB/s",
                   "OSCAR bytes: K and V read (bf16), INT2 slots and BF16 window rows written",
                   "decode steps (tokens <= 256, a request each): oscar_ms is oscar_write_decode, which also rotates "
                   "the step's queries; split_path_ms the previous path, oscar_write + the queries' fp32 rotation",
                   *([f"baseline: {args.baseline}; vs_baseline: oscar_ms / baseline_ms (lower is faster), each the "
                      "faster of two timings taken in turn; baseline_bytes_differ: bytes of the pages and windows "
                      "the two versions write differently (0: the same cache)"] if base else [])])


if __name__ == "__main__":
    main()
