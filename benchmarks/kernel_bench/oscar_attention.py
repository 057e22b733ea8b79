"""Benchmarks of ``csrc_triton/oscar_attention.py`` on an H200-class GPU: prefill chunks over a
cached prefix against vLLM's FA3 on the BF16 paged cache, and the launch sweep of the Triton
decode kernel (the fallback where ``oscar_decode`` does not serve the shape). Decode attention
is timed by ``oscar_decode.py decode``, both kernels beside FA3; the helpers it shares (BF16
paged caches, FA3 and Triton baseline calls, the plot) are here.

    python -m benchmarks.kernel_bench.oscar_attention prefill --out results/kernels
    python -m benchmarks.kernel_bench.oscar_attention sweep   --out results/kernels/sweep

``sweep`` times every decode launch choice (unpacking, warps, stages, splits) and prefill
tile and prints the table ``csrc_triton/paged_layout.py`` keeps (``DECODE_LAUNCH``).
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path

import torch
import triton

from csrc_triton import paged_layout
from csrc_triton.oscar_attention import oscar_decode_attention, oscar_prefill_attention
from csrc_triton.oscar_dense_kv import oscar_dense_kv
from csrc_triton.paged_layout import DECODE_LAUNCH, MAX_DECODE_SPLITS, launch_bucket
from oscar_vllm.serving.prefill import (
    DecodeReadPrefill,
    DensePrefill,
    oscar_decode_read_prefill,
    oscar_dense_prefill_attention,
)

from .common import (
    SHAPES,
    copies_for,
    copy_bandwidth_gbs,
    environment,
    int2_bytes_read,
    make_int2_batch,
    time_calls,
    write_reports,
)

SINK, RECENT = 64, 256
FA_BLOCK = 16  # vLLM's default block size for FLASH_ATTN


def _fa3():
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001
        print(f"FA3 baseline unavailable: {e}", file=sys.stderr)
        return None


def _vllm_triton():
    try:
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention

        return unified_attention
    except Exception as e:  # noqa: BLE001
        print(f"vLLM Triton baseline unavailable: {e}", file=sys.stderr)
        return None


class Bf16Paged:
    """A BF16 paged cache as vLLM's FLASH_ATTN / TRITON_ATTN backends hold it."""

    def __init__(self, ctx: list[int], q_lens: list[int], hkv: int, d: int, seed: int):
        g = torch.Generator(device="cuda").manual_seed(seed)
        seq = [c + n for c, n in zip(ctx, q_lens)]
        per_req = [math.ceil(s / FA_BLOCK) for s in seq]
        n = sum(per_req)
        self.k = torch.empty(n, FA_BLOCK, hkv, d, device="cuda", dtype=torch.bfloat16).normal_(generator=g)
        self.v = torch.empty(n, FA_BLOCK, hkv, d, device="cuda", dtype=torch.bfloat16).normal_(generator=g)
        perm = torch.randperm(n, device="cuda", generator=g).to(torch.int32)
        self.block_table = torch.zeros(len(ctx), max(per_req), dtype=torch.int32, device="cuda")
        at = 0
        for r, m in enumerate(per_req):
            self.block_table[r, :m] = perm[at: at + m]
            at += m
        self.seq_lens = torch.tensor(seq, dtype=torch.int32, device="cuda")
        self.cu_q = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32).cuda()
        self.max_q, self.max_k = max(q_lens), max(seq)


def fa3_call(fa, cache: Bf16Paged, q, out, scale, hq=None):
    paged = cache.block_table is not None
    return lambda: fa(q, cache.k, cache.v, max_seqlen_q=cache.max_q, cu_seqlens_q=cache.cu_q,
                      max_seqlen_k=cache.max_k, cu_seqlens_k=None if paged else cache.cu_q,
                      seqused_k=cache.seq_lens, softmax_scale=scale, causal=True, block_table=cache.block_table,
                      return_softmax_lse=not paged, out=out, fa_version=3)


