"""Benchmark of ``csrc_triton/oscar_dense_kv.py`` (a prefill batch's cached prefix dequantized
to dense BF16 beside its chunk) against the copy bandwidth of the same run: the kernel moves
bytes and nothing else, so that is its bound. ``key_mean_ms``: the same fill adding a key mean
to the INT2 rows (``key_mean`` "on": a seeded mean, a random rotation, a RoPE table), whose
product with each row's table row is all it adds.

    python -m benchmarks.kernel_bench.oscar_dense_kv --out results/kernels
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from csrc_triton.oscar_dense_kv import key_mean_basis, oscar_dense_kv
from csrc_triton.paged_layout import KEY_MEAN_PAIRS
from oscar_vllm.core.key_mean import served_pairs

from .common import SHAPES, copy_bandwidth_gbs, environment, int2_bytes_read, make_int2_batch, time_calls, write_reports

SINK, RECENT = 64, 256


def key_mean_operands(hkv: int, d: int, positions: int) -> dict:
    """What the fill takes for a key mean: a seeded mean on each KV head's ``KEY_MEAN_PAIRS``
    strongest pairs (as the backend serves one: that decides the basis's size), its basis under a
    random rotation, and a RoPE table (base 1e6, Qwen3's) of ``positions`` rows."""
    g = torch.Generator().manual_seed(0)
    rot, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    mean = served_pairs(torch.randn(hkv, d, generator=g), KEY_MEAN_PAIRS)
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * 1e6 ** (-torch.arange(0, d, 2) / d)[None]
    table = torch.cat([angles.cos(), angles.sin()], dim=-1).float()
    return {"mean_basis": key_mean_basis(mean.cuda(), rot.float()), "cos_sin": table.cuda()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results/kernels")
    p.add_argument("--shapes", nargs="+", default=["qwen3-8b"], choices=list(SHAPES))
    p.add_argument("--batches", nargs="+", default=["1x8192:8192", "1x8192:122880", "4x2048:30000"],
                   help="REQUESTSxCHUNK:PREFIX (default: %(default)s)")
    args = p.parse_args()
    bw = copy_bandwidth_gbs()
    env = environment()
    rows = []
    for key in args.shapes:
        s = SHAPES[key]
        hkv, d = s.num_kv_heads, s.head_dim
        for spec in args.batches:
            n, rest = spec.split("x")
            chunk, prefix = (int(x) for x in rest.split(":"))
            n = int(n)
            b = make_int2_batch([prefix] * n, [chunk] * n, hkv, d, SINK, RECENT)
            k = torch.randn(n * chunk, hkv, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            total = n * (prefix + chunk)
            k_out = torch.empty(total, hkv, d, device="cuda", dtype=torch.bfloat16)
            v_out = torch.empty_like(k_out)
            cu_k = torch.arange(n + 1, dtype=torch.int32, device="cuda") * (prefix + chunk)
            mean = key_mean_operands(hkv, d, prefix + chunk)

            def fill(**kw):
                oscar_dense_kv(k_out, v_out, k, v, cache=b.mixed(SINK, RECENT), batch=b.batch(), cu_k=cu_k,
                               max_seq_len=prefix + chunk, **kw)

            ms = time_calls([fill], rep_ms=100)
            key_mean_ms = time_calls([lambda: fill(**mean)], rep_ms=100)
            # Read: the INT2 prefix and its ring, the chunk's K and V; written: bf16 K and V of every row.
            nbytes = int2_bytes_read([prefix] * n, hkv, d, SINK, RECENT) + k.nbytes * 2 + k_out.nbytes * 2
            row = {"shape": s.name, "requests": n, "chunk": chunk, "prefix": prefix, "ms": ms,
                   "GBps": nbytes / ms / 1e6}
            row["pct_copy"] = 100 * row["GBps"] / bw
            row["key_mean_ms"] = key_mean_ms
            rows.append(row)
            print(row, flush=True)
    write_reports(Path(args.out), "dense_kv", rows, env, "Dense prefix for prefill: INT2 prefix -> BF16 rows",
                  ["shape", "requests", "chunk", "prefix", "ms", "GBps", "pct_copy", "key_mean_ms"],
                  [f"copy bandwidth in this run: {bw:,.0f} GB/s",
                   "bytes: INT2 prefix + ring read, chunk K/V read, bf16 K/V of every row written",
                   "key_mean_ms: the same fill adding a key mean to the INT2 rows (key_mean on)"])


if __name__ == "__main__":
    main()
