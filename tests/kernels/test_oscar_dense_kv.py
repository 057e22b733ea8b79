"""csrc_triton/oscar_dense_kv.py against its PyTorch reference, and the dense prefill path
(dequantized prefix + one causal attention) against the attention reference."""
import math

import pytest
import torch

from csrc_triton.oscar_dense_kv import key_mean_basis, oscar_dense_kv
from csrc_triton.paged_layout import BLOCK_SIZE
from oscar_vllm.core.key_mean import KeyMean
from oscar_vllm.reference.oscar_attention import (
    causal_attention_reference, decode_read_attention_reference, oscar_attention_reference,
)
from oscar_vllm.reference.oscar_dense_kv import oscar_dense_kv_reference
from oscar_vllm.reference.oscar_write import oscar_write_reference
from oscar_vllm.serving.prefill import (
    DecodeReadPrefill, DensePrefill, oscar_attention, oscar_decode_read_prefill, pack_requests,
)
from paged_sim import PagedCache
from oscar_vllm.reference.paged import rotated_key_mean
from kernel_cases import (
    CASES, CLIP_K, CLIP_V, DEVICE, DTYPES, KEY_MEAN_BF16_MAX, KeyMeanCase, assert_close_to_reference,
    case_id, decode_read_twins, dense_twin, prepare, random_rotation, random_rows,
)

PREFILL_CASES = [c for c in CASES if max(c[6]) > 1]


def cumulative(seq_lens: torch.Tensor) -> torch.Tensor:
    return torch.cat([seq_lens.new_zeros(1), seq_lens.cumsum(0)]).to(torch.int32)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_dense_kv_matches_reference(case, out_dtype):
    """Every row bit-equal: INT2 rows round once (c·scale is exact), ring and new rows are copies."""
    d, hkv, g, sink, recent, prefix, new = case
    pc, step, q, q_rot, k, v = prepare(*case, torch.float32)
    cu_k = cumulative(step.seq_lens)
    total = int(cu_k[-1])
    # Spare rows past the end: a write out of bounds shows as a non-NaN there.
    k_out = torch.full((total + 70, hkv, d), float("nan"), dtype=out_dtype, device=DEVICE)
    v_out = torch.full_like(k_out, float("nan"))
    cache, batch = pc.mixed(), step.batch()
    oscar_dense_kv(k_out, v_out, k, v, cache=cache, batch=batch, cu_k=cu_k, max_seq_len=int(step.seq_lens.max()) + 65)
    want_k, want_v = oscar_dense_kv_reference(k, v, cache=cache, batch=batch)
    assert k_out[total:].isnan().all() and v_out[total:].isnan().all()
    torch.testing.assert_close(k_out[:total].cpu(), want_k.to(out_dtype), rtol=0, atol=0)
    torch.testing.assert_close(v_out[:total].cpu(), want_v.to(out_dtype), rtol=0, atol=0)


