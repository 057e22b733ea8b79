"""Rotation files: the published RotationZoo files, our format, conversion, and every bad
input rejected with a message that names the problem."""

import json
import shutil

import pytest
import torch
from rotationzoo_files import write_published_files

from oscar_vllm.core.rotation import rotation_from_moment
from oscar_vllm.core.rotation_io import (
    METADATA_FILE,
    ModelShape,
    OscarRotations,
    RotationFileError,
    RotationSet,
    hadamard_rotation_sets,
    load_rotations,
    main,
    save_rotations,
    save_rotationzoo,
)

QWEN3_8B = ModelShape(36, 8, 128)
SMALL = ModelShape(4, 2, 16, "tiny-llama", {"model_type": "llama", "num_hidden_layers": 4, "head_dim": 16})


def random_set(kind, shape=SMALL, per_head=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    rots, eigs = {}, {}
    for i in range(shape.num_layers):
        lead = (shape.num_kv_heads,) if per_head else ()
        x = torch.randn(*lead, 64, shape.head_dim, generator=g, dtype=torch.float64)
        r, e = rotation_from_moment(x.transpose(-1, -2) @ x)
        rots[i], eigs[i] = r.float(), e.float()
    objective = "qqt_r_h_pbr" if kind == "key" else "sst_r_h_pbr"
    return RotationSet(kind, objective, rots, eigs)


def small_rotations(per_head=False, **kw):
    return OscarRotations(
        random_set("key", per_head=per_head), random_set("value", per_head=per_head, seed=1),
        model="tiny-llama", model_fingerprint=dict(SMALL.fingerprint), **kw,
    )


def test_qwen3_8b_rotationzoo_files(qwen3_8b_zoo):
    rot = load_rotations(qwen3_8b_zoo, QWEN3_8B)
    assert rot.source_format == "rotationzoo"
    assert rot.layer_ids == list(range(36)) and rot.key.head_dim == 128 and not rot.key.per_head
    assert (rot.key.objective, rot.value.objective) == ("qqt_r_h_pbr", "sst_r_h_pbr")
    raw = torch.load(qwen3_8b_zoo / "k_rotation_qqt_r_h_pbr.pt", weights_only=True)
    assert raw["format_version"] == 1 and raw["source_grouping"] == "layer"
    assert torch.equal(rot.key.rotations[7], raw["layers"][7]["rotation"])
    assert torch.equal(rot.key.eigenvalues[7], raw["layers"][7]["eigenvalues"])
    r = rot.value.rotations[35].double()
    assert (r.T @ r - torch.eye(128, dtype=torch.float64)).abs().max() < 1e-5
    assert rot.clip_ratio("key", 0) == 0.96 and rot.clip_ratio("value", 3) == 0.92


def test_rotationzoo_files_convert_to_ours_and_back(qwen3_8b_zoo, tmp_path):
    rot = load_rotations(qwen3_8b_zoo, QWEN3_8B)
    ours = load_rotations(save_rotations(rot, tmp_path / "ours"), QWEN3_8B)
    back = load_rotations(save_rotationzoo(ours, tmp_path / "zoo"), QWEN3_8B)
    for a, b in ((rot, ours), (rot, back)):
        for i in rot.layer_ids:
            assert torch.equal(a.key.rotations[i], b.key.rotations[i])
            assert torch.equal(a.value.eigenvalues[i], b.value.eigenvalues[i])
    raw = torch.load(tmp_path / "zoo" / "v_rotation_sst_r_h_pbr.pt", weights_only=True)
    assert set(raw) == {"format_version", "objective", "source_grouping", "layers"}


def test_written_files_have_the_published_layout(qwen3_8b_rotations, written_qwen3_8b_rotations):
    """What the other tests read in place of the published files is laid out like them."""
    for name in ("k_rotation_qqt_r_h_pbr.pt", "v_rotation_sst_r_h_pbr.pt"):
        published = torch.load(qwen3_8b_rotations / name, weights_only=True)
        written = torch.load(written_qwen3_8b_rotations / name, weights_only=True)
        assert ({k: v for k, v in written.items() if k != "layers"}
                == {k: v for k, v in published.items() if k != "layers"})
        assert list(written["layers"]) == list(published["layers"])  # the same int keys, in order
        for i, entry in published["layers"].items():
            ours = written["layers"][i]
            assert set(ours) == set(entry) and type(ours["layer_id"]) is type(entry["layer_id"])
            assert ours["layer_id"] == entry["layer_id"]
            for key in ("rotation", "eigenvalues"):
                assert (ours[key].dtype, ours[key].shape) == (entry[key].dtype, entry[key].shape)


def test_published_format_2_per_head_files(tmp_path):
    """Format 2 as published: one rotation per KV head, read by the same loader."""
    write_published_files(tmp_path, num_layers=4, head_dim=16, num_kv_heads=2)
    raw = torch.load(tmp_path / "v_rotation_sst_r_h_pbr.pt", weights_only=True)
    rot = load_rotations(tmp_path, SMALL)
    assert rot.key.per_head and rot.value.per_head and rot.layer_ids == [0, 1, 2, 3]
    assert rot.value.rotations[2].shape == (2, 16, 16) and rot.value.eigenvalues[2].shape == (2, 16)
    assert torch.equal(rot.value.rotations[2], raw["layers"][2]["rotation"])
    with pytest.raises(RotationFileError, match="per-head rotations for 2 KV heads but the model has 8"):
        load_rotations(tmp_path, ModelShape(4, 8, 16))


@pytest.mark.parametrize("per_head", [False, True])
def test_our_format_round_trip_with_metadata(tmp_path, per_head):
    rot = small_rotations(per_head, clip_ratios_k=[0.9, 0.91, 0.92, 0.93], clip_ratios_v=[0.8] * 4,
                          calibration={"tokens": 8192, "corpus": "x"})
    save_rotations(rot, tmp_path)
    info = json.loads((tmp_path / METADATA_FILE).read_text())
    assert info["format_version"] == 1 and info["per_head"] is per_head and info["head_dim"] == 16
    assert info["layer_ids"] == [0, 1, 2, 3] and info["calibration"]["tokens"] == 8192
    assert info["num_kv_heads"] == (2 if per_head else None)
    got = load_rotations(tmp_path, SMALL)
    assert got.key.per_head is per_head
    assert got.clip_ratio("key", 2) == 0.92 and got.clip_ratio("value", 0) == 0.8
    assert torch.equal(got.value.rotations[3], rot.value.rotations[3])


def test_format_2_per_head_rotationzoo(tmp_path):
    save_rotationzoo(small_rotations(per_head=True), tmp_path)
    raw = torch.load(tmp_path / "k_rotation_qqt_r_h_pbr.pt", weights_only=True)
    assert raw["format_version"] == 2 and raw["source_grouping"] == "per_kv_head"
    assert raw["layers"][0]["rotation"].shape == (2, 16, 16)
    assert load_rotations(tmp_path, SMALL).key.per_head


def test_convert_cli(qwen3_8b_zoo, tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 36, "hidden_size": 4096,
                                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}))
    main(["convert", str(qwen3_8b_zoo), str(tmp_path / "out"), "--to", "oscar", "--config", str(config)])
    info = json.loads((tmp_path / "out" / METADATA_FILE).read_text())
    assert info["model_fingerprint"]["num_hidden_layers"] == 36
    main(["inspect", str(tmp_path / "out")])
    assert "layers:      0-35 (36)" in capsys.readouterr().out


