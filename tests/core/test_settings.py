"""Settings from --additional-config and OSCAR_* variables, and `oscar-vllm serve` flags."""
import json

import pytest

from oscar_vllm.core import settings as settings_module
from oscar_vllm.core.settings import OscarSettings, OscarSettingsError
from oscar_vllm.serving.serve import build_vllm_argv


def test_defaults():
    s = OscarSettings.from_sources({}, environ={})
    assert (s.rotation_path, s.sink_size, s.recent_size, s.clip_ratio_k, s.scale_dtype) == (None, 64, 256, None, "fp16")
    assert s.logit_correction is None  # each layer's from how it rounds its keys (logit_correction_for)
    assert s.prefill_read == "chunk" and s.decode_splits == 0 and not s.batch_invariant


def test_prefill_read_from_either_source():
    assert OscarSettings.from_sources({}, environ={"OSCAR_PREFILL_READ": "decode"}).prefill_read == "decode"
    assert OscarSettings.from_sources({"oscar": {"prefill_read": "chunk"}},
                                      environ={"OSCAR_PREFILL_READ": "decode"}).prefill_read == "chunk"


def test_warm_up_threads_from_either_source():
    assert OscarSettings.from_sources({}, environ={}).warm_up_threads == 4
    assert OscarSettings.from_sources({}, environ={"OSCAR_WARM_UP_THREADS": "8"}).warm_up_threads == 8
    assert OscarSettings.from_sources({"oscar": {"warm_up_threads": 2}},
                                      environ={"OSCAR_WARM_UP_THREADS": "8"}).warm_up_threads == 2


def test_decode_splits_from_either_source_and_what_makes_reads_batch_invariant():
    env = {"OSCAR_DECODE_SPLITS": "16", "OSCAR_PREFILL_READ": "decode"}
    s = OscarSettings.from_sources({}, environ=env)
    assert s.decode_splits == 16 and s.batch_invariant
    assert not OscarSettings.from_sources({"oscar": {"decode_splits": 0}}, environ=env).batch_invariant
    assert not OscarSettings.from_sources({"oscar": {"prefill_read": "chunk"}}, environ=env).batch_invariant


def test_logit_correction_from_either_source():
    assert OscarSettings.from_sources({}, environ={"OSCAR_LOGIT_CORRECTION": "0.5"}).logit_correction == 0.5
    assert OscarSettings.from_sources({"oscar": {"logit_correction": 0}}, environ={}).logit_correction == 0.0
    s = OscarSettings.from_sources({"oscar": {"logit_correction": 2}}, environ={"OSCAR_LOGIT_CORRECTION": "0"})
    assert s.logit_correction == 2.0 and isinstance(s.logit_correction, float)


def test_logit_correction_default_follows_the_key_mean_and_a_given_one_holds_for_both():
    """The study's best λ: 0.5 for keys rounded as they are, none for keys less their mean
    (docs/quality.md); a λ the operator gives is served with and without the mean."""
    s = OscarSettings.from_sources({}, environ={})
    assert (s.logit_correction_for(key_mean=False), s.logit_correction_for(key_mean=True)) == (0.5, 0.0)
    given = OscarSettings.from_sources({}, environ={"OSCAR_LOGIT_CORRECTION": "0.25"})
    assert (given.logit_correction_for(key_mean=False), given.logit_correction_for(key_mean=True)) == (0.25, 0.25)
    off = OscarSettings.from_sources({"oscar": {"logit_correction": 0}}, environ={})
    assert off.logit_correction_for(key_mean=False) == 0.0


def test_additional_config_wins_over_environment():
    env = {"OSCAR_SINK_SIZE": "32", "OSCAR_RECENT_SIZE": "128", "OSCAR_ROTATION_PATH": "/env/rot"}
    s = OscarSettings.from_sources({"oscar": {"sink_size": 16, "clip_ratio_v": 0.9}}, environ=env)
    assert (s.sink_size, s.recent_size, s.rotation_path, s.clip_ratio_v) == (16, 128, "/env/rot", 0.9)


