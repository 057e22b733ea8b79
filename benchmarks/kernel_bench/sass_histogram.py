"""Instruction mix of compiled Triton kernels, from the Triton cache: for each compiled
variant of a kernel, its launch options, registers, shared memory, spills and the most
frequent SASS opcodes (are the loads 16 bytes wide, are the products HMMA or HGMMA, is there
any I2F left). Needs ``cuobjdump`` (CUDA toolkit).

    python -m benchmarks.kernel_bench.sass_histogram _oscar_attention_kernel [--top 25]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
from pathlib import Path

from .compile_check import sass_instructions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kernel")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--cache", default=os.environ.get("TRITON_CACHE_DIR", str(Path.home() / ".triton" / "cache")))
    args = p.parse_args()
    cuobjdump = shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump"
    for meta_path in sorted(Path(args.cache).rglob(f"{args.kernel}.json")):
        meta = json.loads(meta_path.read_text())
        cubin = meta_path.with_suffix(".cubin")
        if not cubin.exists():
            continue
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True).stdout
        ops = collections.Counter(op for _, op, _ in sass_instructions(sass))
        head = {k: meta.get(k) for k in ("num_warps", "num_stages", "shared", "n_regs", "n_spills")}
        consts = {k: v for k, v in (meta.get("constants") or {}).items()
                  if k in ("BLOCK_M", "DECODE", "SPLIT", "USE_ASM", "MERGE_SELF", "NEW_KEYS", "D", "G")}
        print(f"== {meta_path.parent.name[:12]} {head} {consts} total {sum(ops.values())}")
        print("   " + ", ".join(f"{op} {n}" for op, n in ops.most_common(args.top)))


if __name__ == "__main__":
    main()