# ------------------------------------------------------------------------ bad inputs


def write_zoo(tmp_path, rot=None):
    save_rotationzoo(rot or small_rotations(), tmp_path)
    return tmp_path


def rewrite_zoo(path, edit):
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)


def test_missing_path(tmp_path):
    with pytest.raises(RotationFileError, match="does not exist"):
        load_rotations(tmp_path / "nope")


def test_folder_without_rotation_files(tmp_path):
    with pytest.raises(RotationFileError, match="no rotation files found.*oscar-calibrate"):
        load_rotations(tmp_path)


def test_missing_value_file(tmp_path):
    write_zoo(tmp_path)
    (tmp_path / "v_rotation_sst_r_h_pbr.pt").unlink()
    with pytest.raises(RotationFileError, match="expected one value file"):
        load_rotations(tmp_path)


def test_missing_file_in_our_format(tmp_path):
    save_rotations(small_rotations(), tmp_path)
    (tmp_path / "k_rotation.safetensors").unlink()
    with pytest.raises(RotationFileError, match="k_rotation.safetensors: missing"):
        load_rotations(tmp_path)


def test_wrong_zoo_format_version(tmp_path):
    write_zoo(tmp_path)
    rewrite_zoo(tmp_path / "k_rotation_qqt_r_h_pbr.pt", lambda s: s.update(format_version=3))
    with pytest.raises(RotationFileError, match="format_version 3"):
        load_rotations(tmp_path)


