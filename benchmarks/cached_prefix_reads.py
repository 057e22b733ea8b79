"""What a prefix-cache hit changes in what OSCAR reads, in the reference cache (CPU, SmolLM2).

``tests/gpu/e2e_vllm.py prefix`` scores the same held-out windows through vLLM with prefix
caching on and off, in chunks of 8192 and 256 tokens. With caching off, a prompt of one chunk
reads every key in BF16, and a later chunk finds the ring before it in BF16; with caching on,
the chunk after the hit reads the cached prefix, whose middle (past the sink) is 2-bit there,
with no ring before it. This runs the same windows and cuts through the reference cache
(``oscar_vllm.core.mixed_cache``) each of those ways, plus as a decode step reads them, so the vLLM
numbers can be read against what the method itself gives. The ``deep_hit`` reads take each cut's
prompt after the deepest hit the scheduler allows (the prompts of one window hit each other's
blocks in vLLM's check), as it was before (no ring) and as it is now (the hit a ring shorter):

    python -m benchmarks.cached_prefix_reads --out results/windows/cached_prefix_reads

Writes ``cached_prefix_reads.{md,json}`` into ``--out``.
"""
import argparse
import math

from oscar_vllm.calibration import corpus
from oscar_vllm.calibration.evaluate import (
    CACHED_PREFIX_CUTS,
    add_served_arguments,
    cached_prefix_reads,
    cached_prefix_workload,
    environment,
    load_served,
    report_header,
    save_report,
)

READS = {
    "bf16": "BF16 cache",
    "one_chunk": "OSCAR, prompt prefilled in one chunk (caching off): every key BF16",
    "chunked": "OSCAR, prompt prefilled in chunks of {chunk} (caching off): chunk, sink and ring before it BF16",
    "hit": "OSCAR, one chunk after a hit on the shared prefix: sink and chunk BF16, rest of the prefix 2-bit",
    "hit_chunked": "OSCAR, chunks of {chunk} after that hit: the first as `hit`, later ones also with their ring",
    "deep_hit": "OSCAR, one chunk after the deepest hit vLLM's scheduler allowed before (ending 256-319 tokens "
                "before the prompt's end): the prefix 2-bit up to the chunk",
    "deep_hit_ring": "OSCAR, the same hit as the scheduler now trims it, a ring (256 tokens) shorter, those "
                     "computed again: one chunk from there",
    "deep_hit_ring_chunked": "OSCAR, that hit, the rest in chunks of {chunk}, each with its ring",
    "decode": "OSCAR, as a decode step: sink and last 256 BF16, the rest 2-bit",
}


def ppl(nll: list[float]) -> float:
    return math.exp(sum(nll) / len(nll))


def report(nll: dict, meta: dict) -> str:
    base = {name: ppl(nll["bf16"][name]) for name in ("cut", "after")}
    rows = []
    for read, what in READS.items():
        cells = [f"{ppl(nll[read][name]):.3f} ({100 * (ppl(nll[read][name]) / base[name] - 1):+.2f}%)"
                 for name in ("cut", "after")]
        rows.append(f"| {read} | {what.format(chunk=meta['chunk'])} | {cells[0]} | {cells[1]} |")
    return "\n".join([
        "# Cached-prefix reads in the reference cache", "",
        *report_header(meta),
        f"- rotations: {meta['rotations']} ({meta['method']}); sink {meta['sink']}, recent {meta['recent']}",
        f"- windows: {meta['windows']} of a shared {meta['prefix']}-token prefix plus distinct held-out text "
        f"({corpus.EVALUATION_NAME}), cut at prefix + {', '.join(map(str, meta['cuts']))}: "
        f"{meta['tokens']} tokens per column, the workload of `tests/gpu/e2e_vllm.py prefix`",
        "- token at the cut: predicted by the prompt's last position (what the vLLM check scores as "
        "next-token perplexity); token after: predicted from the cut, as the decode step after it reads the cache",
        "", "| read | how the cache is read | perplexity, token at the cut | token after |",
        "|---|---|---|---|", *rows, ""])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_served_arguments(p, "runs/cached_prefix_reads")
    p.add_argument("--windows", type=int, default=23, help="windows to score, of 23 (default: %(default)s)")
    p.add_argument("--chunk", type=int, default=256, help="prefill chunk of the chunked reads (default: %(default)s)")
    args = p.parse_args()

    loaded, method, oscar = load_served(args, dense_prefill=True)  # prompt chunks of a 16-bit model
    _, shared, windows = cached_prefix_workload(corpus.tokenize(loaded.tokenizer, corpus.evaluation_text()).tolist())
    windows = windows[: args.windows]
    nll = cached_prefix_reads(loaded, windows, len(shared), oscar, chunk=args.chunk)
    meta = {**environment("python -m benchmarks.cached_prefix_reads"), "model": loaded.name, "dtype": args.dtype,
            "rotations": str(args.rotations), "method": method.name, "sink": 64, "recent": 256,
            "prefix": len(shared), "windows": len(windows), "cuts": list(CACHED_PREFIX_CUTS), "chunk": args.chunk,
            "tokens": len(windows) * len(CACHED_PREFIX_CUTS)}
    save_report(args.out, "cached_prefix_reads", {"meta": meta, "nll": nll}, report(nll, meta))


if __name__ == "__main__":
    main()
