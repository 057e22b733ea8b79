"""Bad input refused at startup, by name: every kind in docs/reliability.md's table has its
``test_refuses_*`` here, and each goes through the path vLLM itself takes, the plugin's check on
``EngineArgs.create_engine_config`` (run before any engine process, worker or GPU memory
exists), on the CPU, with real vLLM configs built from config.json files (benchmarks/vllm_cpu.py)."""
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rotationzoo_files import write_published_files
from benchmarks.vllm_cpu import Card, vllm_configs_on_cpu

from oscar_vllm.core.atomic_output import PARTIAL_MARK
from oscar_vllm.core.rotation_io import RotationFileError, load_rotations, save_rotations
from oscar_vllm.core.settings import OscarSettings, OscarSettingsError
from oscar_vllm.serving.preflight import SUPPORTED_HEAD_DIMS, WINDOW_BLOCK_TOKENS, OscarStartupError

vllm = pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "reliability.md"
QWEN3 = dict(json.loads((REPO / "benchmarks" / "configs" / "qwen3-8b.json").read_text()), num_hidden_layers=2,
             hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
             vocab_size=1000, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
# Other architectures, as small as their configs allow.
MODELS = {
    "qwen3": QWEN3,
    "qwen3_moe": dict(QWEN3, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=128, decoder_sparse_step=1),
    "qwen2_swa": dict(QWEN3, architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=True,
                      sliding_window=1024, max_window_layers=0),
    "head_dim_96": dict(QWEN3, head_dim=96),
    "head_dim_80": dict(QWEN3, head_dim=80),
    "head_dim_256": dict(QWEN3, head_dim=256),
    "awq": dict(QWEN3, quantization_config={"quant_method": "awq", "bits": 4, "group_size": 128,
                                            "zero_point": True, "version": "gemm"}),
    "one_kv_head": dict(QWEN3, num_key_value_heads=1),
    "deepseek_v3": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 256,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 128,
                    "q_lora_rank": 96, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
                    "vocab_size": 1000, "intermediate_size": 512, "moe_intermediate_size": 64, "n_routed_experts": 4,
                    "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
                    "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "rope_theta": 10000},
    "whisper": {"architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper", "d_model": 256,
                "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
                "vocab_size": 1000, "num_mel_bins": 80, "max_source_positions": 1500, "max_target_positions": 448,
                "encoder_ffn_dim": 512, "decoder_ffn_dim": 512, "pad_token_id": 0, "bos_token_id": 1,
                "eos_token_id": 2, "decoder_start_token_id": 1},
    "bert": {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 256, "num_hidden_layers": 2,
             "num_attention_heads": 4, "intermediate_size": 512, "vocab_size": 1000, "max_position_embeddings": 512,
             "type_vocab_size": 2},
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 256,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
               "intermediate_size": 512, "vocab_size": 1000, "sliding_window": 1024, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 128, "max_position_embeddings": 4096},
}


@pytest.fixture(scope="module")
def engine_args():
    """vLLM's ``EngineArgs``, its configs buildable on this CPU machine (benchmarks/vllm_cpu.py)."""
    with vllm_configs_on_cpu() as engine_args_cls:
        yield engine_args_cls


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A folder with a config.json per model of MODELS."""
    base = tmp_path_factory.mktemp("models")
    for name, config in MODELS.items():
        (base / name).mkdir()
        (base / name / "config.json").write_text(json.dumps(config))
    return base


def build(engine_args, model: Path, oscar: dict | None = None, **kwargs):
    """``vllm serve MODEL --attention-backend OSCAR --additional-config '{"oscar": ...}' ...``'s config."""
    args = dict(model=str(model), attention_backend="OSCAR", skip_tokenizer_init=True, max_model_len=2048,
                additional_config={"oscar": {"rotation_path": "hadamard"} if oscar is None else oscar})
    return engine_args(**{**args, **kwargs}).create_engine_config()


