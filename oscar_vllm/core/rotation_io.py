"""Rotation files: RotationZoo (formats 1 and 2) as published, and our own format.

RotationZoo (the OSCAR authors' files, read as they are, ``torch.load(weights_only=True)``)::

    k_rotation_qqt_r_h_pbr.pt / v_rotation_sst_r_h_pbr.pt:
    {"format_version": 1 | 2, "objective": str, "source_grouping": "layer" | "per_kv_head",
     "layers": {layer_id: {"layer_id": int, "rotation": f32 [d, d] | [Hkv, d, d],
                           "eigenvalues": f32 [d] | [Hkv, d]}}}

Ours, a folder::

    oscar_rotations.json       model, shape fingerprint, layer ids, head_dim, per-head,
                               calibration (tokens, corpus), clip ratios, format version
    k_rotation.safetensors     layers.{i}.rotation, layers.{i}.eigenvalues; the kind
    v_rotation.safetensors     ("key"/"value") is also in the safetensors metadata;
                               format 2 adds layers.{i}.key_mean to the key file: f32
                               [Hkv, d], each KV head's mean key before RoPE (rotate-half
                               pairs), what a cache may round keys less (``core.key_mean``)

Every loader validates what it reads and raises :class:`RotationFileError` naming the
file and the problem. Depends on torch and safetensors only.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import pickle
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from oscar_vllm import __version__
from oscar_vllm.core.atomic_output import atomic_output_dir, is_partial_output
from oscar_vllm.core.errors import DEBUG_FLAG, DEBUG_HELP, OscarError, cli
from oscar_vllm.core.quant import REFERENCE_CLIP_RATIO_K, REFERENCE_CLIP_RATIO_V
from oscar_vllm.core.rotation import hadamard_rotation

logger = logging.getLogger(__name__)

KEY, VALUE = "key", "value"
FORMAT_NAME = "oscar_vllm.rotations"
FORMAT_VERSION = 2  # written with key means; without them, 1 (what earlier versions read)
READ_FORMAT_VERSIONS = (1, 2)
METADATA_FILE = "oscar_rotations.json"
OUR_FILES = {KEY: "k_rotation.safetensors", VALUE: "v_rotation.safetensors"}
ZOO_FORMAT_VERSIONS = (1, 2)
ZOO_GROUPING = {1: "layer", 2: "per_kv_head"}
ORTHOGONALITY_TOL = 1e-4
# Half precision cannot hold an orthogonal matrix to ORTHOGONALITY_TOL: refused by name.
ROTATION_DTYPES = (torch.float32, torch.float64)

# Which statistic an objective's prefix names, hence whether it rotates keys or values.
_OBJECTIVE_KIND = {"qqt": KEY, "ktk": KEY, "sst": VALUE, "vtv": VALUE}


class RotationFileError(OscarError, ValueError):
    """A rotation file or folder that cannot be used; the message names file and problem."""


def objective_kind(objective: str) -> str | None:
    """``"key"``/``"value"`` for statistic-based objectives, None for data-free ones."""
    return _OBJECTIVE_KIND.get(objective.split("_", 1)[0])


@dataclass(frozen=True)
class ModelShape:
    """What a rotation set must match; built from a Hugging Face config (dict or object)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    name: str = ""
    fingerprint: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_hf_config(cls, config: Any, name: str = "") -> "ModelShape":
        get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
        heads = get("num_attention_heads")
        kv_heads = get("num_key_value_heads") or heads
        head_dim = get("head_dim") or get("hidden_size") // heads
        fp = {
            "model_type": get("model_type"),
            "num_hidden_layers": get("num_hidden_layers"),
            "hidden_size": get("hidden_size"),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
        }
        name = name or get("_name_or_path") or get("name_or_path") or ""
        return cls(get("num_hidden_layers"), kv_heads, head_dim, str(name), fp)


