"""Key clip ratios fitted with each key's logit error weighted by how much the key is read.

    python -m benchmarks.studies.clip_fit_weights --out results/quality/clip_fit_weights

``oscar-calibrate`` fits each layer's key clip ratio to the mean squared logit error of held-out
keys (``oscar_vllm.calibration.fit.fit_clip_ratios``), every key alike; a retrieval reads one key
far more than the rest, and the fitted clip (0.87-0.93 of the sorted row in SmolLM2) cuts what sets
such a key apart (docs/quality.md). This study fits the same ratios on the same held-out tokens
with each key's error weighted by the value rotation's proxy weights (``k·QᵀQ·k``: its mean squared
logit) or by real softmax weights (``Σ p²`` over the queries), the sink's positions left out (they
are read in BF16), and writes them beside the committed ratios: ``clip_fit_weights.{md,json}``.
"""
from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch

from benchmarks.quality_study import AUSTEN, REPO, Calibrator
from oscar_vllm.calibration.evaluate import environment
from oscar_vllm.calibration.fit import LayerErrorMeasure, LayerStats, best_clip_ratio
from oscar_vllm.calibration.models import load_model
from oscar_vllm.core.rotation_io import load_rotations

WEIGHTS = ("uniform", "proxy", "softmax")
SINK = 64  # positions of each held-out sequence read in BF16 by default: no clip reaches them


def past_sink(stats: LayerStats, sink: int) -> torch.Tensor:
    """Bool ``[T]`` over the held-out sequences' positions: beyond each sequence's first ``sink``."""
    return torch.cat([torch.arange(k.shape[0]) >= sink for k in stats.keys])


def fitted_ratios(stats: LayerStats, key_rotation: torch.Tensor, value_rotation: torch.Tensor,
                  sink: int = SINK) -> dict[str, float]:
    """One layer's key clip ratio under each of ``WEIGHTS`` (fp16 scales, one group a row, as served)."""
    em = LayerErrorMeasure.build(stats, key_rotation, value_rotation)
    keep = past_sink(stats, sink)
    em = LayerErrorMeasure(em.keys[keep], em.values[keep], em.query_moment, em.weights[keep])
    out = {}
    for kind in WEIGHTS:
        w = torch.ones(em.keys.shape[:2], dtype=torch.float64) if kind == "uniform" else \
            stats.value_weights(kind)[keep].double()
        w = w / w.mean(0, keepdim=True).clamp(min=1e-12)
        out[kind] = best_clip_ratio(em.keys, partial(em.key_error, weights=w), None, torch.float16)[0]
    return out


def markdown(rows: list[dict], meta: dict) -> str:
    d = meta["head_dim"]
    lines = ["# Key clip ratios fitted with weighted logit errors: SmolLM2-135M-Instruct", "",
             f"- date: {meta['date']}; hardware: {meta['hardware']}", f"- command: `{meta['command']}`",
             f"- held-out keys: {meta['heldout']:,} Austen tokens after the calibration's, in sequences of 2,048, "
             f"each sequence's first {SINK} positions left out", "",
             "| layer | committed | uniform | proxy-weighted | softmax-weighted |", "|---|---|---|---|---|"]
    lines += [f"| {r['layer']} | {r['committed']:.3f} | " + " | ".join(f"{r[k]:.3f}" for k in WEIGHTS) + " |"
              for r in rows]
    moved = {k: sum(abs(r[k] - r["uniform"]) > 1e-9 for r in rows) for k in WEIGHTS[1:]}
    largest = max(abs(r[k] - r["uniform"]) for r in rows for k in WEIGHTS[1:]) * d
    lines += ["", "Layers whose ratio the weights move from the uniform fit: "
              + ", ".join(f"{k} {n} of {len(rows)}" for k, n in moved.items())
              + f"; largest move {largest:.0f} sorted entries of {d}.", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "clip_fit_weights")
    p.add_argument("--cache", type=Path, default=REPO / "runs" / "quality_cache", help="quality_study's cache")
    args = p.parse_args()
    lm = load_model(device="cpu")
    rot = load_rotations(REPO / "tests" / "data" / "smollm2_rotations", lm.shape)
    heldout = Calibrator(lm, args.cache).capture("austen", AUSTEN.tokens, AUSTEN.heldout, 2048, softmax=True)
    rows = [{"layer": i, "committed": rot.clip_ratio("key", i),
             **fitted_ratios(heldout[i], rot.key.rotations[i], rot.value.rotations[i])}
            for i in range(lm.shape.num_layers)]
    meta = {**{k: environment("python -m benchmarks.studies.clip_fit_weights")[k] for k in ("date", "hardware")},
            "command": "python -m benchmarks.studies.clip_fit_weights --out " + str(args.out),
            "heldout": AUSTEN.heldout, "head_dim": lm.shape.head_dim}
    args.out.mkdir(parents=True, exist_ok=True)
    text = markdown(rows, meta)
    (args.out / "clip_fit_weights.md").write_text(text)
    (args.out / "clip_fit_weights.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