def refused(engine_args, model: Path, match: str, error=OscarStartupError, oscar=None, **kwargs) -> str:
    with pytest.raises(error, match=match) as info:
        build(engine_args, model, oscar, **kwargs)
    return str(info.value)


# ------------------------------------------------------------------ what passes, and how it travels


def test_a_servable_engine_passes_and_its_settings_travel_in_its_config(engine_args, models, zoo, tmp_path,
                                                                         monkeypatch):
    rotations = zoo()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OSCAR_RECENT_SIZE", "128")
    config = build(engine_args, models / "qwen3", {"rotation_path": "rot"})
    # Every setting, from the JSON or the environment, in the config every process unpickles; the
    # folder absolute: a worker started elsewhere has another working directory and environment.
    assert config.additional_config["oscar"] == {"rotation_path": str(rotations), "sink_size": 64,
                                                 "recent_size": 128, "scale_dtype": "fp16",
                                                 "prefill_read": "chunk",
                                                 "decode_splits": 0, "hit_ring": "recompute",
                                                 "key_mean": "off", "decode_kernel": "auto",
                                                 "warm_up_threads": 4}
    monkeypatch.delenv("OSCAR_RECENT_SIZE")
    assert OscarSettings.from_vllm_config(config).recent_size == 128
    assert build(engine_args, models / "qwen3", attention_backend="FLASH_ATTN").additional_config == {
        "oscar": {"rotation_path": "hadamard"}}, "other backends are not checked nor changed"


def test_every_problem_is_named_at_once(engine_args, models):
    message = refused(engine_args, models / "gemma2", r"cannot serve .*gemma2: \(1\)", kv_cache_dtype="fp8",
                      oscar={"rotation_path": "hadamard", "sink_size": 50})
    for problem in ("sliding-window attention (window 1024)", "soft-capping (50.0)", "model type 'gemma2'",
                    "--kv-cache-dtype fp8", "sink_size 50"):
        assert problem in message, problem


def test_the_plugin_checks_configs_as_vllm_builds_them():
    """In a fresh interpreter, as in ``vllm serve``: building EngineArgs loads the plugin, which
    wraps ``create_engine_config``."""
    code = ("from vllm.engine.arg_utils import EngineArgs; EngineArgs(model='m'); "
            "print(EngineArgs.create_engine_config.__oscar_wrapped__, "
            "EngineArgs.create_engine_config.__doc__ is not None)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.stdout.strip().splitlines()[-1] == "True True", proc.stderr[-2000:]


def test_workers_check_configs_that_skipped_the_startup_check(engine_args, models):
    from oscar_vllm.serving import preflight

    config = build(engine_args, models / "qwen3", attention_backend="FLASH_ATTN")
    preflight.check_in_worker(config)  # not an OSCAR engine: nothing to refuse
    config = build(engine_args, models / "qwen3")
    config.cache_config.cache_dtype = "fp8"  # changed after the startup check, as a hand-built config could be
    with pytest.raises(OscarStartupError, match="--kv-cache-dtype fp8"):
        preflight.check_in_worker(config)


def test_the_checks_agree_with_the_kernels():
    from csrc_triton.paged_layout import BLOCK_SIZE

    from oscar_vllm.serving.backend import OscarAttentionBackend

    assert WINDOW_BLOCK_TOKENS == BLOCK_SIZE
    assert tuple(OscarAttentionBackend.get_supported_head_sizes()) == SUPPORTED_HEAD_DIMS


# ------------------------------------------------------------------ rotation files


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """RotationZoo folders written once (an eigendecomposition per matrix): -> a copy of one."""
    base = tmp_path_factory.mktemp("pristine")
    made = {}

    def copy(tmp_path: Path, layers: int = 2, head_dim: int = 128, num_kv_heads: int | None = None) -> Path:
        key = (layers, head_dim)
        if key not in made:
            made[key] = write_published_files(base / "-".join(map(str, key)), layers, head_dim)
        folder = shutil.copytree(made[key], tmp_path / "rot")
        if num_kv_heads:  # format 2: the layer's rotation for every head (a per-head file, made without eigh)
            for prefix in "kv":
                edit_zoo(folder, prefix, lambda s: (s.update(format_version=2, source_grouping="per_kv_head"), [
                    e.update(rotation=e["rotation"].expand(num_kv_heads, -1, -1).clone(),
                             eigenvalues=e["eigenvalues"].expand(num_kv_heads, -1).clone())
                    for e in s["layers"].values()]))
        return folder

    return copy


@pytest.fixture
def zoo(pristine, tmp_path):
    """A copy, in this test's folder, of the RotationZoo files for QWEN3 (or another shape)."""
    return lambda **kw: pristine(tmp_path, **kw)


def edit_zoo(folder: Path, prefix: str, edit) -> None:
    path = next(folder.glob(f"{prefix}_rotation_*.pt"))
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)


