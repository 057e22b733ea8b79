"""``oscar-vllm serve MODEL --oscar-rotation-path DIR ...``: ``vllm serve`` with the OSCAR
backend selected and the ``--oscar-*`` flags turned into ``--additional-config``.

Every other argument goes to ``vllm serve`` unchanged; an ``--additional-config`` given
too is merged (its own ``oscar`` entries win over nothing: a setting given both ways is an
error, so no flag is silently ignored).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from oscar_vllm.settings import ADDITIONAL_CONFIG_KEY, OscarSettings

# vLLM's default on an H200 is 1024 running requests. Each one holds BF16 windows in every
# layer (47 MB for Qwen3-8B), so the wrapper starts lower unless told otherwise.
DEFAULT_MAX_NUM_SEQS = "256"

FLAGS = {
    "--oscar-rotation-path": ("rotation_path", str),
    "--oscar-sink-size": ("sink_size", int),
    "--oscar-recent-size": ("recent_size", int),
    "--oscar-clip-ratio-k": ("clip_ratio_k", float),
    "--oscar-clip-ratio-v": ("clip_ratio_v", float),
    "--oscar-scale-dtype": ("scale_dtype", str),
}


def build_vllm_argv(argv: list[str]) -> list[str]:
    """``oscar-vllm`` arguments -> ``vllm`` arguments (``serve MODEL ... --attention-backend OSCAR``)."""
    parser = argparse.ArgumentParser(prog="oscar-vllm", add_help=False)
    for flag, (_, kind) in FLAGS.items():
        parser.add_argument(flag, type=kind)
    parser.add_argument("--additional-config", default=None)
    parser.add_argument("--attention-backend", default=None)
    ours, rest = parser.parse_known_args(argv)
    if not rest or rest[0] != "serve":
        raise SystemExit("usage: oscar-vllm serve MODEL [--oscar-rotation-path DIR] [--oscar-sink-size N] "
                         "[--oscar-recent-size N] [vllm serve arguments...]")
    if ours.attention_backend not in (None, "OSCAR"):
        raise SystemExit(f"oscar-vllm serves with the OSCAR backend, not {ours.attention_backend}")
    extra = json.loads(ours.additional_config) if ours.additional_config else {}
    oscar = dict(extra.get(ADDITIONAL_CONFIG_KEY) or {})
    for flag, (name, _) in FLAGS.items():
        value = getattr(ours, flag[2:].replace("-", "_"))
        if value is None:
            continue
        if name in oscar:
            raise SystemExit(f"{flag} and --additional-config both set {name}")
        oscar[name] = value
    OscarSettings.from_sources({ADDITIONAL_CONFIG_KEY: oscar}, environ={})  # fail here, not in a worker
    extra[ADDITIONAL_CONFIG_KEY] = oscar
    if not any(a == "--max-num-seqs" or a.startswith("--max-num-seqs=") for a in rest):
        rest = [*rest, "--max-num-seqs", DEFAULT_MAX_NUM_SEQS]
    return [*rest, "--attention-backend", "OSCAR", "--additional-config", json.dumps(extra)]


def main(argv: list[str] | None = None) -> None:
    vllm_argv = build_vllm_argv(sys.argv[1:] if argv is None else argv)
    # The request rows OSCAR keys its windows on come from the V2 model runner.
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *vllm_argv]
    vllm_main()


if __name__ == "__main__":
    main()
