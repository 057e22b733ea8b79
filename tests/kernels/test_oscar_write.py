"""csrc_triton/oscar_write.py against its PyTorch reference."""
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from csrc_triton.oscar_write import (PEEL_ROUNDS, WRITE_ROTATION, _clip_threshold, _kth_largest_peeled,
                                     _kth_smallest_abs, oscar_write)
from oscar_vllm.core.quant import clip_index, unpack_int2
from csrc_triton.paged_layout import BLOCK_SIZE, BatchLayout
from oscar_vllm.core.key_mean import KeyMean
from oscar_vllm.reference.oscar_write import oscar_write_decode_reference, oscar_write_reference, token_positions
from oscar_vllm.reference.paged import layout_views, window_views
from kernel_cases import DEVICE, DTYPES, ON_GPU, KeyMeanCase, padded, random_rotation, random_rows, vllm_rope_table
from paged_sim import PagedCache

CASES = [
    # head_dim, kv heads, per-head rotation, sink, recent, schedule of steps
    (64, 2, False, 4, 8, [{0: 37, 1: 1, 2: 20}, {0: 1, 1: 1, 2: 13}]),
    (128, 1, True, 0, 5, [{0: 3, 1: 17}, {0: 16, 1: 1}]),
    (64, 3, False, 6, 7, [{0: 1}, {0: 63, 1: 65}]),
    # a whole tile of decodes first (no request search), then a mixed tile
    (64, 1, False, 4, 8, [{r: 9 for r in range(20)}, {**{r: 1 for r in range(18)}, 18: 5, 19: 1}]),
]
if ON_GPU:
    CASES += [
        (128, 8, False, 64, 256, [{0: 1000, 1: 333, 2: 1}, {0: 1, 1: 512, 2: 300}]),
        (64, 3, True, 64, 256, [{r: 257 + 31 * r for r in range(16)}]),
        (256, 2, False, 64, 256, [{0: 129, 1: 64}, {0: 1, 1: 1}]),
    ]


def run_both(d, hkv, per_head, sink, recent, schedule, dtype, param_dtype, launch=None, key_mean=False,
             clips=(0.96, 0.92), rotation=WRITE_ROTATION):
    """Both through ``schedule`` (the kernel at ``launch``: tokens a program and warps; ``rotation``:
    how it multiplies k @ R); with ``key_mean``, keys that have a mean before RoPE, written less it;
    ``clips``: the K and V clip ratios."""
    pc = PagedCache(max(max(s) for s in schedule) + 1, 2048, hkv, d, sink, recent, DEVICE)
    ref = pc.clone()
    rot = random_rotation(d, hkv if per_head else None).to(DEVICE)
    mean = table = km = None
    if key_mean:
        mean, table = 3 * random_rows((hkv, d), torch.float32, seed=99), vllm_rope_table(2048, d).to(DEVICE)
        km = KeyMean.from_cos_sin_cache(mean.cpu(), table.cpu(), block=BLOCK_SIZE)  # what the cache takes off
        model = KeyMean.from_cos_sin_cache(mean.cpu(), table.cpu())  # what the keys have
    for i, new in enumerate(schedule):
        step = pc.schedule(new)
        ref.schedule(new)
        t = int(step.cu_q[-1])
        k = random_rows((t, hkv, d), dtype, seed=2 * i)
        v = random_rows((t, hkv, d), dtype, seed=2 * i + 1)
        if key_mean:
            _, pos = token_positions(step.cu_q, step.seq_lens, len(step.reqs))
            k = (k.float() + model.turned(pos).to(DEVICE)).to(dtype)
        batch = step.batch(num_decodes=next((i for i, n in enumerate(new.values()) if n > 1), len(new)))
        oscar_write(k, v, rot_k=rot, slot_mapping=step.slot_mapping, cache=pc.mixed(param_dtype), batch=batch,
                    clip_idx_k=clip_index(clips[0], d), clip_idx_v=clip_index(clips[1], d), launch=launch,
                    key_mean=mean, cos_sin=table, rotation=rotation)
        oscar_write_reference(k, v, rot_k=rot, slot_mapping=step.slot_mapping, cache=ref.mixed(param_dtype),
                              batch=batch, clip_ratio_k=clips[0], clip_ratio_v=clips[1], key_mean=km)
    return pc, ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("param_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c[0]}-h{c[1]}-s{c[3]}-r{c[4]}")
