"""Key clip ratios fitted to attention itself: the KL between each query's softmax over the exact
keys and over the keys as the cache serves them.

    python -m benchmarks.studies.clip_fit_attention --out runs/clip_fit_attention

``oscar-calibrate`` fits each layer's key clip ratio to the mean squared logit error of held-out
keys, every key alike, and the ratios it finds (0.87-0.93 in SmolLM2) cut what sets a retrieved key
apart (docs/quality.md). Here each candidate ratio is scored by what attention does with it: on
held-out tokens (the calibration's clip-fit tokens), each layer's keys rotated, rounded to INT2
(fp16 scales) and turned back wherever the cache holds them in INT2 for a query (past the sink,
older than the recent window), the mean over queries and query heads of KL(softmax over the exact
logits ‖ softmax over those). Two forms: the keys as they are, and the keys less their block's
mean (``key_mean``, the mean added back exactly). Writes ``clip_fit_attention.{md,json}`` and, per
form, a rotation folder with the committed rotations and the fitted key clips
(``rotations-keys/``, ``rotations-key-mean/``) for ``passkey_reference`` and ``oscar-evaluate``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from benchmarks.quality_study import AUSTEN, REPO, Calibrator
from oscar_vllm.calibration.evaluate import METHODS_BY_NAME, environment, method_key_mean
from oscar_vllm.calibration.fit import clip_candidates
from oscar_vllm.calibration.models import attention_hooks, load_model, rope_tables
from oscar_vllm.core.quant import fake_quantize_int2
from oscar_vllm.core.rotation import apply_rotation
from oscar_vllm.core.rotation_io import load_rotations, save_rotations

SINK, RECENT = 64, 256  # the BF16 windows as served by default
FORMS = ("keys", "key-mean")


class QueryKeyCapture:
    """Records one layer's post-RoPE queries and keys, then runs plain attention."""

    def __init__(self, out: dict, layer: int):
        self.out, self.layer = out, layer

    def __call__(self, q, k, v, scaling):
        self.out[self.layer] = (q.detach().float().cpu(), k.detach().float().cpu(), scaling)
        g = q.shape[1] // k.shape[1]
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(g, 0), v.transpose(0, 1).repeat_interleave(g, 0),
            is_causal=True, scale=scaling)
        return o.transpose(0, 1)


def int2_mask(t: int, sink: int, recent: int) -> torch.Tensor:
    """Bool ``[T, T]``: query i reads key j from the INT2 pages (past the sink, older than its recent
    window of ``recent`` positions, itself included)."""
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    return (j >= sink) & (j <= i - recent)


