"""Benchmarks of ``csrc_triton/oscar_decode.py`` (Gluon decode attention) on an H200-class GPU.

Each row times, on the same paged shapes in the same run: OSCAR's decode kernel as the backend
launches it, the Triton decode kernel it replaces (``oscar_attention``, still the path for fp32
and shapes the Gluon kernel does not take), vLLM's FA3 and Triton unified attention on the BF16
paged cache, the bytes each reads, the GB/s that makes and its share of the device-to-device
copy bandwidth measured at the start of the run. Every request reads its own blocks in
shuffled order, over enough copies of the data that L2 serves nothing.

    python -m benchmarks.kernel_bench.oscar_decode decode --out results/kernels
    python -m benchmarks.kernel_bench.oscar_decode sweep  --out results/kernels/sweep

``sweep`` times the launch choices (register cap, programs per SM) the wrapper fixes;
``against --baseline OLD.py`` times this tree's kernel beside an earlier version of its module.
"""
from __future__ import annotations

import argparse
import inspect
import itertools
from pathlib import Path

import torch

from csrc_triton import gluon_layout
from csrc_triton import oscar_decode as od

from .common import (SHAPES, copies_for, copy_bandwidth_gbs, environment, int2_bytes_read, load_baseline,
                     make_int2_batch, time_calls, timed_in_turn, write_reports)
from .oscar_attention import Bf16Paged, _fa3, _vllm_triton, decode_calls, fa3_call, plot_decode, triton_call

SINK, RECENT = 64, 256


def gluon_data(ctx: list[int], hkv: int, hq: int, d: int, copies: int, seed: int = 0) -> list[tuple]:
    """``copies`` decode batches whose step token is already written (as the backend runs them)."""
    n = len(ctx)
    out = []
    for c in range(copies):
        b = make_int2_batch(ctx, [1] * n, hkv, d, SINK, RECENT, seed=seed + c, written=True)
        q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16)
        out.append((b, q, torch.empty_like(q)))
    return out


def key_mean_for(hkv: int, d: int, positions: int, module=od) -> dict:
    """``module.oscar_decode``'s key-mean operands for a seeded mean (16 pairs a head) and a RoPE table."""
    from csrc_triton.paged_layout import KEY_MEAN_PAIRS
    from oscar_vllm.core.key_mean import strongest_pairs

    angles = torch.arange(positions, dtype=torch.float64)[:, None] * 1e6 ** (-torch.arange(0, d, 2) / d)[None]
    table = torch.cat([angles.cos(), angles.sin()], dim=-1).float().cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    mean = strongest_pairs(3 * torch.randn(hkv, d, device="cuda", generator=gen), KEY_MEAN_PAIRS)
    return module.key_mean_operands(mean, table)


def gluon_calls(data: list[tuple], ctas: int | None = None, maxnreg: int | None = -1, splits: int = 0,
                prefetch: int | None = None, max_splits: int | None = None,
                ring_cost: int | None = None, module=od, key_mean: dict | None = None,
                logit_correction: float = 0.0) -> tuple[list, int]:
    """The kernel's launches over ``data``; ``splits`` > 0 fixes the split count (the
    ``decode_splits`` setting, or a sweep's), else the wrapper's choice for the batch size
    (``max_splits`` instead of ``MAX_DECODE_SPLITS`` as its cap). ``maxnreg``, ``prefetch`` and ``ring_cost``: the
    wrapper's choice unless given. ``module``: the decode module whose wrapper launches (``against``:
    an earlier version of it). ``key_mean``: the ``key_mean`` variant with these operands;
    ``logit_correction``: λ (its variant past 0)."""
    b, q, _ = data[0]
    n, hq, d = q.shape
    hkv = b.cache.shape[1]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = splits or module.decode_splits(n, hkv, sms, ctas, max_splits)
    part_out = torch.empty(n * hq * splits * d, device="cuda")
    part_lse = torch.empty(n * hq * splits, device="cuda")
    launch = ({} if maxnreg == -1 else {"maxnreg": maxnreg}) | ({} if prefetch is None else {"prefetch": prefetch}) \
        | ({} if ring_cost is None else {"ring_cost": ring_cost}) \
        | ({} if key_mean is None else {"key_mean": key_mean})
    objects = "batch" in inspect.signature(module.oscar_decode).parameters

    def call(b, q, out):
        kw = dict(num_splits=splits, part_out=part_out, part_lse=part_lse, logit_correction=logit_correction,
                  **launch, **({} if key_mean is None else {"q": q}))
        if objects:
            return module.oscar_decode(out, q, cache=b.mixed(SINK, RECENT), batch=b.batch(n), scale=d ** -0.5, **kw)
        # a baseline from before the cache and batch objects (against --baseline OLD.py)
        return module.oscar_decode(out, q, b.cache, b.windows, b.window_pages, b.window_pos, b.block_table,
                                   b.seq_lens, b.ring_slots, n, d ** -0.5, SINK, RECENT, **kw)

    return [lambda b=b, q=q, out=out: call(b, q, out) for b, q, out in data], splits