def test_a_variable_the_json_overrides_is_named_in_a_warning(caplog, monkeypatch, tmp_path):
    monkeypatch.setattr(settings_module, "_warned", set())  # earlier tests warned in this process
    # The JSON's sink_size wins; the exported variable that says otherwise is named, once a process,
    # and a variable that agrees (or one the JSON does not give) is not.
    env = {"OSCAR_SINK_SIZE": "32", "OSCAR_RECENT_SIZE": "256", "OSCAR_HIT_RING": "reuse"}
    given = {"oscar": {"sink_size": 16, "recent_size": 256}}
    with caplog.at_level("WARNING", logger="oscar_vllm.core.settings"):
        OscarSettings.from_sources(given, environ=env)
        OscarSettings.from_sources(given, environ=env)
    warned = [r.getMessage() for r in caplog.records]
    assert warned == ["OSCAR: sink_size is 16 from --additional-config; OSCAR_SINK_SIZE=32 is ignored"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="oscar_vllm.core.settings"):
        s = OscarSettings.from_sources({"oscar": {"recent_size": 128}}, environ={"OSCAR_RECENT_SIZE": "many"})
    assert s.recent_size == 128
    assert [r.getMessage() for r in caplog.records] == [
        "OSCAR: recent_size is 128 from --additional-config; OSCAR_RECENT_SIZE=many is ignored"]
    # A worker reads the rotation path its engine pinned, absolute, where the variable is relative:
    # the same folder, no warning; another folder is named.
    (tmp_path / "rot").mkdir()
    monkeypatch.chdir(tmp_path)
    caplog.clear()
    with caplog.at_level("WARNING", logger="oscar_vllm.core.settings"):
        OscarSettings.from_sources({"oscar": {"rotation_path": str(tmp_path / "rot")}},
                                   environ={"OSCAR_ROTATION_PATH": "rot"})
        assert caplog.records == []
        OscarSettings.from_sources({"oscar": {"rotation_path": str(tmp_path / "rot")}},
                                   environ={"OSCAR_ROTATION_PATH": "other"})
    assert [r.getMessage() for r in caplog.records] == [
        f"OSCAR: rotation_path is '{tmp_path / 'rot'}' from --additional-config; OSCAR_ROTATION_PATH=other is ignored"]


@pytest.mark.parametrize("given,message", [
    ({"sink": 3}, "unknown OSCAR setting"),
    ({"sink_size": -1}, "sink_size must be >= 0"),
    ({"recent_size": 0}, "recent_size must be >= 1"),
    ({"recent_size": 2.5}, "recent_size must be int"),
    ({"clip_ratio_k": 1.5}, r"clip_ratio_k must be in \(0, 1\]"),
    ({"scale_dtype": "fp32"}, "scale_dtype must be one of"),
    ({"sink_size": "many"}, "sink_size must be int"),
    ({"logit_correction": -1}, r"logit_correction must be a finite number >= 0 \(0 turns it off\), got -1.0"),
    ({"logit_correction": float("nan")}, "logit_correction must be a finite number >= 0 .*got nan"),
    ({"logit_correction": "inf"}, "logit_correction must be a finite number >= 0 .*got inf"),
    ({"logit_correction": "strong"}, "logit_correction must be float, got 'strong'"),
    ({"prefill_read": "window"}, r"prefill_read must be one of \('chunk', 'decode'\), got 'window'"),
    ({"logit_correction": True}, "logit_correction must be float, got True"),
    ({"decode_splits": 12}, r"decode_splits must be 0 \(chosen per batch\) or a power of two, got 12"),
    ({"decode_splits": -4}, "decode_splits must be 0 .*got -4"),
    ({"decode_splits": "sixteen"}, "decode_splits must be int, got 'sixteen'"),
    ({"warm_up_threads": 0}, "warm_up_threads must be >= 1, got 0"),
    ({"hit_ring": "keep"}, r"hit_ring must be one of \('recompute', 'reuse'\), got 'keep'"),
    ({"key_mean": "yes"}, r"key_mean must be one of \('off', 'on', 'auto'\), got 'yes'"),
    ({"key_mean": "on", "prefill_read": "decode"}, "key_mean 'on' does not serve prefill_read 'decode'"),
])
def test_bad_settings_are_named(given, message):
    with pytest.raises(OscarSettingsError, match=message):
        OscarSettings.from_sources({"oscar": given}, environ={})


