"""Calibration: streaming statistics, score weights, rotation sets, the clip fit, and the
capture of post-norm post-RoPE q/k on Llama, Qwen2 and Qwen3 models with GQA 1 to 8."""

import dataclasses
import importlib

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from oscar_vllm.calibration.calibrate import capture_stats, full_windows, rotations_from_stats, split_sequences
from oscar_vllm.calibration.fit import (
    LayerErrorMeasure,
    LayerStats,
    build_rotation_sets,
    causal_score_weights,
    clip_candidates,
    fit_clip_ratios,
)
from oscar_vllm.calibration.models import LoadedModel, attention_modules, check_supported, rope_tables
from oscar_vllm.core.errors import OscarError
from oscar_vllm.core.quant import clip_index
from oscar_vllm.core.rotation import key_moment, rotation_from_moment
from oscar_vllm.core.rotation_io import ModelShape, validate_rotations


def test_streaming_stats_equal_one_shot():
    torch.manual_seed(0)
    q, k, v = torch.randn(30, 8, 16), torch.randn(30, 2, 16), torch.randn(30, 2, 16)
    one, two = LayerStats(2), LayerStats(2)
    one.add(q, k, v)
    two.add(q[:11], k[:11], v[:11])
    two.add(q[11:], k[11:], v[11:])
    torch.testing.assert_close(one.qtq(), two.qtq())
    assert two.num_tokens == 30 and two.query_rows == 30 * 4
    torch.testing.assert_close(one.value_weights("proxy"), two.value_weights("proxy"))
    with pytest.raises(ValueError, match="score weights"):
        one.value_weights("softmax")
    with pytest.raises(ValueError, match="value weights must be"):
        one.value_weights("mean")


