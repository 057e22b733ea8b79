"""Tables and a plot from the end-to-end vLLM runs of ``tests/gpu/run.sh`` (its
``results.jsonl``, one ``RESULT`` line per check) and the reference simulation it ran
alongside (``reference_fidelity.json``).

    python -m benchmarks.vllm_report results/vllm --hardware "NVIDIA H200" --date 2026-11-30

Writes ``report.md`` (perplexity against the reference, KV capacity, decode speed, each
baseline from the same run) and ``report.png`` (decode tokens/s) into the folder.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from oscar_vllm.calibration.evaluate import METHODS_BY_NAME


def load(folder: Path) -> tuple[list[dict], dict]:
    rows = [json.loads(line.split(" ", 1)[1]) for line in (folder / "results.jsonl").read_text().splitlines()
            if line.startswith("RESULT ")]
    ref = json.loads((folder / "reference_fidelity.json").read_text())
    decode_ref = folder / "reference_fidelity_decode.json"  # optional: the same without --prefill-chunk
    if decode_ref.exists():
        ref["decode_semantics"] = json.loads(decode_ref.read_text())
    return rows, ref


def reference_of(run: dict, methods: list[str]) -> str:
    """The reference method a vLLM OSCAR run's prompt perplexity is held against, of those a
    reference run scored. Prompt tokens are prefilled: in 16 bits a chunk over a cached prefix
    takes the dense FA3 path, which applies no logit correction (docs/kernels.md), in float32 the
    INT2 kernel, which applies the served one."""
    if len(methods) == 1:
        return methods[0]
    corrected = run["dtype"] == "float32"
    found = [m for m in methods if (METHODS_BY_NAME[m].logit_correction > 0) == corrected]
    if len(found) != 1:
        raise ValueError(f"no single reference for a {run['dtype']} run among {methods}")
    return found[0]


def ppl_table(rows: list[dict], ref: dict) -> list[str]:
    sim = ref["results"]
    methods = [name for name in sim if name != "bf16"]
    chunk = ref.get("meta", {}).get("prefill_chunk") or 0
    how = f", prefilled in chunks of {chunk}" if chunk else ""
    out = ["| run | PPL | vs the reference simulation of OSCAR |", "|---|---|---|",
           f"| reference simulation, BF16 cache (`oscar-evaluate`, fp32 model) | {sim['bf16']['ppl']:.3f} | |"]
    out += [f"| reference simulation, OSCAR INT2 (`{m}`{how}) | {sim[m]['ppl']:.3f} | |" for m in methods]
    if "decode_semantics" in ref:
        decode = ref["decode_semantics"]["results"]
        out += [f"| reference simulation, OSCAR INT2 (`{m}`), every token as decode reads it | "
                f"{decode[m]['ppl']:.3f} | |"
                for m in methods if m in decode]
    for r in (r for r in rows if r["check"] == "ppl"):
        mode = "eager" if r["eager"] else "torch.compile + CUDA graphs"
        delta = ""
        if r["backend"] == "OSCAR":
            m = reference_of(r, methods)
            delta = f"{100 * (r['ppl'] / sim[m]['ppl'] - 1):+.3f}%" + (f" (`{m}`)" if len(methods) > 1 else "")
        out.append(f"| vLLM {r['backend']}, {r['dtype']}, {mode}, chunked prefill {r['chunk']} | "
                   f"{r['ppl']:.3f} | {delta} |")
    return out


def capacity_table(rows: list[dict]) -> list[str]:
    runs = {r["backend"]: r for r in rows if r["check"] == "qwen3"}
    if not {"OSCAR", "FLASH_ATTN"} <= set(runs):
        return []
    base = runs["FLASH_ATTN"]["kv_cache_tokens"]
    out = ["| backend | KV cache tokens | vs FLASH_ATTN BF16 |", "|---|---|---|"]
    for name in ("FLASH_ATTN", "OSCAR"):
        t = runs[name]["kv_cache_tokens"]
        out.append(f"| {name} | {t:,} | {t / base:.2f}x |")
    return out


def decode_table(rows: list[dict]) -> tuple[list[str], dict]:
    """Decode tokens/s by context and batch, FLASH_ATTN beside OSCAR; a shape whose prompts and
    new tokens do not fit a backend's KV cache says so (``tokens_per_s`` None in its row)."""
    decode = {(r["backend"], r["context"], r["batch"]): r for r in rows if r["check"] == "decode"}
    runs = {key: r["tokens_per_s"] for key, r in decode.items()}
    shapes = sorted({(c, b) for _, c, b in runs})
    out = ["| context | batch | FLASH_ATTN tok/s | OSCAR tok/s | OSCAR / FLASH_ATTN |", "|---|---|---|---|---|"]

    def cell(key):
        r = decode.get(key)
        if r is None:
            return "not run"
        if r["tokens_per_s"] is None:
            return f"does not fit ({r['kv_tokens_needed']:,} KV tokens, has {r['kv_cache_tokens']:,})"
        return f"{r['tokens_per_s']:,.1f}"

    for c, b in shapes:
        fa, osc = runs.get(("FLASH_ATTN", c, b)), runs.get(("OSCAR", c, b))
        ratio = f"{osc / fa:.2f}x" if fa and osc else "n/a"
        out.append(f"| {c:,} | {b} | {cell(('FLASH_ATTN', c, b))} | {cell(('OSCAR', c, b))} | {ratio} |")
    # Runs before 2026-12-04 gave the whole batch one prompt (no "prompts" key).
    labels = {"distinct": "a distinct prompt per request"}
    prompts = {labels.get(r.get("prompts"), "one prompt shared by the batch") for r in decode.values()}
    return out, {"shapes": shapes, "runs": runs, "prompts": ", ".join(sorted(prompts))}


def plot(decode: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = decode["shapes"]
    labels = [f"{c // 1024}K x{b}" for c, b in shapes]
    xs = range(len(shapes))
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, name in enumerate(("FLASH_ATTN", "OSCAR")):
        ax.bar([x + 0.4 * i for x in xs], [decode["runs"].get((name, c, b)) or 0 for c, b in shapes], 0.4, label=name)
    ax.set_xticks([x + 0.2 for x in xs], labels)
    ax.set_xlabel("context x batch")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("Qwen3-8B shape (dummy weights), decode, same run")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--hardware", default="")
    p.add_argument("--date", default="")
    p.add_argument("--command", default="bash tests/gpu/run.sh OUT e2e decode")
    args = p.parse_args()
    rows, ref = load(args.folder)
    decode, decode_data = decode_table(rows)
    lines = [f"- hardware: {args.hardware or rows[0].get('hardware', 'unknown')}",
             f"- date: {args.date or rows[0].get('date', 'unknown')}",
             f"- command: `{args.command}`",
             "", "**Perplexity, SmolLM2-135M-Instruct, Chesterton text, 8 windows of 2,048 tokens**", "",
             *ppl_table(rows, ref)]
    capacity = capacity_table(rows)
    if capacity:
        lines += ["", "**KV cache capacity, Qwen3-8B shape, gpu_memory_utilization 0.9, max_num_seqs 64, eager**", "",
                  *capacity]
    if decode_data["runs"]:
        lines += ["", f"**Decode, Qwen3-8B shape, 128 new tokens, prompts prefix-cached ({decode_data['prompts']}), "
                  "CUDA graphs**", "", *decode]
        plot(decode_data, args.folder / "report.png")
    (args.folder / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