@dataclass
class RotationSet:
    """Rotations for one of K or V: layer id -> f32 ``[d, d]`` or per head ``[Hkv, d, d]``."""

    kind: str
    objective: str
    rotations: dict[int, torch.Tensor]
    eigenvalues: dict[int, torch.Tensor]
    source: str = ""

    @property
    def layer_ids(self) -> list[int]:
        return sorted(self.rotations)

    @property
    def head_dim(self) -> int:
        return next(iter(self.rotations.values())).shape[-1]

    @property
    def per_head(self) -> bool:
        return next(iter(self.rotations.values())).dim() == 3


@dataclass
class OscarRotations:
    """A key and a value rotation set plus what we know of their making."""

    key: RotationSet
    value: RotationSet
    clip_ratios_k: list[float] | None = None  # per layer, in layer-id order; None: reference
    clip_ratios_v: list[float] | None = None
    model: str = ""
    model_fingerprint: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] = field(default_factory=dict)
    source_format: str = FORMAT_NAME
    # layer id -> f32 [Hkv, d]: each KV head's mean key before RoPE (rotate-half pairs), in the
    # model's basis (not rotated); None: not calibrated (RotationZoo files have none)
    key_means: dict[int, torch.Tensor] | None = None

    @property
    def layer_ids(self) -> list[int]:
        return self.key.layer_ids

    def clip_ratio(self, kind: str, layer_id: int) -> float:
        ratios = self.clip_ratios_k if kind == KEY else self.clip_ratios_v
        if ratios is None:
            return REFERENCE_CLIP_RATIO_K if kind == KEY else REFERENCE_CLIP_RATIO_V
        return ratios[self.layer_ids.index(layer_id)]


def hadamard_rotation_sets(layer_ids: list[int], head_dim: int) -> tuple[RotationSet, RotationSet]:
    """Data-free Hadamard rotations for every layer (the QuaRot-like ablation)."""
    h = hadamard_rotation(head_dim).float()
    ones = torch.ones(head_dim)
    sets = tuple(
        RotationSet(kind, "hadamard", {i: h for i in layer_ids}, {i: ones for i in layer_ids})
        for kind in (KEY, VALUE)
    )
    return sets[0], sets[1]


# ---------------------------------------------------------------------------- validation


def _fail(source: str, problem: str) -> RotationFileError:
    return RotationFileError(f"{source}: {problem}")


def validate_rotation_set(
    rs: RotationSet, expected_kind: str, shape: ModelShape | None = None
) -> None:
    """Raise :class:`RotationFileError` unless ``rs`` is a usable ``expected_kind`` set."""
    src = rs.source or f"{expected_kind} rotations"
    if rs.kind != expected_kind:
        raise _fail(
            src,
            f"holds {rs.kind} rotations (objective {rs.objective!r}) but was given as the "
            f"{expected_kind} rotation file; swap the key and value files",
        )
    if not rs.rotations:
        raise _fail(src, "has no layers")
    d = rs.head_dim
    first_shape = None
    for layer_id in rs.layer_ids:
        r = rs.rotations[layer_id]
        if r.dim() not in (2, 3) or r.shape[-1] != r.shape[-2]:
            raise _fail(src, f"layer {layer_id} rotation has shape {tuple(r.shape)}, not [d, d] or [heads, d, d]")
        if first_shape is None:
            first_shape = r.shape
        elif r.shape != first_shape:
            raise _fail(src, f"layer {layer_id} rotation has shape {tuple(r.shape)}, other layers {tuple(first_shape)}")
        if not torch.isfinite(r).all():
            raise _fail(src, f"layer {layer_id} rotation contains NaN or Inf")
        r64 = r.double()
        eye = torch.eye(d, dtype=torch.float64)
        err = (r64.transpose(-1, -2) @ r64 - eye).abs().max().item()
        if not err <= ORTHOGONALITY_TOL:
            raise _fail(
                src,
                f"layer {layer_id} rotation is not orthogonal (max |RᵀR - I| = {err:.3g}, "
                f"tolerance {ORTHOGONALITY_TOL:g})",
            )
    if shape is None:
        return
    if d != shape.head_dim:
        raise _fail(src, f"rotations are {d}x{d} but the model's head_dim is {shape.head_dim}")
    if rs.per_head and first_shape[0] != shape.num_kv_heads:
        raise _fail(
            src,
            f"has per-head rotations for {first_shape[0]} KV heads but the model has "
            f"{shape.num_kv_heads} KV heads",
        )
    expected = set(range(shape.num_layers))
    missing, extra = sorted(expected - set(rs.layer_ids)), sorted(set(rs.layer_ids) - expected)
    if missing:
        raise _fail(src, f"missing layers {_ranges(missing)} (the model has {shape.num_layers} layers)")
    if extra:
        raise _fail(src, f"has extra layers {_ranges(extra)} (the model has {shape.num_layers} layers)")