@pytest.mark.parametrize("launch", [None, (32, 8)], ids=["table", "32x8"])
def test_write_matches_reference(case, dtype, param_dtype, launch):
    if param_dtype == torch.bfloat16 and case is not CASES[0] and not ON_GPU:
        pytest.skip("bf16 scales: one case is enough under the (slow) interpreter")
    if launch and not ON_GPU and (param_dtype == torch.bfloat16 or case not in (CASES[0], CASES[3])):
        pytest.skip("the prefill launch: two cases are enough under the (slow) interpreter")
    check_write(case, dtype, param_dtype, launch)


@pytest.mark.parametrize("key_mean", [False, True], ids=["keys", "less-the-mean"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c[0]}-h{c[1]}-s{c[3]}-r{c[4]}")
def test_write_with_tf32x3_rotation_matches_reference(case, key_mean):
    """k @ R as three TF32 tensor-core products: within the tolerance of any other summation order.
    (The interpreter multiplies in fp32 whatever the precision: the GPU is where this bites.)"""
    if not ON_GPU and (case is not CASES[0] or key_mean):
        pytest.skip("one case is enough under the interpreter, which ignores the precision")
    check_write(case, torch.bfloat16, torch.float16, None, key_mean=key_mean, rotation="tf32x3")


def test_an_unknown_rotation_is_refused_by_name():
    pc = PagedCache(1, 64, 1, 64, 4, 8, DEVICE)
    step = pc.schedule({0: 3})
    k = random_rows((3, 1, 64), torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="rotation must be one of .*'tf32'"):
        oscar_write(k, k, rot_k=random_rotation(64, None).to(DEVICE), slot_mapping=step.slot_mapping,
                    cache=pc.mixed(torch.float16), batch=step.batch(), clip_idx_k=60, clip_idx_v=58, rotation="tf32")


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c[0]}-h{c[1]}-s{c[3]}-r{c[4]}")
def test_write_less_the_key_mean_matches_reference(case):
    if not ON_GPU and case not in (CASES[0], CASES[1]):
        pytest.skip("two cases are enough under the (slow) interpreter")
    pc, ref = check_write(case, torch.bfloat16, torch.float16, None, key_mean=True)
    # Rounded less the mean, the pages are not the pages of the keys as they are.
    plain = run_both(*case, torch.bfloat16, torch.float16)[1]
    assert not torch.equal(layout_views(plain.cache.cpu(), case[0], torch.float16)[2],
                           layout_views(ref.cache.cpu(), case[0], torch.float16)[2])


@pytest.mark.parametrize("clips", [(0.4, 0.7), (0.0, 0.5)], ids=lambda c: f"clip{c[0]}/{c[1]}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c[0]}-h{c[1]}-s{c[3]}-r{c[4]}")
def test_write_with_deep_clip_thresholds_matches_reference(case, clips):
    """Clip thresholds off the peel's reach: K at 0.4 lies deeper than ``PEEL_ROUNDS`` from the
    rows' tops at every head_dim (the bisection); V at 0.7 and 0.5 is peeled at head_dim 64 (20
    rounds, and 32: ``PEEL_ROUNDS`` itself) and bisected from 128 on; K unclipped beside it."""
    if not ON_GPU and case is not CASES[0]:
        pytest.skip("one case is enough under the (slow) interpreter")
    check_write(case, torch.float32, torch.float16, None, clips=clips)


