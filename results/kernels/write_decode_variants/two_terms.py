"""The decode write with R as two bf16 terms (this tree) against three (the module of an earlier
tree, ``argv[1]``, e.g. ``f7bd12a``'s), in one process. Each layer its own R (``[d, d]``, as the
published rotations: one a layer, shared by the heads). Timed in CUDA graphs of 1 call, of 36 calls
(a decode step's layers: their R stay in L2) and of 2,560 calls each with its own R (over 4x the
L2: R comes from DRAM, as in serving, where the weights stream through L2 between two layers'
writes). The run in ``two_terms/`` also timed an L2 prefetch of R (slower: not landed).

    PYTHONPATH=$PWD python3 results/kernels/write_decode_variants/two_terms.py BEFORE/csrc_triton/oscar_write.py OUT
"""
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd() / "benchmarks" / "kernels"))
sys.path.insert(0, str(Path.cwd()))
import torch  # noqa: E402
from common import L2_BYTES, environment, make_int2_batch, time_calls, write_reports  # noqa: E402

import csrc_triton.oscar_write as after  # noqa: E402
from oscar_vllm.core.quant import clip_index  # noqa: E402

spec = importlib.util.spec_from_file_location("oscar_write_before", sys.argv[1])
before = importlib.util.module_from_spec(spec)
spec.loader.exec_module(before)
out = Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
COLD = 2560
rows = []
for hkv, hq, d, t in [(8, 32, 128, 1), (8, 32, 128, 32), (8, 32, 128, 256), (3, 9, 64, 1)]:
    b = make_int2_batch([1000] * t, [1] * t, hkv, d, 64, 256)
    k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
    q_rot = torch.empty_like(q)
    pos = torch.full((t,), 1000)
    slots = (b.block_table.cpu()[torch.arange(t), pos // 64].long() * 64 + pos % 64).cuda()
    cold = max(36, min(COLD, 4 * L2_BYTES // (3 * 2 * d * d)))
    rots = [torch.linalg.qr(torch.randn(d, d, device="cuda"))[0] for _ in range(cold)]
    for name, m in [("three terms (before)", before), ("two terms", after)] * 2:
        rt = [m.decode_rotation(r) for r in rots]

        def call(r, m=m):
            m.oscar_write_decode(k, v, q, q_rot, r, slots, b.seq_lens, b.ring_slots, b.cache, b.windows,
                                 b.window_pages, b.window_pos, clip_index(0.96, d), clip_index(0.92, d), 64, 256)

        row = dict(kv_heads=hkv, head_dim=d, tokens=t, write=name,
                   us_graph_of_1=time_calls([lambda: call(rt[0])]) * 1e3,
                   us_each_graph_of_36=time_calls([lambda r=r: call(r) for r in rt[:36]]) * 1e3,
                   us_each_cold=time_calls([lambda r=r: call(r) for r in rt], rep_ms=200) * 1e3)
        rows.append({key: round(val, 2) if isinstance(val, float) else val for key, val in row.items()})
        print(rows[-1], flush=True)
        del rt
write_reports(out, "two_terms", rows, environment(),
              "Decode write: R as two bf16 terms against three",
              ["kv_heads", "head_dim", "tokens", "write", "us_graph_of_1", "us_each_graph_of_36", "us_each_cold"],
              ["µs a call; us_each_cold: graphs of calls each with its own R, over 4x the L2 (R from DRAM)"])
