"""Where the decode write's time goes: the kernel with parts switched off (constexpr flags in a
copy of csrc_triton/oscar_write.py), each timed in CUDA graphs of 1 call and of 36 calls (one
per layer, each with its own rotation, as a decode step's graph has them)."""
import sys, json, datetime
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path.cwd() / "benchmarks" / "kernels"))
sys.path.insert(0, str(Path.cwd()))
import torch
from common import make_int2_batch, time_calls, copy_bandwidth_gbs
from oscar_vllm.core.quant import clip_index
import oscar_write_ablate as W

SINK, RECENT, LAYERS = 64, 256, 36
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
rows = []
for hkv, hq, d, t in [(8, 32, 128, 1), (8, 32, 128, 32), (3, 9, 64, 1)]:
    b = make_int2_batch([1000] * t, [1] * t, hkv, d, SINK, RECENT)
    k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16); q_rot = torch.empty_like(q)
    rots = [W.decode_rotation(torch.linalg.qr(torch.randn(hkv, d, d, device="cuda"))[0]) for _ in range(LAYERS)]
    pos = torch.full((t,), 1000)
    blocks = b.block_table.cpu()[torch.arange(t), pos // 64].long()
    slots = (blocks * 64 + pos % 64).cuda()
    variants = {
        "full": {}, "no clip search": {"clip": False}, "no query rotation": {"DO_Q": False},
        "no R (no query or key rotation)": {"DO_Q": False, "DO_K": False}, "no ring": {"DO_RING": False},
        "no ring, no codes (quantize unused)": {"DO_RING": False, "DO_CODES": False},
        "all parts off (the compiler drops every load)": {"DO_Q": False, "DO_K": False, "DO_RING": False, "DO_CODES": False},
    }
    for name, f in variants.items():
        f = dict(f); clip = f.pop("clip", True)
        ck, cv = (clip_index(0.96, d), clip_index(0.92, d)) if clip else (-1, -1)
        call = lambda r, f=f, ck=ck, cv=cv: W.oscar_write_decode(k, v, q, q_rot, r, slots, b.seq_lens, b.ring_slots, b.cache,
                                                  b.windows, b.window_pages, b.window_pos, ck, cv, SINK, RECENT, **f)
        one = time_calls([lambda: call(rots[0])]) * 1e3
        many = time_calls([lambda r=r: call(r) for r in rots]) * 1e3
        rows.append(dict(kv_heads=hkv, head_dim=d, tokens=t, variant=name, us_graph_of_1=round(one, 2), us_each_graph_of_36=round(many, 2)))
        print(rows[-1], flush=True)
    x = torch.empty(1, device="cuda")
    one = time_calls([lambda: W.empty_launch(x, hkv)]) * 1e3
    many = time_calls([lambda: W.empty_launch(x, hkv) for _ in range(LAYERS)]) * 1e3
    rows.append(dict(kv_heads=hkv, head_dim=d, tokens=t, variant="empty kernel, same grid", us_graph_of_1=round(one, 2), us_each_graph_of_36=round(many, 2)))
    print(rows[-1], flush=True)
meta = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), gpu=torch.cuda.get_device_name(0),
            torch=torch.__version__, copy_GBps=copy_bandwidth_gbs())
lines = [f"# Decode write ablation, {meta['gpu']}, {meta['date']}", "", f"`python run_ablate.py OUT` ({meta})", "",
         "| kv heads | head_dim | tokens | variant | µs, graph of 1 | µs each, graph of 36 |", "|---|---|---|---|---|---|"]
lines += [f"| {r['kv_heads']} | {r['head_dim']} | {r['tokens']} | {r['variant']} | {r['us_graph_of_1']} | {r['us_each_graph_of_36']} |" for r in rows]
(out / "ablation.md").write_text("\n".join(lines) + "\n")
(out / "ablation.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
