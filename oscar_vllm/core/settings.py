"""OSCAR serving settings: from ``--additional-config '{"oscar": {...}}'`` or ``OSCAR_*``
environment variables (the JSON wins where both are given). Plain Python, so the plugin,
the CLI and every vLLM process parse them the same way."""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Mapping

from oscar_vllm.core.errors import OscarError

logger = logging.getLogger(__name__)

BACKEND_NAME = "OSCAR"  # what --attention-backend names
BACKEND_PATH = "oscar_vllm.serving.backend.OscarAttentionBackend"
ADDITIONAL_CONFIG_KEY = "oscar"
ENV_PREFIX = "OSCAR_"
HADAMARD = "hadamard"
SCALE_DTYPES = ("fp16", "bf16")
# What a prefill query reads in BF16 besides the sink: "chunk", its own chunk and the ring before
# it (as the OSCAR reference prefills; fewer keys in 2 bits, but which ones depends on where vLLM
# cuts the prompt into chunks), or "decode", the last recent_size positions, as a decode step
# reads them (replies that do not depend on vLLM's schedule; docs/backend.md).
PREFILL_READS = ("chunk", "decode")
# Where a prefix-cache hit's BF16 recent window and the ring before its first new token come
# from: "recompute", computed again (the hit ends that much earlier); or "reuse", copied from the
# ring an earlier request of the same prefix left, where one is still in the pool (the hit then
# ends where vLLM's does), else computed again (oscar_vllm.serving.window_pages).
HIT_RINGS = ("recompute", "reuse")
# Whether the INT2 pages hold keys less their block's mean ("on": the rotation file's means before
# RoPE, oscar-calibrate writes them; docs/quality.md) or the keys as they are ("off"); "auto", the
# default: "on" where the rotations have means, the model's RoPE takes them and prefill_read is
# "chunk", else "off" (said once at startup). A read adds one logit per block and query.
KEY_MEANS = ("off", "on", "auto")
# Which decode kernels serve: "auto", the Gluon decode and decode write on Hopper (compute capability
# 9.x, the only cards they are compiled for) and the Triton ones elsewhere; "triton" on every card (on
# Hopper, the fallback other cards take, end to end); "gluon", refused at startup on a card not 9.x
# (oscar_vllm.serving.gpu).
DECODE_KERNELS = ("auto", "gluon", "triton")
HOW_TO_GET_ROTATIONS = (
    "give a rotation folder with --additional-config '{\"oscar\": {\"rotation_path\": DIR}}' "
    "or OSCAR_ROTATION_PATH=DIR: published RotationZoo files, a folder written by "
    "`oscar-calibrate --model-path MODEL --output-dir DIR` (about 8K tokens, minutes), or "
    "hf://ORG/REPO[/SUBFOLDER][@REVISION] on the Hugging Face Hub; or ask for the data-free "
    f"mode by name with rotation_path={HADAMARD!r} (lower quality)"
)


FLOATS = ("logit_correction",)  # float settings besides the clip ratios
# λ where logit_correction is not given (OscarSettings.logit_correction_for): rounding noise inflates a
# key's softmax weight, and λ = 0.5 undoes the best share of it for keys rounded whole; keys rounded
# less their mean are rounded finer, and there any correction scored worse than none.
DEFAULT_LOGIT_CORRECTION = 0.5
DEFAULT_LOGIT_CORRECTION_WITH_KEY_MEAN = 0.0
INTS = ("decode_splits", "warm_up_threads")  # int settings besides the *_size ones


class OscarSettingsError(OscarError, ValueError):
    """A setting that is missing, unknown or out of range; the message names it."""