def test_wrong_our_format_version(tmp_path):
    save_rotations(small_rotations(), tmp_path)
    info = json.loads((tmp_path / METADATA_FILE).read_text())
    info["format_version"] = 3
    (tmp_path / METADATA_FILE).write_text(json.dumps(info))
    with pytest.raises(RotationFileError, match="format_version 3"):
        load_rotations(tmp_path)


def test_not_a_torch_file(tmp_path):
    write_zoo(tmp_path)
    (tmp_path / "k_rotation_qqt_r_h_pbr.pt").write_bytes(b"garbage")
    with pytest.raises(RotationFileError, match="not a readable torch.save file"):
        load_rotations(tmp_path)


def test_missing_layers(tmp_path):
    write_zoo(tmp_path)
    rewrite_zoo(tmp_path / "k_rotation_qqt_r_h_pbr.pt", lambda s: (s["layers"].pop(1), s["layers"].pop(2)))
    with pytest.raises(RotationFileError, match=r"missing layers 1-2 \(the model has 4 layers\)"):
        load_rotations(tmp_path, SMALL)


def test_extra_layers(tmp_path):
    write_zoo(tmp_path)
    with pytest.raises(RotationFileError, match=r"extra layers 3"):
        load_rotations(tmp_path, ModelShape(3, 2, 16))


def test_wrong_head_dim(tmp_path):
    write_zoo(tmp_path)
    with pytest.raises(RotationFileError, match="16x16 but the model's head_dim is 128"):
        load_rotations(tmp_path, ModelShape(4, 2, 128))


def test_wrong_head_count(tmp_path):
    write_zoo(tmp_path, small_rotations(per_head=True))
    with pytest.raises(RotationFileError, match="per-head rotations for 2 KV heads but the model has 8"):
        load_rotations(tmp_path, ModelShape(4, 8, 16))


def test_per_head_shape_in_a_format_1_file(tmp_path):
    write_zoo(tmp_path, small_rotations(per_head=True))
    rewrite_zoo(tmp_path / "k_rotation_qqt_r_h_pbr.pt", lambda s: s.update(format_version=1, source_grouping="layer"))
    with pytest.raises(RotationFileError, match="needs 2 dims"):
        load_rotations(tmp_path)


def test_non_orthogonal(tmp_path):
    write_zoo(tmp_path)

    def scale_layer(state):
        state["layers"][2]["rotation"] = state["layers"][2]["rotation"] * 1.01

    rewrite_zoo(tmp_path / "v_rotation_sst_r_h_pbr.pt", scale_layer)
    with pytest.raises(RotationFileError, match="layer 2 rotation is not orthogonal"):
        load_rotations(tmp_path)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf(tmp_path, bad):
    write_zoo(tmp_path)

    def poison(state):
        state["layers"][0]["rotation"][3, 5] = bad

    rewrite_zoo(tmp_path / "k_rotation_qqt_r_h_pbr.pt", poison)
    with pytest.raises(RotationFileError, match="layer 0 rotation contains NaN or Inf"):
        load_rotations(tmp_path)