def check_write(case, dtype, param_dtype, launch, key_mean=False, clips=(0.96, 0.92), rotation=WRITE_ROTATION):
    pc, ref = run_both(*case, dtype, param_dtype, launch, key_mean, clips, rotation)
    d = case[0]
    got, want = layout_views(pc.cache.cpu(), d, param_dtype), layout_views(ref.cache.cpu(), d, param_dtype)
    for codes_got, codes_want in zip(got[:2], want[:2]):
        # k @ R sums in another order than the reference: a code may flip at a rounding tie.
        assert (unpack_int2(codes_got) != unpack_int2(codes_want)).float().mean() <= 1e-3
    params_got, params_want = got[2].float(), want[2].float()
    # min/max of k @ R summed in another order may round to the neighbouring 16-bit value.
    rtol = 8e-3 if param_dtype == torch.bfloat16 else 1e-3
    torch.testing.assert_close(params_got, params_want, rtol=rtol, atol=1e-5, equal_nan=True)
    assert torch.equal(pc.window_pos.cpu(), ref.window_pos.cpu())
    (k_got, v_got), (k_want, v_want) = (window_views(x.windows, case[1], d, case[3]) for x in (pc, ref))
    # Keys: k @ R in another summation order may round to the neighbouring bf16.
    torch.testing.assert_close(k_got.float().cpu(), k_want.float().cpu(), rtol=8e-3, atol=1e-3, equal_nan=True)
    assert torch.equal(v_got.float().cpu().nan_to_num(7.0), v_want.float().cpu().nan_to_num(7.0))
    # Nothing outside the entries: the padding after each page's values is never written.
    assert bool(pc.windows[:, 2 * k_got[0].numel():].isnan().all())
    return pc, ref


def assert_same_cache(pc, ref, d, hkv, sink, param_dtype):
    got, want = layout_views(pc.cache.cpu(), d, param_dtype), layout_views(ref.cache.cpu(), d, param_dtype)
    for codes_got, codes_want in zip(got[:2], want[:2]):
        assert (unpack_int2(codes_got) != unpack_int2(codes_want)).float().mean() <= 1e-3
    rtol = 8e-3 if param_dtype == torch.bfloat16 else 1e-3
    torch.testing.assert_close(got[2].float(), want[2].float(), rtol=rtol, atol=1e-5, equal_nan=True)
    assert torch.equal(pc.window_pos.cpu(), ref.window_pos.cpu())
    (k_got, v_got), (k_want, v_want) = (window_views(x.windows, hkv, d, sink) for x in (pc, ref))
    torch.testing.assert_close(k_got.float().cpu(), k_want.float().cpu(), rtol=8e-3, atol=1e-3, equal_nan=True)
    assert torch.equal(v_got.float().cpu().nan_to_num(7.0), v_want.float().cpu().nan_to_num(7.0))


DECODE_CASES = [
    # head_dim, kv heads, query heads per kv head, per-head rotation, sink, recent, prefix lengths,
    # clip ratios (K, V; 0: no clip). Query heads per KV head 1-16: 16 down to 1 token a program.
    (128, 8, 4, False, 64, 256, [1000, 0, 63, 64, 319, 320, 5000, 17, 1], (0.96, 0.92)),
    (128, 4, 7, True, 64, 256, [300] * 37, (0.96, 0.92)),
    (64, 3, 3, False, 64, 256, [130, 2, 700], (0.96, 0.92)),
    (128, 2, 16, False, 8, 56, [90, 30], (0.96, 0.92)),
    (128, 1, 8, False, 0, 40, [77], (0.96, 0.92)),
    (128, 2, 1, False, 64, 256, [200 + 7 * i for i in range(21)], (0.96, 0.0)),
    (64, 4, 2, True, 64, 256, [65, 321, 9, 1000, 64, 320, 3, 4, 5], (0.0, 0.92)),
    (128, 8, 4, False, 64, 256, [500, 10, 70], (0.0, 0.0)),
    # thresholds deep in the rows: the 4-ary search, not the peel off the top
    (128, 2, 4, False, 64, 256, [100, 300, 5], (0.5, 0.7)),
    (64, 3, 3, True, 64, 256, [90, 400], (0.0, 0.4)),
]


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize("param_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", DECODE_CASES,
                         ids=lambda c: f"d{c[0]}-h{c[1]}x{c[2]}-s{c[4]}-r{c[5]}-n{len(c[6])}-clip{c[7][0]}/{c[7][1]}")
