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
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from csrc_triton.oscar_write import decode_rotation, oscar_write, oscar_write_decode
from oscar_vllm.core.quant import clip_index

from .common import SHAPES, copy_bandwidth_gbs, environment, make_int2_batch, time_calls, write_reports

SINK, RECENT = 64, 256


def parse_launch(text: str) -> tuple[int | None, int | None]:
    """``table`` -> (None, None); ``32x8`` -> (32, 8); ``x8`` -> (None, 8)."""
    if text == "table":
        return None, None
    tokens, _, warps = text.partition("x")
    if not warps.isdigit() or tokens and not tokens.isdigit():
        raise SystemExit(f"--launch {text!r}: give table, TxW or xW")
    return (int(tokens) if tokens else None), int(warps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results/kernels")
    p.add_argument("--shapes", nargs="+", default=["qwen3-8b", "smollm2"], choices=list(SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 32, 256, 8192, 16384],
                   help="new tokens per step; one request each below 256, else 256-token chunks of 16 requests")
    p.add_argument("--launch", nargs="+", default=["table"], help="table, TxW or xW (see above)")
    p.add_argument("--query-rows", nargs="+", type=int, default=[None],
                   help="decode rows: the decode write's query rows a program (default: its launch table's)")
    args = p.parse_args()
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
            rot_t = decode_rotation(rot)

            def rotate_queries():
                return (q.float() @ rot).to(q.dtype)

            for launch, query_rows in [(la, qr) for la in args.launch
                                       for qr in (args.query_rows if decodes else [None])]:
                block_t, warps = parse_launch(launch)
                if block_t if decodes else (warps and not block_t):
                    continue  # a choice for the other kernel
                label = launch if query_rows is None else f"{launch}, {query_rows} query rows"
                row = {"shape": s.name, "tokens": t, "requests": len(q_lens), "launch": label}
                clips = dict(clip_idx_k=clip_index(0.96, d), clip_idx_v=clip_index(0.92, d))
                cache, batch = b.mixed(SINK, RECENT), b.batch(num_decodes=decodes)
                split = lambda lc=((block_t, warps) if block_t else None): oscar_write(  # noqa: E731
                    k, v, rot_k=rot, slot_mapping=slots, cache=cache, batch=batch, **clips, launch=lc)
                if decodes:
                    row["oscar_ms"] = time_calls([lambda w=warps, qr=query_rows: oscar_write_decode(
                        k, v, q, q_rot, rot_t=rot_t, slot_mapping=slots, cache=cache, batch=batch, **clips,
                        num_warps=w, query_rows=qr)])
                    row["split_path_ms"] = time_calls([lambda: (split(), rotate_queries())])
                else:
                    row["oscar_ms"] = time_calls([split])
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
                base_ms = time_calls([lambda: ops.reshape_and_cache_flash(k, v, kc, vc, flat, "auto", scale, scale)])
                for row in rows:
                    if row["shape"] == s.name and row["tokens"] == t:
                        row["vllm_bf16_ms"] = base_ms
    write_reports(Path(args.out), "write", rows, env, "Cache write: OSCAR quantize-on-write against vLLM BF16",
                  ["shape", "tokens", "requests", "launch", "oscar_ms", "split_path_ms", "vllm_bf16_ms", "oscar_GBps",
                   "oscar_pct_copy"],
                  [f"copy bandwidth in this run: {bw:,.0f} GB/s",
                   "OSCAR bytes: K and V read (bf16), INT2 slots and BF16 window rows written",
                   "decode steps (tokens <= 256, a request each): oscar_ms is oscar_write_decode, which also rotates "
                   "the step's queries; split_path_ms the previous path, oscar_write + the queries' fp32 rotation"])


if __name__ == "__main__":
    main()