def triton_call(ua, cache: Bf16Paged, q, out, scale, hq):
    n = cache.seq_lens.shape[0]
    seg = 16
    threshold = max(1, 128 // cache.k.shape[2])
    seg_out = torch.empty(max(threshold, n), hq, seg, triton.next_power_of_2(q.shape[-1]), device="cuda")
    seg_max = torch.empty(max(threshold, n), hq, seg, device="cuda")
    seg_sum = torch.empty_like(seg_max)
    return lambda: ua(q=q, k=cache.k, v=cache.v, out=out, cu_seqlens_q=cache.cu_q, max_seqlen_q=cache.max_q,
                      seqused_k=cache.seq_lens, max_seqlen_k=cache.max_k, softmax_scale=scale, causal=True,
                      window_size=(-1, -1), block_table=cache.block_table, softcap=0, q_descale=None,
                      k_descale=None, v_descale=None, seq_threshold_3D=threshold, num_par_softmax_segments=seg,
                      softmax_segm_output=seg_out, softmax_segm_max=seg_max, softmax_segm_expsum=seg_sum)


def decode_data(ctx: list[int], hkv: int, hq: int, d: int, copies: int, seed: int = 0) -> list[tuple]:
    """``copies`` decode batches (cache, q, k, v, out), each on its own memory."""
    n = len(ctx)
    data = []
    for c in range(copies):
        b = make_int2_batch(ctx, [1] * n, hkv, d, SINK, RECENT, seed=seed + c)
        q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(n, hkv, d, device="cuda", dtype=torch.bfloat16)
        data.append((b, q, k, torch.randn_like(k), torch.empty_like(q)))
    return data


def split_count(n: int, hkv: int, ctas: int) -> int:
    """The Triton decode's split count for ``n`` requests at ``ctas`` programs an SM (``decode_splits``' rule)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return paged_layout.split_count(ctas * sms, n * hkv, MAX_DECODE_SPLITS)


def decode_calls(data: list[tuple], ctas: int | None = None, launch=None, use_asm=None) -> tuple[list, int]:
    """One OSCAR decode call per batch in ``data`` (the production launch unless overridden)."""
    b, q, k, _, _ = data[0]
    n, hq, d = q.shape
    hkv = k.shape[1]
    splits = split_count(n, hkv, launch_bucket(DECODE_LAUNCH, n)[2] if ctas is None else ctas)
    part_out = torch.empty(n * hq * splits * d, device="cuda")
    part_lse = torch.empty(n * hq * splits, device="cuda")
    calls = [lambda b=b, q=q, k=k, v=v, out=out: oscar_decode_attention(
        out, q, q, k, v, cache=b.mixed(SINK, RECENT), batch=b.batch(n), scale=d ** -0.5, num_splits=splits,
        part_out=part_out, part_lse=part_lse, launch=launch, use_asm=use_asm) for b, q, k, v, out in data]
    return calls, splits


def prefill(args, bw: float, env: dict) -> list[dict]:
    """A chunk of ``C`` new tokens over ``P`` cached ones, one request, against FA3 on the BF16
    paged cache. OSCAR as the backend runs it: with a prefix, the dense path (the prefix
    dequantized by ``oscar_dense_kv``, one FA3 pass); without, FA3 on the chunk alone. The INT2
    prefix kernel (the path for batches the dense buffers cannot hold) is timed beside it."""
    fa = _fa3()
    if fa is None:
        raise SystemExit("the prefill benchmark needs vLLM's FA3")
    rows = []
    for key in args.shapes:
        s = SHAPES[key]
        hq, hkv, d = s.num_heads, s.num_kv_heads, s.head_dim
        for chunk, prefix in args.chunks:
            b = make_int2_batch([prefix], [chunk], hkv, d, SINK, RECENT)
            q = torch.randn(chunk, hq, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(chunk, hkv, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            out = torch.empty_like(q)
            scale = d ** -0.5
            flops = 4 * hq * d * (chunk * prefix + chunk * chunk / 2)
            row = {"shape": s.name, "chunk": chunk, "prefix": prefix}
            own = fa3_call(fa, _Dense(k, v, chunk), q, out, scale)
            row["fa3_own_ms"] = time_calls([own], rep_ms=100)
            row["oscar_ms"] = row["fa3_own_ms"]  # the backend skips the prefix when nothing is cached
            if prefix:
                rows_kv = prefix + chunk
                dense = DensePrefill(k, torch.empty(rows_kv, hkv, d, device="cuda", dtype=torch.bfloat16),
                                     torch.empty(rows_kv, hkv, d, device="cuda", dtype=torch.bfloat16), rows_kv,
                                     _fa3_dense(fa, scale))
                cu_k = torch.tensor([0, rows_kv], dtype=torch.int32, device="cuda")
                row["dense_kv_ms"] = time_calls([lambda b=b: oscar_dense_kv(
                    dense.k_buf, dense.v_buf, k, v, cache=b.mixed(SINK, RECENT), batch=b.batch(), cu_k=cu_k,
                    max_seq_len=rows_kv)], rep_ms=100)
                # Written: bf16 K and V of every row; read: the INT2 prefix, the ring, the chunk.
                row["dense_kv_GBps"] = (rows_kv * hkv * d * 4 + int2_bytes_read([prefix], hkv, d, SINK, RECENT)
                                        + chunk * hkv * d * 4) / row["dense_kv_ms"] / 1e6
                row["oscar_ms"] = time_calls([lambda b=b: oscar_dense_prefill_attention(
                    out, q, v, cache=b.mixed(SINK, RECENT), batch=b.batch(max_query_len=chunk), dense=dense)],
                    rep_ms=100)
                del dense
                lse = torch.full((hq, chunk), float("-inf"), device="cuda")
                row["int2_kernel_ms"] = row["fa3_own_ms"] + time_calls([lambda b=b: oscar_prefill_attention(
                    out, q, q, k, v, cache=b.mixed(SINK, RECENT), batch=b.batch(), scale=scale, self_lse=lse)],
                    rep_ms=100)
            row["decode_read_ms"] = time_calls([decode_read_call(b, q, k, v, out, chunk, prefix, scale)], rep_ms=100)
            cache = Bf16Paged([prefix], [chunk], hkv, d, seed=1)
            row["fa3_ms"] = time_calls([fa3_call(fa, cache, q, out, scale)], rep_ms=100)
            row["fa3_TFLOPs"] = flops / row["fa3_ms"] / 1e9
            row["oscar_TFLOPs"] = flops / row["oscar_ms"] / 1e9
            row["oscar_vs_fa3"] = row["oscar_ms"] / row["fa3_ms"]
            row["decode_read_vs_fa3"] = row["decode_read_ms"] / row["fa3_ms"]
            del cache
            rows.append(row)
            print(row, flush=True)
            del b
            torch.cuda.empty_cache()
    cols = ["shape", "chunk", "prefix", "oscar_ms", "fa3_ms", "oscar_vs_fa3", "decode_read_ms", "decode_read_vs_fa3",
            "dense_kv_ms", "dense_kv_GBps", "int2_kernel_ms", "oscar_TFLOPs", "fa3_TFLOPs"]
    write_reports(Path(args.out), "prefill", rows, env, "Prefill attention: a chunk over a cached prefix", cols,
                  ["oscar_ms: what the backend runs: with a prefix, oscar_dense_kv (the prefix dequantized to "
                   "BF16, dense_kv_ms) + one FA3 pass over prefix and chunk; without, FA3 on the chunk",
                   "decode_read_ms: prefill_read=\"decode\" (oscar_decode_read_prefill): the window's BF16 rows and "
                   "every older position's INT2 rows dequantized, two FA3 passes, vLLM's merge (the cache write, "
                   "which both reads run, left out)",
                   "int2_kernel_ms: the fallback for batches the dense buffers cannot hold: FA3 on the chunk's "
                   "own keys + the INT2 prefix kernel merged in",
                   f"dense_kv_GBps: bytes read and written over dense_kv_ms (copy bandwidth {bw:,.0f} GB/s)",
                   "TFLOPs: 4·heads·d·(chunk·prefix + chunk²/2) over the time"])
    return rows


def decode_read_call(b, q, k, v, out, chunk: int, prefix: int, scale: float):
    """One request's chunk as ``prefill_read="decode"`` runs it, through the backend's FlashAttention
    and vLLM's merge (the write left out: both reads run it)."""
    from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

    from oscar_vllm.serving.backend import _flash_attention

    seq = prefix + chunk
    n_int2, n_window = max(seq - RECENT, 0), min(seq, chunk + RECENT - 1)
    hkv, d = k.shape[1:]
    buf = [torch.empty(n_int2 + n_window, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    plan = DecodeReadPrefill(k, *buf, n_int2, n_int2, n_window, n_window, seq, write=lambda: None,
                             attention=_flash_attention(scale, torch.bfloat16, unsplit=True), merge=merge_attn_states)
    return lambda: oscar_decode_read_prefill(out, q, v, cache=b.mixed(SINK, RECENT), batch=b.batch(max_query_len=chunk),
                                             plan=plan)


def _fa3_dense(fa, scale):
    """The backend's dense attention: causal varlen FA3 over non-paged K/V."""
    def attend(q, k, v, cu_q, cu_k, max_query_len, max_seq_len, out):
        fa(q, k, v, max_seqlen_q=max_query_len, cu_seqlens_q=cu_q, max_seqlen_k=max_seq_len, cu_seqlens_k=cu_k,
           softmax_scale=scale, causal=True, out=out, fa_version=3)
    return attend


class _Dense:
    """The chunk's own keys as FA3 varlen input (no paging), for the own-keys half of OSCAR."""

    def __init__(self, k, v, n):
        self.k, self.v = k, v
        self.cu_q = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        self.max_q = self.max_k = n
        self.seq_lens = None
        self.block_table = None


DECODE_VARIANTS = [dict(use_asm=True, launch=(w, st)) for w in (1, 2, 4) for st in (2, 3)] + [
    dict(use_asm=False, launch=(2, 3))]
PREFILL_VARIANTS = [((64, 4, 2), True), ((128, 8, 2), True), ((128, 8, 3), True), ((128, 8, 2), False)]
PREFILL_SWEEP_SHAPE = (4096, 28672)  # a 4K chunk over a 28K prefix


def _compile_decode(var: dict) -> str:
    """Compile one decode variant (split and unsplit) in a worker process: Triton's compiler is
    single-threaded, the sweep has many variants, and the on-disk cache serves the parent."""
    try:
        s = SHAPES["qwen3-8b"]
        for ctx, ctas in (([3000, 700, 9000], 4), ([300] * 64, 1)):
            calls, _ = decode_calls(decode_data(ctx, s.num_kv_heads, s.num_heads, s.head_dim, 1, seed=7), ctas, **var)
            calls[0]()
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:300]}"


def _compile_prefill(var: tuple) -> str:
    try:
        launch, asm = var
        s = SHAPES["qwen3-8b"]
        b = make_int2_batch([1000], [300], s.num_kv_heads, s.head_dim, SINK, RECENT)
        q = torch.randn(300, s.num_heads, s.head_dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(300, s.num_kv_heads, s.head_dim, device="cuda", dtype=torch.bfloat16)
        lse = torch.zeros(s.num_heads, 300, device="cuda")
        oscar_prefill_attention(torch.empty_like(q), q, q, k, k, cache=b.mixed(SINK, RECENT), batch=b.batch(),
                                scale=0.088, self_lse=lse, launch=launch, use_asm=asm)
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:300]}"


