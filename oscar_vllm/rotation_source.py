"""Where serving rotations come from: a local folder (ours or RotationZoo files), a
Hugging Face Hub repo (+ subfolder) fetched into the hub cache, or the data-free Hadamard
mode asked for by name."""
from __future__ import annotations

import re
from pathlib import Path

from oscar_vllm.calibration import hadamard_rotation_sets
from oscar_vllm.rotation_io import ModelShape, OscarRotations, RotationFileError, load_rotations, validate_rotations
from oscar_vllm.settings import OscarSettings

HUB_PREFIX = "hf://"
_HUB_SPEC = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+)(?P<sub>(/[\w.-]+)*)(@(?P<rev>[\w./-]+))?$")


def parse_hub_spec(spec: str) -> tuple[str, str, str | None]:
    """``[hf://]ORG/REPO[/SUB/FOLDER][@REVISION]`` -> ``(repo_id, subfolder, revision)``."""
    m = _HUB_SPEC.match(spec.removeprefix(HUB_PREFIX))
    if m is None:
        raise RotationFileError(f"{spec}: not a local folder nor a Hub spec ORG/REPO[/SUBFOLDER][@REVISION]")
    return m["repo"], m["sub"].strip("/"), m["rev"]


def resolve_rotation_path(spec: str) -> Path:
    """A local folder for ``spec``; Hub specs are fetched (or found) in the hub cache."""
    local = Path(spec).expanduser()
    if not spec.startswith(HUB_PREFIX) and local.exists():
        return local
    if not spec.startswith(HUB_PREFIX) and (spec.startswith((".", "/", "~")) or spec.count("/") == 0):
        raise RotationFileError(f"{spec}: rotation path does not exist")
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


def rotations_for_model(settings: OscarSettings, shape: ModelShape) -> OscarRotations:
    """The rotations the backend serves ``shape`` with; raises with a fix when there are none."""
    if settings.is_hadamard:
        layers = list(range(shape.num_layers))
        k, v = hadamard_rotation_sets(layers, shape.head_dim)
        rot = OscarRotations(k, v, model=shape.name, source_format="hadamard")
        validate_rotations(rot, shape)
        return rot
    return load_rotations(resolve_rotation_path(settings.require_rotation_path()), shape)