@pytest.mark.parametrize("pairs", ["served", "all", "uneven"])
@pytest.mark.parametrize("per_head", [False, True], ids=["shared", "per-head"])
def test_key_mean_basis_gives_the_mean_turned_and_rotated(per_head, pairs):
    """A RoPE table row's columns of head h's pairs times its rows of the basis is
    RoPE_p(mean_h) @ R_K, as the write took it off: for a mean on the pairs the backend serves
    (16 a head: 32 rows), on all pairs (d rows), and on a different count a head (one with a single
    pair, one with none: the rows past a head's pairs are zero)."""
    hkv, d = 3, 64
    km = KeyMeanCase(hkv, d, 500)
    if pairs != "served":
        mean = 3 * random_rows((hkv, d), torch.float32, 7)
        if pairs == "uneven":
            mean[1, 1:d // 2] = mean[1, d // 2 + 1:] = 0
            mean[2] = 0
        km.mean, km.model = mean, KeyMean.from_cos_sin_cache(mean, km.table.cpu())
    rot = random_rotation(d, hkv if per_head else None, seed=4)
    pos = torch.tensor([0, 1, 63, 64, 65, 300, 499])
    basis = key_mean_basis(km.mean.cpu(), rot)
    assert basis.rows.shape == ({"served": 32, "all": d, "uneven": d}[pairs], hkv, d)
    got = torch.stack([km.table.cpu()[pos][:, basis.columns[h].long()] @ basis.rows[:, h] for h in range(hkv)], dim=1)
    torch.testing.assert_close(got, rotated_key_mean(km.model, rot, pos), rtol=1e-5, atol=1e-4)
    if pairs == "uneven":
        k = basis.rows.shape[0]  # head 1: its pair's cosine row 0 and sine row K/2; head 2: none
        assert (basis.rows[:, 1].abs().amax(dim=1) > 0).nonzero().flatten().tolist() == [0, k // 2]
        assert basis.rows[:, 2].abs().max() == 0


# The key mean's product runs in TF32x3 on a GPU (fp32 under the interpreter): near fp32, not
# bit-equal to the reference's sum. Here the mean term reaches 19-35; TF32x3 emulated on the CPU
# over the GPU cases leaves it at most 1.9e-5 off the reference.
DENSE_KEY_MEAN_FP32_ATOL = 1e-4


@pytest.mark.parametrize("pairs", ["served", "all"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_dense_kv_reads_int2_keys_plus_their_mean(case, out_dtype, pairs):
    """Prefix keys written less their mean (``key_mean`` "on"): the INT2 rows come back plus
    RoPE_p(mean) @ R_K, the ring's and the chunk's rows as they are, values untouched; read
    without the mean the keys are far off. ``pairs``: the mean on the 16 pairs a head serves (a
    32-row basis), or on all of them (d rows; one case)."""
    if pairs == "all" and (case != CASES[0] or out_dtype != torch.float32):
        pytest.skip("a mean on all pairs: one case")
    d, hkv, g, sink, recent, prefix, new = case
    km = KeyMeanCase(hkv, d, max(prefix) + max(new) + 1)
    if pairs == "all":
        km.mean = 3 * random_rows((hkv, d), torch.float32, 7).to(DEVICE)
        km.twin = KeyMean.from_cos_sin_cache(km.mean.cpu(), km.table.cpu(), block=BLOCK_SIZE)
        km.model = KeyMean.from_cos_sin_cache(km.mean.cpu(), km.table.cpu())
    pc, step, q, q_rot, k, v = prepare(*case, torch.float32, key_mean=km)
    rot = random_rotation(d).to(DEVICE)  # prepare's rotation (seed 0)
    cu_k = cumulative(step.seq_lens)
    total = int(cu_k[-1])
    k_out = torch.full((total + 70, hkv, d), float("nan"), dtype=out_dtype, device=DEVICE)
    v_out = torch.full_like(k_out, float("nan"))
    cache, batch = pc.mixed(), step.batch()
    oscar_dense_kv(k_out, v_out, k, v, cache=cache, batch=batch, cu_k=cu_k, max_seq_len=int(step.seq_lens.max()) + 65,
                   mean_basis=key_mean_basis(km.mean, rot), cos_sin=km.table)
    want_k, want_v = oscar_dense_kv_reference(k, v, cache=cache, batch=batch, key_mean=km.twin, rot_k=rot)
    without_k, _ = oscar_dense_kv_reference(k, v, cache=cache, batch=batch)
    assert k_out[total:].isnan().all() and v_out[total:].isnan().all()
    if out_dtype == torch.float32:
        torch.testing.assert_close(k_out[:total].cpu(), want_k, rtol=0, atol=DENSE_KEY_MEAN_FP32_ATOL)
    else:  # one rounding to bf16 of numbers DENSE_KEY_MEAN_FP32_ATOL apart: one bf16 step apart, or
        # (near zero, where a step is smaller) that far
        torch.testing.assert_close(k_out[:total].cpu().float(), want_k.to(out_dtype).float(), rtol=2 ** -7,
                                   atol=DENSE_KEY_MEAN_FP32_ATOL)
    torch.testing.assert_close(v_out[:total].cpu(), want_v.to(out_dtype), rtol=0, atol=0)
    assert (without_k - want_k).abs().max() > 100 * DENSE_KEY_MEAN_FP32_ATOL


def test_dense_kv_rejects_a_key_mean_basis_without_its_table():
    pc, step, q, q_rot, k, v = prepare(64, 1, 2, 4, 8, [70], [3], torch.float32)
    out = torch.empty(73, 1, 64, device=DEVICE)
    args = (out, out.clone(), k, v)
    kw = dict(cache=pc.mixed(), batch=step.batch(), cu_k=cumulative(step.seq_lens), max_seq_len=73)
    km = KeyMeanCase(1, 64, 73)
    with pytest.raises(ValueError, match="pass both or neither"):
        oscar_dense_kv(*args, **kw, mean_basis=key_mean_basis(km.mean, random_rotation(64).to(DEVICE)))
    with pytest.raises(ValueError, match="must be a KeyMeanBasis"):
        oscar_dense_kv(*args, **kw, mean_basis=torch.zeros(64, 1, 64, device=DEVICE), cos_sin=km.table)
    basis = key_mean_basis(km.mean, random_rotation(64).to(DEVICE))
    with pytest.raises(ValueError, match=r"rows must be contiguous fp32 \[K, 1, 64\]"):
        oscar_dense_kv(*args, **kw, mean_basis=basis._replace(rows=basis.rows[:, :, :32].contiguous()),
                       cos_sin=km.table)
    with pytest.raises(ValueError, match=r"columns must be contiguous int32 \[1, 32\]"):
        oscar_dense_kv(*args, **kw, mean_basis=basis._replace(columns=basis.columns.long()), cos_sin=km.table)


@pytest.mark.parametrize("rows", ["window", "int2"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_dense_kv_fills_the_decode_reads_rows(case, rows):
    """The decode-read prefill's two fills, bit-equal to the reference: its window's rows (from
    ``first_pos``), and every position but the last ``recent`` from INT2 with the ring for the
    sink only (a ``cu_q`` of empty chunks)."""
    d, hkv, g, sink, recent, prefix, new = case
    pc, step, q, q_rot, k, v = prepare(*case, torch.float32)
    seq = step.seq_lens.long()
    q_len = (step.cu_q[1:] - step.cu_q[:-1]).long()
    if rows == "window":
        count = torch.minimum(seq, q_len + recent - 1)
        cu_q, kw = step.cu_q, dict(first_pos=(seq - count).to(torch.int32))
    else:  # after the chunk's write, as the prefill runs it
        oscar_write_reference(k, v, rot_k=random_rotation(d).to(DEVICE), slot_mapping=step.slot_mapping,
                              cache=pc.mixed(), batch=step.batch(), clip_ratio_k=CLIP_K, clip_ratio_v=CLIP_V)
        count = (seq - recent).clamp(min=0)
        cu_q, kw = torch.zeros_like(step.cu_q), dict(drop_last=recent, ring_recent=False)
    cu_k = cumulative(count)
    total = int(cu_k[-1])
    k_out = torch.full((total + 70, hkv, d), float("nan"), device=DEVICE)
    v_out = torch.full_like(k_out, float("nan"))
    cache, batch = pc.mixed(), step.batch()._replace(cu_q=cu_q)
    oscar_dense_kv(k_out, v_out, k, v, cache=cache, batch=batch, cu_k=cu_k, max_seq_len=int(seq.max()) + 65, **kw)
    want_k, want_v = oscar_dense_kv_reference(k, v, cache=cache, batch=batch, **kw)
    assert want_k.shape[0] == total and k_out[total:].isnan().all() and v_out[total:].isnan().all()
    torch.testing.assert_close(k_out[:total].cpu(), want_k, rtol=0, atol=0)
    torch.testing.assert_close(v_out[:total].cpu(), want_v, rtol=0, atol=0)


def run_decode_read(case, dtype, attention, merge, spare_rows=64):
    """``oscar_decode_read_prefill`` on a prepared case with NaN-filled buffers (``spare_rows``
    past what it fills) and the reference write, and what it should give: a softmax over
    decode's read of every query. Returns ``(out, want)``."""
    d, hkv, g, sink, recent, prefix, new = case
    pc, step, q, q_rot, k, v = prepare(*case, dtype)
    rot = random_rotation(d).to(DEVICE)  # prepare's rotation (seed 0)
    n, scale = len(new), 1 / math.sqrt(d)
    seq, q_len = step.seq_lens.long().cpu(), (step.cu_q[1:] - step.cu_q[:-1]).long().cpu()
    k_rot = (k.float() @ rot).to(dtype)
    # The reference's rows: BF16 as the window reads them (before the write), INT2 after it.
    cache, batch = pc.mixed(), step.batch()
    k_bf16, v_bf16 = oscar_dense_kv_reference(k_rot, v, cache=cache, batch=batch)

    def write():
        oscar_write_reference(k, v, rot_k=rot, slot_mapping=step.slot_mapping, cache=cache, batch=batch,
                              clip_ratio_k=CLIP_K, clip_ratio_v=CLIP_V)

    n_int2, n_window = (seq - recent).clamp(min=0), torch.minimum(seq, q_len + recent - 1)
    rows = int(n_int2.sum() + n_window.sum()) + spare_rows
    plan = DecodeReadPrefill(
        k_rot=k_rot, k_buf=torch.full((rows, hkv, d), float("nan"), dtype=dtype, device=DEVICE),
        v_buf=torch.full((rows, hkv, d), float("nan"), dtype=dtype, device=DEVICE),
        rows_int2=int(n_int2.sum()), max_int2=int(n_int2.max()), rows_window=int(n_window.sum()),
        max_window=int(n_window.max()), max_seq_len=int(seq.max()), write=write, attention=attention, merge=merge)
    out = torch.full_like(q, float("nan"))
    oscar_decode_read_prefill(out, q_rot, v, cache=cache, batch=batch, plan=plan)
    no_chunk = batch._replace(cu_q=torch.zeros_like(step.cu_q))
    k_int2, v_int2 = oscar_dense_kv_reference(k_rot, v, cache=cache, batch=no_chunk, ring_recent=False)
    return out, decode_read_attention_reference(q_rot, k_bf16, v_bf16, k_int2, v_int2, step.seq_lens, step.cu_q, n,
                                                scale, recent)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=case_id)
def test_decode_read_prefill_matches_reference(case, dtype):
    """Prefill chunks read as decode reads the cache (two attention passes and a merge, the
    write between the fills) against a softmax over decode's read of every query, with the
    attention and the merge as their PyTorch twins."""
    out, want = run_decode_read(case, dtype, *decode_read_twins(1 / math.sqrt(case[0])))
    assert_close_to_reference(out, want, dtype, fp32_atol=2e-4, bf16_max=2e-2, bf16_mean=8e-3)


def test_decode_read_reference_reads_as_decode_whatever_the_chunks():
    """The point of the decode read: a prompt's outputs do not depend on where it is cut. The
    same prompt attended in one chunk and as two chunks (the second over the first, written)
    gives the same outputs at every position; the chunk read does not (the second chunk reads
    the first's older tokens in 2 bits, the one chunk reads them in BF16)."""
    d, hkv, g, sink, recent = 64, 1, 2, 4, 8
    total, cut = 40, 23
    _, _, q, q_rot, k, v = prepare(d, hkv, g, sink, recent, [0], [total], torch.float32)
    rot = random_rotation(d).to(DEVICE)
    scale = 1 / math.sqrt(d)
    # Values the ring holds exactly (it stores BF16), so one chunk's new rows equal its copies.
    k, v = k.bfloat16().float(), v.bfloat16().float()
    k_rot = (k @ rot).bfloat16().float()

    def prefill(pc, lo, hi):
        step = pc.schedule({0: hi - lo})
        cache, batch = pc.mixed(), step.batch()
        k_bf16, v_bf16 = oscar_dense_kv_reference(k_rot[lo:hi], v[lo:hi], cache=cache, batch=batch)
        oscar_write_reference(k[lo:hi], v[lo:hi], rot_k=rot, slot_mapping=step.slot_mapping, cache=cache, batch=batch,
                              clip_ratio_k=CLIP_K, clip_ratio_v=CLIP_V)
        k_int2, v_int2 = oscar_dense_kv_reference(k_rot[lo:hi], v[lo:hi], cache=cache,
                                                  batch=batch._replace(cu_q=torch.zeros_like(step.cu_q)),
                                                  ring_recent=False)
        chunk_read, _ = causal_attention_reference(q_rot[lo:hi], k_bf16, v_bf16, step.cu_q, cumulative(step.seq_lens),
                                                   1, scale)
        decode_read = decode_read_attention_reference(q_rot[lo:hi], k_bf16, v_bf16, k_int2, v_int2, step.seq_lens,
                                                      step.cu_q, 1, scale, recent)
        return chunk_read, decode_read

    def cache():
        return PagedCache(1, total + 1, hkv, d, sink, recent, DEVICE, 0)

    whole_chunk, whole_decode = prefill(cache(), 0, total)
    pc = cache()
    head_chunk, head_decode = prefill(pc, 0, cut)
    tail_chunk, tail_decode = prefill(pc, cut, total)
    torch.testing.assert_close(torch.cat([head_decode, tail_decode]), whole_decode, rtol=0, atol=1e-5)
    moved = (torch.cat([head_chunk, tail_chunk]) - whole_chunk).abs().amax(dim=(1, 2))
    assert moved[:cut].max() < 1e-5 and moved[cut:].max() > 0.1
    assert (whole_decode - whole_chunk).abs().amax(dim=(1, 2))[:recent].max() < 1e-5  # nothing 2-bit yet


def test_dense_kv_reads_the_ring_only_in_the_window():
    """The ring holds the sink and the last ``recent`` positions; only those rows differ from INT2."""
    case = (64, 1, 2, 4, 8, [100], [5])
    pc, step, q, q_rot, k, v = prepare(*case, torch.float32)
    kw = dict(cache=pc.mixed(), batch=step.batch())
    with_ring, _ = oscar_dense_kv_reference(k, v, **kw)
    pc.window_pos.fill_(-1)
    without, _ = oscar_dense_kv_reference(k, v, **kw)
    moved = (with_ring - without).abs().amax(dim=(1, 2)) > 0
    assert moved.nonzero().flatten().tolist() == [0, 1, 2, 3] + list(range(93, 100))


def dense_prefill_against_reference(case, dtype, grouped: bool, roomy: bool = False,
                                    key_mean: bool = False) -> list[int]:
    """Decodes through the split kernel, prefills through the dense path, one batch, against the
    reference; ``grouped``: the requests' shapes given, with buffers of only the longest prefill
    request's rows (``roomy``: 64 rows more than all need), so the prefills run in groups;
    ``key_mean``: the prefixes written less a key mean, which both paths add back.
    Returns the buffer rows of each attention call, and the prefill rows."""
    d, hkv, g, sink, recent, prefix, new = case
    order = sorted(range(len(new)), key=lambda r: new[r] > 1)  # decodes first, as vLLM orders them
    case = (d, hkv, g, sink, recent, [prefix[r] for r in order], [new[r] for r in order])
    km = KeyMeanCase(hkv, d, max(prefix) + max(new) + 1) if key_mean else None
    pc, step, q, q_rot, k, v = prepare(*case, dtype, key_mean=km)
    rot = random_rotation(d).to(DEVICE)  # prepare's rotation (seed 0)
    t, hq, scale = q.shape[0], hkv * g, 1 / math.sqrt(d)
    num_decodes = sum(1 for x in case[6] if x == 1)
    shapes = tuple((q_len, p + q_len) for p, q_len in zip(case[5][num_decodes:], case[6][num_decodes:]))
    rows = max(s for _, s in shapes) if grouped and not roomy else int(step.seq_lens.sum()) + 64
    twin, calls = dense_twin(scale), []

    def attention(q, k_buf, v_buf, *args):
        calls.append(k_buf.shape[0])
        twin(q, k_buf, v_buf, *args)

    dense = DensePrefill(
        k_rot=(k[num_decodes:].float() @ rot).to(dtype),
        k_buf=torch.full((rows, hkv, d), float("nan"), dtype=dtype, device=DEVICE),
        v_buf=torch.full((rows, hkv, d), float("nan"), dtype=dtype, device=DEVICE),
        max_seq_len=int(step.seq_lens.max()), attention=attention, shapes=shapes if grouped else (),
        mean_basis=km and key_mean_basis(km.mean, rot), cos_sin=km and km.table)
    out = torch.full_like(q, float("nan"))
    part_out = torch.empty(t * hq * 4 * d, device=DEVICE)
    part_lse = torch.empty(t * hq * 4, device=DEVICE)
    mean = dict(key_mean=km.mean, cos_sin=km.table) if km else {}
    cache, batch = pc.mixed(), step.batch(num_decodes)
    oscar_attention(out, q, q_rot, k, v, cache=cache, batch=batch, scale=scale, decode_splits=4, part_out=part_out,
                    part_lse=part_lse, dense=dense, **mean)
    want = oscar_attention_reference(q, q_rot, k, v, cache=cache, batch=batch, scale=scale, key_mean=km and km.twin,
                                     rot_k=rot)
    # fp32: the chunk's own keys meet the queries rotated, (q R)·(k R), in the dense pass and
    # unrotated in the reference: on the H200, 2 of 3.9M outputs moved by up to 1.5e-4. bf16:
    # the dense rows are rounded to bf16 as well (the reference keeps fp32 INT2 values): on the
    # CPU the mean error is 0.52-0.54% of the mean output, the worst 0.8-1.2% of the largest.
    assert_close_to_reference(out, want, dtype, fp32_atol=3e-4, bf16_max=KEY_MEAN_BF16_MAX if km else 2e-2,
                              bf16_mean=8e-3)
    return calls, sum(s for _, s in shapes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", PREFILL_CASES, ids=case_id)
def test_dense_prefill_matches_reference(case, dtype):
    calls, _ = dense_prefill_against_reference(case, dtype, grouped=False)
    assert len(calls) == 1


GROUPED_CASES = [c for c in PREFILL_CASES if sum(1 for x in c[6] if x > 1) > 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", GROUPED_CASES, ids=case_id)
def test_dense_prefill_in_groups_matches_reference(case, dtype):
    """Buffers that hold only the longest prefill request: the batch runs in groups, each
    attention call over its own group's rows (NaN in every buffer row, so a group that reads
    rows it did not fill shows)."""
    calls, rows = dense_prefill_against_reference(case, dtype, grouped=True)
    assert len(calls) > 1 and sum(calls) == rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("grouped", [False, True], ids=["one-launch", "grouped"])
@pytest.mark.parametrize("case", PREFILL_CASES, ids=case_id)
def test_dense_prefill_with_a_key_mean_matches_reference(case, grouped, dtype):
    """``key_mean`` "on" keeps the dense path: its INT2 prefix rows plus the mean, against the
    reference that adds it to every INT2 key (the batch's decodes through the split kernel's)."""
    dense_prefill_against_reference(case, dtype, grouped=grouped, key_mean=True)


def test_a_dense_prefill_needs_the_basis_of_the_mean_the_kernels_add():
    """A key mean for the INT2 kernels and a dense path without its basis (or the reverse) would
    read the prefix two ways in one batch: refused."""
    d, hkv, g, sink, recent, prefix, new = case = PREFILL_CASES[0]
    km = KeyMeanCase(hkv, d, 400)
    pc, step, q, q_rot, k, v = prepare(*case, torch.float32, key_mean=km)
    buf = torch.zeros(1000, hkv, d, device=DEVICE)
    dense = DensePrefill(k_rot=k, k_buf=buf, v_buf=buf.clone(), max_seq_len=int(step.seq_lens.max()),
                         attention=dense_twin(1.0))
    args = (torch.empty_like(q), q, q_rot, k, v)
    kw = dict(cache=pc.mixed(), batch=step.batch(), scale=1.0)
    with pytest.raises(ValueError, match="exactly when the INT2 kernels do"):
        oscar_attention(*args, **kw, dense=dense, key_mean=km.mean, cos_sin=km.table)
    dense.mean_basis, dense.cos_sin = key_mean_basis(km.mean, random_rotation(d).to(DEVICE)), km.table
    with pytest.raises(ValueError, match="exactly when the INT2 kernels do"):
        oscar_attention(*args, **kw, dense=dense)


@pytest.mark.parametrize("case", GROUPED_CASES, ids=case_id)
def test_dense_prefill_with_shapes_that_fit_is_one_call_over_its_rows(case):
    calls, rows = dense_prefill_against_reference(case, torch.float32, grouped=True, roomy=True)
    assert calls == [rows], "one group, the buffers cut at the batch's rows"


def test_pack_requests_groups_consecutive_requests_that_fit():
    assert pack_requests([3, 4, 2, 5, 1], 6) == [(0, 1), (1, 3), (3, 5)]
    assert pack_requests([6, 6], 6) == [(0, 1), (1, 2)]
    assert pack_requests([1, 2, 3], 6) == [(0, 3)]
    assert pack_requests([], 6) == []
    with pytest.raises(ValueError, match="request 1 needs 7 dense rows, the buffers hold 6"):
        pack_requests([1, 7], 6)


def test_dense_kv_rejects_a_buffer_of_the_wrong_shape():
    pc, step, q, q_rot, k, v = prepare(64, 1, 2, 4, 8, [70], [3], torch.float32)
    bad = torch.empty(100, 2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="k_out must be contiguous"):
        oscar_dense_kv(bad, bad, k, v, cache=pc.mixed(), batch=step.batch(), cu_k=cumulative(step.seq_lens),
                       max_seq_len=73)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention needs a GPU")
@pytest.mark.parametrize("key_mean", [False, True], ids=["", "key-mean"])
@pytest.mark.parametrize("grouped", [False, True], ids=["one-launch", "grouped"])
@pytest.mark.parametrize("prefix,new", [([0, 1536], [56, 200]), ([1504, 0, 1648], [24, 88, 232])])
def test_dense_prefill_through_flash_attention_ignores_rows_past_the_batch(prefix, new, grouped, key_mean):
    """The backend's dense path with vLLM's FlashAttention, chunks ordered as vLLM orders them
    (the longest last) and NaN in every buffer row past the batch: FlashAttention reads whole
    key tiles, and the rows past the last chunk must not reach its output. ``grouped``: buffers of
    the longest request's rows alone, so the batch runs in groups over the same buffers;
    ``key_mean``: prefixes written less a key mean, which the layer's fill adds back."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from oscar_vllm.serving.backend import OscarAttentionImpl, _flash_attention

    d, hkv, g, sink, recent, dtype = 64, 3, 3, 64, 256, torch.bfloat16
    scale = 1 / math.sqrt(d)
    attention = _flash_attention(scale, dtype)
    if attention is None:
        pytest.skip("no FlashAttention build")
    km = KeyMeanCase(hkv, d, max(prefix) + max(new) + 1) if key_mean else None
    pc, step, q, q_rot, k, v = prepare(d, hkv, g, sink, recent, prefix, new, dtype, key_mean=km)
    rot = random_rotation(d).to(DEVICE)
    rows = int(step.seq_lens.max()) if grouped else 4352
    buffers = [torch.full((rows, hkv, d), float("nan"), dtype=dtype, device=DEVICE) for _ in range(2)]
    mean = dict(key_mean=km.mean, cos_sin=km.table) if km else {}
    impl = SimpleNamespace(dense_kv=tuple(buffers), rotate=lambda x: (x.float() @ rot).to(x.dtype),
                           flash_attention=attention, key_mean=mean,
                           dense_mean_basis=km and key_mean_basis(km.mean, rot))
    md = SimpleNamespace(prefill_has_prefix=True, num_decodes=0, num_reqs=len(new),
                         prefill_shapes=tuple((n, p + n) for p, n in zip(prefix, new)))
    dense = OscarAttentionImpl.dense_prefill(impl, md, k)
    out = torch.full_like(q, float("nan"))
    cache, batch = pc.mixed(), step.batch()
    oscar_attention(out, q, q_rot, k, v, cache=cache, batch=batch, scale=scale, dense=dense, **mean)
    assert not out.isnan().any()
    want = oscar_attention_reference(q, q_rot, k, v, cache=cache, batch=batch, scale=scale, key_mean=km and km.twin,
                                     rot_k=rot)
    # The twin's bounds (test_dense_prefill_matches_reference) with room for FlashAttention's
    # bf16 probabilities in p @ v; garbage read past the batch lands far outside them.
    assert_close_to_reference(out, want, dtype, bf16_max=3e-2, bf16_mean=1.2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention needs a GPU")
@pytest.mark.parametrize("prefix,new", [
    ([0, 1536], [56, 200]),  # the first chunk reads itself in 2 bits beyond its window; the second a prefix
    ([1504, 0, 1648], [24, 88, 232]),  # a request shorter than its window: an empty INT2 pass
    ([0, 40], [100, 17]),  # every request within its window: the INT2 pass is skipped
])
def test_decode_read_prefill_through_flash_attention(prefix, new):
    """The decode read with vLLM's FlashAttention (the window pass's `window_size`, the INT2
    pass's bottom-right alignment over cut keys, queries that see no INT2 key) and vLLM's
    `merge_attn_states`, NaN in every buffer row it does not fill, against the reference."""
    pytest.importorskip("vllm")
    from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

    from oscar_vllm.serving.backend import _flash_attention

    d, dtype = 128, torch.bfloat16
    attention = _flash_attention(1 / math.sqrt(d), dtype, unsplit=True)  # as the backend runs it
    if attention is None:
        pytest.skip("no FlashAttention build")
    out, want = run_decode_read((d, 2, 4, 64, 256, prefix, new), dtype, attention, merge_attn_states, spare_rows=300)
    assert_close_to_reference(out, want, dtype, bf16_max=3e-2, bf16_mean=1.2e-2)
