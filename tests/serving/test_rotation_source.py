"""Rotation paths: local folders, the Hub cache (offline, from a local cache) and Hadamard."""
import shutil

import pytest
import torch

import huggingface_hub.constants as hub_constants
from oscar_vllm.core.rotation_io import ModelShape, RotationFileError
from oscar_vllm.core.settings import OscarSettings, OscarSettingsError
from oscar_vllm.serving.rotation_source import parse_hub_spec, resolve_rotation_path, rotations_for_model

QWEN3_8B = ModelShape(36, 8, 128, "Qwen/Qwen3-8B")


def test_local_rotationzoo_folder(qwen3_8b_zoo):
    rot = rotations_for_model(OscarSettings(rotation_path=str(qwen3_8b_zoo)), QWEN3_8B)
    assert rot.layer_ids == list(range(36)) and rot.key.rotations[0].shape == (128, 128)


def test_hadamard_by_name():
    rot = rotations_for_model(OscarSettings(rotation_path="hadamard"), QWEN3_8B)
    r = rot.key.rotations[5]
    torch.testing.assert_close(r @ r.T, torch.eye(128), atol=1e-5, rtol=0)


def test_no_rotation_path_is_an_error_with_the_fix():
    with pytest.raises(OscarSettingsError, match="oscar-calibrate"):
        rotations_for_model(OscarSettings(), QWEN3_8B)


def test_key_mean_on_needs_rotations_that_have_them(qwen3_8b_zoo, tmp_path):
    from oscar_vllm.core.rotation_io import load_rotations, save_rotations

    for path in (str(qwen3_8b_zoo), "hadamard"):
        with pytest.raises(OscarSettingsError, match="key_mean 'on' needs rotations with key means, and .* has none: "
                                                     "write them with `oscar-calibrate"):
            rotations_for_model(OscarSettings(rotation_path=path, key_mean="on"), QWEN3_8B)
    rot = load_rotations(qwen3_8b_zoo, QWEN3_8B)
    rot.key_means = {i: torch.zeros(8, 128) for i in rot.layer_ids}
    save_rotations(rot, tmp_path / "ours")
    got = rotations_for_model(OscarSettings(rotation_path=str(tmp_path / "ours"), key_mean="on"), QWEN3_8B)
    assert got.key_means[35].shape == (8, 128)


def test_wrong_model_is_refused(qwen3_8b_zoo):
    with pytest.raises(RotationFileError):
        rotations_for_model(OscarSettings(rotation_path=str(qwen3_8b_zoo)), ModelShape(30, 3, 64, "SmolLM2"))


@pytest.mark.parametrize("spec,want", [
    ("hf://org/repo", ("org/repo", "", None)),
    ("org/repo/rotations/qwen3", ("org/repo", "rotations/qwen3", None)),
    ("hf://org/repo/sub@v1.0", ("org/repo", "sub", "v1.0")),
])
def test_parse_hub_spec(spec, want):
    assert parse_hub_spec(spec) == want


def make_hub_cache(cache, files, repo="oscar-org/rotation-zoo", commit="0123456789abcdef0123456789abcdef01234567"):
    base = cache / f"models--{repo.replace('/', '--')}"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    snap = base / "snapshots" / commit
    for src, rel in files:
        (snap / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, snap / rel)
    return snap


def test_hub_spec_resolves_from_the_local_hub_cache(tmp_path, monkeypatch, qwen3_8b_zoo):
    files = [(p, f"Qwen3-8B/{p.name}") for p in qwen3_8b_zoo.glob("*.pt")]
    snap = make_hub_cache(tmp_path, files)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    folder = resolve_rotation_path("hf://oscar-org/rotation-zoo/Qwen3-8B")
    assert folder == snap / "Qwen3-8B"
    rot = rotations_for_model(OscarSettings(rotation_path="oscar-org/rotation-zoo/Qwen3-8B"), QWEN3_8B)
    assert rot.source_format == "rotationzoo"
    with pytest.raises(RotationFileError, match="Hugging Face Hub"):
        resolve_rotation_path("hf://oscar-org/not-cached/Qwen3-8B")
    with pytest.raises(RotationFileError, match="has no folder"):
        resolve_rotation_path("hf://oscar-org/rotation-zoo/Llama")


def test_missing_local_folder():
    with pytest.raises(RotationFileError, match="does not exist"):
        resolve_rotation_path("./no/such/rotations")