def rot_refused(engine_args, models, folder: Path, match: str, model: str = "qwen3") -> str:
    return refused(engine_args, models / model, match, RotationFileError, oscar={"rotation_path": str(folder)})


@pytest.mark.parametrize("case", ["head_dim", "not_square"])
def test_refuses_rotations_of_the_wrong_shape(engine_args, models, zoo, tmp_path, case):
    if case == "head_dim":
        folder = zoo(head_dim=64)
        rot_refused(engine_args, models, folder, "rotations are 64x64 but the model's head_dim is 128")
    else:
        folder = zoo()
        edit_zoo(folder, "k", lambda s: s["layers"][1].update(rotation=s["layers"][1]["rotation"][:, :96]))
        rot_refused(engine_args, models, folder, r"layer 1 rotation has shape \(128, 96\), not \[d, d\]")


@pytest.mark.parametrize("layers,match", [(1, r"missing layers 1 \(the model has 2 layers\)"),
                                          (3, r"has extra layers 2 \(the model has 2 layers\)")])
def test_refuses_rotations_with_the_wrong_layer_count(engine_args, models, zoo, tmp_path, layers, match):
    rot_refused(engine_args, models, zoo(layers=layers), match)


def test_refuses_per_head_rotations_for_other_kv_heads(engine_args, models, zoo, tmp_path):
    rot_refused(engine_args, models, zoo(num_kv_heads=4),
                "per-head rotations for 4 KV heads but the model has 2 KV heads")


def test_refuses_non_orthogonal_rotations(engine_args, models, zoo, tmp_path):
    folder = zoo()
    edit_zoo(folder, "v", lambda s: s["layers"][1]["rotation"].mul_(1.001))
    rot_refused(engine_args, models, folder, r"layer 1 rotation is not orthogonal \(max \|RᵀR - I\| = 0.002")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_refuses_nan_or_inf_rotations(engine_args, models, zoo, tmp_path, bad):
    folder = zoo()
    edit_zoo(folder, "k", lambda s: s["layers"][0]["rotation"].__setitem__((5, 7), bad))
    rot_refused(engine_args, models, folder, "layer 0 rotation contains NaN or Inf")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("fmt", ["rotationzoo", "ours"])
def test_refuses_rotations_of_the_wrong_dtype(engine_args, models, zoo, pristine, tmp_path, dtype, fmt):
    folder = zoo()
    edit_zoo(folder, "k", lambda s: s["layers"][1].update(rotation=s["layers"][1]["rotation"].to(dtype)))
    if fmt == "ours":  # our safetensors files, written by hand with the half-precision tensor in them
        from safetensors.torch import load_file, save_file

        ours = tmp_path / "ours"
        save_rotations(load_rotations(pristine(tmp_path / "ok")), ours)
        path = ours / "k_rotation.safetensors"
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
        tensors = load_file(str(path))
        tensors["layers.1.rotation"] = tensors["layers.1.rotation"].to(dtype)
        save_file(tensors, str(path), metadata=meta)
        folder = ours
    name = str(dtype).removeprefix("torch.")
    rot_refused(engine_args, models, folder, f"layer 1 rotation is stored as {name}; rotations are float32")