def test_decode_write_matches_reference(case, param_dtype):
    check_decode_write(case, param_dtype)


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize("query_rows", [32])
@pytest.mark.parametrize("case", [c for c in DECODE_CASES if len(c[6]) > 4],
                         ids=lambda c: f"d{c[0]}-h{c[1]}x{c[2]}-n{len(c[6])}-clip{c[7][0]}/{c[7][1]}")
def test_decode_write_with_more_tokens_a_program_matches_reference(case, query_rows):
    # A launch table entry of 32 query rows: up to 8 tokens a program share R (64 query rows spill, sm_90).
    check_decode_write(case, torch.bfloat16, query_rows)


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize("case", DECODE_CASES[:4] + DECODE_CASES[6:7],
                         ids=lambda c: f"d{c[0]}-h{c[1]}x{c[2]}-n{len(c[6])}-perhead{c[3]}")
def test_decode_write_less_the_key_mean_matches_reference(case):
    """key_mean "on": the decode write rounds its keys less their mean turned to their positions
    into the pages and keeps them whole in the ring, as the twin does; pages far from those of the
    same keys written whole. The batch ends in the entries a full CUDA graph pads it with (slot -1,
    sequence length 0): before 2026-12-05 they read the RoPE table's row -1, an illegal address
    in vLLM on the H100 (the rows before a table are not always mapped, so only the twin's outputs
    can be checked here)."""
    pc, slots = check_decode_write(case, torch.bfloat16, key_mean="write", pad=3)
    plain, _ = check_decode_write(case, torch.bfloat16, key_mean="keys")
    d = case[0]
    block, tok = (slots.long().cpu() // 64), (slots.long().cpu() % 64)
    codes = [unpack_int2(layout_views(c.cache.cpu(), d, torch.bfloat16)[0])[block, :, tok] for c in (pc, plain)]
    assert (codes[0] != codes[1]).float().mean() > 0.1


def check_decode_write(case, param_dtype, query_rows=None, key_mean=None, pad=0):
    """The decode write of ``case`` against its twin; ``key_mean``: "keys" (the step's keys have a
    mean before RoPE) or "write" (and are written less it); ``pad``: entries after the requests as a
    full CUDA graph pads a batch (slot -1, sequence length 0), which write nothing."""
    from csrc_triton.oscar_write import decode_rotation, oscar_write_decode

    d, hkv, g, per_head, sink, recent, prefix, (clip_k, clip_v) = case
    n = len(prefix)
    km = KeyMeanCase(hkv, d, max(prefix) + 2) if key_mean else None
    pc = PagedCache(n, max(prefix) + 2, hkv, d, sink, recent, DEVICE, entries_per_page=8)
    rot = random_rotation(d, hkv if per_head else None).to(DEVICE)
    todo = {r: p for r, p in enumerate(prefix) if p}
    st = pc.schedule(todo)
    t = int(st.cu_q[-1])
    k, v = random_rows((t, hkv, d), torch.bfloat16, 1), random_rows((t, hkv, d), torch.bfloat16, 2)
    oscar_write(k, v, rot_k=rot, slot_mapping=st.slot_mapping, cache=pc.mixed(param_dtype), batch=st.batch(),
                clip_idx_k=clip_index(0.96, d), clip_idx_v=clip_index(0.92, d))
    ref = pc.clone()
    step = pc.schedule({r: 1 for r in range(n)})
    slot_mapping, seq_lens, ring_slots = (padded(step.slot_mapping, pad, -1), padded(step.seq_lens, pad, 0),
                                          padded(step.ring_slots, pad, 0))
    t = n + pad
    cu_q = torch.arange(t + 1, dtype=torch.int32, device=DEVICE)
    batch = BatchLayout(padded(step.block_table, pad, 0), seq_lens, cu_q, ring_slots, t, num_decodes=t, max_query_len=1)
    k, v = random_rows((t, hkv, d), torch.bfloat16, 3), random_rows((t, hkv, d), torch.bfloat16, 4)
    if km:
        k = km.keys_at(k, (seq_lens.long().cpu() - 1).clamp(min=0))
    q = random_rows((t, hkv * g, d), torch.bfloat16, 5)
    q_rot = torch.full_like(q, float("nan"))
    oscar_write_decode(k, v, q, q_rot, rot_t=decode_rotation(rot), slot_mapping=slot_mapping,
                       cache=pc.mixed(param_dtype), batch=batch, clip_idx_k=clip_index(clip_k, d),
                       clip_idx_v=clip_index(clip_v, d), query_rows=query_rows,
                       **(dict(key_mean=km.mean, cos_sin=km.table) if key_mean == "write" else {}))
    want = oscar_write_decode_reference(k, v, q, rot_k=rot, slot_mapping=slot_mapping, cache=ref.mixed(param_dtype),
                                        batch=batch, clip_ratio_k=clip_k, clip_ratio_v=clip_v,
                                        key_mean=km.twin if key_mean == "write" else None)
    assert_same_cache(pc, ref, d, hkv, sink, param_dtype)
    # The queries: bf16 operands in the tensor cores, as bf16 as the model's queries.
    err = (q_rot.float().cpu() - want).abs()
    assert err.max() <= 2e-2 * want.abs().max() and err.mean() <= 4e-3 * want.abs().mean(), (err.max(), err.mean())
    return pc, step.slot_mapping


def test_decode_write_tiles_follow_the_launch_table(monkeypatch):
    import csrc_triton.gluon_layout as ow

    # 4 query heads a KV head: 16 rows are 4 tokens on 8 warps (a K or V row each), 32 rows 8 on 16.
    assert ow.decode_write_tiles(4, 128) == dict(TP=4, QM=16, KM=16, num_warps=8)
    assert ow.decode_write_tiles(4, 128, query_rows=32) == dict(TP=8, QM=32, KM=16, num_warps=16)
    # One query head: 16 tokens at most (every warp holds the keys' whole operand); 7 heads pad to 8.
    assert ow.decode_write_tiles(1, 128, query_rows=64)["TP"] == 16
    assert ow.decode_write_tiles(7, 128) == dict(TP=2, QM=16, KM=16, num_warps=4)
    # head_dim 64: at most 8 warps (one per 8 dims of the MMA tiles' width).
    assert ow.decode_write_tiles(4, 64, query_rows=32)["num_warps"] == 8
    monkeypatch.setattr(ow, "DECODE_WRITE_LAUNCH", {1: 16, 128: 32})
    assert [ow.decode_write_tiles(4, 128, t)["TP"] for t in (1, 127, 128, 256)] == [4, 4, 8, 8]


@pytest.mark.parametrize("per_head", [False, True])
def test_decode_rotation_is_two_bf16_terms_within_2_pow_16(per_head):
    from csrc_triton.oscar_write import decode_rotation

    rot = random_rotation(128, 4 if per_head else None)
    terms = decode_rotation(rot)
    assert terms.dtype == torch.bfloat16 and terms.shape == (2, *rot.shape)
    back = (terms[0].float() + terms[1].float()).transpose(-1, -2)
    err = (back - rot).abs()
    assert (err <= rot.abs() * 2**-16).all(), err.max()
    assert err.max() > 0, "a second term that held every entry exactly would not test the bound"
    # One term alone is 2^-8: the second is what the kernel's products need.
    assert ((terms[0].float().transpose(-1, -2) - rot).abs() > rot.abs() * 2**-16).any()


def hard_rows(n: int, d: int) -> torch.Tensor:
    """Rows a search on bit patterns, or a peel off the top, can get wrong: ties across the
    threshold, zeros, one value repeated, subnormals, huge and tiny magnitudes in one row,
    infinities, outliers, negative rows, |x| tied between signs, runs of copies at every rank from
    the top and across ``PEEL_ROUNDS``."""
    g = torch.Generator().manual_seed(d)
    x = torch.randn(n, d, generator=g)
    x[0] = 0.0
    x[1] = -2.5
    x[2] = torch.randn(d, generator=g).round()  # few distinct values, many ties
    x[3] = torch.randn(d, generator=g) * 1e-40  # subnormals
    x[4, : d // 2] = 1e30
    x[4, d // 2:] = -1e-30
    x[5, ::3] = float("inf")
    x[6] = x[6].to(torch.bfloat16).float()  # 16-bit values: runs of equal low bits
    x[7, ::7] *= 1e4
    if n > 12:
        signs = torch.where(torch.rand(d, generator=g) < 0.5, -1.0, 1.0)
        x[8] = (torch.arange(d) // 3).float() * signs  # copies in threes, both signs, at every rank
        x[9] = -(torch.arange(d) // 5).float() - 1  # negative, copies in fives
        x[10] = -torch.randn(d, generator=g).abs()
        x[11, :40] = (9 - torch.arange(40) // 10).float()  # four runs of ten at the top: ranks 0-39 ...
        x[11, 40:] = torch.rand(d - 40, generator=g)  # ... PEEL_ROUNDS (32) inside the fourth
        x[12] = 3.0
        x[12, d // 2:] = -3.0
        x[:13] = x[:13, torch.randperm(d, generator=g)]
    return x


@pytest.mark.parametrize("d", [64, 128, 256])
def test_kth_smallest_abs_is_exact(d):
    """The clip threshold's bisection against torch.kthvalue, every row and k."""

    @triton.jit
    def kth(x_ptr, out_ptr, ks_ptr, N: tl.constexpr, D: tl.constexpr, NK: tl.constexpr):
        rows = tl.arange(0, N)
        x = tl.load(x_ptr + rows[:, None] * D + tl.arange(0, D)[None, :])
        for i in tl.static_range(NK):
            tl.store(out_ptr + i * N + rows, _kth_smallest_abs(x, tl.load(ks_ptr + i)))

    x = hard_rows(16, d)
    ks = sorted({0, 1, d // 2, clip_index(0.92, d), clip_index(0.96, d), d - 2, d - 1})
    out = torch.full((len(ks), 16), float("nan"), device=DEVICE)
    kth[(1,)](x.to(DEVICE), out, torch.tensor(ks, dtype=torch.int32, device=DEVICE), N=16, D=d, NK=len(ks))
    want = torch.stack([x.abs().kthvalue(k + 1, dim=1).values for k in ks])
    assert torch.equal(out.cpu(), want), (out.cpu() - want).abs().max()


@triton.jit(do_not_specialize=["k", "n"])
def _clip_thresholds(x_ptr, out_ptr, k, n, BLOCK: tl.constexpr, D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < n
    x = tl.load(x_ptr + rows[:, None] * D + tl.arange(0, D)[None, :], mask=ok[:, None], other=0.0)
    tl.store(out_ptr + rows, _clip_threshold(x, k, D), mask=ok)


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_clip_threshold_is_exact(d, block):
    """The write's clip threshold (peeled off the top, or the bisection from ``PEEL_ROUNDS`` ranks
    down) against torch's sort, exactly: every row of a tile and of a partial last tile, ranks from
    the top 0, 1, the reference and fitted clip ratios', either side of ``PEEL_ROUNDS`` and deep.
    ``k`` is a runtime argument, as ``clip_idx_*`` in the write: one compiled loop for every rank."""
    n = 2 * block + 5
    x = hard_rows(n, d)[torch.randperm(n, generator=torch.Generator().manual_seed(1))]
    peel = PEEL_ROUNDS.value
    ks = sorted({0, 1, d // 2, d - 1 - peel, d - peel, *(clip_index(r, d) for r in (0.84, 0.92, 0.96)), d - 2, d - 1})
    want = x.abs().sort(dim=1).values
    for k in ks:
        out = torch.full((n,), float("nan"), device=DEVICE)
        _clip_thresholds[(triton.cdiv(n, block),)](x.to(DEVICE), out, k, n, BLOCK=block, D=d)
        assert torch.equal(out.cpu(), want[:, k]), (k, (out.cpu() - want[:, k]).abs().max())


@pytest.mark.parametrize("rounds", [1, 3, 10])
def test_peel_finds_what_its_rounds_reach_and_says_so_otherwise(rounds):
    """``_kth_largest_peeled``: the ``j``-th largest bit pattern (copies counted) where it lies
    within ``rounds`` distinct values of the top, else -1."""

    @triton.jit
    def peel(x_ptr, out_ptr, j, rounds, N: tl.constexpr, D: tl.constexpr):
        rows = tl.arange(0, N)
        bits = tl.abs(tl.load(x_ptr + rows[:, None] * D + tl.arange(0, D)[None, :])).to(tl.int32, bitcast=True)
        tl.store(out_ptr + rows, _kth_largest_peeled(bits, j, rounds))

    x = hard_rows(16, 64)
    bits = x.abs().view(torch.int32).sort(dim=1, descending=True).values
    first_of_run = torch.ones_like(bits, dtype=torch.bool)
    first_of_run[:, 1:] = bits[:, 1:] != bits[:, :-1]
    for j in (0, 2, 5, 11):
        out = torch.full((16,), -2, dtype=torch.int32, device=DEVICE)
        peel[(1,)](x.to(DEVICE), out, j, rounds, N=16, D=64)
        distinct_above = (first_of_run & (bits > bits[:, j:j + 1])).sum(dim=1)  # the answer's round, less one
        want = torch.where(distinct_above < rounds, bits[:, j], -1)
        assert torch.equal(out.cpu(), want), (j, out.cpu(), want)


def test_window_holds_sink_and_last_recent_positions():
    """After a long prefill only the sink and the last ``recent`` positions are in the ring."""
    pc, _ = run_both(64, 1, False, 4, 8, [{0: 30}], torch.float32, torch.float16)
    ring = int(pc.ring_slots[0])
    held = sorted(int(p) for p in pc.window_pos[ring].cpu() if p >= 0)
    assert held == [0, 1, 2, 3] + list(range(22, 30))


def test_padding_tokens_are_skipped():
    pc = PagedCache(1, 64, 1, 64, 2, 4, DEVICE)
    before = pc.cache.clone()
    step = pc.schedule({0: 5})
    step.slot_mapping[:] = -1
    k = random_rows((5, 1, 64), torch.float32, 0)
    oscar_write(k, k, rot_k=random_rotation(64).to(DEVICE), slot_mapping=step.slot_mapping, cache=pc.mixed(),
                batch=step.batch(), clip_idx_k=clip_index(0.96, 64), clip_idx_v=clip_index(0.92, 64))
    assert torch.equal(before, pc.cache)
    assert bool((pc.window_pos == -1).all())


def test_twins_depend_on_torch_only():
    """The PyTorch twins read the paged layout on their own: no Triton, no kernels module."""
    code = ("import sys, oscar_vllm.reference.oscar_attention, oscar_vllm.reference.oscar_write; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'triton', 'csrc_triton', 'vllm', 'transformers'}))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.strip() == "[]", out