def test_missing_rotations_say_how_to_get_them():
    with pytest.raises(OscarSettingsError, match="oscar-calibrate.*hadamard"):
        OscarSettings.from_sources({}, environ={}).require_rotation_path()
    assert OscarSettings(rotation_path="hadamard").is_hadamard


def test_serve_maps_flags_onto_vllm_serve():
    argv = build_vllm_argv(["serve", "Qwen/Qwen3-8B", "--oscar-rotation-path", "./rot", "--oscar-sink-size", "64",
                            "--oscar-recent-size", "256", "--max-model-len", "8192",
                            "--additional-config", '{"other": 1}'])
    # vLLM's own max_num_seqs: the windows take memory per running request, not per slot.
    assert argv[:4] == ["serve", "Qwen/Qwen3-8B", "--max-model-len", "8192"]
    assert argv[4:6] == ["--attention-backend", "OSCAR"]
    extra = json.loads(argv[argv.index("--additional-config") + 1])
    assert extra == {"other": 1, "oscar": {"rotation_path": "./rot", "sink_size": 64, "recent_size": 256}}


def test_serve_passes_the_users_max_num_seqs_alone():
    argv = build_vllm_argv(["serve", "m", "--max-num-seqs=32"])
    assert argv.count("--max-num-seqs") == 0 and "--max-num-seqs=32" in argv
    assert not any("max-num-seqs" in a for a in build_vllm_argv(["serve", "m"]))


@pytest.mark.parametrize("argv,message", [
    (["Qwen/Qwen3-8B"], "runs `serve` only; usage: oscar-vllm serve MODEL"),
    (["serve", "m", "--attention-backend", "FLASH_ATTN"], "OSCAR backend"),
    (["serve", "m", "--oscar-sink-size", "8", "--additional-config", '{"oscar": {"sink_size": 4}}'], "both set"),
    (["serve", "m", "--additional-config", "{oscar"], "--additional-config is not valid JSON"),
    (["serve", "m", "--additional-config", "[1]"], "--additional-config must be a JSON object"),
])
def test_serve_refuses_conflicts(argv, message):
    with pytest.raises(OscarSettingsError, match=message):
        build_vllm_argv(argv)


def test_serve_passes_every_setting_as_a_flag():
    argv = build_vllm_argv(["serve", "m", "--oscar-rotation-path", "hadamard", "--oscar-clip-ratio-k", "0.9",
                            "--oscar-clip-ratio-v", "0.8", "--oscar-scale-dtype", "bf16",
                            "--oscar-logit-correction", "0.5", "--oscar-prefill-read", "decode",
                            "--oscar-decode-splits", "16"])
    extra = json.loads(argv[argv.index("--additional-config") + 1])
    assert extra == {"oscar": {"rotation_path": "hadamard", "clip_ratio_k": 0.9, "clip_ratio_v": 0.8,
                               "scale_dtype": "bf16", "logit_correction": 0.5, "prefill_read": "decode",
                               "decode_splits": 16}}


def test_serve_validates_before_starting_vllm():
    with pytest.raises(OscarSettingsError, match="recent_size"):
        build_vllm_argv(["serve", "m", "--oscar-recent-size", "0"])
    with pytest.raises(OscarSettingsError, match="logit_correction must be a finite number >= 0"):
        build_vllm_argv(["serve", "m", "--oscar-logit-correction", "nan"])