def test_key_file_given_as_value_file(tmp_path):
    write_zoo(tmp_path)
    k, v = tmp_path / "k_rotation_qqt_r_h_pbr.pt", tmp_path / "v_rotation_sst_r_h_pbr.pt"
    shutil.move(k, tmp_path / "tmp.pt")
    shutil.move(v, tmp_path / "k_rotation_sst_r_h_pbr.pt")
    shutil.move(tmp_path / "tmp.pt", tmp_path / "v_rotation_qqt_r_h_pbr.pt")
    with pytest.raises(RotationFileError, match="holds value rotations .* given as the key rotation file"):
        load_rotations(tmp_path)


def test_key_file_given_as_value_file_in_our_format(tmp_path):
    save_rotations(small_rotations(), tmp_path)
    k, v = tmp_path / "k_rotation.safetensors", tmp_path / "v_rotation.safetensors"
    k.rename(tmp_path / "tmp"), v.rename(k), (tmp_path / "tmp").rename(v)
    with pytest.raises(RotationFileError, match="holds value rotations"):
        load_rotations(tmp_path)


def test_file_made_for_another_model(tmp_path):
    save_rotations(small_rotations(), tmp_path)
    other = ModelShape(4, 2, 16, "tiny-qwen3", {"model_type": "qwen3", "num_hidden_layers": 4, "head_dim": 16})
    with pytest.raises(RotationFileError, match=r"calibrated for tiny-llama but the model tiny-qwen3 differs "
                                                r"\(model_type llama vs qwen3\)"):
        load_rotations(tmp_path, other)


def test_clip_ratio_count_must_match_layers(tmp_path):
    save_rotations(small_rotations(clip_ratios_k=[0.9, 0.9]), tmp_path)
    with pytest.raises(RotationFileError, match="2 key clip ratios for 4 layers"):
        load_rotations(tmp_path)


def test_key_and_value_layers_must_agree(tmp_path):
    rot = small_rotations()
    del rot.value.rotations[3]
    save_rotationzoo(rot, tmp_path)
    with pytest.raises(RotationFileError, match="key rotations cover layers 0-3 but value rotations cover 0-2"):
        load_rotations(tmp_path)


def test_hadamard_sets_validate():
    k, v = hadamard_rotation_sets([0, 1, 2, 3], 16)
    from oscar_vllm.core.rotation_io import validate_rotations

    validate_rotations(OscarRotations(k, v), SMALL)
    with pytest.raises(RotationFileError, match="given as the value rotation"):
        validate_rotations(OscarRotations(k, k), SMALL)


def test_hadamard_sets_save_and_load(tmp_path):
    """The Hadamard sets give every layer the same tensor; safetensors refuses to write tensors that
    share memory, so saving them failed until the writer copied each."""
    k, v = hadamard_rotation_sets([0, 1, 2, 3], 16)
    back = load_rotations(save_rotations(OscarRotations(k, v), tmp_path), SMALL)
    assert all(torch.equal(back.key.rotations[i], k.rotations[i]) for i in range(4))
    assert back.key.objective == "hadamard"
    transposed = RotationSet("key", k.objective, {i: r.t() for i, r in k.rotations.items()}, k.eigenvalues)
    back = load_rotations(save_rotations(OscarRotations(transposed, v), tmp_path / "t"), SMALL)
    assert torch.equal(back.key.rotations[0], k.rotations[0].t()), "views are written as their values"


def key_means(shape=SMALL, seed=2):
    g = torch.Generator().manual_seed(seed)
    return {i: torch.randn(shape.num_kv_heads, shape.head_dim, generator=g) for i in range(shape.num_layers)}


