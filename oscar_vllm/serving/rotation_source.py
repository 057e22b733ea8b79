"""Where serving rotations come from: a local folder (ours or RotationZoo files), a
Hugging Face Hub repo (+ subfolder) fetched into the hub cache, or the data-free Hadamard
mode asked for by name."""
from __future__ import annotations

import os
import re
import socket
from pathlib import Path

from oscar_vllm.core.rotation_io import (
    ModelShape,
    OscarRotations,
    RotationFileError,
    hadamard_rotation_sets,
    load_rotations,
    validate_rotations,
)
from oscar_vllm.core.settings import OscarSettings, OscarSettingsError

HUB_PREFIX = "hf://"
_HUB_SPEC = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+)(?P<sub>(/[\w.-]+)*)(@(?P<rev>[\w./-]+))?$")


def parse_hub_spec(spec: str) -> tuple[str, str, str | None]:
    """``[hf://]ORG/REPO[/SUB/FOLDER][@REVISION]`` -> ``(repo_id, subfolder, revision)``."""
    m = _HUB_SPEC.match(spec.removeprefix(HUB_PREFIX))
    if m is None:
        raise RotationFileError(f"{spec}: not a local folder nor a Hub spec ORG/REPO[/SUBFOLDER][@REVISION]")
    return m["repo"], m["sub"].strip("/"), m["rev"]


def local_rotation_folder(spec: str) -> Path | None:
    """The local path ``spec`` names, without the network: None for a Hub spec (``hf://...``, or
    ``ORG/REPO...`` where no such path exists here); a path that does not exist is an error."""
    local = Path(spec).expanduser()
    if spec.startswith(HUB_PREFIX):
        return None
    if local.exists():
        return local
    if spec.startswith((".", "/", "~")) or spec.count("/") == 0:
        raise RotationFileError(f"{spec}: rotation path does not exist")
    return None


def resolve_rotation_path(spec: str) -> Path:
    """A local folder for ``spec``; Hub specs are fetched (or found) in the hub cache."""
    local = local_rotation_folder(spec)
    if local is not None:
        return local
    repo_id, sub, revision = parse_hub_spec(spec)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        root = snapshot_download(repo_id, revision=revision, allow_patterns=[f"{sub}/*"] if sub else None)
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as e:
        raise RotationFileError(f"{spec}: could not fetch rotations from the Hugging Face Hub ({e})") from e
    folder = Path(root) / sub
    if not folder.is_dir():
        raise RotationFileError(f"{spec}: the Hub repo {repo_id} has no folder {sub!r}")
    return folder


def rotations_for_model(settings: OscarSettings, shape: ModelShape | None) -> OscarRotations:
    """The rotations the backend serves ``shape`` with (None: the files alone, not the Hadamard
    mode, which is built for a shape); raises with a fix when there are none, or when ``key_mean``
    "on" finds no key means in them."""
    if settings.is_hadamard:
        layers = list(range(shape.num_layers))
        k, v = hadamard_rotation_sets(layers, shape.head_dim)
        rot = OscarRotations(k, v, model=shape.name, source_format="hadamard")
        validate_rotations(rot, shape)
    else:
        rot = load_rotations(resolve_rotation_path(settings.require_rotation_path()), shape)
    if settings.key_mean == "on" and rot.key_means is None:
        raise OscarSettingsError(
            f"key_mean 'on' needs rotations with key means, and {settings.rotation_path!r} ({rot.source_format}) has "
            "none: write them with `oscar-calibrate --model-path MODEL --output-dir DIR` (format 2)")
    return rot


def rotations_in_process(settings: OscarSettings, shape: ModelShape | None,
                         worker: str | None = None) -> OscarRotations:
    """:func:`rotations_for_model`, a path this process cannot read named as such. In a vLLM
    worker (``worker``: which one) the error also names the host and pid: every process that
    holds model weights reads the rotations itself, after the process that started the engine
    read them, so a worker that cannot sees another folder than that one did."""
    try:
        return rotations_for_model(settings, shape)
    except (RotationFileError, OSError) as e:
        if settings.is_hadamard or not settings.rotation_path:
            raise
        problem = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.strerror else str(e)
        if worker is None:
            if isinstance(e, RotationFileError):
                raise
            raise RotationFileError(f"rotation path {settings.rotation_path!r} cannot be read ({problem})") from e
        raise RotationFileError(
            f"{worker} on host {socket.gethostname()} (pid {os.getpid()}) cannot use rotation path "
            f"{settings.rotation_path!r}: {problem}. Every vLLM process that holds model weights loads the "
            "rotations itself, so the folder must be readable, with the same files, at the same path on every "
            "node (or give hf://ORG/REPO, which each node fetches)"
        ) from e
