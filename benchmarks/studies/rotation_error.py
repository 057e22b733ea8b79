"""Does the attention-aware eigenbasis help on this model? The quantity OSCAR optimizes,
measured per rotation.

    python -m benchmarks.studies.rotation_error                    # SmolLM2, ~2 min on 2 CPU cores
    python -m benchmarks.studies.rotation_error --model-path /path/to/Qwen3-8B --device cuda

For identity, the data-free Hadamard and OSCAR's ``U·H·P`` rotations, on held-out tokens
the rotations never saw, it reports the mean over layers of the expected squared logit
error of the INT2 keys and the score-weighted error of the INT2 values
(:class:`oscar_vllm.calibration.fit.LayerErrorMeasure`), for each clip setting and group size.
Writes ``rotation_error.md`` and ``rotation_error.json`` into ``--output-dir``.
"""

import argparse
import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from oscar_vllm.calibration import corpus
from oscar_vllm.calibration.calibrate import DTYPES, capture_stats
from oscar_vllm.calibration.evaluate import environment
from oscar_vllm.calibration.fit import LayerErrorMeasure, build_rotation_sets
from oscar_vllm.calibration.models import load_model
from oscar_vllm.core.rotation_io import hadamard_rotation_sets

CLIPS = {"reference 0.96/0.92": (0.96, 0.92), "none": (0.0, 0.0)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path")
    parser.add_argument("--gguf-file")
    parser.add_argument("--calib-tokens", type=int, default=8192)
    parser.add_argument("--heldout-tokens", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--group-divisors", default="1,4", help="group sizes as head_dim / N")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--output-dir", type=Path, default=Path("results/rotation_error"))
    args = parser.parse_args()

    lm = load_model(args.model_path, args.gguf_file, args.device, DTYPES[args.dtype])
    ids = corpus.tokenize(lm.tokenizer, corpus.calibration_text())
    stats = capture_stats(lm, ids[: args.calib_tokens], args.seq_len, desc="calibration")
    heldout = capture_stats(lm, ids[args.calib_tokens : args.calib_tokens + args.heldout_tokens], args.seq_len,
                            desc="held-out")
    layers = sorted(stats)
    d = lm.shape.head_dim
    key, value = build_rotation_sets(stats)
    had_k, had_v = hadamard_rotation_sets(layers, d)
    rotations = {
        "identity": ({i: torch.eye(d) for i in layers},) * 2,
        "hadamard": (had_k.rotations, had_v.rotations),
        "oscar": (key.rotations, value.rotations),
    }
    rows = []
    for name, (rk, rv) in tqdm(rotations.items(), desc="rotations"):
        measures = [LayerErrorMeasure.build(heldout[i], rk[i], rv[i]) for i in layers]
        for div in (int(x) for x in args.group_divisors.split(",")):
            for clip_name, (ck, cv) in CLIPS.items():
                errs = [m.errors(ck, cv, d // div) for m in measures]
                rows.append({
                    "rotation": name, "group": d // div, "clip": clip_name,
                    "key_error": sum(e[0] for e in errs) / len(errs),
                    "value_error": sum(e[1] for e in errs) / len(errs),
                })
    meta = {**environment("python -m benchmarks.studies.rotation_error"), "model": lm.name,
            "calib_tokens": args.calib_tokens, "heldout_tokens": args.heldout_tokens}
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "rotation_error.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    base = {(r["group"], r["clip"]): r for r in rows if r["rotation"] == "hadamard"}
    lines = [
        f"# INT2 error by rotation: {meta['model']}",
        "",
        f"- date: {meta['date']}; hardware: {meta['hardware']}; command: `{meta['command']}`",
        f"- rotations from {args.calib_tokens} tokens, errors on {args.heldout_tokens} held-out tokens of "
        f"{corpus.CALIBRATION_NAME}; mean over {len(layers)} layers; fp16 scale/zero",
        "- key error: E[(q'·Δk')²] per token; value error: score-weighted Σ‖Δv'‖² per token; "
        "in parentheses, relative to Hadamard with the same group and clip (lower is better)",
        "",
        "| rotation | group | clip | key error | value error |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        b = base[(r["group"], r["clip"])]
        lines.append(
            f"| {r['rotation']} | {r['group']} | {r['clip']} "
            f"| {r['key_error']:.4g} ({r['key_error'] / b['key_error']:.3f}) "
            f"| {r['value_error']:.4g} ({r['value_error'] / b['value_error']:.3f}) |"
        )
    (args.output_dir / "rotation_error.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
