"""Calibration CLI: compute OSCAR rotations (and fitted clip ratios) for a model.

    oscar-calibrate --model-path PATH --calib-tokens 8192 --output-dir DIR [--per-head]
    oscar-calibrate --model-path PATH --from-rotations ZOO_DIR --output-dir DIR
    python -m oscar_vllm.calibration.calibrate --gguf-file model.gguf --output-dir DIR

Runs the model in transformers over calibration text, captures per layer the queries
and keys after q/k norm and RoPE and the values, builds ``R_K`` from ``C_Q`` and ``R_V``
from ``C_S``, fits per-layer clip ratios on held-out tokens the rotations never saw, takes each
KV head's mean key before RoPE (past the sink's positions; ``oscar_vllm.core.key_mean``), and
writes both rotation files with their metadata. Without ``--model-path``/``--gguf-file``
it calibrates the embedded default, SmolLM2-135M-Instruct.

``--from-rotations DIR`` keeps the rotations of DIR (published RotationZoo files, or ours) and adds
what the published files lack and the backend serves best with: clip ratios fitted to them on the
held-out tokens, and the key means (the backend's default takes keys less their block's mean).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from oscar_vllm.calibration import corpus
from oscar_vllm.calibration.fit import (
    VALUE_WEIGHTS,
    LayerStats,
    build_rotation_sets,
    fit_clip_ratios,
)
from oscar_vllm.calibration.models import (
    CaptureHook,
    LoadedModel,
    ModelError,
    add_model_arguments,
    attention_hooks,
    load_model,
    rope_tables,
)
from oscar_vllm.core.atomic_output import atomic_output_dir, check_replaceable
from oscar_vllm.core.errors import DEBUG_FLAG, DEBUG_HELP, OscarError, cli
from oscar_vllm.core.key_mean import pre_rope_mean
from oscar_vllm.core.quant import PARAM_DTYPES, param_dtype_from_name
from oscar_vllm.core.rotation_io import OscarRotations, load_rotations, save_rotations, validate_rotations
from oscar_vllm.core.settings import OscarSettings

logger = logging.getLogger(__name__)

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def split_sequences(token_ids: torch.Tensor, seq_len: int) -> list[torch.Tensor]:
    """Cut a 1-D token stream into consecutive sequences of at most ``seq_len``."""
    return [token_ids[i : i + seq_len] for i in range(0, token_ids.numel(), seq_len)]


def full_windows(token_ids: torch.Tensor, seq_len: int) -> list[torch.Tensor]:
    """The consecutive windows of exactly ``seq_len`` tokens (a shorter tail is dropped)."""
    return [w for w in split_sequences(token_ids, seq_len) if w.numel() == seq_len]


@torch.no_grad()
def capture_stats(
    loaded: LoadedModel,
    token_ids: torch.Tensor,
    seq_len: int,
    score_weights: bool = False,
    desc: str = "capturing q/k/v",
) -> dict[int, LayerStats]:
    """Run ``token_ids`` through the model in ``seq_len`` pieces; per-layer statistics."""
    stats = {}

    def make_hook(layer_idx: int) -> CaptureHook:
        stats[layer_idx] = LayerStats(loaded.shape.num_kv_heads)
        return CaptureHook(stats[layer_idx], score_weights)

    device = next(loaded.model.parameters()).device
    with attention_hooks(loaded.model, make_hook):
        for seq in tqdm(split_sequences(token_ids, seq_len), desc=desc, unit="seq"):
            loaded.model(seq[None].to(device), use_cache=False)
    return stats


def key_means_from_stats(loaded: LoadedModel, stats: dict[int, LayerStats],
                         skip: int) -> dict[int, torch.Tensor] | None:
    """Each layer's mean key before RoPE ``[Hkv, d]`` over the calibration sequences, their first
    ``skip`` positions left out (the sink holds those in BF16), turned back with the model's own
    RoPE table; None, with the reason logged, where the model's RoPE is not the rotate-half form
    over the whole head that ``core.key_mean`` takes (the means would be wrong, not missing)."""
    longest = max(k.shape[0] for st in stats.values() for k in st.keys)
    try:
        cos, sin = rope_tables(loaded, longest)
    except ModelError as e:
        logger.warning("no key means: %s", e)
        return None
    d = loaded.shape.head_dim
    if cos.shape[-1] != d or not torch.equal(cos[:, : d // 2], cos[:, d // 2:]):
        logger.warning("no key means: %s's RoPE table is not rotate-half over all %d dims", loaded.name, d)
        return None
    if longest <= skip:
        raise OscarError(f"calibration sequences of {longest} tokens leave no key past the first {skip} "
                         "to average; raise --seq-len or lower --key-mean-skip")
    return {i: pre_rope_mean(st.keys, cos, sin, skip).float() for i, st in stats.items()}


def completed_rotations(
    loaded: LoadedModel,
    base: OscarRotations,
    stats: dict[int, LayerStats],
    heldout: dict[int, LayerStats] | None,
    value_weights: str = "proxy",
    group_size: int | None = None,
    param_dtype: torch.dtype = torch.float16,
    calibration_info: dict | None = None,
    key_mean_skip: int | None = None,
) -> OscarRotations:
    """``base``'s rotations for ``loaded``, with clip ratios fitted to them on ``heldout`` (where
    given; else ``base``'s own) and key means from ``stats`` (where ``key_mean_skip`` is given; else
    ``base``'s), validated against the model."""
    info = {**base.calibration, **(calibration_info or {}), "tokens": next(iter(stats.values())).num_tokens}
    key_means = base.key_means if key_mean_skip is None else key_means_from_stats(loaded, stats, key_mean_skip)
    if key_mean_skip is not None and key_means is not None:
        info["key_mean_skip"] = key_mean_skip
    rot = OscarRotations(
        key=base.key, value=base.value, clip_ratios_k=base.clip_ratios_k, clip_ratios_v=base.clip_ratios_v,
        model=loaded.name, model_fingerprint=dict(loaded.shape.fingerprint), calibration=info, key_means=key_means,
    )
    if heldout is not None:
        rot.clip_ratios_k, rot.clip_ratios_v, report = fit_clip_ratios(
            base.key, base.value, heldout, value_weights, group_size, param_dtype
        )
        info["clip_fit"] = report
    validate_rotations(rot, loaded.shape)
    return rot