@dataclass(frozen=True)
class OscarSettings:
    rotation_path: str | None = None
    sink_size: int = 64
    recent_size: int = 256
    clip_ratio_k: float | None = None  # None: the rotation file's per-layer ratios (reference: 0.96)
    clip_ratio_v: float | None = None  # None: per layer from the file (reference: 0.92)
    scale_dtype: str = "fp16"
    # λ: an INT2 key's attention logit is lowered by λ/2 times its expected rounding variance
    # (oscar_vllm.core.mixed_cache.LayerCacheSpec.logit_correction); 0 turns it off. None: what the
    # quality study found best for how the layer rounds its keys (logit_correction_for).
    logit_correction: float | None = None
    prefill_read: str = "chunk"
    # How many programs split each decode request's keys: 0 picks the count per batch (more for
    # small batches, to fill the GPU), so a request's floating-point sums depend on the batch it
    # runs in; a power of two fixes it for every batch (replies independent of the batch, with
    # prefill_read "decode"; docs/backend.md).
    decode_splits: int = 0
    hit_ring: str = "recompute"
    # "off" by default: keys less their block's mean halved perplexity's loss inside vLLM but found a
    # third as many passkeys (the clip ratios fitted for the keys as they are cut the residuals'
    # token-specific outliers; docs/quality.md); "auto" serves the means where the file has them.
    key_mean: str = "off"
    decode_kernel: str = "auto"
    # Threads that compile the kernels' serving variants at startup (csrc_triton.warm_up.launch_all).
    # An OSCAR engine's warm-up (17 variants, Qwen3-8B shape, empty Triton cache) took 43.9 s in one
    # thread and 25.9 s in 4 on the H200 machine, inside a 69 s engine init (tests/gpu/run.sh warmup,
    # results/kernels/warm_up_engine_h200); the warm-up runs alone, so a start saves what it saves.
    warm_up_threads: int = 4

    def __post_init__(self) -> None:
        if self.sink_size < 0:
            raise OscarSettingsError(f"sink_size must be >= 0, got {self.sink_size}")
        if self.recent_size < 1:
            raise OscarSettingsError(f"recent_size must be >= 1, got {self.recent_size}")
        for name in ("clip_ratio_k", "clip_ratio_v"):
            ratio = getattr(self, name)
            if ratio is not None and not 0.0 < ratio <= 1.0:
                raise OscarSettingsError(f"{name} must be in (0, 1], got {ratio}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise OscarSettingsError(f"scale_dtype must be one of {SCALE_DTYPES}, got {self.scale_dtype!r}")
        if self.prefill_read not in PREFILL_READS:
            raise OscarSettingsError(f"prefill_read must be one of {PREFILL_READS}, got {self.prefill_read!r}")
        if self.hit_ring not in HIT_RINGS:
            raise OscarSettingsError(f"hit_ring must be one of {HIT_RINGS}, got {self.hit_ring!r}")
        if self.key_mean not in KEY_MEANS:
            raise OscarSettingsError(f"key_mean must be one of {KEY_MEANS}, got {self.key_mean!r}")
        if self.decode_kernel not in DECODE_KERNELS:
            raise OscarSettingsError(f"decode_kernel must be one of {DECODE_KERNELS}, got {self.decode_kernel!r}")
        if self.key_mean == "on" and self.prefill_read == "decode":
            raise OscarSettingsError("key_mean 'on' does not serve prefill_read 'decode' (its dense reads do not add "
                                     "the mean back); choose one of them")
        if self.decode_splits < 0 or self.decode_splits & (self.decode_splits - 1):
            raise OscarSettingsError(f"decode_splits must be 0 (chosen per batch) or a power of two, "
                                     f"got {self.decode_splits}")
        if self.warm_up_threads < 1:
            raise OscarSettingsError(f"warm_up_threads must be >= 1, got {self.warm_up_threads}")
        if self.logit_correction is not None and not (math.isfinite(self.logit_correction)
                                                      and self.logit_correction >= 0):
            raise OscarSettingsError(f"logit_correction must be a finite number >= 0 (0 turns it off), "
                                     f"got {self.logit_correction}")

    def logit_correction_for(self, key_mean: bool) -> float:
        """λ for a layer whose INT2 keys are rounded as they are (``key_mean`` False) or less their
        mean: the setting where given, else the quality study's best for each: 0.5 of 0.25-1 for
        the keys as they are, 0 of 0-0.5 with the mean (docs/quality.md)."""
        if self.logit_correction is not None:
            return self.logit_correction
        return DEFAULT_LOGIT_CORRECTION_WITH_KEY_MEAN if key_mean else DEFAULT_LOGIT_CORRECTION

    @property
    def batch_invariant(self) -> bool:
        """Whether a request's attention reads the same numbers in the same order whatever
        batch it runs in: prompts read as decode does, decode splits fixed."""
        return self.prefill_read == "decode" and self.decode_splits > 0

    @property
    def is_hadamard(self) -> bool:
        return self.rotation_path == HADAMARD

    @staticmethod
    def env_name(field_name: str) -> str:
        return ENV_PREFIX + field_name.upper()

    @classmethod
    def from_sources(
        cls, additional_config: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> "OscarSettings":
        environ = os.environ if environ is None else environ
        given = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY) or {}
        if not isinstance(given, Mapping):
            raise OscarSettingsError(f"--additional-config's {ADDITIONAL_CONFIG_KEY!r} entry must be a JSON object of "
                                     f"settings, like {{\"rotation_path\": DIR}}; got {given!r}")
        given = dict(given)
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise OscarSettingsError(f"unknown OSCAR setting(s) {unknown}; valid: {sorted(known)}")
        values: dict[str, Any] = {}
        for name, f in known.items():
            from_env = environ.get(cls.env_name(name))
            raw = given.get(name, from_env)
            if raw is None or raw == "":
                continue
            values[name] = _convert(name, raw, f.default)
            if name in given and from_env not in (None, "") and _differs(name, from_env, values[name], f.default):
                _warn_overridden(name, values[name], from_env)
        return cls(**values)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> "OscarSettings":
        return cls.from_sources(getattr(vllm_config, "additional_config", None) or {})

    def require_rotation_path(self) -> str:
        if not self.rotation_path:
            raise OscarSettingsError(f"the OSCAR backend needs rotations: {HOW_TO_GET_ROTATIONS}")
        return self.rotation_path


_warned: set[tuple[str, str]] = set()


def pinned_rotation_path(path: str) -> str:
    """A rotation path as the engine pins it into its config for every process: absolute where it
    is a folder here; a Hub id and the Hadamard mode as given."""
    folder = Path(path).expanduser()
    return str(folder.resolve()) if path != HADAMARD and folder.exists() else path


def _differs(name: str, from_env: str, value: Any, default: Any) -> bool:
    if name == "rotation_path":  # a worker reads the pinned absolute path; the variable may be relative
        return pinned_rotation_path(from_env) != pinned_rotation_path(value)
    try:
        return _convert(name, from_env, default) != value
    except OscarSettingsError:  # not even a valid value: ignored all the same
        return True


def _warn_overridden(name: str, value: Any, from_env: str) -> None:
    """Once a process: the JSON's value wins, and an operator who exported the variable should see
    that it does not apply (every vLLM process parses the settings again)."""
    if (name, from_env) not in _warned:
        _warned.add((name, from_env))
        logger.warning("OSCAR: %s is %r from --additional-config; %s=%s is ignored", name, value,
                       OscarSettings.env_name(name), from_env)


def _convert(name: str, raw: Any, default: Any) -> Any:
    kind = (int if name.endswith("_size") or name in INTS
            else float if name.startswith("clip_ratio") or name in FLOATS else str)
    if kind is str:
        return str(raw)
    if isinstance(raw, bool) or (kind is int and isinstance(raw, float)):
        raise OscarSettingsError(f"{name} must be {kind.__name__}, got {raw!r}")
    try:
        return kind(raw)
    except (TypeError, ValueError):
        raise OscarSettingsError(f"{name} must be {kind.__name__}, got {raw!r}") from None