def decode(args, bw: float, env: dict) -> list[dict]:
    from .oscar_attention import decode_data

    fa, ua = _fa3(), _vllm_triton()
    rows = []
    for key in args.shapes:
        s = SHAPES[key]
        for n, ctx in itertools.product(args.batches, args.contexts):
            bf16_bytes = n * ctx * s.num_kv_heads * s.head_dim * 4
            if bf16_bytes > args.max_gb * 1e9:
                continue
            lens = [ctx] * n
            osc_bytes = int2_bytes_read(lens, s.num_kv_heads, s.head_dim, SINK, RECENT)
            row = {"shape": s.name, "batch": n, "context": ctx}
            if od.supports(s.num_heads, s.num_kv_heads, s.head_dim, torch.bfloat16, SINK):
                data = gluon_data(lens, s.num_kv_heads, s.num_heads, s.head_dim, copies_for(osc_bytes))
                calls, row["splits"] = gluon_calls(data)
                row["oscar_ms"] = time_calls(calls)
                if args.fixed_splits:
                    calls, _ = gluon_calls(data, splits=args.fixed_splits,
                                           ring_cost=gluon_layout.decode_ring_cost(n, args.fixed_splits))
                    row["oscar_fixed_ms"] = time_calls(calls)
                    row["fixed_vs_chosen"] = row["oscar_fixed_ms"] / row["oscar_ms"]
                if args.key_mean:
                    # The previous default (keys as they are, λ = 0.5) against the served one (keys
                    # less their block's mean, λ = 0), at the table's register cap and at others.
                    calls, _ = gluon_calls(data, logit_correction=0.5)
                    row["oscar_corrected_ms"] = time_calls(calls)
                    mean = key_mean_for(s.num_kv_heads, s.head_dim, ctx + 1)
                    calls, _ = gluon_calls(data, key_mean=mean)
                    row["oscar_mean_ms"] = time_calls(calls)
                    row["mean_vs_corrected"] = row["oscar_mean_ms"] / row["oscar_corrected_ms"]
                    for cap in args.mean_maxnreg:
                        calls, _ = gluon_calls(data, key_mean=mean, maxnreg=cap)
                        row[f"oscar_mean_{cap}_ms"] = time_calls(calls)
                        row[f"mean_{cap}_vs_corrected"] = row[f"oscar_mean_{cap}_ms"] / row["oscar_corrected_ms"]
                del calls, data
            calls, _ = decode_calls(decode_data(lens, s.num_kv_heads, s.num_heads, s.head_dim, copies_for(osc_bytes)))
            row["oscar_triton_ms"] = time_calls(calls)
            del calls
            row.setdefault("oscar_ms", row["oscar_triton_ms"])
            row["oscar_MB"] = osc_bytes / 1e6
            row["oscar_GBps"] = osc_bytes / row["oscar_ms"] / 1e6
            row["oscar_pct_copy"] = 100 * row["oscar_GBps"] / bw
            row["bf16_MB"] = bf16_bytes / 1e6
            if fa or ua:
                caches = [Bf16Paged(lens, [1] * n, s.num_kv_heads, s.head_dim, seed=c)
                          for c in range(copies_for(bf16_bytes))]
                q = torch.randn(n, s.num_heads, s.head_dim, device="cuda", dtype=torch.bfloat16)
                out = torch.empty_like(q)
                for name, fn, make in (("fa3", fa, fa3_call), ("triton", ua, triton_call)):
                    if fn is None:
                        continue
                    try:
                        row[f"{name}_ms"] = time_calls([make(fn, c, q, out, s.head_dim ** -0.5, s.num_heads)
                                                        for c in caches])
                        row[f"{name}_GBps"] = bf16_bytes / row[f"{name}_ms"] / 1e6
                        row[f"{name}_pct_copy"] = 100 * row[f"{name}_GBps"] / bw
                    except Exception as e:  # noqa: BLE001  (a baseline that fails says why)
                        row[f"{name}_ms"] = f"failed: {type(e).__name__}: {str(e)[:80]}"
                del caches
                if isinstance(row.get("fa3_ms"), float):
                    row["oscar_vs_fa3"] = row["oscar_ms"] / row["fa3_ms"]
            rows.append(row)
            print(row, flush=True)
            torch.cuda.empty_cache()
    cols = ["shape", "batch", "context", "splits", "oscar_ms", "oscar_triton_ms", "fa3_ms", "triton_ms", "oscar_vs_fa3",
            "oscar_GBps", "oscar_pct_copy", "fa3_GBps", "fa3_pct_copy"]
    notes = []
    if args.key_mean:
        caps = [c for cap in args.mean_maxnreg for c in (f"oscar_mean_{cap}_ms", f"mean_{cap}_vs_corrected")]
        cols[5:5] = ["oscar_corrected_ms", "oscar_mean_ms", "mean_vs_corrected", *caps]
        notes.append("oscar_corrected_ms: the Gluon kernel with the logit correction (λ 0.5), keys as they are (the "
                     "default before key means); oscar_mean_ms: keys less their block's mean (16 RoPE pairs a KV "
                     "head), λ 0, the default with key means; oscar_mean_N_ms: the same capped at N registers; "
                     "oscar_ms: neither")
    if args.fixed_splits:
        cols[5:5] = ["oscar_fixed_ms", "fixed_vs_chosen"]
        notes.append(f"oscar_fixed_ms: the Gluon kernel with decode_splits={args.fixed_splits} (every batch split so, "
                     "replies independent of the batch) against oscar_ms, the split count chosen per batch (splits)")
    write_reports(Path(args.out), "decode", rows, env, "Decode attention kernel: OSCAR INT2 against vLLM BF16",
                  cols, [f"copy bandwidth in this run: {bw:,.0f} GB/s (read + write)",
                         "oscar_ms: csrc_triton/oscar_decode.py (Gluon) as the backend launches it; "
                         "oscar_triton_ms: the Triton decode kernel it replaces (oscar_attention.py)",
                         "bytes: what each kernel must read (OSCAR: whole INT2 blocks, the BF16 window "
                         "entries; BF16: K and V of every token)",
                         "oscar_vs_fa3: OSCAR time / FA3 time (lower is faster)", *notes])
    plot_decode(Path(args.out))
    return rows


