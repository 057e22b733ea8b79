"""Compile the OSCAR kernels for Hopper (sm_90) on any machine, no GPU needed, and show what
came out: registers, spills, shared memory and, for every loop of the SASS, its instruction
mix (are the loads 16 bytes wide and asynchronous, how many HMMA, barriers, conversions).
Arguments are specialized as a real launch would be (pointers and strides 16-aligned, except
the pointers a kernel lists in ``do_not_specialize_on_alignment``).

    python -m benchmarks.kernel_bench.compile_check decode --num-warps 4 --num-stages 3
    python -m benchmarks.kernel_bench.compile_check prefill --block-m 128 --num-warps 8 --dump /tmp/prefill.sass
    python -m benchmarks.kernel_bench.compile_check gluon_decode --maxnreg 168
    python -m benchmarks.kernel_bench.compile_check write_decode --query-rows 32
    python -m benchmarks.kernel_bench.compile_check write --block-t 16 --num-warps 8
"""
from __future__ import annotations

import argparse
import collections
import inspect
import re
import subprocess
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

from csrc_triton import gluon_layout, oscar_attention, oscar_decode, oscar_dense_kv, oscar_write
from csrc_triton.paged_layout import KEY_MEAN_PAIRS, WRITE_LAUNCH

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
# Integer arguments a launch passes as multiples of 16 (Triton specializes those).
ALIGNED_INTS = {"stride_cb", "stride_qt", "stride_rt", "stride_kt", "stride_vt", "stride_ot", "stride_qh",
                "stride_rh", "stride_oh", "stride_kh", "stride_vh", "stride_bt", "stride_nt", "stride_nh",
                "stride_page", "stride_qt", "stride_ot", "stride_mt", "stride_mh", "stride_cs"}
PREFILL_WRITE = WRITE_LAUNCH[max(WRITE_LAUNCH)]  # (tokens, warps) of the largest calls
WIN_E = 8  # window entries per page at 8 KV heads x head_dim 128, sink 64 (paged_layout.window_entries_per_page)
TYPES = {
    "out_ptr": "*bf16", "self_lse_ptr": "*fp32", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
    "q_ptr": "*bf16", "q_rot_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "key_ptr": "*bf16",
    "value_ptr": "*bf16", "rot_k_ptr": "*fp32", "slot_mapping_ptr": "*i64", "codes_ptr": "*u8",
    "params_ptr": "*fp16", "window_k_ptr": "*bf16", "window_v_ptr": "*bf16", "window_pos_ptr": "*i32",
    "window_pages_ptr": "*i32",
    "block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "cu_q_ptr": "*i32", "ring_slot_ptr": "*i32",
    "k_out_ptr": "*bf16", "v_out_ptr": "*bf16", "k_new_ptr": "*bf16", "v_new_ptr": "*bf16", "cu_k_ptr": "*i32",
    "first_pos_ptr": "*i32",
    "qk_scale": "fp32", "logit_coef": "fp32", "num_splits": "i32", "query_ptr": "*bf16", "rot_t_ptr": "*bf16",
    "q_mean_ptr": "*fp32", "key_mean_ptr": "*fp32", "cos_sin_ptr": "*fp32", "mean_pairs_ptr": "*i32",
    "mean_features_ptr": "*fp16", "mean_basis_ptr": "*fp32", "mean_cols_ptr": "*i32",
}


