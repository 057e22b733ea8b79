"""How much OSCAR's next-token distributions depend on where vLLM cuts a prompt into prefill
chunks, in the reference cache (CPU, SmolLM2).

A prefill chunk reads its own tokens, the sink and the ring before it in BF16, every older key
in 2 bits; so the same prompt cut into other chunks reads other keys in 2 bits, and which cut a
prompt gets depends on what else the scheduler runs beside it. The server-under-load check
found OSCAR's replies schedule-dependent where FLASH_ATTN's are not (docs/reliability.md);
this measures the mechanism: the same windows read with chunks of 256, 512 and 2048 tokens
(one chunk), and as decode reads them (each position: the sink and the last 256 keys in BF16,
the rest 2-bit, whatever the chunks), against each other and against BF16.

    python -m benchmarks.studies.chunking_dependence --out results/reliability/chunking

Writes ``chunking.{md,json}`` into ``--out``.
"""
import argparse
import itertools
import math

import torch
from tqdm import tqdm

from oscar_vllm.calibration import corpus
from oscar_vllm.calibration.calibrate import full_windows
from oscar_vllm.calibration.evaluate import (
    METHODS_BY_NAME,
    REFERENCE,
    add_served_arguments,
    environment,
    layer_specs,
    load_served,
    report_header,
    save_report,
)
from oscar_vllm.calibration.models import MixedCacheHook, attention_hooks

CHUNKS = (256, 512, 2048)
SINK, RECENT = 64, 256  # the backend's defaults


def reads(chunks: tuple[int, ...]) -> dict[str, str]:
    """Each read's name and what it is."""
    out = {"bf16": "BF16 cache (no chunk changes what it reads)"}
    out.update({f"chunk_{c}": f"OSCAR, prefilled in chunks of {c}" for c in chunks})
    out["decode"] = f"OSCAR, as decode reads: sink and last {RECENT} BF16, the rest 2-bit (chunk-independent)"
    return out


def read_logprobs(loaded, ids: torch.Tensor, oscar: dict, bf16: dict, chunks: tuple[int, ...],
                  sink: int, recent: int) -> dict[str, torch.Tensor]:
    """Next-token log-probabilities of every position of ``ids`` ``[T]``, each read."""
    hooks = {"bf16": lambda i: MixedCacheHook(bf16[i], 0, 0)}
    hooks.update({f"chunk_{c}": (lambda c: lambda i: MixedCacheHook(oscar[i], sink, recent, prefill_chunk=c))(c)
                  for c in chunks})
    hooks["decode"] = lambda i: MixedCacheHook(oscar[i], sink, recent)
    out = {}
    for name, make_hook in hooks.items():
        with attention_hooks(loaded.model, make_hook), torch.no_grad():
            logits = loaded.model(ids[None], use_cache=False).logits[0, :-1]
        out[name] = torch.log_softmax(logits.float(), dim=-1).cpu()
    return out


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Two reads' next-token distributions over the same positions: how often their greedy
    tokens differ, and their mean KL(a || b) in nats."""
    return {"top1_differs": float((a.argmax(-1) != b.argmax(-1)).float().mean()),
            "kl": float((a.exp() * (a - b)).sum(-1).mean())}


def report(result: dict, meta: dict) -> str:
    described = reads(tuple(meta["chunks"]))
    names = list(described)
    rows = [f"| {n} | {described[n]} | {result['ppl'][n]:.3f} "
            f"({100 * (result['ppl'][n] / result['ppl']['bf16'] - 1):+.2f}%) |" for n in names]
    pairs = [f"| {a} | {b} | {100 * result['pairs'][f'{a}/{b}']['top1_differs']:.2f}% | "
             f"{result['pairs'][f'{a}/{b}']['kl']:.4f} |" for a, b in itertools.combinations(names[1:], 2)]
    return "\n".join([
        "# Where vLLM cuts a prompt into chunks changes what OSCAR predicts", "",
        *report_header(meta),
        f"- rotations: {meta['rotations']} ({meta['method']}); sink {meta['sink']}, recent {meta['recent']}",
        f"- {meta['windows']} windows of {meta['context']} tokens of held-out text ({corpus.EVALUATION_NAME}): "
        f"{meta['tokens']:,} predicted positions per read",
        "", "Perplexity of each read:", "",
        "| read | how the cache is read | perplexity (vs BF16) |", "|---|---|---|", *rows, "",
        "Two reads of the same positions: how often their greedy next tokens differ, and their mean KL "
        "(nats). Under BF16 a chunk boundary changes nothing but the order of floating-point sums.", "",
        "| read | against | greedy token differs | KL |", "|---|---|---|---|", *pairs, ""])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_served_arguments(p, "runs/chunking")
    p.add_argument("--context", type=int, default=2048, help="tokens a window (default: %(default)s)")
    p.add_argument("--windows", type=int, default=4, help="held-out windows to read (default: %(default)s)")
    p.add_argument("--chunks", type=int, nargs="+", default=list(CHUNKS), help="prefill chunk sizes to compare")
    args = p.parse_args()

    loaded, method, oscar = load_served(args, dense_prefill=True)  # prompt chunks of a 16-bit model
    bf16 = layer_specs(METHODS_BY_NAME[REFERENCE], {}, list(oscar))
    ids = corpus.tokenize(loaded.tokenizer, corpus.evaluation_text())
    windows = full_windows(ids, args.context)[: args.windows]
    chunks = tuple(args.chunks)
    names = list(reads(chunks))
    pairs = list(itertools.combinations(names[1:], 2))
    nll = dict.fromkeys(names, 0.0)
    sums = {f"{a}/{b}": {"top1_differs": 0.0, "kl": 0.0} for a, b in pairs}
    tokens = 0
    for window in tqdm(windows, desc="windows", unit="window"):
        window = window.to(args.device)
        logp = read_logprobs(loaded, window, oscar, bf16, chunks, SINK, RECENT)  # a window at a time: 0.4 GB a read
        n = window.numel() - 1
        tokens += n
        for name in names:
            nll[name] -= float(logp[name].gather(-1, window[1:, None].cpu()).sum())
        for a, b in pairs:
            for key, value in compare(logp[a], logp[b]).items():
                sums[f"{a}/{b}"][key] += value * n
    result = {"ppl": {n: math.exp(nll[n] / tokens) for n in names},
              "pairs": {pair: {k: v / tokens for k, v in s.items()} for pair, s in sums.items()}}
    meta = {**environment("python -m benchmarks.studies.chunking_dependence"), "model": loaded.name,
            "dtype": args.dtype, "rotations": str(args.rotations), "method": method.name, "sink": SINK,
            "recent": RECENT, "context": args.context, "windows": len(windows), "chunks": list(chunks),
            "tokens": tokens}
    save_report(args.out, "chunking", {"meta": meta, **result}, report(result, meta), indent=1)


if __name__ == "__main__":
    main()
