"""The backend's own wiring around the kernels, with vLLM imported and the attention as its
PyTorch twin: the decode-read prefill of a mixed batch (prefill_read="decode")."""
import math
from types import SimpleNamespace

import pytest
import torch

from kernel_cases import CLIP_K, CLIP_V, DEVICE, decode_read_twins, prepare, random_rotation
from csrc_triton.paged_layout import KEY_MEAN_PAIRS, BatchLayout
from oscar_vllm.core.quant import clip_index
from oscar_vllm.reference.oscar_attention import decode_read_attention_reference
from oscar_vllm.reference.oscar_dense_kv import oscar_dense_kv_reference


@pytest.mark.parametrize("buffer_rows,host_shapes", [(400, True), (96, True), (400, False)])
def test_decode_read_prefill_of_a_mixed_batch(buffer_rows, host_shapes):
    """A decode, then two prefills (one over a cached prefix): the prefills read as decode
    does and are written, all at once where their rows fit the dense buffers and one at a time
    where they do not (96 rows: 16 and 89 the two requests' needs), with the
    lengths from the host or, missing, read from the GPU; the decode's rows are left alone."""
    from oscar_vllm.serving.backend import OscarAttentionImpl

    d, hkv, g, sink, recent = 64, 1, 2, 4, 8
    prefix, new = [30, 0, 50], [1, 12, 20]
    pc, step, q, q_rot, k, v = prepare(d, hkv, g, sink, recent, prefix, new, torch.float32)
    rot = random_rotation(d).to(DEVICE)  # prepare's rotation (seed 0)
    scale = 1 / math.sqrt(d)
    attention, merge = decode_read_twins(scale)
    k_rot = (k.float() @ rot)[1:]
    cu = step.cu_q[1:] - step.cu_q[1]
    cache, pre = pc.mixed(), BatchLayout(step.block_table[1:], step.seq_lens[1:], cu, step.ring_slots[1:], 2)
    k_bf16, v_bf16 = oscar_dense_kv_reference(k_rot, v[1:], cache=cache, batch=pre)
    buffers = tuple(torch.full((buffer_rows, hkv, d), float("nan"), device=DEVICE) for _ in range(2))
    impl = SimpleNamespace(
        dense_kv=buffers, flash_attention=attention, merge_attention=merge, sink=sink, recent=recent,
        rotate=lambda x: (x.float() @ rot).to(x.dtype), rot_k=rot, window_pos=pc.window_pos,
        clip_idx_k=clip_index(CLIP_K, d), clip_idx_v=clip_index(CLIP_V, d), param_dtype=torch.float16)
    md = SimpleNamespace(
        num_decodes=1, num_reqs=3, num_actual_tokens=int(step.cu_q[-1]),
        prefill_shapes=((12, 12), (20, 70)) if host_shapes else (), query_start_loc=step.cu_q,
        seq_lens=step.seq_lens, block_table=step.block_table, slot_mapping=step.slot_mapping,
        ring_slots=step.ring_slots, window_pages=pc.window_pages)
    out = torch.full_like(q, float("nan"))
    batch = BatchLayout(step.block_table, step.seq_lens, step.cu_q, step.ring_slots, 3, num_decodes=1)
    OscarAttentionImpl.decode_read_prefill(impl, md, batch, q_rot, k, v, out, cache)
    assert out[:1].isnan().all(), "the decode's output is the decode kernel's, not this path's"
    assert (pc.window_pos[step.ring_slots[2].long()] >= 0).sum() == sink + recent, "the prefills were written"
    assert buffers[0][:89].isfinite().all() and buffers[0][105 if buffer_rows == 400 else 89:].isnan().all()
    k_int2, v_int2 = oscar_dense_kv_reference(k_rot, v[1:], cache=cache, batch=pre._replace(cu_q=torch.zeros_like(cu)),
                                              ring_recent=False)
    want = decode_read_attention_reference(q_rot[1:], k_bf16, v_bf16, k_int2, v_int2, step.seq_lens[1:], cu, 2, scale,
                                           recent)
    torch.testing.assert_close(out[1:].cpu(), want, rtol=1e-4, atol=2e-4)


