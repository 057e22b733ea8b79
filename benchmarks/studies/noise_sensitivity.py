"""How much a 2-bit cache amplifies small numerical differences upstream of it, in the reference
cache (CPU, SmolLM2): the same held-out windows read with the query, key and value rows of every
layer as computed, and again each element times (1 + d), d uniform in [-eps, eps] (eps about half
a BF16 step: the size of the differences between two correct builds of one model, such as vLLM
with CUDA graphs and torch.compile against eager), through a BF16 cache and through OSCAR as
served. Both caches see the same perturbation, position for position.

A flip of the greedy next token under such noise is what makes two servers of the same model
disagree on a reply (vLLM's graphs-against-eager check, docs/reliability.md). Rounding to two
bits is a step function: a key near a code boundary crosses it under the noise and moves by a
whole code step, where BF16 moves it by at most one BF16 step. So OSCAR's replies can be no
more stable against such differences than BF16's; this measures by how much less.

    python -m benchmarks.studies.noise_sensitivity --out results/reliability/noise_sensitivity

Writes ``noise_sensitivity.{md,json}`` into ``--out``.
"""
import argparse
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

SINK, RECENT = 64, 256  # the backend's defaults
EPS = (2.0 ** -9, 2.0 ** -12)


class PerturbedHook:
    """``inner`` on q, k, v each scaled element-wise by (1 + d), d ~ U(-eps, eps), drawn from
    ``seed`` (the same numbers for every cache that reads this layer of this window)."""

    def __init__(self, inner: MixedCacheHook, eps: float, seed: int):
        self.inner, self.eps, self.seed = inner, eps, seed

    def __call__(self, q, k, v, scaling):
        gen = torch.Generator().manual_seed(self.seed)

        def jitter(x: torch.Tensor) -> torch.Tensor:
            d = (2 * torch.rand(x.shape, generator=gen, dtype=torch.float64) - 1) * self.eps
            return (x.double() * (1 + d.to(x.device))).to(x.dtype)

        return self.inner(jitter(q), jitter(k), jitter(v), scaling)


def read_logprobs(model, ids: torch.Tensor, specs: dict, sink: int, recent: int, eps: float, seed: int) -> torch.Tensor:
    """Next-token log-probabilities ``[T-1, V]`` of ``ids`` through ``specs``; ``eps`` > 0 perturbs."""
    def make_hook(i):
        hook = MixedCacheHook(specs[i], sink, recent)
        return PerturbedHook(hook, eps, seed * 1000 + i) if eps else hook

    with attention_hooks(model, make_hook), torch.no_grad():
        logits = model(ids[None], use_cache=False).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def compare(clean: torch.Tensor, noisy: torch.Tensor) -> dict:
    """Greedy-token flips between a clean and a perturbed read, their mean KL (nats), and the
    clean read's top-1 margin (log-prob) at the flipped positions."""
    top2 = clean.topk(2, dim=-1).values
    flipped = clean.argmax(-1) != noisy.argmax(-1)
    return {"flips": int(flipped.sum()), "kl_sum": float((clean.exp() * (clean - noisy)).sum(-1).sum()),
            "flip_margins": (top2[flipped, 0] - top2[flipped, 1]).tolist()}


def report(result: dict, meta: dict) -> str:
    rows = []
    for eps in meta["eps"]:
        r = {c: result[f"{c}@{eps}"] for c in ("bf16", "oscar")}
        ratio = r["oscar"]["flip_rate"] / r["bf16"]["flip_rate"] if r["bf16"]["flip_rate"] else math.inf
        rows.append(f"| 2^{math.log2(eps):.0f} | {100 * r['bf16']['flip_rate']:.2f}% "
                    f"| {100 * r['oscar']['flip_rate']:.2f}% "
                    f"| {ratio:.2f}x | {r['bf16']['kl']:.2e} | {r['oscar']['kl']:.2e} "
                    f"| {r['bf16']['median_flip_margin']:.4f} | {r['oscar']['median_flip_margin']:.4f} |")
    return "\n".join([
        "# How much a 2-bit cache amplifies small numerical differences upstream of it", "",
        *report_header(meta),
        f"- rotations: {meta['rotations']} ({meta['method']}); sink {meta['sink']}, recent {meta['recent']}, "
        "read as decode reads (every key beyond the sink and the recent window in 2 bits)",
        f"- {meta['windows']} windows of {meta['context']} tokens of held-out text ({corpus.EVALUATION_NAME}): "
        f"{meta['tokens']:,} predicted positions per read",
        "", "Each layer's q, k and v times (1 + d), d uniform in [-eps, eps], the same draws for both caches. "
        "Flip: the greedy next token differs from the unperturbed read of the same cache; margin: the "
        "unperturbed read's top-1 minus top-2 log-probability where it flipped.", "",
        "| eps | BF16 flips | OSCAR flips | OSCAR / BF16 | BF16 KL | OSCAR KL "
        "| BF16 median margin | OSCAR median margin |",
        "|---|---|---|---|---|---|---|---|", *rows, ""])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_served_arguments(p, "runs/noise_sensitivity")
    p.add_argument("--context", type=int, default=2048, help="tokens a window (default: %(default)s)")
    p.add_argument("--windows", type=int, default=4, help="held-out windows to read (default: %(default)s)")
    p.add_argument("--eps", type=float, nargs="+", default=list(EPS), help="relative perturbations to apply")
    args = p.parse_args()

    loaded, method, oscar = load_served(args)
    specs = {"bf16": layer_specs(METHODS_BY_NAME[REFERENCE], {}, list(oscar)), "oscar": oscar}
    ids = corpus.tokenize(loaded.tokenizer, corpus.evaluation_text())
    windows = full_windows(ids, args.context)[: args.windows]
    sums = {f"{c}@{eps}": {"flips": 0, "kl_sum": 0.0, "flip_margins": []} for c in specs for eps in args.eps}
    tokens = 0
    bar = tqdm(total=len(windows) * len(specs) * (1 + len(args.eps)), desc="reads", unit="read")
    for w, window in enumerate(windows):
        window = window.to(args.device)
        tokens += window.numel() - 1
        for c, spec in specs.items():
            clean = read_logprobs(loaded.model, window, spec, SINK if c == "oscar" else 0,
                                  RECENT if c == "oscar" else 0, 0.0, 0)
            bar.update()
            for eps in args.eps:
                noisy = read_logprobs(loaded.model, window, spec, SINK if c == "oscar" else 0,
                                      RECENT if c == "oscar" else 0, eps, w + 1)
                for key, value in compare(clean, noisy).items():
                    sums[f"{c}@{eps}"][key] += value
                bar.update()
    bar.close()
    result = {name: {"flip_rate": s["flips"] / tokens, "flips": s["flips"], "kl": s["kl_sum"] / tokens,
                     "median_flip_margin": float(torch.tensor(s["flip_margins"]).median()) if s["flip_margins"]
                     else float("nan")} for name, s in sums.items()}
    meta = {**environment("python -m benchmarks.studies.noise_sensitivity"), "model": loaded.name, "dtype": args.dtype,
            "rotations": str(args.rotations), "method": method.name, "sink": SINK, "recent": RECENT,
            "context": args.context, "windows": len(windows), "eps": args.eps, "tokens": tokens}
    save_report(args.out, "noise_sensitivity", {"meta": meta, **result}, report(result, meta), indent=1)


if __name__ == "__main__":
    main()
