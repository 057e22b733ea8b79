"""Greedy generation from SmolLM2 with a BF16 cache and with a simulated OSCAR INT2 cache.

    python examples/generate_with_int2_cache.py [--rotations DIR] [--new-tokens 40]

The prompt is ~600 tokens of the evaluation text, so most of it sits in the INT2 part of the
cache (beyond the 64-token sink, outside the 256-token recent window) while the model
writes. Without --rotations it calibrates on 4,096 tokens first (about a minute on a CPU).
Every step recomputes the whole sequence through the simulated cache: slow, but exactly the
numbers a decoding INT2 cache would give.
"""

import argparse

import torch

from oscar_vllm.calibration import corpus
from oscar_vllm.calibration.calibrate import capture_stats, rotations_from_stats
from oscar_vllm.calibration.models import MixedCacheHook, attention_hooks, load_model
from oscar_vllm.core.mixed_cache import LayerCacheSpec, RowQuantizer
from oscar_vllm.core.rotation_io import load_rotations


@torch.no_grad()
def generate(model, ids, new_tokens, spec_of_layer, sink=64, recent=256):
    with attention_hooks(model, lambda i: MixedCacheHook(spec_of_layer(i), sink, recent)):
        for _ in range(new_tokens):
            next_id = model(ids[None], use_cache=False).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id[None]])
    return ids


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rotations",
                        help="a rotation folder, ours or RotationZoo, e.g. tests/data/smollm2_rotations "
                             "(default: calibrate now)")
    parser.add_argument("--new-tokens", type=int, default=40, help="greedy tokens per cache (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default: %(default)s)")
    args = parser.parse_args()

    lm = load_model(device=args.device)
    if args.rotations:
        rot = load_rotations(args.rotations, lm.shape)
    else:
        calib = corpus.tokenize(lm.tokenizer, corpus.calibration_text())
        rot = rotations_from_stats(lm, capture_stats(lm, calib[:4096], 2048), capture_stats(lm, calib[4096:6144], 2048))
    prompt = corpus.tokenize(lm.tokenizer, corpus.evaluation_text())[:600]

    def bf16(i):
        return LayerCacheSpec(None, None, RowQuantizer("bf16"), RowQuantizer("bf16"))

    def oscar(i):
        return LayerCacheSpec(
            rot.key.rotations[i], rot.value.rotations[i],
            RowQuantizer("int2", rot.clip_ratio("key", i)), RowQuantizer("int2", rot.clip_ratio("value", i)),
        )

    print("...", lm.tokenizer.decode(prompt[-60:].tolist()))
    for name, spec in (("BF16 cache", bf16), ("OSCAR INT2 cache", oscar)):
        out = generate(lm.model, prompt.to(args.device), args.new_tokens, spec)
        print(f"\n[{name}]", lm.tokenizer.decode(out[len(prompt) :].tolist()))


if __name__ == "__main__":
    main()