class AttentionKL:
    """One layer's queries and exact keys on held-out tokens: :meth:`__call__` scores keys as a cache
    gives them back by the mean KL(softmax over the exact logits ‖ softmax over the cache's where it
    holds INT2, the exact logits elsewhere), over every query that reads an INT2 key and every query
    head. q ``[T, Hq, d]``, k ``[T, Hkv, d]``; fp32 (KL differences between clips are far larger
    than its rounding)."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, scale: float, sink: int = SINK, recent: int = RECENT):
        t = q.shape[0]
        self.g, self.scale = q.shape[1] // k.shape[1], scale
        self.rows = torch.arange(t) >= sink + recent  # queries that read an INT2 key
        self.q = q.float().transpose(0, 1)[:, self.rows]  # [Hq, R, d]
        self.int2 = int2_mask(t, sink, recent)[self.rows]  # [R, T]
        causal = torch.ones(t, t, dtype=torch.bool).tril()[self.rows]
        self.exact = (self.q @ self.keys(k)).masked_fill(~causal, float("-inf"))
        self.logp = torch.log_softmax(self.exact, -1)

    def keys(self, k: torch.Tensor) -> torch.Tensor:
        return k.float().repeat_interleave(self.g, 1).permute(1, 2, 0) * self.scale  # [Hq, d, T]

    def __call__(self, k_cache: torch.Tensor) -> float:
        mixed = torch.where(self.int2, self.q @ self.keys(k_cache), self.exact)
        kl = (self.logp.exp() * (self.logp - torch.log_softmax(mixed, -1))).nan_to_num(0.0).sum(-1)
        return kl.mean().item()


def served_keys(k: torch.Tensor, rotation: torch.Tensor, ratio: float, mean: torch.Tensor | None) -> torch.Tensor:
    """``k`` ``[T, Hkv, d]`` as the INT2 pages give it back: less ``mean`` (``[T, Hkv, d]``, or None),
    rotated, clipped at ``ratio`` and rounded (fp16 scale and minimum), turned back, the mean added."""
    base = (k if mean is None else k - mean).double()
    rotated = apply_rotation(base, rotation)
    back = apply_rotation(fake_quantize_int2(rotated, ratio, None, torch.float16).double(), rotation.transpose(-1, -2))
    return back if mean is None else back + mean.double()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "clip_fit_attention")
    p.add_argument("--cache", type=Path, default=REPO / "runs" / "quality_cache", help="quality_study's cache")
    p.add_argument("--rotations", type=Path, default=REPO / "tests" / "data" / "smollm2_rotations")
    args = p.parse_args()
    lm = load_model(device="cpu")
    rot = load_rotations(args.rotations, lm.shape)
    ids = Calibrator(lm, args.cache).tokens("austen")[AUSTEN.tokens:AUSTEN.tokens + AUSTEN.heldout]
    captured: dict[int, tuple] = {}
    with torch.no_grad(), attention_hooks(lm.model, lambda i: QueryKeyCapture(captured, i)):
        lm.model(ids[None], use_cache=False)
    cos, sin = rope_tables(lm, ids.numel())
    block_mean = METHODS_BY_NAME["oscar-int2-fit-key-mean"]
    rows, fitted = [], {form: [] for form in FORMS}
    for i in tqdm(range(lm.shape.num_layers), desc="layers"):
        q, k, scale = captured[i]
        attention_kl = AttentionKL(q, k, scale)
        means = {"keys": None, "key-mean": method_key_mean(block_mean, rot.key_means[i], (cos, sin)).at(k.shape[0])}
        row = {"layer": i, "committed": rot.clip_ratio("key", i)}
        for form in FORMS:
            kl = {c: attention_kl(served_keys(k, rot.key.rotations[i], c, means[form]))
                  for c in [*clip_candidates(lm.shape.head_dim), 1.0]}
            best = min(kl, key=kl.get)
            fitted[form].append(best)
            nearest = {r: min(kl, key=lambda c: abs(c - r)) for r in (row["committed"], 0.96)}
            row[form] = {"best": best, "kl_best": kl[best], "kl_committed": kl[nearest[row["committed"]]],
                         "kl_096": kl[nearest[0.96]], "kl": {f"{c:.4f}": v for c, v in kl.items()}}
        rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    for form in FORMS:
        save_rotations(dataclasses.replace(rot, clip_ratios_k=fitted[form]), args.out / f"rotations-{form}")
    meta = {**{k: environment("python -m benchmarks.studies.clip_fit_attention")[k] for k in ("date", "hardware")},
            "command": f"python -m benchmarks.studies.clip_fit_attention --out {args.out}",
            "heldout": ids.numel(), "head_dim": lm.shape.head_dim, "sink": SINK, "recent": RECENT}
    lines = ["# Key clip ratios fitted to attention's KL: SmolLM2-135M-Instruct", "",
             f"- date: {meta['date']}; hardware: {meta['hardware']}", f"- command: `{meta['command']}`",
             f"- {meta['heldout']:,} held-out Austen tokens (the calibration's clip-fit tokens), one sequence; keys "
             f"read from INT2 past the sink ({SINK}) and older than the recent window ({RECENT}); KL over the queries "
             f"from position {SINK + RECENT} on, every query head", "",
             "| layer | committed (logit MSE) | keys: KL-best | KL there / at committed / at 0.96 (x1e-3) "
             "| less block mean: KL-best | KL there / at committed / at 0.96 (x1e-3) |", "|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[f]['best']:.3f} | {1e3 * r[f]['kl_best']:.2f} / {1e3 * r[f]['kl_committed']:.2f} / "
                 f"{1e3 * r[f]['kl_096']:.2f}" for f in FORMS]
        lines.append(f"| {r['layer']} | {r['committed']:.3f} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    (args.out / "clip_fit_attention.md").write_text(text)
    (args.out / "clip_fit_attention.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
