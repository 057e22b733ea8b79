"""``oscar-vllm serve MODEL --oscar-rotation-path DIR ...``: ``vllm serve`` with the OSCAR
backend selected and the ``--oscar-*`` flags turned into ``--additional-config``.

Every other argument goes to ``vllm serve`` unchanged; an ``--additional-config`` given
too is merged (its own ``oscar`` entries win over nothing: a setting given both ways is an
error, so no flag is silently ignored).

Before vLLM loads (it takes seconds, and on a machine without a CUDA GPU it stops with a
traceback), what the user can fix whatever the machine is checked, and refused in one line: the
model argument, the settings (the flags, ``--additional-config`` and the ``OSCAR_*`` variables, as
every vLLM process reads them) and a local rotation folder (its files read and validated); then
the GPU: none, or one the backend cannot serve on (``oscar_vllm.serving.gpu``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from typing import Mapping

from oscar_vllm.core.errors import DEBUG_FLAG, DEBUG_HELP, cli
from oscar_vllm.core.settings import ADDITIONAL_CONFIG_KEY, DECODE_KERNELS, OscarSettings, OscarSettingsError
from oscar_vllm.serving.gpu import check_gpu

FLAGS = {
    "--oscar-rotation-path": ("rotation_path", str, "DIR",
                              "rotation folder, hf://ORG/REPO[/SUB][@REV], or 'hadamard' (no default: required)"),
    "--oscar-sink-size": ("sink_size", int, "N", "first tokens kept in BF16 (default: 64)"),
    "--oscar-recent-size": ("recent_size", int, "N", "last tokens kept in BF16 (default: 256)"),
    "--oscar-clip-ratio-k": ("clip_ratio_k", float, "R",
                             "INT2 key clip ratio (default: the rotation file's, else 0.96)"),
    "--oscar-clip-ratio-v": ("clip_ratio_v", float, "R",
                             "INT2 value clip ratio (default: the rotation file's, else 0.92)"),
    "--oscar-scale-dtype": ("scale_dtype", str, "{fp16,bf16}", "INT2 scale and min dtype (default: fp16)"),
    "--oscar-logit-correction": ("logit_correction", float, "L",
                                 "INT2 keys' logits lowered by L/2 times their rounding variance; 0: off "
                                 "(default: 0.5, and 0 where the keys are rounded less their mean)"),
    "--oscar-prefill-read": ("prefill_read", str, "{chunk,decode}",
                             "prefill queries read their own chunk in BF16 (chunk), or only the last "
                             "recent-size positions, as decode does: replies independent of vLLM's schedule "
                             "(default: chunk)"),
    "--oscar-decode-splits": ("decode_splits", int, "N",
                              "programs each decode request's keys are split over: 0 chooses per batch, a "
                              "power of two fixes it, so a request's decode does not depend on its batch "
                              "(default: 0)"),
    "--oscar-hit-ring": ("hit_ring", str, "{recompute,reuse}",
                         "a prefix-cache hit computes its BF16 recent window again (recompute), or copies "
                         "the ring an earlier request of the prefix left, where one is cached (reuse) "
                         "(default: recompute)"),
    "--oscar-key-mean": ("key_mean", str, "{off,on,auto}",
                         "INT2 pages hold keys less their block's mean (on; the rotation file's means, which "
                         "oscar-calibrate writes), each head's 16 strongest RoPE pairs; auto: where the file has "
                         "means (default: auto)"),
    "--oscar-decode-kernel": ("decode_kernel", str, "{" + ",".join(DECODE_KERNELS) + "}",
                              "decode kernels: auto, the Gluon ones on Hopper (compute capability 9.x) and the "
                              "Triton ones on other GPUs; triton on every GPU; gluon, Hopper only (default: auto)"),
    "--oscar-warm-up-threads": ("warm_up_threads", int, "N",
                                "threads compiling the kernels' variants at startup (default: 4)"),
}
HELP_FLAGS = ("-h", "--help")
USAGE = (f"oscar-vllm serve MODEL {' '.join(f'[{flag} {metavar}]' for flag, (_, _, metavar, _) in FLAGS.items())} "
         "[vllm serve arguments...]")


def build_parser() -> argparse.ArgumentParser:
    """The arguments ``oscar-vllm`` reads itself; everything else goes to ``vllm serve``."""
    parser = argparse.ArgumentParser(
        prog="oscar-vllm", add_help=False,
        usage=USAGE,
        description="`vllm serve` with the OSCAR 2-bit KV-cache backend. Each --oscar-* flag may also "
                    "come from its OSCAR_* variable or from --additional-config '{\"oscar\": {...}}'.",
    )
    oscar = parser.add_argument_group("OSCAR flags")
    for flag, (name, kind, metavar, text) in FLAGS.items():
        oscar.add_argument(flag, type=kind, metavar=metavar, help=f"{text}; variable {OscarSettings.env_name(name)}")
    given = parser.add_argument_group("vllm serve flags that oscar-vllm reads too")
    given.add_argument("--additional-config", default=None, metavar="JSON",
                       help="merged with the --oscar-* flags; a setting given both ways is an error")
    given.add_argument("--attention-backend", default=None, metavar="OSCAR",
                       help="always OSCAR (set for you; another backend is an error)")
    other = parser.add_argument_group("other")
    other.add_argument("-h", "--help", action="store_true",
                       help="this help; --help=all (or =SECTION, =FLAG) then vllm serve's own")
    other.add_argument(DEBUG_FLAG, action="store_true", help=DEBUG_HELP)
    return parser


def model_given(rest: list[str]) -> bool:
    """Whether ``vllm serve``'s arguments name a model: first, as the usage has it, or as
    ``--model`` (or in a ``--config`` file, which is vLLM's to read). Without one vLLM would serve
    a default model of its own."""
    first_is_model = len(rest) > 1 and not rest[1].startswith("-")
    return first_is_model or any(a in ("--model", "--config") or a.startswith(("--model=", "--config="))
                                 for a in rest[1:])


def parse(argv: list[str], environ: Mapping[str, str] | None = None) -> tuple[list[str], dict, OscarSettings]:
    """``oscar-vllm`` arguments -> ``vllm serve``'s own arguments, the ``--additional-config`` with
    the ``--oscar-*`` flags merged into its ``oscar`` entry, and the settings every vLLM process
    will read from that and the ``OSCAR_*`` variables of ``environ`` (default: this process's)."""
    parser = build_parser()
    ours, rest = parser.parse_known_args(argv)
    if not rest or rest[0] != "serve":
        raise OscarSettingsError(f"oscar-vllm runs `serve` only; usage: {USAGE}")
    if not model_given(rest):
        raise OscarSettingsError("no model given: name it first, `oscar-vllm serve MODEL ...` (a folder or a Hub "
                                 "id such as Qwen/Qwen3-8B), or with --model MODEL")
    if ours.attention_backend not in (None, "OSCAR"):
        raise OscarSettingsError(f"oscar-vllm serves with the OSCAR backend, not {ours.attention_backend}")
    try:
        extra = json.loads(ours.additional_config) if ours.additional_config else {}
    except json.JSONDecodeError as e:
        raise OscarSettingsError(f"--additional-config is not valid JSON ({e})") from e
    if not isinstance(extra, dict):
        raise OscarSettingsError(f"--additional-config must be a JSON object, got {ours.additional_config}")
    oscar = dict(extra.get(ADDITIONAL_CONFIG_KEY) or {})
    for flag, (name, *_) in FLAGS.items():
        value = getattr(ours, flag[2:].replace("-", "_"))
        if value is None:
            continue
        if name in oscar:
            raise OscarSettingsError(f"{flag} and --additional-config both set {name}")
        oscar[name] = value
    settings = OscarSettings.from_sources({ADDITIONAL_CONFIG_KEY: oscar}, environ=environ)  # here, not in a worker
    extra[ADDITIONAL_CONFIG_KEY] = oscar
    return rest, extra, settings


def vllm_argv(rest: list[str], extra: dict) -> list[str]:
    return [*rest, "--attention-backend", "OSCAR", "--additional-config", json.dumps(extra)]


def build_vllm_argv(argv: list[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """``oscar-vllm`` arguments -> ``vllm`` arguments (``serve MODEL ... --attention-backend OSCAR``)."""
    rest, extra, _ = parse(argv, environ)
    return vllm_argv(rest, extra)


def check_rotations(settings: OscarSettings) -> None:
    """A rotation path given, and where it is a local folder, its files readable and well-formed, as
    the startup check inside vLLM loads them (which also matches them to the model, and fetches a
    Hub id: no network here)."""
    from oscar_vllm.serving.preflight import torch_single_threaded
    from oscar_vllm.serving.rotation_source import local_rotation_folder, rotations_in_process

    path = settings.require_rotation_path()
    if not settings.is_hadamard and local_rotation_folder(path) is not None:
        with torch_single_threaded():  # vLLM forks its engine from this process
            rotations_in_process(settings, shape=None)  # the files alone: the model is vLLM's to read


def vllm_serve_help(help_arg: str) -> int:
    """Show ``vllm serve --help``; where vLLM cannot start (no CUDA GPU), say so in one line.

    vLLM picks its platform before it parses arguments, so even its help needs a GPU. It runs
    in a child process so that its traceback can be kept from the user.
    """
    proc = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", help_arg], capture_output=True, text=True,
    )
    if proc.returncode == 0:
        print(proc.stdout, end="")
        return 0
    import torch

    if not torch.cuda.is_available():
        print(f"vLLM's own help (`vllm serve {help_arg}`) needs a CUDA GPU, and this machine has none. "
              "Every argument not listed above goes to `vllm serve` unchanged.")
        return 0
    sys.stderr.write(proc.stderr)
    return proc.returncode


VLLM_HELP = (
    "Every other argument goes to `vllm serve` unchanged. See vLLM's own flags with `vllm serve --help`, or with "
    "`oscar-vllm --help=all` (also --help=SECTION, --help=FLAG), which prints them after these; either needs a "
    "CUDA GPU, as vLLM does even for its help."
)


def print_help(argv: list[str]) -> int:
    """Our flags at once (nothing heavy imported); vLLM's only when asked for with ``--help=...``,
    since producing them means starting vLLM (about 15 s, and a CUDA GPU)."""
    print(build_parser().format_help())
    print(textwrap.fill(VLLM_HELP, 79), flush=True)
    help_arg = next((a for a in argv if a.startswith("--help=")), None)
    if help_arg is None:
        return 0
    print(f"\n--- vllm serve {help_arg} ---", flush=True)
    return vllm_serve_help(help_arg)


@cli
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in HELP_FLAGS or a.startswith("--help=") for a in argv):
        raise SystemExit(print_help(argv))
    rest, extra, settings = parse(argv)  # the model argument and the settings
    check_rotations(settings)
    check_gpu(settings.decode_kernel)  # last: the user's own mistakes are named whatever the machine
    # The request rows OSCAR keys its windows on come from the V2 model runner.
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *vllm_argv(rest, extra)]
    vllm_main()


if __name__ == "__main__":
    main()