@pytest.mark.parametrize("fmt", ["rotationzoo", "ours"])
def test_refuses_a_truncated_rotation_file(engine_args, models, zoo, tmp_path, fmt):
    folder = zoo()
    if fmt == "ours":
        save_rotations(load_rotations(folder), tmp_path / "ours")
        folder = tmp_path / "ours"
    path = next(p for p in folder.iterdir() if p.name.startswith("v_"))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    what = "torch.save" if fmt == "rotationzoo" else "safetensors"
    rot_refused(engine_args, models, folder, rf"{path.name}: is not a readable {what} file")


class RunsCode:
    """What a malicious file pickles: a call made while the file is read, if it were ever read."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_refuses_a_pickle_with_code_in_it(engine_args, models, zoo, tmp_path):
    folder = zoo()
    marker = tmp_path / "the-code-ran"
    edit_zoo(folder, "k", lambda s: s["layers"][0].update(note=RunsCode(marker)))
    rot_refused(engine_args, models, folder, r"holds a pickled object other than tensors.*\(posix.mkdir\); "
                                              "refused unread, since loading it would run code")
    assert not marker.exists()


@pytest.mark.parametrize("case,match", [
    ("no_rotation", r"layer 1 entry has no 'rotation' \(it holds \['eigenvalues', 'layer_id'\]\); format 2"),
    ("no_layers", "is not a RotationZoo file \\(expected keys format_version, objective, layers\\)"),
    ("entry_not_a_map", r"layer 0 entry has no 'rotation' \(it holds Tensor\)"),
])
def test_refuses_a_format_2_file_with_missing_keys(engine_args, models, zoo, tmp_path, case, match):
    folder = zoo(num_kv_heads=2)
    edit = {"no_rotation": lambda s: s["layers"][1].pop("rotation"), "no_layers": lambda s: s.pop("layers"),
            "entry_not_a_map": lambda s: s["layers"].update({0: s["layers"][0]["rotation"]})}[case]
    edit_zoo(folder, "v", edit)
    rot_refused(engine_args, models, folder, match)


def test_refuses_a_hub_id_that_does_not_exist(engine_args, models, tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))  # nothing cached, no network
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    refused(engine_args, models / "qwen3", r"hf://no-such-org/no-such-rotations: could not fetch rotations from "
            "the Hugging Face Hub", RotationFileError, oscar={"rotation_path": "hf://no-such-org/no-such-rotations"})


@pytest.mark.parametrize("case", ["no_such_path", "empty_folder"])
def test_refuses_a_rotation_path_without_rotations(engine_args, models, tmp_path, case):
    folder = tmp_path / "rot"
    if case == "empty_folder":
        folder.mkdir()
    match = "rotation path does not exist" if case == "no_such_path" else "no rotation files found"
    rot_refused(engine_args, models, folder, match)


def test_refuses_swapped_key_and_value_files(engine_args, models, zoo, tmp_path):
    folder = zoo()
    k, v = folder / "k_rotation_qqt_r_h_pbr.pt", folder / "v_rotation_sst_r_h_pbr.pt"
    k.rename(tmp_path / "k"), v.rename(folder / "k_rotation_sst_r_h_pbr.pt")
    (tmp_path / "k").rename(folder / "v_rotation_qqt_r_h_pbr.pt")
    rot_refused(engine_args, models, folder, "holds value rotations .* given as the key rotation file")


def test_refuses_rotations_made_for_another_model(engine_args, models, zoo, tmp_path):
    rot = load_rotations(zoo())
    rot.model, rot.model_fingerprint = "Llama-tiny", {"model_type": "llama", "num_hidden_layers": 2}
    save_rotations(rot, tmp_path / "ours")
    rot_refused(engine_args, models, tmp_path / "ours", r"calibrated for Llama-tiny but the model .*qwen3 differs "
                                                        r"\(model_type llama vs qwen3, ")


def test_refuses_an_engine_without_rotations(engine_args, models):
    refused(engine_args, models / "qwen3", "the OSCAR backend needs rotations: .*oscar-calibrate", OscarSettingsError,
            oscar={})


def test_refuses_key_mean_without_key_means(engine_args, models, zoo, tmp_path):
    """``key_mean`` "on" with rotations that have no means (RotationZoo files, the Hadamard mode,
    format 1): refused with the command that writes them; with format 2's means it starts, and
    "auto" starts with either (the means where the file has them)."""
    folder = zoo()
    for path in (str(folder), "hadamard"):
        refused(engine_args, models / "qwen3", "key_mean 'on' needs rotations with key means, and .* has none: write "
                "them with `oscar-calibrate", OscarSettingsError, oscar={"rotation_path": path, "key_mean": "on"})
        build(engine_args, models / "qwen3", {"rotation_path": path, "key_mean": "auto"})
    rot = load_rotations(folder)
    rot.key_means = {i: torch.zeros(2, 128) for i in rot.layer_ids}
    save_rotations(rot, tmp_path / "ours")
    build(engine_args, models / "qwen3", {"rotation_path": str(tmp_path / "ours"), "key_mean": "on"})


@pytest.mark.parametrize("case,match", [("heads", r"layer 1 key mean has shape \(3, 128\), not \[2, 128\]"),
                                        ("nan", "layer 0 key mean contains NaN or Inf")])
def test_refuses_bad_key_means(engine_args, models, zoo, tmp_path, case, match):
    rot = load_rotations(zoo())
    rot.key_means = {i: torch.zeros(2, 128) for i in rot.layer_ids}
    if case == "heads":
        rot.key_means[1] = torch.zeros(3, 128)
    else:
        rot.key_means[0][1, 5] = math.nan
    save_rotations(rot, tmp_path / "ours")
    rot_refused(engine_args, models, tmp_path / "ours", match)


def test_refuses_key_mean_with_the_decode_read(engine_args, models):
    refused(engine_args, models / "qwen3", "key_mean 'on' does not serve prefill_read 'decode'", OscarSettingsError,
            oscar={"rotation_path": "hadamard", "key_mean": "on", "prefill_read": "decode"})


def test_refuses_an_unfinished_output_folder(engine_args, models, zoo, tmp_path):
    folder = tmp_path / f".rotations{PARTIAL_MARK}host-123"
    shutil.copytree(zoo(), folder)
    rot_refused(engine_args, models, folder, "the temporary folder of an output that was being written")


@pytest.mark.parametrize("case", ["absent_on_that_node", "unreadable_there"])
def test_refuses_a_rotation_path_a_worker_cannot_read(engine_args, models, zoo, tmp_path, case):
    """The process that starts vLLM reads the folder (its check passes); a worker, in another
    process (as on another node), cannot, and says which process, where and what."""
    folder = zoo()
    config = build(engine_args, models / "qwen3", {"rotation_path": str(folder)})
    if case == "absent_on_that_node":
        shutil.rmtree(folder)
        match = "rotation path does not exist"
    else:
        if os.geteuid() == 0:
            pytest.skip("root reads any folder: a permission cannot hide one from a worker")
        folder.chmod(0)
        match = "Permission denied"
    code = ("import json, sys; from oscar_vllm.core.settings import OscarSettings; "
            "from oscar_vllm.core.rotation_io import ModelShape; "
            "from oscar_vllm.serving.rotation_source import rotations_in_process; "
            "rotations_in_process(OscarSettings.from_sources(json.loads(sys.argv[1]), environ={}), "
            "ModelShape(2, 2, 128), worker='vLLM worker (tensor-parallel rank 1)')")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(config.additional_config)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)))
    folder.chmod(0o755) if folder.exists() else None
    error = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1 and error.startswith("oscar_vllm.core.rotation_io.RotationFileError: vLLM worker "
                                                     "(tensor-parallel rank 1) on host "), proc.stderr[-2000:]
    assert f"cannot use rotation path {str(folder)!r}" in error and match in error
    assert "at the same path on every node" in error


# ------------------------------------------------------------------ models


def test_refuses_mla(engine_args, models):
    refused(engine_args, models / "deepseek_v3", r"multi-head latent attention \(MLA")


def test_refuses_sliding_window_attention(engine_args, models):
    refused(engine_args, models / "qwen2_swa", r"sliding-window attention \(window 1024\)")


def test_refuses_cross_attention(engine_args, models):
    refused(engine_args, models / "whisper", r"cross-attention \(an encoder-decoder model\)", max_model_len=448)


def test_refuses_encoder_only_models(engine_args, models):
    refused(engine_args, models / "bert", r"an encoder-only model \(bidirectional attention", max_model_len=512)


@pytest.mark.parametrize("model,head_dim", [("head_dim_96", 96), ("head_dim_80", 80)])
def test_refuses_a_head_dim_the_kernels_do_not_serve(engine_args, models, model, head_dim):
    message = refused(engine_args, models / model, rf"head_dim {head_dim}: the kernels serve head_dim 64, 128 and 256")
    assert "(2)" not in message, "that one problem only"


@pytest.mark.parametrize("model,kwargs,name", [("awq", {}, "awq"), ("qwen3", {"quantization": "fp8"}, "fp8")])
def test_refuses_quantized_weights(engine_args, models, model, kwargs, name):
    refused(engine_args, models / model, rf"quantized weights \(\w*{name}\): OSCAR folds its value rotation", **kwargs)


def test_refuses_an_architecture_it_cannot_fold_into(engine_args, models):
    refused(engine_args, models / "gemma2", r"model type 'gemma2': the backend folds its rotations into llama, qwen2")


# ------------------------------------------------------------------ settings and engine arguments


def test_refuses_an_unknown_oscar_setting(engine_args, models):
    refused(engine_args, models / "qwen3", r"unknown OSCAR setting\(s\) \['sink'\]; valid: \[", OscarSettingsError,
            oscar={"rotation_path": "hadamard", "sink": 64})


@pytest.mark.parametrize("given,match", [
    ({"recent_size": 0}, "recent_size must be >= 1, got 0"),
    ({"sink_size": -64}, "sink_size must be >= 0"),
    ({"clip_ratio_v": 1.5}, r"clip_ratio_v must be in \(0, 1\]"),
    ({"scale_dtype": "fp8"}, "scale_dtype must be one of"),
    ({"sink_size": "64 tokens"}, "sink_size must be int, got '64 tokens'"),
    ({"logit_correction": -1.0}, r"logit_correction must be a finite number >= 0 \(0 turns it off\), got -1.0"),
    ({"logit_correction": "nan"}, "logit_correction must be a finite number >= 0 .*got nan"),
    ({"prefill_read": "prompt"}, r"prefill_read must be one of \('chunk', 'decode'\), got 'prompt'"),
    ({"decode_splits": 24}, r"decode_splits must be 0 \(chosen per batch\) or a power of two, got 24"),
    ({"decode_kernel": "cuda"}, r"decode_kernel must be one of \('auto', 'gluon', 'triton'\), got 'cuda'"),
])
def test_refuses_a_setting_out_of_range(engine_args, models, given, match):
    refused(engine_args, models / "qwen3", match, OscarSettingsError, oscar={"rotation_path": "hadamard", **given})


def test_refuses_an_oscar_entry_that_is_not_an_object(engine_args, models):
    refused(engine_args, models / "qwen3", "'oscar' entry must be a JSON object of settings", OscarSettingsError,
            oscar="hadamard")


def test_refuses_batch_invariance_without_the_settings_that_give_it(engine_args, models, monkeypatch):
    """VLLM_BATCH_INVARIANT=1 asks every backend for replies that do not depend on the batch:
    OSCAR's default reads depend on it, so the startup check names the two settings that do
    not, and the backend tells vLLM's selector it supports the mode only with them."""
    from vllm.config import set_current_vllm_config

    from oscar_vllm.serving.backend import OscarAttentionBackend

    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    refused(engine_args, models / "qwen3", r"VLLM_BATCH_INVARIANT=1 .*prefill_read 'decode' and a fixed "
            r"decode_splits; add OSCAR_PREFILL_READ=decode OSCAR_DECODE_SPLITS=16", dtype="bfloat16")
    refused(engine_args, models / "qwen3", "VLLM_BATCH_INVARIANT=1", dtype="bfloat16",
            oscar={"rotation_path": "hadamard", "prefill_read": "decode"})
    config = build(engine_args, models / "qwen3", {"rotation_path": "hadamard", "prefill_read": "decode",
                                                   "decode_splits": 16}, dtype="bfloat16")
    with set_current_vllm_config(config):
        assert OscarAttentionBackend.supports_batch_invariance()
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    with set_current_vllm_config(build(engine_args, models / "qwen3", dtype="bfloat16")):
        assert not OscarAttentionBackend.supports_batch_invariance()