@pytest.mark.parametrize("per_head", [False, True])
def test_key_means_round_trip_in_format_2(tmp_path, per_head):
    means = key_means()
    save_rotations(small_rotations(per_head, key_means=means), tmp_path)
    assert json.loads((tmp_path / METADATA_FILE).read_text())["format_version"] == 2
    got = load_rotations(tmp_path, SMALL)
    assert sorted(got.key_means) == [0, 1, 2, 3]
    assert all(torch.equal(got.key_means[i], means[i]) for i in means)
    assert load_rotations(save_rotations(small_rotations(per_head), tmp_path / "none"), SMALL).key_means is None


def test_key_means_are_left_out_of_rotationzoo_files_with_a_warning(tmp_path, caplog):
    save_rotationzoo(small_rotations(key_means=key_means()), tmp_path)
    assert "leave them out" in caplog.text
    assert load_rotations(tmp_path, SMALL).key_means is None


def edit_key_file(folder, edit):
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = folder / "k_rotation.safetensors"
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    edit(meta, tensors)
    save_file(tensors, str(path), metadata=meta)


@pytest.mark.parametrize("edit, problem", [
    (lambda m, t: t.update({"layers.2.key_mean": torch.zeros(2, 8)}),
     r"layer 2 key mean has shape \(2, 8\), not \[2, 16\]"),
    (lambda m, t: t.update({"layers.1.key_mean": torch.zeros(3, 16)}),
     r"layer 1 key mean has shape \(3, 16\), not \[2, 16\]"),
    (lambda m, t: t["layers.0.key_mean"].__setitem__((1, 3), float("nan")), "layer 0 key mean contains NaN or Inf"),
    (lambda m, t: t.update({"layers.3.key_mean": torch.zeros(2, 16, dtype=torch.int32)}),
     "layer 3 key mean is int32, not float"),
    (lambda m, t: t.pop("layers.3.key_mean"), "key means missing for layers 3"),
    (lambda m, t: m.update(format_version="1"), "unexpected tensor 'layers.0.key_mean'"),
])
def test_bad_key_means_are_refused_by_name(tmp_path, edit, problem):
    save_rotations(small_rotations(key_means=key_means()), tmp_path)
    edit_key_file(tmp_path, edit)
    with pytest.raises(RotationFileError, match=problem):
        load_rotations(tmp_path, SMALL)


def test_a_key_mean_in_the_value_file_is_refused(tmp_path):
    save_rotations(small_rotations(key_means=key_means()), tmp_path)
    (tmp_path / "v_rotation.safetensors").unlink()
    (tmp_path / "k_rotation.safetensors").rename(tmp_path / "v_rotation.safetensors")
    save_rotations(small_rotations(), tmp_path / "keys")
    (tmp_path / "keys" / "k_rotation.safetensors").rename(tmp_path / "k_rotation.safetensors")
    with pytest.raises(RotationFileError, match="v_rotation.safetensors: unexpected tensor 'layers.0.key_mean'"):
        load_rotations(tmp_path, SMALL)


def test_inspect_names_the_key_means(tmp_path, capsys):
    save_rotations(small_rotations(key_means=key_means()), tmp_path)
    main(["inspect", str(tmp_path)])
    assert "key means:   before RoPE, [2, 16] per layer" in capsys.readouterr().out


def test_loaded_rotations_do_not_change_when_the_files_are_written_over(tmp_path):
    """safetensors maps the files: what a process loaded must be its own copy, not change when
    someone copies other rotations over the files in place."""
    save_rotations(small_rotations(key_means=key_means()), tmp_path / "a")
    save_rotations(small_rotations(key_means=key_means(seed=5)), tmp_path / "b")
    got = load_rotations(tmp_path / "a", SMALL)
    before = (got.key.rotations[1].clone(), got.key_means[2].clone())
    for name in ("k_rotation.safetensors", "v_rotation.safetensors"):
        (tmp_path / "a" / name).write_bytes((tmp_path / "b" / name).read_bytes())  # in place, as cp does
    assert torch.equal(got.key.rotations[1], before[0]) and torch.equal(got.key_means[2], before[1])