def rotations_from_stats(
    loaded: LoadedModel,
    stats: dict[int, LayerStats],
    heldout: dict[int, LayerStats] | None,
    per_head: bool = False,
    value_weights: str = "proxy",
    group_size: int | None = None,
    param_dtype: torch.dtype = torch.float16,
    calibration_info: dict | None = None,
    key_mean_skip: int | None = None,
) -> OscarRotations:
    """OSCAR rotations from captured statistics; clip ratios fitted when ``heldout`` is given,
    key means taken when ``key_mean_skip`` is (``key_means_from_stats``)."""
    key, value = build_rotation_sets(stats, per_head, value_weights)
    info = {**(calibration_info or {}), "per_head": per_head, "value_weights": value_weights}
    return completed_rotations(loaded, OscarRotations(key, value), stats, heldout, value_weights, group_size,
                               param_dtype, info, key_mean_skip)


class OneLineParser(argparse.ArgumentParser):
    """Its errors (a missing or malformed argument) as the CLI's others: one line, ``error: ...``, exit 1."""

    def error(self, message: str):
        raise OscarError(f"{message} (oscar-calibrate --help lists the options)")


def at_least(minimum: int):
    """An argparse type: a whole number >= ``minimum``, refused at parsing (a count of -5 would
    otherwise slice the corpus from its end, and run for hours)."""

    def whole_number(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {minimum} or more, got {value}")
        return value

    return whole_number


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="oscar-calibrate", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--output-dir", required=True, type=Path,
                        help="the folder to write the rotation files into (required, no default)")
    parser.add_argument("--calib-tokens", type=at_least(1), default=8192,
                        help="tokens for the rotations (default: %(default)s)")
    parser.add_argument("--heldout-tokens", type=at_least(0), default=2048,
                        help="further tokens, unseen by the rotations, to fit the clip ratios; 0 keeps the "
                             "reference ratios (default: %(default)s)")
    parser.add_argument("--seq-len", type=at_least(1), default=2048,
                        help="calibration sequence length (default: %(default)s)")
    parser.add_argument("--per-head", action="store_true",
                        help="one rotation per KV head, RotationZoo format 2 (default: one per layer)")
    parser.add_argument("--from-rotations", type=Path, metavar="DIR",
                        help="keep the rotations of DIR (published RotationZoo files, or ours) and add fitted clip "
                             "ratios and key means, which published files lack (default: compute new rotations)")
    parser.add_argument("--value-weights", choices=VALUE_WEIGHTS, default="proxy",
                        help="C_S token weights: the reference's proxy or true softmax scores (default: %(default)s)")
    parser.add_argument("--corpus", type=Path,
                        help="a UTF-8 text file to calibrate on (default: the embedded corpus, Jane Austen)")
    parser.add_argument("--group-size", type=at_least(1),
                        help="quantization group for the clip fit (default: head_dim)")
    parser.add_argument("--key-mean-skip", type=int, default=OscarSettings.sink_size,
                        help="the key means leave out each sequence's first positions, which the sink holds in "
                             "BF16; -1 takes no key means (default: %(default)s, the default sink)")
    parser.add_argument("--scale-dtype", choices=sorted(PARAM_DTYPES), default="fp16",
                        help="scale and min dtype the clip fit assumes (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default: %(default)s)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="model compute dtype (default: %(default)s)")
    parser.add_argument(DEBUG_FLAG, action="store_true", help=DEBUG_HELP)
    return parser


def read_corpus(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise OscarError(f"{path}: cannot read the --corpus file ({e.strerror or e})") from e
    except UnicodeDecodeError as e:
        raise OscarError(f"{path}: the --corpus file is not UTF-8 text ({e.reason} at byte {e.start})") from e


@cli
def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    t0 = time.time()
    check_replaceable(args.output_dir)  # before minutes of calibration, not after
    if args.from_rotations is not None and args.per_head:
        raise OscarError("--per-head computes new rotations; --from-rotations keeps DIR's as they are: give one")
    base = None if args.from_rotations is None else load_rotations(args.from_rotations)  # its errors before the model
    text, corpus_name = (  # before the model loads, so a missing text fails at once
        (read_corpus(args.corpus), str(args.corpus))
        if args.corpus else (corpus.calibration_text(), corpus.CALIBRATION_NAME)
    )
    loaded = load_model(args.model_path, args.gguf_file, args.device, DTYPES[args.dtype])
    ids = corpus.tokenize(loaded.tokenizer, text)
    need = args.calib_tokens + args.heldout_tokens
    if ids.numel() < need:
        raise OscarError(f"{corpus_name} has {ids.numel()} tokens; --calib-tokens + --heldout-tokens need {need}")
    softmax = args.value_weights == "softmax"
    stats = capture_stats(loaded, ids[: args.calib_tokens], args.seq_len, softmax, "calibration")
    heldout = None
    if args.heldout_tokens:
        heldout = capture_stats(loaded, ids[args.calib_tokens : need], args.seq_len, softmax, "held-out")
    info = {"corpus": corpus_name, "seq_len": args.seq_len, "heldout_tokens": args.heldout_tokens}
    skip = None if args.key_mean_skip < 0 else args.key_mean_skip
    if base is None:
        rot = rotations_from_stats(loaded, stats, heldout, args.per_head, args.value_weights, args.group_size,
                                   param_dtype_from_name(args.scale_dtype), info, key_mean_skip=skip)
    else:
        validate_rotations(base, loaded.shape)  # the rotations are for this model
        rot = completed_rotations(loaded, base, stats, heldout, args.value_weights, args.group_size,
                                  param_dtype_from_name(args.scale_dtype),
                                  {**info, "rotations_from": f"{args.from_rotations} ({base.source_format})"},
                                  key_mean_skip=skip)
    with atomic_output_dir(args.output_dir) as tmp:  # killed at any moment: the old folder, or none
        save_rotations(rot, tmp)
    out = args.output_dir
    logger.info("wrote rotations for %s (%d layers) to %s in %.0f s", loaded.name, len(rot.layer_ids), out,
                time.time() - t0)
    if rot.clip_ratios_k is not None:
        fit = rot.calibration["clip_fit"]
        logger.info(
            "fitted clip ratios: keys %.3f..%.3f (error %.2fx the reference 0.96), values %.3f..%.3f (%.2fx of 0.92)",
            min(rot.clip_ratios_k), max(rot.clip_ratios_k), fit["error_vs_reference_key"],
            min(rot.clip_ratios_v), max(rot.clip_ratios_v), fit["error_vs_reference_value"],
        )


if __name__ == "__main__":
    main()