def compile_all(fn, variants, workers: int) -> list[str]:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        return list(ex.map(fn, variants))


def sweep(args, bw: float, env: dict) -> None:
    """Every decode launch choice on the Qwen3-8B shape; each checked against the first."""
    s = SHAPES["qwen3-8b"]
    hkv, hq, d = s.num_kv_heads, s.num_heads, s.head_dim
    errors = compile_all(_compile_decode, DECODE_VARIANTS, args.workers)
    check = decode_data([3000, 700, 9000], hkv, hq, d, 1, seed=7)
    ref = None
    ok = []
    for var, err in zip(DECODE_VARIANTS, errors):
        if err:
            print(f"variant {var} failed: {err}", flush=True)
            continue
        calls, _ = decode_calls(check, 4, **var)
        calls[0]()
        out = check[0][4].float()
        if ref is None:
            ref = out.clone()
        rel = ((out - ref).abs().max() / ref.abs().max()).item()
        ok.append(var) if rel < 1e-2 else print(f"variant {var} wrong: rel err {rel:.2e}", flush=True)
    rows = []
    for n, ctx in itertools.product(args.batches, args.contexts):
        lens = [ctx] * n
        nbytes = int2_bytes_read(lens, hkv, d, SINK, RECENT)
        data = decode_data(lens, hkv, hq, d, copies_for(nbytes))
        for var, ctas in itertools.product(ok, (2, 4, 8)):
            calls, splits = decode_calls(data, ctas, **var)
            ms = time_calls(calls, rep_ms=30)
            rows.append({"batch": n, "context": ctx, "use_asm": var["use_asm"], "num_warps": var["launch"][0],
                         "num_stages": var["launch"][1], "ctas_per_sm": ctas, "splits": splits, "ms": ms,
                         "GBps": nbytes / ms / 1e6, "pct_copy": 100 * nbytes / ms / 1e6 / bw})
        del data
        best = min((r for r in rows if r["batch"] == n and r["context"] == ctx), key=lambda r: r["ms"])
        print("best", best, flush=True)
        torch.cuda.empty_cache()
    # Per batch: the choice with the least total time relative to each context's best.
    table = {}
    for n in args.batches:
        mine = [r for r in rows if r["batch"] == n]
        best_ms = {c: min(r["ms"] for r in mine if r["context"] == c) for c in args.contexts}
        score = {}
        for r in mine:
            k = (r["use_asm"], r["num_warps"], r["num_stages"], r["ctas_per_sm"])
            score[k] = score.get(k, 0.0) + r["ms"] / best_ms[r["context"]]
        table[n] = min(score, key=score.get)
        print(f"batch {n}: use_asm, warps, stages, ctas = {table[n]} (score {score[table[n]]:.3f} "
              f"over {len(args.contexts)} contexts)", flush=True)
    write_reports(Path(args.out), "sweep_decode", rows, env, "Decode launch sweep, Qwen3-8B shape",
                  ["batch", "context", "use_asm", "num_warps", "num_stages", "ctas_per_sm", "splits", "ms", "GBps",
                   "pct_copy"], [f"copy bandwidth: {bw:,.0f} GB/s", f"chosen per batch: {table}"])
    prefill_sweep(args, bw, env)


