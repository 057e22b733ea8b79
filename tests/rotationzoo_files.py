"""RotationZoo files written the way the OSCAR authors publish them, so the reader is tested
on that layout without a copy of the published files (a GitHub clone has no ../shared/).

Layout (format 1 per layer, format 2 per KV head), plain ``torch.save`` of a dict:

    {"format_version": 1 | 2, "objective": "qqt_r_h_pbr" | "sst_r_h_pbr",
     "source_grouping": "layer" | "per_kv_head",
     "layers": {layer_id: {"layer_id": layer_id, "rotation": f32 [d, d] | [Hkv, d, d],
                           "eigenvalues": f32 [d] | [Hkv, d]}}}

Written here with torch.save directly, not with ``save_rotationzoo``, so a mistake shared by
our writer and our reader cannot hide.
"""
from pathlib import Path

import torch

from oscar_vllm.core.rotation import rotation_from_moment

OBJECTIVES = {"k": "qqt_r_h_pbr", "v": "sst_r_h_pbr"}


def published_state(objective: str, num_layers: int, head_dim: int, num_kv_heads: int | None, seed: int) -> dict:
    """One file's dict; ``num_kv_heads`` given: format 2 (per KV head), else format 1."""
    g = torch.Generator().manual_seed(seed)
    lead = (num_kv_heads,) if num_kv_heads else ()
    layers = {}
    for i in range(num_layers):
        x = torch.randn(*lead, 4 * head_dim, head_dim, generator=g, dtype=torch.float64)
        rotation, eigenvalues = rotation_from_moment(x.transpose(-1, -2) @ x)
        layers[i] = {"layer_id": i, "rotation": rotation.float(), "eigenvalues": eigenvalues.float()}
    version = 2 if num_kv_heads else 1
    return {
        "format_version": version,
        "objective": objective,
        "source_grouping": "per_kv_head" if num_kv_heads else "layer",
        "layers": layers,
    }


def write_published_files(folder: Path, num_layers: int, head_dim: int, num_kv_heads: int | None = None) -> Path:
    """``k_rotation_qqt_r_h_pbr.pt`` and ``v_rotation_sst_r_h_pbr.pt`` in ``folder`` (created)."""
    folder.mkdir(parents=True, exist_ok=True)
    for seed, (prefix, objective) in enumerate(OBJECTIVES.items()):
        state = published_state(objective, num_layers, head_dim, num_kv_heads, seed)
        torch.save(state, folder / f"{prefix}_rotation_{objective}.pt")
    return folder