def test_triton_decode_read_splits_the_decodes_over_scratch_for_their_own_rows():
    """The Triton decode path with prefill_read "decode" (cards without the Gluon kernels): a
    decode split two ways beside a prefill of 12 tokens, its split scratch sized as the builder
    sizes it, for the decodes alone. The decode reads as its twin does; given the whole batch's
    rows, the kernel sized the scratch for 13 tokens and refused it."""
    from oscar_vllm.reference.oscar_attention import oscar_attention_reference
    from oscar_vllm.serving.backend import OscarAttentionImpl

    d, hkv, g, sink, recent = 64, 1, 2, 4, 8
    pc, step, q, q_rot, k, v = prepare(d, hkv, g, sink, recent, [30, 50], [1, 12], torch.float32)
    rot = random_rotation(d).to(DEVICE)  # prepare's rotation (seed 0)
    scale, splits = 1 / math.sqrt(d), 2
    attention, merge = decode_read_twins(scale)
    decode = BatchLayout(step.block_table[:1], step.seq_lens[:1], step.cu_q[:2], step.ring_slots[:1], 1)
    want = oscar_attention_reference(q[:1], q_rot[:1], k[:1], v[:1], cache=pc.mixed(), batch=decode, scale=scale)
    impl = SimpleNamespace(
        dense_kv=tuple(torch.full((400, hkv, d), float("nan"), device=DEVICE) for _ in range(2)),
        flash_attention=attention, merge_attention=merge, sink=sink, recent=recent, scale=scale,
        logit_correction=0.0, rotate=lambda x: (x.float() @ rot).to(x.dtype), rot_k=rot, window_pos=pc.window_pos,
        clip_idx_k=clip_index(CLIP_K, d), clip_idx_v=clip_index(CLIP_V, d), param_dtype=torch.float16)
    impl.decode_read_prefill = lambda *a: OscarAttentionImpl.decode_read_prefill(impl, *a)
    md = SimpleNamespace(
        num_decodes=1, num_reqs=2, num_actual_tokens=13, prefill_shapes=((12, 62),), decode_splits=splits,
        part_out=torch.full((hkv * g * splits * d,), float("nan"), device=DEVICE),
        part_lse=torch.full((hkv * g * splits,), float("nan"), device=DEVICE),
        query_start_loc=step.cu_q, seq_lens=step.seq_lens, block_table=step.block_table,
        slot_mapping=step.slot_mapping, ring_slots=step.ring_slots, window_pages=pc.window_pages)
    out = torch.full_like(q, float("nan"))
    OscarAttentionImpl._forward_decode_read(impl, md, step.batch(num_decodes=1), q, k, v, out, pc.mixed(), out)
    torch.testing.assert_close(out[:1].cpu(), want.cpu(), rtol=1e-4, atol=1e-4)
    assert out[1:].isfinite().all(), "the prefill's rows were read"


def test_decode_read_refuses_rows_its_buffers_do_not_hold():
    from oscar_vllm.serving.prefill import DecodeReadPrefill, oscar_decode_read_prefill

    pc, step, q, q_rot, k, v = prepare(64, 1, 2, 4, 8, [50], [20], torch.float32)
    buf = torch.empty(88, 1, 64)
    plan = DecodeReadPrefill(k, buf, buf, 62, 62, 27, 27, 70, write=None, attention=None, merge=None)
    with pytest.raises(ValueError, match=r"needs 62 \+ 27 dense rows, the buffers hold 88"):
        oscar_decode_read_prefill(q, q_rot, v, cache=pc.mixed(), batch=step.batch(), plan=plan)


@pytest.mark.parametrize("has_prefix", [False, True])
def test_fresh_prefill_queries_are_not_rotated(has_prefix):
    """A prefill chunk with no cached prefix attends to its own keys through FlashAttention only,
    so its queries skip the rotation (an fp32 GEMM over every prompt token and layer); over a
    cached prefix they are rotated for the INT2 kernel. Prefill only: no Gluon launch."""
    from oscar_vllm.serving.backend import OscarAttentionImpl, _own_keys

    d, hkv, g, sink, recent = 64, 1, 2, 4, 8
    pc, step, q, _, k, v = prepare(d, hkv, g, sink, recent, [30 if has_prefix else 0], [20], torch.float32)
    rot = random_rotation(d).to(DEVICE)
    scale = 1 / math.sqrt(d)
    attention, _ = decode_read_twins(scale)
    rotated = []

    def rotate(x):
        rotated.append(x.shape[0])
        return (x.float() @ rot).to(x.dtype)

    impl = SimpleNamespace(
        rotate=rotate, decode_read=False, own_keys_attention=lambda *a: _own_keys(
            lambda *b, return_lse: attention(*b, return_lse=return_lse, window_left=-1), *a),
        dense_prefill=lambda md, k: None, scale=scale, sink=sink, recent=recent, param_dtype=torch.float16,
        logit_correction=0.0, rot_k=rot, window_pos=pc.window_pos, clip_idx_k=clip_index(CLIP_K, d),
        clip_idx_v=clip_index(CLIP_V, d), key_mean={}, decode_key_mean=None)
    md = SimpleNamespace(
        num_decodes=0, num_reqs=1, num_actual_tokens=20, max_query_len=20, prefill_has_prefix=has_prefix,
        query_start_loc=step.cu_q, seq_lens=step.seq_lens, block_table=step.block_table,
        slot_mapping=step.slot_mapping, ring_slots=step.ring_slots, window_pages=pc.window_pages)
    out = torch.full_like(q, float("nan"))
    OscarAttentionImpl._forward_write_first(impl, md, step.batch(), q, k, v, out, pc.mixed(), out)
    assert rotated == ([20] if has_prefix else [])
    assert not out.isnan().any() and (pc.window_pos[step.ring_slots[0].long()] >= 0).sum() == sink + recent
    if not has_prefix:
        own = torch.empty_like(out)
        attention(q, k, v, step.cu_q, step.cu_q, 20, 20, own, return_lse=False, window_left=-1)
        torch.testing.assert_close(out, own, rtol=0, atol=0)