def test_batch_invariance_with_prefix_caching_warns_that_hits_still_change_replies(engine_args, models, monkeypatch):
    """Accepted (prefix caching is vLLM's default), but a prefix-cache hit changes what the tokens
    after it read, so the start says so and names the flag that removes it."""
    from oscar_vllm.serving import preflight

    said = []
    monkeypatch.setattr(preflight.logger, "warning", lambda msg, *args: said.append(msg % args))
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    invariant = {"rotation_path": "hadamard", "prefill_read": "decode", "decode_splits": 16}
    build(engine_args, models / "qwen3", invariant, dtype="bfloat16")
    assert len(said) == 1 and "the up to 256 tokens just before it in 2 bits" in said[0]
    assert "--no-enable-prefix-caching" in said[0]
    build(engine_args, models / "qwen3", invariant, dtype="bfloat16", enable_prefix_caching=False)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    build(engine_args, models / "qwen3", invariant, dtype="bfloat16")
    assert len(said) == 1


def test_refuses_the_decode_read_for_a_float32_model(engine_args, models):
    refused(engine_args, models / "qwen3", r"prefill_read 'decode' with a float32 model: it runs on FlashAttention",
            oscar={"rotation_path": "hadamard", "prefill_read": "decode"}, dtype="float32")
    build(engine_args, models / "qwen3", {"rotation_path": "hadamard", "prefill_read": "decode"}, dtype="bfloat16")


