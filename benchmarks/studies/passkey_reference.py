"""Passkey retrieval through the reference cache: which cache forms find the key where BF16 does.

    python -m benchmarks.studies.passkey_reference --lengths 2048 4096 --out runs/passkey_reference

The prompts are ``benchmarks/quality_vllm.py``'s (a five-digit key at five depths of filler, then the
question). Each prompt and its key's answer tokens go through SmolLM2 once per cache form,
teacher-forced and prefilled in chunks of 256 as vLLM reads them: greedy decoding writes the key
exactly when every answer token is the argmax at its position, so "found" here is greedy's verdict
without a decode loop (the answer's positions read the cache as the prompt's last chunk does, not
as a decode step: a near miss can differ). Writes ``passkey.json`` and ``passkey.md``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from contextlib import nullcontext
from pathlib import Path

import torch
from tqdm.auto import tqdm

from benchmarks import quality_vllm
from benchmarks.quality_vllm import PASSKEY_KEYS, PASSKEY_LENGTHS, passkey_prompts
from oscar_vllm.calibration.evaluate import DTYPES, METHODS_BY_NAME, environment, layer_specs
from oscar_vllm.calibration.models import MixedCacheHook, attention_hooks, load_model, rope_tables
from oscar_vllm.core.rotation_io import load_rotations

SINK, RECENT = 64, 256  # the BF16 windows, as served by default
CHUNK = quality_vllm.CHUNK  # prompts prefilled in chunks of this many tokens, as the vLLM run did
DEFAULT_METHODS = ("bf16", "oscar-int2-fit-debiased-half", "oscar-int2-fit-key-mean",
                   "oscar-int2-fit-key-mean-debiased-half", "oscar-int2-fit-key-mean16")
# The served block mean with the previous default's logit correction: not a row of evaluate's tables.
STUDY_METHODS = {"oscar-int2-fit-key-mean-debiased-half": dataclasses.replace(
    METHODS_BY_NAME["oscar-int2-fit-key-mean"], name="oscar-int2-fit-key-mean-debiased-half", logit_correction=0.5)}


def answer_ids(tokenizer, key: int) -> list[int]:
    return tokenizer.encode(f" {key}", add_special_tokens=False)


@torch.no_grad()
def found(loaded, specs, ids: list[int], answer: list[int], device: str) -> tuple[bool, int]:
    """Greedy's verdict on ``answer`` after ``ids`` through ``specs`` (None: BF16 attention as the
    model computes it), and how many answer tokens in a row were the argmax."""
    seq = torch.tensor([ids + answer], device=device)
    with (nullcontext() if specs is None else
          attention_hooks(loaded.model, lambda i: MixedCacheHook(specs[i], SINK, RECENT, CHUNK))):
        logits = loaded.model(seq, use_cache=False).logits[0]
    picked = logits[len(ids) - 1: len(ids) + len(answer) - 1].argmax(-1).tolist()
    run = next((i for i, (a, b) in enumerate(zip(picked, answer)) if a != b), len(answer))
    return run == len(answer), run


def markdown(rows: dict[str, list[dict]], meta: dict) -> str:
    ref = [r["found"] for r in rows["bf16"]]
    lines = [f"- date: {meta['date']}; hardware: {meta['hardware']}; command: `{meta['command']}`", "",
             "| cache | found | where BF16 finds it | mean answer tokens right |", "|---|---|---|---|"]
    for name, rs in rows.items():
        mine = [r["found"] for r in rs]
        lines.append(f"| {name} | {sum(mine)} of {len(mine)} | {sum(a and b for a, b in zip(mine, ref))} of "
                     f"{sum(ref)} | {sum(r['run'] for r in rs) / len(rs):.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rotations", type=Path, default=Path("tests/data/smollm2_rotations"))
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS))
    p.add_argument("--lengths", nargs="+", type=int, default=list(PASSKEY_LENGTHS))
    p.add_argument("--key-clips", nargs="*", type=float, default=[],
                   help="each INT2 method again with its keys clipped at each ratio (1: no clip)")
    p.add_argument("--keys", type=int, default=len(PASSKEY_KEYS), help="the first this many keys at each depth")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--out", type=Path, default=Path("runs/passkey_reference"))
    args = p.parse_args()
    loaded = load_model(None, None, args.device, DTYPES[args.dtype])
    rope = rope_tables(loaded, max(args.lengths) + 64)
    rotations = {"oscar": load_rotations(args.rotations, loaded.shape)}
    layers = list(range(loaded.shape.num_layers))
    methods = {**METHODS_BY_NAME, **STUDY_METHODS}
    specs = {m: None if m == "bf16" else layer_specs(methods[m], rotations, layers, rope) for m in args.methods}
    for m in [m for m in args.methods if m != "bf16"]:
        for ratio in args.key_clips:  # the method's keys clipped at one ratio instead of its own
            specs[f"{m}, key clip {ratio:g}"] = {
                i: dataclasses.replace(sp, key_quant=dataclasses.replace(sp.key_quant, clip_ratio=ratio))
                for i, sp in specs[m].items()}
    prompts = [q for q in passkey_prompts(loaded.tokenizer)
               if q["length"] in args.lengths and q["key"] in PASSKEY_KEYS[:args.keys]]
    rows: dict[str, list[dict]] = {m: [] for m in specs}
    for q in tqdm(prompts, desc="passkeys", unit="prompt"):
        answer = answer_ids(loaded.tokenizer, q["key"])
        for m in specs:
            ok, run = found(loaded, specs[m], q["ids"], answer, args.device)
            rows[m].append({"length": q["length"], "depth": q["depth"], "key": q["key"], "found": ok, "run": run})
    meta = environment("python -m benchmarks.studies.passkey_reference")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "passkey.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    text = markdown(rows, meta)
    (args.out / "passkey.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