def validate_rotations(rot: OscarRotations, shape: ModelShape | None = None) -> None:
    """Check both sets, their agreement, the clip ratios and the model fingerprint."""
    validate_rotation_set(rot.key, KEY, shape)
    validate_rotation_set(rot.value, VALUE, shape)
    if rot.key.layer_ids != rot.value.layer_ids:
        raise RotationFileError(
            f"key rotations cover layers {_ranges(rot.key.layer_ids)} but value rotations "
            f"cover {_ranges(rot.value.layer_ids)}"
        )
    if rot.key.head_dim != rot.value.head_dim:
        raise RotationFileError(
            f"key rotations are {rot.key.head_dim}-dim but value rotations {rot.value.head_dim}-dim"
        )
    for kind, ratios in ((KEY, rot.clip_ratios_k), (VALUE, rot.clip_ratios_v)):
        if ratios is None:
            continue
        if len(ratios) != len(rot.layer_ids):
            raise RotationFileError(
                f"{len(ratios)} {kind} clip ratios for {len(rot.layer_ids)} layers"
            )
        bad = [r for r in ratios if not (isinstance(r, (int, float)) and math.isfinite(r) and 0 <= r <= 1)]
        if bad:
            raise RotationFileError(f"{kind} clip ratios must lie in [0, 1], got {bad[:4]}")
    if rot.key_means is not None:
        validate_key_means(rot, shape)
    if shape is None or not rot.model_fingerprint or not shape.fingerprint:
        return
    diffs = {
        k: (rot.model_fingerprint.get(k), v)
        for k, v in shape.fingerprint.items()
        if rot.model_fingerprint.get(k) != v
    }
    if diffs:
        detail = ", ".join(f"{k} {a} vs {b}" for k, (a, b) in diffs.items())
        raise RotationFileError(
            f"rotations were calibrated for {rot.model or 'another model'} but the model "
            f"{shape.name or ''} differs ({detail}); calibrate for this model with "
            f"`oscar-calibrate --model-path ...`"
        )
    if rot.model and shape.name and Path(rot.model).name != Path(shape.name).name:
        logger.warning(
            "rotations were calibrated for %s, serving %s (same shape): fine for a fine-tune "
            "of the same base, otherwise calibrate for this model",
            rot.model,
            shape.name,
        )


def validate_key_means(rot: OscarRotations, shape: ModelShape | None = None) -> None:
    """The key means cover the rotations' layers, each ``[Hkv, d]`` and finite."""
    src = rot.key.source or "key rotations"
    means = rot.key_means
    if sorted(means) != rot.layer_ids:
        missing, extra = sorted(set(rot.layer_ids) - set(means)), sorted(set(means) - set(rot.layer_ids))
        raise _fail(src, "key means " + (f"missing for layers {_ranges(missing)}" if missing else
                                         f"for layers {_ranges(extra)} that have no rotation"))
    heads = shape.num_kv_heads if shape is not None else None
    if heads is None and rot.key.per_head:
        heads = rot.key.rotations[rot.layer_ids[0]].shape[0]
    for layer_id in rot.layer_ids:
        m = means[layer_id]
        if m.dim() != 2 or m.shape[1] != rot.key.head_dim or (heads is not None and m.shape[0] != heads):
            want = f"[{heads if heads is not None else 'Hkv'}, {rot.key.head_dim}]"
            raise _fail(src, f"layer {layer_id} key mean has shape {tuple(m.shape)}, not {want}")
        if not m.is_floating_point():
            raise _fail(src, f"layer {layer_id} key mean is {str(m.dtype).removeprefix('torch.')}, not float")
        if not torch.isfinite(m).all():
            raise _fail(src, f"layer {layer_id} key mean contains NaN or Inf")