@pytest.mark.parametrize("dtype", ["fp8", "fp8_e5m2", "turboquant_4bit_nc"])
def test_refuses_a_conflicting_kv_cache_dtype(engine_args, models, dtype):
    refused(engine_args, models / "qwen3", rf"--kv-cache-dtype {dtype}: OSCAR is its own 2-bit KV format",
            kv_cache_dtype=dtype)


@pytest.mark.parametrize("sink,recent", [(50, 256), (64, 100), (61, 255)])
def test_refuses_windows_that_are_not_whole_pages(engine_args, models, sink, recent):
    bad = " and ".join(f"{n} {v}" for n, v in (("sink_size", sink), ("recent_size", recent)) if v % 64)
    refused(engine_args, models / "qwen3", rf"{bad}: not whole 64-token KV blocks",
            oscar={"rotation_path": "hadamard", "sink_size": sink, "recent_size": recent})


@pytest.mark.parametrize("max_model_len", [256, 320])
def test_refuses_windows_that_do_not_fit_the_context(engine_args, models, max_model_len):
    refused(engine_args, models / "qwen3", rf"sink_size 64 \+ recent_size 256 = 320 tokens do not fit in "
            rf"max_model_len {max_model_len}", max_model_len=max_model_len)


def test_refuses_speculative_decoding(engine_args, models):
    refused(engine_args, models / "qwen3", r"speculative decoding \(--speculative-config, method 'ngram'\): draft",
            speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})