@pytest.mark.parametrize("path", ["triton", "write-first", "dense"])
def test_forward_with_key_mean_writes_and_reads_keys_less_their_mean(monkeypatch, path):
    """``key_mean`` "on" through the backend: a decode and a prefill over a cached prefix read the
    INT2 keys plus their mean as the twin does, and the step's keys go into the pages less it, as
    the twin writes them; on the Triton path (attention, then the write), on the Gluon one
    (decode tokens written first, the decode kernel given the queries and its key-mean operands:
    here the Gluon kernels' twins, from the arguments they are given), and with the prefill on the
    dense path (its prefix dequantized plus the mean, FlashAttention's twin over it; no λ there,
    so λ 0, the key mean's default)."""
    import oscar_vllm.serving.backend as backend
    from csrc_triton.oscar_decode import key_mean_operands
    from csrc_triton.paged_layout import BLOCK_SIZE
    from kernel_cases import KeyMeanCase
    from oscar_vllm.core.key_mean import KeyMean
    from oscar_vllm.reference.oscar_attention import oscar_attention_reference
    from oscar_vllm.reference.oscar_decode import oscar_decode_reference
    from oscar_vllm.reference.oscar_write import oscar_write_decode_reference
    from oscar_vllm.reference.oscar_write import oscar_write_reference, token_positions
    from oscar_vllm.reference.oscar_attention import read_int2_slots
    from csrc_triton.oscar_dense_kv import key_mean_basis
    from kernel_cases import dense_twin

    d, hkv, g, sink, recent = 64, 2, 2, 4, 8
    prefix, new = [90, 70], [1, 9]
    km = KeyMeanCase(hkv, d, 256)
    pc, step, q, q_rot, k, v = prepare(d, hkv, g, sink, recent, prefix, new, torch.float32, key_mean=km)
    k = km.keys_at(k, token_positions(step.cu_q, step.seq_lens, 2)[1])
    rot = random_rotation(d).to(DEVICE)  # prepare's rotation (seed 0)
    scale, lam = 1 / math.sqrt(d), 0.0 if path == "dense" else 0.5
    want = oscar_attention_reference(q, q @ rot, k, v, cache=pc.mixed(), batch=step.batch(1), scale=scale,
                                     logit_correction=lam, key_mean=km.twin, rot_k=rot)
    written = pc.clone()
    oscar_write_reference(k, v, rot_k=rot, slot_mapping=step.slot_mapping, cache=written.mixed(), batch=step.batch(1),
                          clip_ratio_k=CLIP_K, clip_ratio_v=CLIP_V, key_mean=km.twin)
    attention, _ = decode_read_twins(scale)
    impl = SimpleNamespace(
        num_heads=hkv * g, head_size=d, num_kv_heads=hkv, gluon_decode=False, decode_read=False, scale=scale,
        sink=sink, recent=recent, param_dtype=torch.float16, logit_correction=lam, rot_k=rot, window_pos=pc.window_pos,
        clip_idx_k=clip_index(CLIP_K, d), clip_idx_v=clip_index(CLIP_V, d),
        key_mean=dict(key_mean=km.mean, cos_sin=km.table), dense_kv=None,
        decode_key_mean=key_mean_operands(km.mean, km.table) if path == "write-first" else None,
        rotate=lambda x: (x.float() @ rot).to(x.dtype),
        own_keys_attention=lambda *a: backend._own_keys(
            lambda *b, return_lse: attention(*b, return_lse=return_lse, window_left=-1), *a))
    impl.dense_prefill = lambda md, k: backend.OscarAttentionImpl.dense_prefill(impl, md, k)
    dense_calls = []
    if path == "dense":
        impl.dense_kv = tuple(torch.full((100, hkv, d), float("nan"), device=DEVICE) for _ in range(2))
        impl.dense_mean_basis = key_mean_basis(km.mean, rot)
        impl.flash_attention = lambda *a: (dense_calls.append(a[3].tolist()), dense_twin(scale)(*a))
    md = SimpleNamespace(
        num_decodes=1, num_reqs=2, num_actual_tokens=10, max_query_len=9, prefill_has_prefix=True,
        prefill_shapes=((9, 79),) if path == "dense" else (),
        query_start_loc=step.cu_q, seq_lens=step.seq_lens, block_table=step.block_table,
        slot_mapping=step.slot_mapping, ring_slots=step.ring_slots, window_pages=pc.window_pages, decode_splits=2,
        decode_ring_cost=2, part_out=torch.empty(2 * hkv * g * 2 * d, device=DEVICE),
        part_lse=torch.empty(2 * hkv * g * 2, device=DEVICE))
    monkeypatch.setattr(backend, "windows_view", lambda cache: pc.windows)

    def decode_twin(out, q_rot, *, cache, batch, scale, num_splits, part_out, part_lse, logit_correction, ring_cost, q,
                    key_mean):
        assert q is not None and key_mean is impl.decode_key_mean
        twin = KeyMean.from_cos_sin_cache(key_mean["key_mean"].cpu(), key_mean["cos_sin"].cpu(), block=BLOCK_SIZE)
        out.copy_(oscar_decode_reference(q_rot, cache=cache, batch=batch, scale=scale,
                                         logit_correction=logit_correction, key_mean=twin, rot_k=rot))

    def write_decode_twin(k, v, q, q_rot, *, rot_t, slot_mapping, cache, batch, clip_idx_k, clip_idx_v, key_mean,
                          cos_sin):
        assert rot_t is impl.rot_t and clip_idx_k == impl.clip_idx_k and clip_idx_v == impl.clip_idx_v
        twin = KeyMean.from_cos_sin_cache(key_mean.cpu(), cos_sin.cpu(), block=BLOCK_SIZE)
        q_rot.copy_(oscar_write_decode_reference(k, v, q, rot_k=rot, slot_mapping=slot_mapping, cache=cache,
                                                 batch=batch, clip_ratio_k=CLIP_K, clip_ratio_v=CLIP_V, key_mean=twin))

    monkeypatch.setattr(backend, "oscar_decode", decode_twin)
    monkeypatch.setattr(backend, "oscar_write_decode", write_decode_twin)
    impl.rot_t = object()
    impl.gluon_decode = path == "write-first"
    impl._forward_write_first = lambda *a: backend.OscarAttentionImpl._forward_write_first(impl, *a)
    out = torch.full((10, hkv * g * d), float("nan"), device=DEVICE)
    backend.OscarAttentionImpl.forward(impl, SimpleNamespace(layer_name="x"), q.flatten(1), k.flatten(1),
                                       v.flatten(1), pc.cache, md, out)
    torch.testing.assert_close(out.view(10, hkv * g, d).cpu(), want.cpu(), rtol=1e-4, atol=1e-4)
    assert dense_calls == ([[0, 9]] if path == "dense" else []), "the prefill took the dense path where it can"
    # The step's slots as the pages hold them (k @ R sums in another order: a code may flip at a tie).
    for got, expect in zip(read_int2_slots(pc.cache, step.slot_mapping, d, torch.float16),
                           read_int2_slots(written.cache, step.slot_mapping, d, torch.float16)):
        assert ((got - expect).abs() > 1e-2 * expect.abs().max()).float().mean() <= 1e-2


@pytest.mark.parametrize("given,want", [(None, 0.0), (0.25, 0.25)])
def test_a_layer_given_key_means_reads_them_at_their_own_logit_correction(given, want):
    """``set_key_mean`` takes the layer's λ for keys less their mean (none by default: the study's
    best there) where a layer without means keeps 0.5; a λ the operator gives holds for both."""
    from oscar_vllm.core.settings import OscarSettings
    from oscar_vllm.serving.backend import OscarAttentionImpl

    d, hkv = 64, 2
    settings = OscarSettings(logit_correction=given)
    impl = SimpleNamespace(settings=settings, decode_read=False, gluon_decode=False, window_pos=torch.zeros(2, 8),
                           logit_correction=settings.logit_correction_for(key_mean=False), rot_k=torch.eye(d))
    assert impl.logit_correction == (0.5 if given is None else given)
    OscarAttentionImpl.set_key_mean(impl, torch.randn(hkv, d), torch.randn(128, d))
    assert impl.logit_correction == want and impl.key_mean["key_mean"].shape == (hkv, d)
    assert impl.dense_mean_basis.rows.shape == (2 * KEY_MEAN_PAIRS, hkv, d), "and the dense prefill's basis of the mean"