def _first_line(e: Exception) -> str:
    """The problem as torch or safetensors names it, without the advice they add after it
    (a truncated file gets a paragraph about checkpoints, a refused pickle a whole page)."""
    line = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
    return line.split(". ", 1)[0].rstrip(".")


def _dtype_problem(layer_id: int, dtype: torch.dtype) -> str:
    return (f"layer {layer_id} rotation is stored as {str(dtype).removeprefix('torch.')}; rotations are float32 "
            f"(or float64): lower precision is not orthogonal to {ORTHOGONALITY_TOL:g}")


def _ranges(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out, start = [], None
    for i, x in enumerate(ids):
        if start is None:
            start = x
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


# ---------------------------------------------------------------------------- RotationZoo


def load_rotationzoo_file(path: str | Path) -> RotationSet:
    """Read one published RotationZoo file (format 1 or 2) as it is."""
    path = Path(path)
    if not path.is_file():
        raise RotationFileError(f"{path}: no such rotation file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # an object torch will not build without running code, a truncated file, not a torch file
        code = re.search(r"GLOBAL (\S+)", str(e)) if isinstance(e, pickle.UnpicklingError) else None
        if code:
            raise _fail(str(path), f"holds a pickled object other than tensors, numbers and strings ({code[1]}); "
                                   "refused unread, since loading it would run code (a RotationZoo file holds "
                                   "tensors only)") from e
        # torch's refusal of bytes that are no pickle at all names the problem after its advice
        detail = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", str(e))
        raise _fail(str(path), f"is not a readable torch.save file ({type(e).__name__}: "
                               f"{detail[1] if detail else _first_line(e)})") from e
    if not isinstance(state, Mapping) or "layers" not in state or "format_version" not in state:
        raise _fail(str(path), "is not a RotationZoo file (expected keys format_version, objective, layers)")
    version = state["format_version"]
    if version not in ZOO_FORMAT_VERSIONS:
        raise _fail(str(path), f"has RotationZoo format_version {version}; this version reads {ZOO_FORMAT_VERSIONS}")
    grouping = state.get("source_grouping", ZOO_GROUPING[version])
    objective = str(state.get("objective", ""))
    kind = objective_kind(objective) or _kind_from_filename(path)
    rotations, eigenvalues = {}, {}
    if not isinstance(state["layers"], Mapping):
        raise _fail(str(path), f"'layers' is a {type(state['layers']).__name__}, not a map of layer id to entry")
    for key, entry in state["layers"].items():
        if not isinstance(entry, Mapping) or "rotation" not in entry:
            keys = sorted(map(str, entry)) if isinstance(entry, Mapping) else type(entry).__name__
            raise _fail(str(path), f"layer {key} entry has no 'rotation' (it holds {keys}); format {version} "
                                   "entries hold layer_id, rotation and eigenvalues")
        layer_id = int(entry.get("layer_id", key))
        r = entry["rotation"]
        if not isinstance(r, torch.Tensor):
            raise _fail(str(path), f"layer {layer_id} rotation is not a tensor")
        if r.dtype not in ROTATION_DTYPES:
            raise _fail(str(path), _dtype_problem(layer_id, r.dtype))
        want_dims = 3 if grouping == "per_kv_head" else 2
        if r.dim() != want_dims:
            raise _fail(
                str(path),
                f"layer {layer_id} rotation has shape {tuple(r.shape)} but source_grouping "
                f"{grouping!r} (format {version}) needs {want_dims} dims",
            )
        rotations[layer_id] = r.float().contiguous()
        if "eigenvalues" in entry:
            eigenvalues[layer_id] = entry["eigenvalues"].float().contiguous()
    return RotationSet(kind, objective, rotations, eigenvalues, source=str(path))


def _kind_from_filename(path: Path) -> str:
    if path.name.startswith("k_"):
        return KEY
    if path.name.startswith("v_"):
        return VALUE
    raise _fail(str(path), "objective and file name do not say whether it rotates keys or values")


def save_rotationzoo_file(rs: RotationSet, path: str | Path) -> None:
    """Write ``rs`` the way RotationZoo does (format 2 when per head)."""
    version = 2 if rs.per_head else 1
    layers = {
        i: {
            "layer_id": i,
            "rotation": rs.rotations[i].float().contiguous(),
            "eigenvalues": rs.eigenvalues.get(i, torch.zeros(rs.rotations[i].shape[:-1])).float(),
        }
        for i in rs.layer_ids
    }
    torch.save(
        {
            "format_version": version,
            "objective": rs.objective,
            "source_grouping": ZOO_GROUPING[version],
            "layers": layers,
        },
        Path(path),
    )


def _zoo_files(folder: Path) -> dict[str, Path] | None:
    found = {KEY: sorted(folder.glob("k_rotation_*.pt")), VALUE: sorted(folder.glob("v_rotation_*.pt"))}
    if not found[KEY] and not found[VALUE]:
        return None
    for kind, files in found.items():
        if len(files) != 1:
            raise RotationFileError(
                f"{folder}: expected one {kind} file k_/v_rotation_*.pt, found "
                f"{[f.name for f in files] or 'none'}"
            )
    return {k: v[0] for k, v in found.items()}


# ---------------------------------------------------------------------------- ours


def _load_our_file(path: Path, kind: str) -> tuple[RotationSet, dict[int, torch.Tensor]]:
    """The file's rotation set, and its key means (format 2's key file; else empty)."""
    if not path.is_file():
        raise RotationFileError(f"{path}: missing ({kind} rotation file)")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            # Copies: safetensors maps the file, so a file written over in place (cp) would change
            # the rotations under whatever still holds them (a server, an evaluation), silently.
            tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
    except Exception as e:
        raise _fail(str(path), f"is not a readable safetensors file ({_first_line(e)})") from e
    if meta.get("format") != FORMAT_NAME:
        raise _fail(str(path), f"is not an {FORMAT_NAME} file (metadata format={meta.get('format')!r})")
    version = int(meta.get("format_version", -1))
    if version not in READ_FORMAT_VERSIONS:
        raise _fail(str(path), f"has format_version {meta.get('format_version')}; this version reads "
                               f"{READ_FORMAT_VERSIONS}")
    names = ("rotation", "eigenvalues") + (("key_mean",) if version >= 2 and kind == KEY else ())
    found: dict[str, dict[int, torch.Tensor]] = {n: {} for n in names}
    for name, t in tensors.items():
        parts = name.split(".")
        if len(parts) != 3 or parts[0] != "layers" or parts[2] not in names or not parts[1].isdigit():
            raise _fail(str(path), f"unexpected tensor {name!r}")
        if parts[2] == "rotation" and t.dtype not in ROTATION_DTYPES:
            raise _fail(str(path), _dtype_problem(int(parts[1]), t.dtype))
        found[parts[2]][int(parts[1])] = t if parts[2] == "key_mean" else t.float()
    rs = RotationSet(meta.get("kind", ""), meta.get("objective", ""), found["rotation"], found["eigenvalues"],
                     str(path))
    return rs, found.get("key_mean", {})


def _stored(t: torch.Tensor) -> torch.Tensor:
    """A tensor as safetensors writes it: f32, contiguous, and its own memory (it refuses views and
    tensors that share memory, as the layers of a Hadamard set do)."""
    return t.float().clone(memory_format=torch.contiguous_format)


def save_rotations(rot: OscarRotations, folder: str | Path) -> Path:
    """Write ``rot`` in our format into ``folder`` (created); returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    version = FORMAT_VERSION if rot.key_means else 1
    for rs in (rot.key, rot.value):
        tensors = {f"layers.{i}.rotation": _stored(rs.rotations[i]) for i in rs.layer_ids}
        tensors.update({f"layers.{i}.eigenvalues": _stored(e) for i, e in rs.eigenvalues.items()})
        if rs.kind == KEY and rot.key_means:
            tensors.update({f"layers.{i}.key_mean": _stored(m) for i, m in rot.key_means.items()})
        meta = {"format": FORMAT_NAME, "format_version": str(version), "kind": rs.kind, "objective": rs.objective}
        save_file(tensors, str(folder / OUR_FILES[rs.kind]), metadata=meta)
    info = {
        "format": FORMAT_NAME,
        "format_version": version,
        "created_by": f"oscar_vllm {__version__}",
        "model": rot.model,
        "model_fingerprint": rot.model_fingerprint,
        "layer_ids": rot.layer_ids,
        "head_dim": rot.key.head_dim,
        "per_head": rot.key.per_head,
        "num_kv_heads": rot.key.rotations[rot.layer_ids[0]].shape[0] if rot.key.per_head else None,
        "objectives": {KEY: rot.key.objective, VALUE: rot.value.objective},
        "calibration": rot.calibration,
        "clip_ratios": {KEY: rot.clip_ratios_k, VALUE: rot.clip_ratios_v},
    }
    (folder / METADATA_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return folder


def _load_ours(folder: Path) -> OscarRotations:
    meta_path = folder / METADATA_FILE
    try:
        info = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise _fail(str(meta_path), f"is not valid JSON ({e})") from e
    if info.get("format") != FORMAT_NAME:
        raise _fail(str(meta_path), f"is not an {FORMAT_NAME} metadata file")
    if info.get("format_version") not in READ_FORMAT_VERSIONS:
        raise _fail(str(meta_path), f"has format_version {info.get('format_version')}; this version reads "
                                    f"{READ_FORMAT_VERSIONS}")
    clip = info.get("clip_ratios") or {}
    key, key_means = _load_our_file(folder / OUR_FILES[KEY], KEY)
    value, _ = _load_our_file(folder / OUR_FILES[VALUE], VALUE)
    return OscarRotations(
        key=key,
        value=value,
        clip_ratios_k=clip.get(KEY),
        clip_ratios_v=clip.get(VALUE),
        model=info.get("model", ""),
        model_fingerprint=info.get("model_fingerprint") or {},
        calibration=info.get("calibration") or {},
        key_means=key_means or None,
    )


# ---------------------------------------------------------------------------- entry points


def load_rotations(path: str | Path, shape: ModelShape | None = None) -> OscarRotations:
    """Load a rotation folder, ours or RotationZoo, and validate it against ``shape``."""
    folder = Path(path)
    if is_partial_output(folder):
        raise RotationFileError(f"{folder}: the temporary folder of an output that was being written (its writer "
                                "was killed or is still running); use the folder it was written for")
    if not folder.exists():
        raise RotationFileError(f"{folder}: rotation path does not exist")
    if not folder.is_dir():
        raise RotationFileError(f"{folder}: rotation path must be a folder holding the key and value files")
    if (folder / METADATA_FILE).exists():
        rot = _load_ours(folder)
    else:
        zoo = _zoo_files(folder)
        if zoo is None:
            raise RotationFileError(
                f"{folder}: no rotation files found (expected {METADATA_FILE} with "
                f"{OUR_FILES[KEY]}/{OUR_FILES[VALUE]}, or RotationZoo k_rotation_*.pt and "
                f"v_rotation_*.pt); make them with `oscar-calibrate --model-path MODEL --output-dir DIR`"
            )
        rot = OscarRotations(
            key=load_rotationzoo_file(zoo[KEY]),
            value=load_rotationzoo_file(zoo[VALUE]),
            source_format="rotationzoo",
        )
    validate_rotations(rot, shape)
    return rot


def save_rotationzoo(rot: OscarRotations, folder: str | Path) -> Path:
    """Write ``rot`` as RotationZoo files (the clip ratios, key means and metadata have no place there)."""
    if rot.key_means:
        logger.warning("RotationZoo files have no place for key means: the converted files leave them out")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, rs in (("k", rot.key), ("v", rot.value)):
        save_rotationzoo_file(rs, folder / f"{prefix}_rotation_{rs.objective}.pt")
    return folder


def _summary(rot: OscarRotations) -> str:
    k = rot.key
    heads = f"per KV head ({k.rotations[k.layer_ids[0]].shape[0]})" if k.per_head else "shared across KV heads"
    lines = [
        f"format:      {rot.source_format}",
        f"model:       {rot.model or '(not recorded)'}",
        f"layers:      {_ranges(rot.layer_ids)} ({len(rot.layer_ids)})",
        f"head_dim:    {k.head_dim}, {heads}",
        f"objectives:  key {rot.key.objective}, value {rot.value.objective}",
        f"calibration: {json.dumps(rot.calibration) if rot.calibration else '(not recorded)'}",
    ]
    for kind, ratios in ((KEY, rot.clip_ratios_k), (VALUE, rot.clip_ratios_v)):
        if ratios is None:
            lines.append(f"clip {kind:5s}:  reference {rot.clip_ratio(kind, rot.layer_ids[0])}")
        else:
            lines.append(f"clip {kind:5s}:  per layer, {min(ratios):.4f}..{max(ratios):.4f}")
    if rot.key_means:
        size = next(iter(rot.key_means.values())).shape
        lines.append(f"key means:   before RoPE, [{size[0]}, {size[1]}] per layer")
    return "\n".join(lines)


def _read_config(path: str) -> ModelShape:
    try:
        config = json.loads(Path(path).read_text())
    except OSError as e:
        raise OscarError(f"{path}: cannot read the model config ({e.strerror or e})") from e
    except json.JSONDecodeError as e:
        raise OscarError(f"{path}: the model config is not valid JSON ({e})") from e
    try:
        return ModelShape.from_hf_config(config, name=str(Path(path).parent))
    except (AttributeError, TypeError) as e:  # not a dict, or no head counts to divide by
        raise OscarError(f"{path}: not a model config.json (needs num_hidden_layers, num_attention_heads, ...)") from e


@cli
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="oscar-rotations", description="Inspect, validate and convert OSCAR rotation folders."
    )
    # --debug is taken before or after the subcommand: the error handler reads argv itself.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(DEBUG_FLAG, action="store_true", help=DEBUG_HELP)
    parser.add_argument(DEBUG_FLAG, action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", parents=[common], help="validate a folder and print what it holds")
    p.add_argument("path", help="a rotation folder: ours or RotationZoo files")
    p.add_argument("--config", help="a model's config.json to validate against (default: no model check)")
    p = sub.add_parser("convert", parents=[common], help="convert between our format and RotationZoo")
    p.add_argument("src", help="the rotation folder to read")
    p.add_argument("dst", help="the folder to write (created)")
    p.add_argument("--to", choices=["oscar", "rotationzoo"], required=True, help="the format to write")
    p.add_argument("--config", help="a model's config.json: validates and records the model (default: none)")
    args = parser.parse_args(argv)

    shape = _read_config(args.config) if args.config else None
    rot = load_rotations(args.path if args.command == "inspect" else args.src, shape)
    if args.command == "inspect":
        print(_summary(rot))
        return
    if shape is not None:
        rot = replace(rot, model=rot.model or shape.name,
                      model_fingerprint=rot.model_fingerprint or dict(shape.fingerprint))
    with atomic_output_dir(args.dst) as tmp:  # killed at any moment: the old folder, or none
        save_rotations(rot, tmp) if args.to == "oscar" else save_rotationzoo(rot, tmp)
    print(f"wrote {args.to} rotations to {args.dst}")


if __name__ == "__main__":
    main()