def test_causal_score_weights_match_loop():
    torch.manual_seed(1)
    t, hq, hkv, d = 9, 6, 2, 8
    q, k = torch.randn(t, hq, d), torch.randn(t, hkv, d)
    w = causal_score_weights(q, k, 0.3)
    expect = torch.zeros(t, hkv, dtype=torch.float64)
    for h in range(hq):
        for i in range(t):
            p = torch.softmax(k[: i + 1, h // 3] @ q[i, h] * 0.3, 0)
            expect[: i + 1, h // 3] += p.double() ** 2
    torch.testing.assert_close(w, expect)


def synthetic_stats(layers=3, hkv=2, d=32, t=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g) * torch.linspace(0.2, 3, d)
    stats = {}
    for i in range(layers):
        st = LayerStats(hkv)
        k = torch.randn(t, hkv, d, generator=g) @ mix
        k[:, :, 3] += 8 * (torch.rand(t, hkv, generator=g) > 0.97)  # outlier channel
        st.add(torch.randn(t, 2 * hkv, d, generator=g) @ mix, k, torch.randn(t, hkv, d, generator=g) @ mix.T)
        stats[i] = st
    return stats


@pytest.mark.parametrize("per_head", [False, True])
def test_rotation_sets_from_stats(per_head):
    stats = synthetic_stats()
    key, value = build_rotation_sets(stats, per_head)
    assert key.per_head is per_head and key.layer_ids == [0, 1, 2]
    expect, _ = rotation_from_moment(key_moment(stats[1].qtq_sum, stats[1].query_rows, per_head))
    torch.testing.assert_close(key.rotations[1], expect.float())
    assert value.objective == "sst_r_h_pbr" and key.objective == "qqt_r_h_pbr"


def test_clip_fit_beats_or_ties_reference_on_held_out():
    key, value = build_rotation_sets(synthetic_stats(seed=0))
    ratios_k, ratios_v, report = fit_clip_ratios(key, value, synthetic_stats(seed=1))
    assert len(ratios_k) == len(ratios_v) == 3
    assert all(r in clip_candidates(32) for r in ratios_k + ratios_v)
    assert report["error_vs_reference_key"] <= 1.0 and report["error_vs_reference_value"] <= 1.0
    assert report["heldout_tokens"] == 256
    # every candidate maps back to its own sorted index
    assert [clip_index(r, 32) for r in clip_candidates(32)] == list(range(24, 32))


def test_clip_fit_per_kv_head_is_each_head_fitted_alone():
    """Per head: a ratio per KV head per layer, each the one its head's error alone picks; the layer's
    error (the sum over heads) is then no larger than with one ratio for the layer."""
    key, value = build_rotation_sets(synthetic_stats(seed=0))
    heldout = synthetic_stats(seed=1)
    per_layer_k, per_layer_v, layer_report = fit_clip_ratios(key, value, heldout)
    ratios_k, ratios_v, report = fit_clip_ratios(key, value, heldout, per_head=True)
    assert report["per"] == "kv_head" and layer_report["per"] == "layer"
    assert all(len(r) == 2 for r in ratios_k + ratios_v)  # synthetic_stats: 2 KV heads
    assert report["error_vs_reference_key"] <= layer_report["error_vs_reference_key"]
    assert report["error_vs_reference_value"] <= layer_report["error_vs_reference_value"]
    measure = LayerErrorMeasure.build(heldout[1], key.rotations[1], value.rotations[1])
    for h in range(2):
        head = measure.head(h)
        errors = {r: head.errors(r, ratios_v[1][h])[0] for r in clip_candidates(32)}
        assert errors[ratios_k[1][h]] <= min(errors.values()) * (1 + 1e-9)
    # Keys in groups of half a head: fitted with the groups they are stored in.
    grouped_k, _, grouped = fit_clip_ratios(key, value, heldout, key_group_size=16)
    errors = {r: measure.errors(r, 0.9, group_size=16)[0] for r in clip_candidates(32)}
    assert errors[grouped_k[1]] <= min(errors.values()) * (1 + 1e-9)
    assert grouped["error_vs_reference_key"] <= 1.0


# ---------------------------------------------------------------------------- capture on real architectures


def tiny_model(config_cls, hq, hkv):
    config = config_cls(
        vocab_size=128, hidden_size=hq * 16, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=hq, num_key_value_heads=hkv, head_dim=16, max_position_embeddings=256,
    )
    torch.manual_seed(hq * 10 + hkv)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return LoadedModel(model, None, f"tiny-{config.model_type}", ModelShape.from_hf_config(config))


def manual_qk(model, layer_idx, ids):
    """Post-norm, post-RoPE q and k of one layer, computed from the layer's own modules."""
    attn = attention_modules(model)[layer_idx]
    seen = {}
    handle = attn.register_forward_pre_hook(
        lambda m, args, kwargs: seen.update(kwargs, h=args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
    with torch.no_grad():
        model(ids[None], use_cache=False)
    handle.remove()
    h = seen["h"]
    shape = (*h.shape[:-1], -1, attn.head_dim)
    q, k = attn.q_proj(h).view(shape), attn.k_proj(h).view(shape)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    rope = importlib.import_module(type(attn).__module__).apply_rotary_pos_emb
    cos, sin = seen["position_embeddings"]
    q, k = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q[0].transpose(0, 1), k[0].transpose(0, 1), attn.v_proj(h).view(shape)[0]


@pytest.mark.parametrize("config_cls", [LlamaConfig, Qwen2Config, Qwen3Config])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (9, 3), (8, 2), (8, 1)])
def test_capture_sees_post_rope_queries_and_keys(config_cls, hq, hkv):
    loaded = tiny_model(config_cls, hq, hkv)
    check_supported(loaded.model.config)
    ids = torch.randint(0, 128, (23,))
    with torch.no_grad():
        plain = loaded.model(ids[None], use_cache=False).logits
    stats = capture_stats(loaded, ids, seq_len=23, score_weights=True)
    with torch.no_grad():
        after = loaded.model(ids[None], use_cache=False).logits
    torch.testing.assert_close(after, plain)  # hooks removed, model unchanged
    q, k, v = manual_qk(loaded.model, 1, ids)
    st = stats[1]
    torch.testing.assert_close(st.keys[0], k)
    torch.testing.assert_close(st.values[0], v)
    expect = torch.einsum("thgi,thgj->hij", *(q.double().reshape(23, hkv, hq // hkv, 16),) * 2)
    torch.testing.assert_close(st.qtq_sum, expect, rtol=1e-4, atol=1e-5)
    assert st.score_weights[0].shape == (23, hkv)
    rot = rotations_from_stats(loaded, stats, stats, per_head=(hkv > 1))
    validate_rotations(rot, loaded.shape)


def test_capture_output_equals_plain_attention():
    loaded = tiny_model(Qwen3Config, 8, 2)
    ids = torch.randint(0, 128, (40,))
    with torch.no_grad():
        plain = loaded.model(ids[None], use_cache=False).logits
    outputs = []
    hook = loaded.model.register_forward_hook(lambda m, a, out: outputs.append(out.logits))
    capture_stats(loaded, ids, seq_len=40)
    hook.remove()
    torch.testing.assert_close(outputs[0], plain, atol=1e-5, rtol=1e-5)


def test_split_sequences():
    assert [s.tolist() for s in split_sequences(torch.arange(7), 3)] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [s.tolist() for s in full_windows(torch.arange(7), 3)] == [[0, 1, 2], [3, 4, 5]]


def test_unsupported_models_are_refused():
    with pytest.raises(ValueError, match="model type 'gpt2' is not supported"):
        check_supported(type("C", (), {"model_type": "gpt2"})())
    cfg = Qwen2Config(use_sliding_window=True)
    with pytest.raises(ValueError, match="sliding-window"):
        check_supported(cfg)
    cfg = LlamaConfig(hidden_size=96 * 4, num_attention_heads=4)
    with pytest.raises(ValueError, match="head_dim 96 is not a power of two"):
        check_supported(cfg)


def test_error_measure_is_the_mean_squared_logit_error():
    from oscar_vllm.calibration.fit import LayerErrorMeasure

    torch.manual_seed(3)
    t, hq, hkv, d = 20, 6, 2, 16
    q, k, v = torch.randn(t, hq, d), torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    st = LayerStats(hkv)
    st.add(q, k, v)
    r, _ = rotation_from_moment(key_moment(st.qtq_sum, st.query_rows, per_head=False))
    em = LayerErrorMeasure.build(st, r, r)
    delta = torch.randn(t, hkv, d, dtype=torch.float64)
    qr = (q.double() @ r).reshape(t, hkv, hq // hkv, d)
    brute = 0.0
    for h in range(hkv):
        queries = qr[:, h].reshape(-1, d)  # every query row of the group
        brute += ((queries @ delta[:, h].T) ** 2).mean(0).sum().item()
    assert em.key_error(delta) == pytest.approx(brute / t, rel=1e-9)
    assert em.value_error(torch.ones(t, hkv, d)) == pytest.approx(d * hkv, rel=1e-9)  # weights have mean 1


def test_the_reference_cache_as_served_uses_the_serving_defaults():
    """Benchmarks that read 'OSCAR as served' in the reference cache take the backend's settings:
    by default the plain keys and the default λ (but where FlashAttention reads the INT2 keys),
    whether or not the file has means; with key_mean "auto", keys less their block's mean where it
    has them (its 16 strongest pairs, one vector a cache block) and the λ that goes with it (none);
    the rotation file's clip."""
    import dataclasses
    from pathlib import Path

    from oscar_vllm.calibration.evaluate import served_method, served_specs
    from oscar_vllm.core.key_mean import SERVED_BLOCK, SERVED_PAIRS, block_average, strongest_pairs
    from oscar_vllm.core.rotation_io import load_rotations
    from oscar_vllm.core.settings import OscarSettings

    committed = load_rotations(Path(__file__).resolve().parents[2] / "tests" / "data" / "smollm2_rotations")
    assert served_method(committed) == served_method(dataclasses.replace(committed, key_means=None))  # off
    auto = OscarSettings(key_mean="auto")
    with_mean = served_method(committed, settings=auto)
    assert (with_mean.clip, with_mean.logit_correction, with_mean.scale_dtype) == ("fitted", 0.0, torch.float16)
    assert (with_mean.key_mean, with_mean.key_mean_pairs, with_mean.key_mean_block) == (True, SERVED_PAIRS,
                                                                                         SERVED_BLOCK)
    no_means = dataclasses.replace(committed, key_means=None)
    correction = OscarSettings().logit_correction_for(key_mean=False)
    fitted = served_method(no_means)
    assert (fitted.clip, fitted.logit_correction, fitted.key_mean) == ("fitted", correction, False)
    plain = served_method(dataclasses.replace(no_means, clip_ratios_k=None, clip_ratios_v=None))
    assert (plain.clip, plain.logit_correction) == ("reference", correction)
    assert served_method(no_means, dense_prefill=True).logit_correction == 0  # FlashAttention's prompt chunks
    method, specs = served_specs(no_means, 30)
    assert method == fitted and len(specs) == 30
    assert all(s.logit_correction == correction and s.key_mean is None for s in specs.values())
    assert specs[3].key_quant.clip_ratio == committed.clip_ratio("key", 3)
    cos, sin = (torch.rand(300, 64) for _ in range(2))
    cos[0] = 1.0
    method, specs = served_specs(committed, 30, rope=(cos, sin), settings=auto)
    assert method == with_mean and specs[3].key_mean.block == SERVED_BLOCK
    want = strongest_pairs(block_average(committed.key_means[3], cos, sin, SERVED_BLOCK), SERVED_PAIRS)
    torch.testing.assert_close(specs[3].key_mean.mean, want)


def pre_rope_keys(model, layer_idx, ids):
    """One layer's keys as k_proj (and k_norm) give them, before RoPE: ``[T, Hkv, d]``."""
    attn = attention_modules(model)[layer_idx]
    seen = {}
    handle = attn.register_forward_pre_hook(
        lambda m, args, kwargs: seen.update(h=args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
    with torch.no_grad():
        model(ids[None], use_cache=False)
    handle.remove()
    k = attn.k_proj(seen["h"]).view(*seen["h"].shape[:-1], -1, attn.head_dim)
    return (attn.k_norm(k) if hasattr(attn, "k_norm") else k)[0].detach()


@pytest.mark.parametrize("config_cls", [LlamaConfig, Qwen3Config])
def test_key_means_are_the_mean_keys_before_rope_past_the_skip(config_cls):
    loaded = tiny_model(config_cls, 8, 2)
    ids = torch.randint(0, 128, (2, 40))
    stats = capture_stats(loaded, ids.flatten(), seq_len=40)
    rot = rotations_from_stats(loaded, stats, None, key_mean_skip=16)
    for layer in (0, 1):
        keys = torch.cat([pre_rope_keys(loaded.model, layer, seq)[16:] for seq in ids])
        torch.testing.assert_close(rot.key_means[layer], keys.mean(0), atol=1e-5, rtol=1e-5)
    assert rot.calibration["key_mean_skip"] == 16
    assert rotations_from_stats(loaded, stats, None).key_means is None
    with pytest.raises(OscarError, match="sequences of 40 tokens leave no key past the first 40"):
        rotations_from_stats(loaded, stats, None, key_mean_skip=40)


def test_no_key_means_where_rope_is_not_rotate_half(monkeypatch, caplog):
    import oscar_vllm.calibration.calibrate as calibrate

    loaded = tiny_model(LlamaConfig, 4, 2)
    stats = capture_stats(loaded, torch.randint(0, 128, (40,)), seq_len=40)
    table = lambda lm, n: tuple(t[:, :8].repeat_interleave(2, -1) for t in rope_tables(lm, n))  # noqa: E731
    monkeypatch.setattr(calibrate, "rope_tables", table)  # pairs (2i, 2i+1), as GPT-J turns them
    assert rotations_from_stats(loaded, stats, None, key_mean_skip=8).key_means is None
    assert "RoPE table is not rotate-half over all 16 dims" in caplog.text


def test_published_rotations_completed_with_fitted_clips_and_key_means(tmp_path):
    """``oscar-calibrate --from-rotations``: a published RotationZoo folder's rotations kept as they
    are, with clip ratios fitted to them on held-out tokens and the key means that published files
    lack; written in our format and read back; the rotations must be for the model."""
    from oscar_vllm.calibration.calibrate import completed_rotations
    from oscar_vllm.core.rotation_io import load_rotations, save_rotations

    loaded = tiny_model(LlamaConfig, 8, 2)
    ids = torch.randint(0, 128, (4, 40))
    stats = capture_stats(loaded, ids[:2].flatten(), seq_len=40)
    heldout = capture_stats(loaded, ids[2:].flatten(), seq_len=40)
    fresh = rotations_from_stats(loaded, stats, None)
    base = dataclasses.replace(fresh, clip_ratios_k=None, clip_ratios_v=None, key_means=None,
                               source_format="rotationzoo")
    done = completed_rotations(loaded, base, stats, heldout, calibration_info={"rotations_from": "zoo"},
                               key_mean_skip=16)
    assert done.key is base.key and done.value is base.value  # the published rotations, untouched
    assert done.clip_ratios_k is not None and len(done.clip_ratios_k) == len(base.layer_ids)
    assert done.clip_ratios_k != [base.clip_ratio("key", i) for i in base.layer_ids]  # fitted, not the reference
    torch.testing.assert_close(done.key_means[1],
                               rotations_from_stats(loaded, stats, None, key_mean_skip=16).key_means[1])
    assert done.calibration["rotations_from"] == "zoo" and done.calibration["key_mean_skip"] == 16
    assert done.calibration["tokens"] == 80 and "clip_fit" in done.calibration
    again = load_rotations(save_rotations(done, tmp_path / "ours"), loaded.shape)
    assert again.key_means is not None and again.clip_ratios_k == pytest.approx(done.clip_ratios_k)
    kept = completed_rotations(loaded, done, stats, None)  # nothing to add: what it had stays
    assert kept.clip_ratios_k == done.clip_ratios_k and kept.key_means is done.key_means