@pytest.mark.parametrize("model,env,why", [
    ("qwen3", "0", "VLLM_USE_V2_MODEL_RUNNER=0 is set"),
    ("qwen3_moe", None, "vLLM's default for this model"),  # MoE models run on V1 unless asked
])
def test_refuses_the_v1_model_runner(engine_args, models, monkeypatch, model, env, why):
    if env is not None:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", env)
    refused(engine_args, models / model,
            rf"vLLM's V1 model runner \({re.escape(why)}\).*set VLLM_USE_V2_MODEL_RUNNER=1")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    build(engine_args, models / model)


def test_refuses_a_block_size_that_is_not_whole_pages(engine_args, models):
    refused(engine_args, models / "qwen3", "--block-size 16: OSCAR's pages hold 64 tokens", block_size=16)
    assert build(engine_args, models / "qwen3", block_size=128).cache_config.block_size == 128


@pytest.mark.parametrize("card,oscar,model,match", [
    (Card("Tesla T4", (7, 5)), {}, "qwen3", r"the OSCAR backend does not serve Tesla T4 \(compute capability 7.5\): "
     r"its Triton kernels and FlashAttention need compute capability 8.0 or newer; on this card serve with vLLM's own "
     r"attention backends"),
    (Card("NVIDIA L40S", (8, 9)), {"decode_kernel": "gluon"}, "qwen3", r"decode_kernel 'gluon' on NVIDIA L40S "
     r"\(compute capability 8.9\): the Gluon decode kernels are compiled for compute capability 9.x"),
    (Card("NVIDIA A100-SXM4-80GB", (8, 0)), {}, "head_dim_256", r"head_dim 256 on NVIDIA A100-SXM4-80GB \(compute "
     r"capability 8.0\): the OSCAR Triton prefill kernel at head_dim 256 takes 176 KiB of shared memory"),
    (Card("NVIDIA B200", (10, 0)), {}, "qwen3", r"head_dim 128 on NVIDIA B200 \(compute capability 10.0\): Triton "
     r"3.6 does not compile"),
])
def test_refuses_a_gpu_it_cannot_serve(engine_args, models, monkeypatch, card, oscar, model, match):
    """The card as vLLM's platform names it (here one this machine does not have: only the startup
    check reads it from ``serving_platform``); the same card with what it serves passes."""
    from oscar_vllm.serving import preflight

    monkeypatch.setattr(preflight, "serving_platform", lambda: card)
    message = refused(engine_args, models / model, match, oscar={"rotation_path": "hadamard", **oscar})
    assert "(2)" not in message, "that one problem only"
    monkeypatch.setattr(preflight, "serving_platform", lambda: Card("NVIDIA H200", (9, 0)))
    build(engine_args, models / model, {"rotation_path": "hadamard", **oscar})


def test_refuses_a_kv_connector(engine_args, models):
    refused(engine_args, models / "qwen3", r"a KV connector \(--kv-transfer-config",
            kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_both"})


def test_refuses_context_parallelism(engine_args, models):
    refused(engine_args, models / "one_kv_head", r"context parallelism \(decode 2, prefill 1\)",
            tensor_parallel_size=2, decode_context_parallel_size=2)


# ------------------------------------------------------------------ the table


def test_the_table_in_the_docs_lists_every_kind_tested_here():
    # The kinds table: the rows after its header, to the first line that is no row.
    lines = DOC.read_text().splitlines()
    start = lines.index("| # | kind | refused with (excerpt) | before this branch | test |") + 2
    rows = [line for line in itertools.takewhile(lambda x: x.startswith("|"), lines[start:])]
    in_doc = [re.search(r"`(test_refuses_\w+)`", row)[1] for row in rows]
    here = sorted(name for name in globals() if name.startswith("test_refuses_"))
    assert sorted(in_doc) == here
    assert [int(row.split("|")[1]) for row in rows] == list(range(1, len(rows) + 1))
    assert len(rows) >= 20
    assert f"**{len(rows)} kinds**" in DOC.read_text()