def sweep(args, bw: float, env: dict) -> None:
    """Register cap, programs per SM, split cap, L2 prefetch depth, the ring tile's weight in the
    split partition and the split count's rounding (a power of two, or one whole wave), every
    batch and context;
    each variant checked against the first (same inputs, same answer). Variants that launch the
    same kernel with the same split count at a shape are timed once."""
    s = SHAPES[args.shapes[0]]
    hkv, hq, d = s.num_kv_heads, s.num_heads, s.head_dim
    variants = list(itertools.product(args.maxnreg, args.ctas, args.max_splits, args.prefetch, args.ring_cost,
                                      [r == "wave" for r in args.split_rounding]))
    check = gluon_data([3000, 700, 9000], hkv, hq, d, 1, seed=7)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ref, ok = None, []
    for var in variants:
        maxnreg, ctas, cap, prefetch, ring_cost, wave = var
        splits = gluon_layout.decode_splits(len(check[0][1]), hkv, sms, ctas, cap, whole_wave=wave)
        calls, _ = gluon_calls(check, maxnreg=maxnreg, splits=splits, prefetch=prefetch, ring_cost=ring_cost)
        calls[0]()
        out = check[0][2].float()
        ref = out.clone() if ref is None else ref
        rel = ((out - ref).abs().max() / ref.abs().max()).item()
        ok.append(var) if rel < 1e-2 else print(f"variant {var} wrong: rel err {rel:.2e}", flush=True)
    rows = []
    for n, ctx in itertools.product(args.batches, args.contexts):
        lens = [ctx] * n
        nbytes = int2_bytes_read(lens, hkv, d, SINK, RECENT)
        data = gluon_data(lens, hkv, hq, d, copies_for(nbytes))
        timed = {}
        for maxnreg, ctas, cap, prefetch, ring_cost, wave in ok:
            splits = gluon_layout.decode_splits(n, hkv, sms, ctas, cap, whole_wave=wave)
            key = (maxnreg, prefetch, splits, ring_cost)
            if key not in timed:
                calls, _ = gluon_calls(data, maxnreg=maxnreg, splits=splits, prefetch=prefetch, ring_cost=ring_cost)
                timed[key] = time_calls(calls, rep_ms=30)
            ms = timed[key]
            rows.append({"batch": n, "context": ctx, "maxnreg": maxnreg or "none", "ctas_per_sm": ctas,
                         "max_splits": cap, "split_rounding": "wave" if wave else "pow2", "prefetch": prefetch,
                         "ring_cost": ring_cost or gluon_layout.decode_launch(n)[3], "splits": splits, "ms": ms,
                         "GBps": nbytes / ms / 1e6, "pct_copy": 100 * nbytes / ms / 1e6 / bw})
            print(rows[-1], flush=True)
        del data
        torch.cuda.empty_cache()
    write_reports(Path(args.out), "sweep_gluon_decode", rows, env, f"Gluon decode launch sweep, {s.name}",
                  ["batch", "context", "maxnreg", "ctas_per_sm", "max_splits", "split_rounding", "prefetch",
                   "ring_cost", "splits", "ms", "GBps", "pct_copy"],
                  [f"copy bandwidth: {bw:,.0f} GB/s",
                   "prefetch: INT2 blocks ahead brought into L2 (0: none); max_splits: the cap on the split count; "
                   "ring_cost: INT2 blocks a ring tile counts as in the split partition (1: all alike); "
                   "split_rounding: the split count for ctas_per_sm programs an SM rounded up to a power of two, "
                   "or down to one whole wave (wave)"])