def prefill_sweep(args, bw: float, env: dict) -> None:
    s = SHAPES["qwen3-8b"]
    errors = compile_all(_compile_prefill, PREFILL_VARIANTS, args.workers)
    chunk, prefix = PREFILL_SWEEP_SHAPE
    b = make_int2_batch([prefix], [chunk], s.num_kv_heads, s.head_dim, SINK, RECENT)
    q = torch.randn(chunk, s.num_heads, s.head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(chunk, s.num_kv_heads, s.head_dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    lse = torch.full((s.num_heads, chunk), float("-inf"), device="cuda")
    flops = 4 * s.num_heads * s.head_dim * chunk * prefix
    rows = []
    for (launch, asm), err in zip(PREFILL_VARIANTS, errors):
        if err:
            print(f"prefill variant {launch} asm={asm} failed: {err}", flush=True)
            continue
        ms = time_calls([lambda: oscar_prefill_attention(out, q, q, k, k, cache=b.mixed(SINK, RECENT), batch=b.batch(),
                                                         scale=0.088, self_lse=lse, launch=launch, use_asm=asm)],
                        rep_ms=100)
        rows.append({"block_m": launch[0], "num_warps": launch[1], "num_stages": launch[2], "use_asm": asm,
                     "ms": ms, "TFLOPs": flops / ms / 1e9})
        print(rows[-1], flush=True)
    # The same product through PyTorch's flash attention (BF16, dense), as a rate to aim at.
    qd = q.transpose(0, 1)[None]
    kd = torch.randn(1, s.num_heads, prefix, s.head_dim, device="cuda", dtype=torch.bfloat16)
    ms = time_calls([lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, kd)], rep_ms=100)
    rows.append({"block_m": "torch sdpa bf16 dense", "ms": ms, "TFLOPs": flops / ms / 1e9})
    print(rows[-1], flush=True)
    write_reports(Path(args.out), "sweep_prefill", rows, env,
                  f"Prefill prefix-kernel sweep, Qwen3-8B shape, chunk {chunk} over prefix {prefix}",
                  ["block_m", "num_warps", "num_stages", "use_asm", "ms", "TFLOPs"], [])


def once(args, bw: float, env: dict) -> None:
    """A few plain launches of the default decode kernel, for a profiler (ncu) to catch."""
    s = SHAPES[args.shapes[0]]
    n, ctx = args.batches[0], args.contexts[0]
    calls, splits = decode_calls(decode_data([ctx] * n, s.num_kv_heads, s.num_heads, s.head_dim, 1))
    for _ in range(5):
        calls[0]()
    torch.cuda.synchronize()
    print(f"{s.name} batch {n} context {ctx}: {splits} splits", flush=True)


def plot_decode(out_dir: Path) -> None:
    """``decode.png`` from ``decode.csv``: time per call, OSCAR against FA3, by batch and context."""
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(open(out_dir / "decode.csv")))
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        mine = [r for r in rows if r["shape"] == shape]
        for batch in sorted({int(r["batch"]) for r in mine}):
            pts = sorted((int(r["context"]), r) for r in mine if int(r["batch"]) == batch)
            ctx = [c for c, _ in pts]
            line, = ax.plot(ctx, [float(r["oscar_ms"]) for _, r in pts], "o-", label=f"OSCAR, batch {batch}")
            if all(r.get("fa3_ms", "").replace(".", "", 1).isdigit() for _, r in pts):
                ax.plot(ctx, [float(r["fa3_ms"]) for _, r in pts], "s--", color=line.get_color(),
                        label=f"FA3 BF16, batch {batch}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms per layer call")
        ax.set_title(f"decode attention, {shape}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "decode.png", dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["prefill", "sweep", "once", "plot"],
                   help="plot: redraw decode.png from the decode.csv in --out")
    p.add_argument("--out", default="results/kernels")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
    p.add_argument("--contexts", nargs="+", type=int, default=[1024, 8192, 32768, 131072])
    p.add_argument("--chunks", nargs="+",
                   default=["2048:0", "8192:8192", "16384:0", "4096:28672", "8192:122880", "16384:114688"],
                   help="prefill CHUNK:PREFIX pairs (default: %(default)s)")
    p.add_argument("--max-gb", type=float, default=40.0, help="skip shapes whose BF16 cache exceeds this")
    p.add_argument("--workers", type=int, default=8, help="processes compiling sweep variants")
    args = p.parse_args()
    args.chunks = [tuple(int(x) for x in c.split(":")) for c in args.chunks]
    if args.mode == "plot":
        plot_decode(Path(args.out))
        return
    bw = copy_bandwidth_gbs()
    env = environment()
    print(f"{env}; copy bandwidth {bw:,.0f} GB/s", flush=True)
    {"prefill": prefill, "sweep": sweep, "once": once}[args.mode](args, bw, env)


if __name__ == "__main__":
    main()
