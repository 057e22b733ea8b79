"""KV capacity with OSCAR's windows in the pool, from the startup logs of two vLLM engines.

vLLM logs the pool it allocated ("GPU KV cache size: N tokens"); the OSCAR scheduler logs what
one running request's windows take from it and what is left with 32, 256 and ``max_num_seqs``
requests running. This turns both engines' logs into ``capacity.md`` (ratios against the BF16
engine's pool from the same run):

    python -m benchmarks.studies.window_capacity OSCAR_LOG BF16_LOG --meta META_JSON --out DIR
"""
import argparse
import json
import re
from pathlib import Path

POOL = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
WINDOWS = re.compile(
    r"OSCAR: each running request's BF16 windows \(sink (\d+) \+ recent (\d+)\) "
    r"take (\d+) KV blocks \(([\d.]+) MiB\).*?"
    r"the pool's (\d+) blocks hold (\d+) tokens with 32 requests running, (\d+) with 256, (\d+) with all (\d+)"
)


def parse(oscar_log: str, bf16_log: str) -> dict:
    pools = [POOL.search(text) for text in (oscar_log, bf16_log)]
    windows = WINDOWS.search(oscar_log)
    if not all(pools) or windows is None:
        raise SystemExit("the logs lack vLLM's KV cache size or OSCAR's window line")
    sink, recent, blocks, mib, pool_blocks, at32, at256, at_max, max_seqs = windows.groups()
    return {"oscar_pool": int(pools[0][1].replace(",", "")), "bf16_pool": int(pools[1][1].replace(",", "")),
            "sink": int(sink), "recent": int(recent), "window_blocks": int(blocks), "window_mib": float(mib),
            "pool_blocks": int(pool_blocks), "running": {32: int(at32), 256: int(at256), int(max_seqs): int(at_max)}}


def table(c: dict, meta: dict) -> str:
    bf16 = c["bf16_pool"]
    rows = [f"| pool vLLM allocated (none running) | {c['oscar_pool']:,} ({c['oscar_pool'] / bf16:.2f}x) | {bf16:,} |"]
    rows += [f"| left for KV with {n} requests running | {t:,} ({t / bf16:.2f}x) | {bf16:,} |"
             for n, t in sorted(c["running"].items())]
    return "\n".join([
        "# KV capacity with the windows in the pool", "",
        f"- date: {meta['date']}; hardware: {meta['hardware']}; model: {meta['model']}",
        f"- command: `{meta['command']}` (engine start-up logs: engine_OSCAR.log, engine_FLASH_ATTN.log)",
        f"- {meta['versions']}; vLLM's defaults (max_num_seqs, CUDA graphs) but max_model_len, sized by the harness",
        f"- one request's windows (sink {c['sink']} + recent {c['recent']}): {c['window_blocks']} blocks, "
        f"{c['window_mib']} MiB over all layers, taken from the pool only while it runs",
        "", "| KV tokens | OSCAR | FLASH_ATTN (BF16) |", "|---|---|---|", *rows, ""])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("oscar_log")
    p.add_argument("bf16_log")
    p.add_argument("--meta", required=True, help="the harness's meta.json of the run")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    capacity = parse(Path(args.oscar_log).read_text(), Path(args.bf16_log).read_text())
    out = Path(args.out)
    (out / "capacity.md").write_text(table(capacity, json.loads(Path(args.meta).read_text())))
    (out / "capacity.json").write_text(json.dumps(capacity, indent=1) + "\n")


if __name__ == "__main__":
    main()