def compile_kernel(fn, consts: dict, num_warps: int, num_stages: int, maxnreg: int | None = None):
    names = list(inspect.signature(fn.fn).parameters)
    signature = {n: "constexpr" if n in consts else TYPES.get(n, "i32") for n in names}
    unaligned = set(fn.do_not_specialize_on_alignment or ())
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in consts and n not in unaligned and (signature[n].startswith("*") or n in ALIGNED_INTS)}
    source = GluonASTSource if fn.is_gluon() else ASTSource
    src = source(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def decode_consts(args) -> dict:
    return dict(HQ=8 * args.g, HKV=8, G=args.g, D=args.d, BLOCK_SIZE=64, SINK=64, RECENT=256, WIN_E=WIN_E,
                BLOCK_M=16, BLOCK_Q=1,
                SPLIT=True, DECODE=True, NEW_KEYS=True, MERGE_SELF=False, DOT_DT=tl.float16, USE_ASM=not args.no_asm,
                PRECISION="tf32", BLOCK_N_NEW=16, KEY_MEAN=args.key_mean)


def prefill_consts(args) -> dict:
    return dict(HQ=8 * args.g, HKV=8, G=args.g, D=args.d, BLOCK_SIZE=64, SINK=64, RECENT=256, WIN_E=WIN_E,
                BLOCK_M=args.block_m,
                BLOCK_Q=args.block_m // args.g, SPLIT=False, DECODE=False, NEW_KEYS=False, MERGE_SELF=True,
                DOT_DT=tl.float16, USE_ASM=not args.no_asm, PRECISION="tf32", BLOCK_N_NEW=32, KEY_MEAN=args.key_mean)


def write_consts(args) -> dict:
    return dict(ROT_HEAD_STRIDE=0, HKV=8, D=args.d, BLOCK_SIZE=64, SINK=64, RECENT=256, WIN_E=WIN_E,
                PARAM_BF16=args.bf16_params, BLOCK_T=args.block_t or PREFILL_WRITE[0],
                SEARCH_STEPS=oscar_write.SEARCH_STEPS, KEY_MEAN=args.key_mean, ROTATION=args.rotation)


def gluon_decode_consts(args) -> dict:
    launch = gluon_layout.decode_launch(8 if args.maxnreg else 1)
    return dict(HKV=8, G=args.g, N=8 if args.g <= 8 else 16, D=args.d, SINK=64, RECENT=256, SPLIT=True,
                PREFETCH=launch.prefetch if args.prefetch is None else args.prefetch,
                RING_COST=launch.ring_cost if args.ring_cost is None else args.ring_cost, CORRECT=args.correct,
                KEY_MEAN=args.key_mean)


def write_decode_consts(args) -> dict:
    tiles = gluon_layout.decode_write_tiles(args.g, args.d, query_rows=args.query_rows)
    del tiles["num_warps"]
    return dict(ROT_HEAD_STRIDE=0, HKV=8, G=args.g, D=args.d, SINK=64, RECENT=256, WIN_E=WIN_E,
                PARAM_BF16=args.bf16_params, R_TERM=args.d * args.d, KEY_MEAN=args.key_mean, **tiles)


def dense_kv_consts(args) -> dict:
    return dict(HKV=8, D=args.d, BLOCK_SIZE=64, SINK=64, RECENT=256, WIN_E=WIN_E, OUT_BF16=True, HAS_FIRST=False,
                RING_RECENT=True, KEY_MEAN=args.key_mean, MEAN_K=2 * KEY_MEAN_PAIRS)


def sass_instructions(sass: str) -> list[tuple[int, str, str]]:
    """``(address, opcode, text)`` of every instruction in ``cuobjdump -sass`` output."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            text = m.group(2).strip()
            ins.append((int(m.group(1), 16), re.sub(r"^@!?U?P[0-9T]+\s+", "", text).split()[0], text))
    return ins


def sass_loops(sass: str) -> list[tuple[int, int, collections.Counter]]:
    """``(start, end, opcode counts)`` of every backward branch's body."""
    ins = sass_instructions(sass)
    loops = []
    for addr, op, text in ins:
        target = text.split()[-1]
        if op == "BRA" and target.startswith("0x") and int(target, 16) < addr:
            start = int(target, 16)
            loops.append((start, addr, collections.Counter(o for a, o, _ in ins if start <= a <= addr)))
    return loops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kernel", choices=["decode", "prefill", "write", "dense_kv", "gluon_decode", "write_decode"])
    p.add_argument("--num-warps", type=int, help="default: as the launch wrapper has it")
    p.add_argument("--num-stages", type=int, default=3)
    p.add_argument("--block-m", type=int, default=64)
    p.add_argument("--block-t", type=int, help="write: tokens a program (default: WRITE_LAUNCH's for prefill)")
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--g", type=int, default=4)
    p.add_argument("--no-asm", action="store_true")
    p.add_argument("--bf16-params", action="store_true", help="write: bf16 scales and mins")
    p.add_argument("--rotation", choices=oscar_write.WRITE_ROTATIONS, default=oscar_write.WRITE_ROTATION,
                   help="write: how k @ R is multiplied")
    p.add_argument("--key-mean", action="store_true", help="the KEY_MEAN variant")
    p.add_argument("--correct", action="store_true", help="gluon_decode: the logit correction's variant (CORRECT)")
    p.add_argument("--query-rows", type=int,
                   help="write_decode: query rows a program (default: DECODE_WRITE_LAUNCH's at one token)")
    p.add_argument("--maxnreg", type=int, help="registers a thread may use (gluon_decode: as DECODE_LAUNCH has it)")
    p.add_argument("--prefetch", type=int,
                   help="gluon_decode: INT2 blocks prefetched into L2 ahead (default: DECODE_LAUNCH's for the cap)")
    p.add_argument("--ring-cost", type=int,
                   help="gluon_decode: INT2 blocks a ring tile counts as in the split partition "
                        "(default: DECODE_LAUNCH's)")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--dump", help="write the SASS here")
    args = p.parse_args()
    fn, consts = {
        "decode": (oscar_attention._oscar_attention_kernel, decode_consts),
        "prefill": (oscar_attention._oscar_attention_kernel, prefill_consts),
        "write": (oscar_write._oscar_write_kernel, write_consts),
        "dense_kv": (oscar_dense_kv._oscar_dense_kv_kernel, dense_kv_consts),
        "gluon_decode": (oscar_decode._oscar_decode_kernel, gluon_decode_consts),
        "write_decode": (oscar_write._oscar_write_decode_kernel, write_decode_consts),
    }[args.kernel]
    # As the launch wrappers choose, unless --num-warps says otherwise.
    write_warps = gluon_layout.decode_write_tiles(args.g, args.d, query_rows=args.query_rows)["num_warps"]
    default_warps = {"gluon_decode": 1, "write_decode": write_warps, "write": PREFILL_WRITE[1]}.get(args.kernel, 4)
    num_warps = args.num_warps or default_warps
    k = compile_kernel(fn, consts(args), num_warps, args.num_stages, args.maxnreg)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = subprocess.run([BIN / "cuobjdump", "--dump-resource-usage", f.name],
                               capture_output=True, text=True).stdout
        sass = subprocess.run([BIN / "cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
    if args.dump:
        Path(args.dump).write_text(sass)
    print(re.search(r"REG:.*", usage).group(0), f"| triton shared {k.metadata.shared} B",
          f"| {len(sass_instructions(sass))} instructions")
    for start, end, ops in sass_loops(sass):
        print(f"loop {start:#x}-{end:#x}, {sum(ops.values())} instructions:")
        print("   " + ", ".join(f"{op} {n}" for op, n in ops.most_common(args.top)))


if __name__ == "__main__":
    main()
