"""How long a server start spends compiling the Gluon decode kernel's serving variants for
Hopper (sm_90), in one thread and in several (``warm_up_threads``), each run from an empty
Triton cache. No GPU needed: this is the compiler's share of the warm-up, which threads can
shorten only as far as Triton compiles outside the GIL.

    python -m benchmarks.kernel_bench.warm_up_compile --threads 1 2 --out results/kernels/warm_up_compile
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

from csrc_triton import oscar_decode
from csrc_triton.warm_up import gluon_decode_variants

from .common import environment, write_reports
from .compile_check import compile_kernel, gluon_decode_consts


def decode_variants(max_num_seqs: int, num_sms: int) -> list[tuple[int | None, dict]]:
    """The distinct compiles among a Qwen3-8B-shaped server's decode launches: ``(maxnreg, consts)``,
    the constants as ``compile_check`` specializes them."""
    compiles = {}
    for maxnreg, prefetch, ring_cost, splits in gluon_decode_variants(max_num_seqs, 8, num_sms):
        shape = SimpleNamespace(maxnreg=maxnreg, g=4, d=128, prefetch=prefetch, ring_cost=ring_cost, key_mean=False,
                                correct=True)
        consts = {**gluon_decode_consts(shape), "SPLIT": splits > 1}
        compiles.setdefault((maxnreg, *consts.values()), (maxnreg, consts))
    return list(compiles.values())


def compile_all(variants: list[tuple[int | None, dict]], threads: int) -> float:
    """Seconds to compile ``variants`` ``threads`` at a time into a new, empty Triton cache, which is
    removed after (and the caller's ``TRITON_CACHE_DIR`` put back)."""
    before = os.environ.get("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix=f"oscar-warm-up-{threads}-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        try:
            start = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda v: compile_kernel(oscar_decode._oscar_decode_kernel, v[1], 1, 1, v[0]), variants))
            return time.perf_counter() - start
        finally:
            if before is None:
                os.environ.pop("TRITON_CACHE_DIR")
            else:
                os.environ["TRITON_CACHE_DIR"] = before


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--max-num-seqs", type=int, default=1024, help="vLLM's max_num_seqs (its default: 1024)")
    p.add_argument("--num-sms", type=int, default=132, help="the GPU's SMs (H200: 132)")
    p.add_argument("--out", type=Path, help="folder for warm_up_compile.json and .md")
    args = p.parse_args()
    variants = decode_variants(args.max_num_seqs, args.num_sms)
    rows = [{"threads": t, "variants": len(variants), "seconds": round(compile_all(variants, t), 2)}
            for t in args.threads]
    for row in rows:
        row["vs_first"] = round(row["seconds"] / rows[0]["seconds"], 2)
    env = environment()
    print(json.dumps(env))
    for row in rows:
        print(json.dumps(row))
    if args.out:
        write_reports(args.out, "warm_up_compile", rows, env,
                      "Compiling the Gluon decode kernel's serving variants in threads",
                      ["threads", "variants", "seconds", "vs_first"],
                      ["compiling for sm_90 on this machine's CPU; vs_first: seconds over the first row's"])


if __name__ == "__main__":
    main()