def against(args, bw: float, env: dict) -> None:
    """The decode kernel as the backend launches it against an earlier version of its module
    (``--baseline``, e.g. ``git show REV:csrc_triton/oscar_decode.py > old.py``), each at its
    own launch table, on the same data in the same run: the comparison across GPU calls cannot
    make, since one-request times differ by up to 25% between machines. Timed in turn, twice
    each, the faster of each kernel's two kept; outputs must agree. ``--key-mean``: both with a key
    mean (λ 0), and this tree's kernel without one at λ 0.5 beside them (the default before means)."""
    base = load_baseline(args.baseline, "oscar_decode", "oscar_decode")
    s = SHAPES[args.shapes[0]]
    hkv, hq, d = s.num_kv_heads, s.num_heads, s.head_dim
    rows = []
    for n, ctx in itertools.product(args.batches, args.contexts):
        lens = [ctx] * n
        nbytes = int2_bytes_read(lens, hkv, d, SINK, RECENT)
        data = gluon_data(lens, hkv, hq, d, copies_for(nbytes))
        mean = {}
        if args.key_mean:
            mean = dict(now=dict(key_mean=key_mean_for(hkv, d, ctx + 1)),
                        then=dict(key_mean=key_mean_for(hkv, d, ctx + 1, base)))
        now, splits = gluon_calls(data, **mean.get("now", {}))
        then, base_splits = gluon_calls(data, module=base, **mean.get("then", {}))
        now[0]()
        want = data[0][2].float().clone()
        then[0]()
        rel = ((data[0][2].float() - want).abs().max() / want.abs().max()).item()
        if rel > 1e-2:
            raise AssertionError(f"{n} x {ctx}: the two versions differ (rel err {rel:.2e})")
        corrected = gluon_calls(data, logit_correction=0.5)[0] if args.key_mean else None
        times = timed_in_turn({"now": now, "baseline": then, **({"corrected": corrected} if corrected else {})}, 2,
                              rep_ms=30)
        row = {"batch": n, "context": ctx, "splits": splits, "baseline_splits": base_splits,
               "ms": times["now"], "baseline_ms": times["baseline"]}
        row["vs_baseline"] = row["ms"] / row["baseline_ms"]
        if corrected:
            row["corrected_ms"] = times["corrected"]
            row["vs_corrected"] = row["ms"] / row["corrected_ms"]
            row["baseline_vs_corrected"] = row["baseline_ms"] / row["corrected_ms"]
        row["pct_copy"] = 100 * nbytes / row["ms"] / 1e6 / bw
        rows.append(row)
        print(row, flush=True)
        del data, now, then, corrected
        torch.cuda.empty_cache()
    write_reports(Path(args.out), "against_baseline", rows, env,
                  f"Gluon decode against an earlier version, {s.name}",
                  ["batch", "context", "splits", "baseline_splits", "ms", "baseline_ms", "vs_baseline",
                   *(["corrected_ms", "vs_corrected", "baseline_vs_corrected"] if args.key_mean else []), "pct_copy"],
                  [f"baseline: {args.baseline}", f"copy bandwidth: {bw:,.0f} GB/s",
                   "vs_baseline: this tree's time / the baseline's (lower is faster); each the faster of two "
                   "timings taken in turn"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["decode", "sweep", "against"])
    p.add_argument("--out", default="results/kernels")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
    p.add_argument("--contexts", nargs="+", type=int, default=[1024, 8192, 32768, 131072])
    p.add_argument("--max-gb", type=float, default=40.0, help="skip shapes whose BF16 cache exceeds this")
    # The sweep's default axes are DECODE_LAUNCH's own values: a sweep with no axes named times the
    # table's choices against each other at every batch (name others to look beyond them).
    launch = list(gluon_layout.DECODE_LAUNCH.values())
    p.add_argument("--maxnreg", nargs="+", type=lambda v: None if v == "none" else int(v),
                   default=sorted({x.maxnreg for x in launch}, key=lambda v: -1 if v is None else v),
                   help="sweep: register caps ('none': uncapped; default: the launch table's)")
    p.add_argument("--ctas", nargs="+", type=int, default=sorted({x.ctas_per_sm for x in launch}),
                   help="sweep: one-warp programs per SM aimed for (default: the launch table's)")
    p.add_argument("--max-splits", nargs="+", type=int, default=[gluon_layout.MAX_DECODE_SPLITS],
                   help="sweep: split caps")
    p.add_argument("--prefetch", nargs="+", type=int, default=sorted({x.prefetch for x in launch}),
                   help="sweep: INT2 blocks prefetched into L2 ahead (default: the launch table's)")
    p.add_argument("--split-rounding", nargs="+", choices=["pow2", "wave"],
                   default=sorted({"wave" if x.whole_wave else "pow2" for x in launch}),
                   help="sweep: the split count rounded up to a power of two, or down to one whole wave of programs "
                        "(default: the launch table's)")
    p.add_argument("--ring-cost", nargs="+", type=int, default=[None],
                   help="sweep: INT2 blocks a ring tile counts as in the split partition (default: DECODE_LAUNCH's)")
    p.add_argument("--baseline", help="against: an earlier csrc_triton/oscar_decode.py to time beside this tree's")
    p.add_argument("--key-mean", action="store_true",
                   help="decode: time the default with key means (and the one without: λ 0.5) too")
    p.add_argument("--mean-maxnreg", nargs="*", type=int, default=[],
                   help="decode --key-mean: also time the key-mean variant at these register caps")
    p.add_argument("--fixed-splits", type=int, default=0,
                   help="also time the Gluon kernel at this fixed split count (the decode_splits setting)")
    args = p.parse_args()
    bw = copy_bandwidth_gbs()
    env = environment()
    print(f"{env}; copy bandwidth {bw:,.0f} GB/s", flush=True)
    {"decode": decode, "sweep": sweep, "against": against}[args.mode](args, bw, env)


if __name__ == "__main__":
    main()
