"""csrc_triton/oscar_decode.py (Gluon) against its PyTorch reference on the GPU; on the CPU, the
reference against the attention reference it must agree with (Gluon has no interpreter: the
kernel's CPU check is the sm_90 compile in test_kernels_compile.py)."""
import functools
import math

import pytest
import torch

from csrc_triton.gluon_layout import (
    DECODE_LAUNCH, MAX_DECODE_SPLITS, decode_launch, decode_ring_cost, decode_splits,
)
from csrc_triton.oscar_decode import key_mean_operands, split_shares, supports
from csrc_triton.paged_layout import BatchLayout
from oscar_vllm.core.mixed_cache import LayerCacheSpec, RowQuantizer, mixed_cache_attention
from oscar_vllm.core.quant import clip_index
from oscar_vllm.reference.oscar_attention import oscar_attention_reference
from oscar_vllm.reference.oscar_decode import oscar_decode_reference
from oscar_vllm.reference.oscar_write import oscar_write_reference
from kernel_cases import (
    CASES, CLIP_K, CLIP_V, DEVICE, KEY_MEAN_BF16_MAX, ON_GPU, KeyMeanCase, assert_close_to_reference,
    case_id, prepare, random_rotation, random_rows,
)
from paged_sim import PagedCache

# head_dim, kv heads, query heads per kv head, sink, recent, cached tokens per request
GPU_CASES = [
    (128, 8, 4, 64, 256, [8191, 300, 0, 4097, 63, 64, 65, 319, 320, 321]),
    (64, 3, 3, 64, 256, [32767, 1023, 5]),
    (128, 1, 8, 64, 256, [1000] * 64),
    (128, 4, 7, 64, 256, [20000, 64, 65]),
    (128, 2, 16, 64, 256, [3000, 10]),  # 16 query heads a KV head: N = 16
    (128, 2, 4, 8, 56, [700, 63, 64, 130]),  # the ring is one tile
    (128, 1, 4, 16, 100, [900, 115, 116, 117]),  # the ring ends inside a tile
    (64, 2, 2, 0, 40, [500, 39, 41]),  # no sink
]
gpu_case_id = lambda c: f"d{c[0]}-h{c[1]}x{c[2]}-s{c[3]}-r{c[4]}-n{len(c[5])}-{max(c[5])}"  # noqa: E731


def decode_step(case, dtype, write, key_mean=None):
    """A decode step of ``case`` whose tokens ``write`` put into the cache first, as the backend
    does before decode attention (``key_mean``: a ``KeyMeanCase`` the keys have and are written less)."""
    d, hkv, g, sink, recent, prefix = case
    pc, step, q, q_rot, k, v = prepare(d, hkv, g, sink, recent, prefix, [1] * len(prefix), dtype,
                                       entries_per_page=8, key_mean=key_mean)
    rot = random_rotation(d, seed=0).to(q.device)
    if key_mean is not None:
        k = key_mean.keys_at(k, step.seq_lens[: len(prefix)].long().cpu() - 1)
    write(k, v, rot, step, pc)
    return pc, step, q, q_rot, rot


def check_decode_kernel(case, splits, dtype, lam, key_mean=False, **launch):
    """The Gluon decode kernel (``launch``: its launch arguments) against the reference on a
    written step of ``case``, outputs and split scratch NaN before it runs; ``key_mean``: keys
    with a mean (``KeyMeanCase``), written less it."""
    from csrc_triton.oscar_decode import oscar_decode
    from csrc_triton.oscar_write import oscar_write

    d, hkv, g, sink, recent, prefix = case
    km = KeyMeanCase(hkv, d, max(prefix) + 2) if key_mean else None
    mean_args = dict(key_mean=km.mean, cos_sin=km.table) if km else {}

    def write(k, v, rot, step, pc):
        oscar_write(k, v, rot_k=rot, slot_mapping=step.slot_mapping, cache=pc.mixed(), batch=step.batch(len(prefix)),
                    clip_idx_k=clip_index(CLIP_K, d), clip_idx_v=clip_index(CLIP_V, d), **mean_args)

    pc, step, q, q_rot, rot = decode_step(case, dtype, write, km)
    n, hq, scale = len(prefix), hkv * g, 1 / math.sqrt(d)
    out = torch.full_like(q, float("nan"))
    part_out = torch.full((n * hq * splits * d,), float("nan"), device=q.device)
    part_lse = torch.full((n * hq * splits,), float("nan"), device=q.device)
    cache, batch = pc.mixed(), step.batch(n)
    oscar_decode(out, q_rot, cache=cache, batch=batch, scale=scale, num_splits=splits, part_out=part_out,
                 part_lse=part_lse, logit_correction=lam, **(dict(q=q, key_mean=km.operands()) if km else {}), **launch)
    reference = functools.partial(oscar_decode_reference, q_rot, cache=cache, batch=batch, scale=scale,
                                  logit_correction=lam)
    want = reference(key_mean=km and km.twin, rot_k=rot)
    assert_close_to_reference(out, want, torch.bfloat16, bf16_max=KEY_MEAN_BF16_MAX if km else 1e-2)
    return out, want, reference


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize("lam", [0.0, 1.0], ids=lambda x: f"lambda{x:g}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("splits", [1, 4, 24, MAX_DECODE_SPLITS])
@pytest.mark.parametrize("case", GPU_CASES, ids=gpu_case_id)
def test_decode_kernel_matches_reference(case, splits, dtype, lam):
    if dtype == torch.float16 and case is not GPU_CASES[0]:
        pytest.skip("fp16 models: one case")
    check_decode_kernel(case, splits, dtype, lam)


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize(("splits", "prefetch"), [(1, 5), (4, 2)], ids=["splits1-ahead5", "splits4-ahead2"])
@pytest.mark.parametrize("case", GPU_CASES, ids=gpu_case_id)
def test_decode_kernel_with_l2_prefetch_matches_reference(case, splits, prefetch):
    """Prefetching INT2 blocks ahead into L2 changes no result: the prefetch of a split's last
    blocks clamps to them, and a split shorter than the depth prefetches what it has."""
    check_decode_kernel(case, splits, torch.bfloat16, 0.5, prefetch=prefetch)


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize("lam", [0.0, 0.25], ids=lambda x: f"lambda{x:g}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("splits", [1, 24])
@pytest.mark.parametrize("case", GPU_CASES, ids=gpu_case_id)
def test_decode_kernel_adds_the_key_mean_back(case, splits, dtype, lam):
    """key_mean "on": keys written less their mean before RoPE (its 16 strongest pairs a head),
    read plus it by angle addition from each block's first row of the RoPE table, against the
    reference that adds the mean turned to every key's own position; and far from a read that
    leaves the mean out (the mean is three times the keys' spread)."""
    if dtype == torch.float16 and case is not GPU_CASES[0]:
        pytest.skip("fp16 models: one case")
    out, want, reference = check_decode_kernel(case, splits, dtype, lam, key_mean=True)
    _, _, _, sink, recent, prefix = case
    if max(prefix) >= sink + recent + 64:  # some request reads INT2 keys
        far = (reference() - want).abs().max()
        assert (out.float().cpu() - want).abs().max() < 0.1 * far, far


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize(("splits", "ring_cost"), [(2, 7), (8, 7), (16, 7), (64, 7), (16, 1), (8, 3)],
                         ids=lambda x: str(x))
@pytest.mark.parametrize("case", GPU_CASES[:2] + GPU_CASES[5:], ids=gpu_case_id)
def test_decode_kernel_weighs_ring_tiles_and_matches_reference(case, splits, ring_cost):
    """Every way the ring tiles and blocks divide over the splits (ring splits topped up with
    blocks, several ring tiles to a split, blocks only) reads each key once."""
    check_decode_kernel(case, splits, torch.bfloat16, 0.5, ring_cost=ring_cost)


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernels run on a GPU only")
def test_fixed_splits_decode_a_request_alike_in_any_batch():
    """decode_splits fixed: a request's split boundaries and merge follow its own length, so its
    output is bit for bit the same alone as in a batch of twenty (across the launch table's
    buckets, whose ring weights differ: the backend passes ``decode_ring_cost``); another split
    count or ring weight changes the last bits, which the comparison sees."""
    from csrc_triton.oscar_decode import oscar_decode
    from csrc_triton.oscar_write import oscar_write

    d, hkv, g, sink, recent, prefix = GPU_CASES[0]
    prefix = prefix * 2
    case = (d, hkv, g, sink, recent, prefix)

    def write(k, v, rot, step, pc):
        oscar_write(k, v, rot_k=rot, slot_mapping=step.slot_mapping, cache=pc.mixed(), batch=step.batch(len(prefix)),
                    clip_idx_k=clip_index(CLIP_K, d), clip_idx_v=clip_index(CLIP_V, d))

    pc, step, q, q_rot, _ = decode_step(case, torch.bfloat16, write)
    hq, scale = hkv * g, 1 / math.sqrt(d)

    def decode(rows: slice, splits: int, ring_cost: int | None = None) -> torch.Tensor:
        n = len(range(*rows.indices(len(prefix))))
        out = torch.full_like(q[rows], float("nan"))
        part_out = torch.full((n * hq * splits * d,), float("nan"), device=q.device)
        part_lse = torch.full((n * hq * splits,), float("nan"), device=q.device)
        batch = BatchLayout(step.block_table[rows].contiguous(), step.seq_lens[rows].contiguous(),
                            torch.arange(n + 1, dtype=torch.int32, device=q.device),
                            step.ring_slots[rows].contiguous(), n, n)
        oscar_decode(out, q_rot[rows].contiguous(), cache=pc.mixed(), batch=batch, scale=scale, num_splits=splits,
                     part_out=part_out, part_lse=part_lse, ring_cost=ring_cost or decode_ring_cost(n, splits))
        return out

    assert decode_launch(1)[3] != decode_launch(len(prefix))[3]
    for splits in (4, 16):
        batch = decode(slice(None), splits)
        for r in (0, 3, 9, 13):
            assert torch.equal(decode(slice(r, r + 1), splits)[0], batch[r]), (splits, r)
    assert not torch.equal(decode(slice(0, 1), 1)[0], decode(slice(None), 4)[0])
    assert not torch.equal(decode(slice(0, 1), 16, decode_launch(1)[3])[0], decode(slice(None), 16)[0])


@pytest.mark.parametrize("lam", [0.0, 1.0], ids=lambda x: f"lambda{x:g}")
@pytest.mark.parametrize("case", [c for c in CASES if max(c[6]) == 1], ids=case_id)
def test_reference_reads_the_written_token_as_attention_reads_it_unwritten(case, lam):
    """Writing the decode token first and reading it from the ring (this kernel) gives what the
    attention reference gives with the token in hand (the prefill path's order): they differ
    only by the BF16 rounding of the token's rotated key."""
    d, hkv, g, sink, recent, prefix, new = case
    pc, step, q, q_rot, k, v = prepare(*case, torch.float32)
    # Gentle queries, so that no key's weight rounds to zero (the token's included).
    q, q_rot = q * 0.05, q_rot * 0.05
    n, scale = len(prefix), 1 / math.sqrt(d)
    cache, batch = pc.mixed(), step.batch(n)
    before = oscar_attention_reference(q, q_rot, k, v, cache=cache, batch=batch, scale=scale, logit_correction=lam)
    rot = random_rotation(d, seed=0).to(q.device)
    oscar_write_reference(k, v, rot_k=rot, slot_mapping=step.slot_mapping, cache=cache, batch=batch,
                          clip_ratio_k=CLIP_K, clip_ratio_v=CLIP_V)
    after = oscar_decode_reference(q_rot, cache=cache, batch=batch, scale=scale, logit_correction=lam)
    assert_close_to_reference(after, before, torch.bfloat16)
    # Not the same function: the token's key is rounded to BF16 in the ring.
    assert not torch.equal(after, before)


@pytest.mark.parametrize("key_mean", [False, True], ids=["no-mean", "key-mean"])
@pytest.mark.parametrize("lam", [0.0, 0.5, 1.0], ids=lambda x: f"lambda{x:g}")
def test_references_correct_logits_as_the_mixed_cache_reference(lam, key_mean):
    """The paged twins' λ is ``LayerCacheSpec.logit_correction`` and their key mean its
    ``key_mean`` (the core reference is the ground truth): a decode step over a prefix written as
    serving writes it equals ``mixed_cache_attention`` with the same λ and mean at the step's
    position, the twin of ``oscar_decode`` (token written first) and of ``oscar_attention`` (token
    in hand) alike."""
    d, hkv, g, sink, recent, lens = 64, 2, 2, 4, 8, [100, 37]
    pc = PagedCache(len(lens), max(lens), hkv, d, sink, recent, DEVICE)
    rot = random_rotation(d).to(DEVICE)
    km = KeyMeanCase(hkv, d, max(lens), seed=50)
    mean = km.twin if key_mean else None
    ks = [random_rows((n, hkv, d), torch.float32, 20 + r) for r, n in enumerate(lens)]
    if key_mean:  # keys that have a mean, which they are rounded less block by block
        ks = [k + km.model.at(k.shape[0]).to(k.device) for k in ks]
    vs = [random_rows((n, hkv, d), torch.float32, 30 + r) for r, n in enumerate(lens)]
    qs = [random_rows((n, hkv * g, d), torch.float32, 40 + r) for r, n in enumerate(lens)]
    prefill = pc.schedule({r: n - 1 for r, n in enumerate(lens)})
    cache = pc.mixed()
    oscar_write_reference(torch.cat([k[:-1] for k in ks]), torch.cat([v[:-1] for v in vs]), rot_k=rot,
                          slot_mapping=prefill.slot_mapping, cache=cache, batch=prefill.batch(), clip_ratio_k=CLIP_K,
                          clip_ratio_v=CLIP_V, key_mean=mean)
    step = pc.schedule({r: 1 for r in range(len(lens))})
    q, k, v = (torch.cat([x[-1:] for x in xs]) for xs in (qs, ks, vs))
    n, scale = len(lens), 1 / math.sqrt(d)
    spec = LayerCacheSpec(rot.cpu(), None, RowQuantizer("int2", CLIP_K), RowQuantizer("int2", CLIP_V),
                          logit_correction=lam, key_mean=mean)
    want = torch.cat([mixed_cache_attention(qs[r].cpu()[-1:], ks[r].cpu(), vs[r].cpu(), spec, sink, recent, scale)
                      for r in range(n)])
    batch = step.batch(n)
    in_hand = oscar_attention_reference(q, q @ rot, k, v, cache=cache, batch=batch, scale=scale,
                                        logit_correction=lam, key_mean=mean, rot_k=rot)
    oscar_write_reference(k, v, rot_k=rot, slot_mapping=step.slot_mapping, cache=cache, batch=batch,
                          clip_ratio_k=CLIP_K, clip_ratio_v=CLIP_V, key_mean=mean)
    decode = functools.partial(oscar_decode_reference, q @ rot, cache=cache, batch=batch, scale=scale)
    written = decode(logit_correction=lam, key_mean=mean, rot_k=rot)
    # Both read the step's key in BF16 from the ring: the same numbers but for the order of sums.
    torch.testing.assert_close(written, want, rtol=1e-4, atol=1e-4)
    # The token in hand is exact here and BF16 in the core reference.
    assert_close_to_reference(in_hand, want, torch.bfloat16)
    if lam:
        uncorrected = decode(key_mean=mean, rot_k=rot)
        assert (uncorrected - want).abs().max() > 100 * 1e-4  # the correction is far above the tolerance
    if key_mean:  # the pages hold the keys less their mean: read without it, they are far off
        assert (decode(logit_correction=lam) - want).abs().max() > 100 * 1e-4


def record_launches(monkeypatch, module, kernel: str) -> list[tuple]:
    """``module.kernel`` replaced by a recorder: each launch appends ``(grid, args, kwargs)`` and runs
    nothing (Gluon has no interpreter: on the CPU a wrapper's launch is checked this way)."""
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, args, kwargs))

    monkeypatch.setattr(module, kernel, Recorder())
    return launches


@pytest.mark.parametrize("lam", [0.0, 1.0], ids=lambda x: f"lambda{x:g}")
def test_logit_correction_reaches_the_kernel_as_a_runtime_float(monkeypatch, lam):
    """Gluon has no interpreter: on the CPU the launch ``oscar_decode`` makes is recorded. λ
    reaches the kernel as ``logit_coef`` (``paged_layout.logit_coef``), a runtime float, not a
    constexpr, so that no λ compiles a variant of its own (warm-up covers them all)."""
    from csrc_triton import oscar_decode as od
    from csrc_triton.paged_layout import logit_coef

    kernel = od._oscar_decode_kernel
    names = [p.name for p in kernel.params]
    assert "logit_coef" in names and "logit_coef" not in [p.name for p in kernel.params if p.is_constexpr]
    launches = record_launches(monkeypatch, od, "_oscar_decode_kernel")
    d, hkv, g, sink, recent, prefix = 64, 2, 2, 8, 16, [100, 37]
    pc, step, q, q_rot, _, _ = prepare(d, hkv, g, sink, recent, prefix, [1, 1], torch.bfloat16, entries_per_page=8)
    scale = 1 / math.sqrt(d)
    od.oscar_decode(torch.empty_like(q_rot), q_rot, cache=pc.mixed(), batch=step.batch(2), scale=scale,
                    logit_correction=lam)
    (_, args, kwargs), = launches
    assert "logit_coef" not in kwargs
    coef = args[names.index("logit_coef")]
    assert isinstance(coef, float) and coef == logit_coef(lam, scale)
    assert coef == pytest.approx(lam / 24 * scale * scale * math.log2(math.e))
    for bad in (-0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="logit_correction must be a finite number >= 0"):
            od.oscar_decode(torch.empty_like(q_rot), q_rot, cache=pc.mixed(), batch=step.batch(2), scale=scale,
                            logit_correction=bad)


@pytest.mark.parametrize("path", ["gluon", "triton"])
def test_split_scratch_too_short_for_the_batch_is_refused(monkeypatch, path):
    """A split launch writes ``num_reqs * Hq * num_splits`` partial rows: scratch sized for fewer
    (Triton's decode_split_rows where the Gluon kernel's splits fill whole waves: a test did) is
    refused before any launch by either decode, where a slice of it would have handed the kernel
    short buffers (``paged_layout.split_scratch``). Launches recorded on the CPU."""
    from csrc_triton import oscar_attention as oa
    from csrc_triton import oscar_decode as od

    module, kernel = (od, "_oscar_decode_kernel") if path == "gluon" else (oa, "_oscar_attention_kernel")
    launches = record_launches(monkeypatch, module, kernel)
    monkeypatch.setattr(module, "merge_splits", lambda *a: None)
    d, hkv, g, sink, recent, n, splits = 64, 2, 2, 8, 16, 3, 4
    pc, step, q, q_rot, k, v = prepare(d, hkv, g, sink, recent, [100] * n, [1] * n, torch.bfloat16,
                                       entries_per_page=8)
    rows = n * hkv * g * splits

    def decode(out_rows, lse_rows):
        scratch = dict(part_out=torch.empty(out_rows * d, device=DEVICE), part_lse=torch.empty(lse_rows, device=DEVICE))
        layout = dict(cache=pc.mixed(), batch=step.batch(n), scale=1 / math.sqrt(d), num_splits=splits)
        if path == "gluon":
            od.oscar_decode(torch.empty_like(q_rot), q_rot, **layout, **scratch)
        else:
            oa.oscar_decode_attention(torch.empty_like(q), q, q_rot, k, v, **layout, **scratch)

    for short in ((rows - 1, rows), (rows, rows - 1)):
        with pytest.raises(ValueError, match=f"needs part_out of >= {rows * d} and part_lse of >= {rows} "):
            decode(*short)
    assert launches == []
    decode(rows, rows)
    assert [grid for grid, _, _ in launches] == [(n, hkv, splits)]


def test_key_mean_and_logit_correction_launch_as_compiled_variants_under_the_register_cap(monkeypatch):
    """A batch the table caps at 168 registers launches under that cap with the key mean too (a
    block's mean is one logit: MEAN_PAIRS coefficients a head held, nothing a key), and λ = 0
    launches the variant without the correction's product (``CORRECT``). Recorded on the CPU."""
    from csrc_triton import oscar_decode as od

    launches = record_launches(monkeypatch, od, "_oscar_decode_kernel")
    d, hkv, g, sink, recent = 64, 2, 2, 8, 16
    n = 8
    assert decode_launch(n).maxnreg == 168
    pc, step, q, q_rot, _, _ = prepare(d, hkv, g, sink, recent, [100] * n, [1] * n, torch.bfloat16,
                                       entries_per_page=8)
    km = KeyMeanCase(hkv, d, 256)
    for mean, lam in ((None, 0.5), (km.operands(), 0.0)):
        od.oscar_decode(torch.empty_like(q_rot), q_rot, cache=pc.mixed(), batch=step.batch(n), scale=1 / math.sqrt(d),
                        logit_correction=lam, q=q, key_mean=mean)
    plain, with_mean = (kwargs for _, _, kwargs in launches)
    assert plain["maxnreg"] == 168 and plain["KEY_MEAN"] is False and plain["CORRECT"] is True
    assert with_mean["maxnreg"] == 168 and with_mean["KEY_MEAN"] is True and with_mean["CORRECT"] is False


def block_mean_logits_as_the_kernel_adds_them(q, operands, h, g, blk):
    """fp64 ``[g]``: what ``_block_mean_scores`` adds to every score of block ``blk`` of KV head
    ``h`` (before the softmax scale), from the operands as the kernel reads them: each head's
    coefficients over the pairs ``mean_pairs`` names, times the table's row of the block's first
    position."""
    half = q.shape[-1] // 2
    cols = operands["mean_pairs"][h].long().cpu()
    mean = operands["key_mean"][h].double().cpu()
    qh = q[h * g:(h + 1) * g].double().cpu()
    a = qh[:, cols] * mean[cols] + qh[:, cols + half] * mean[cols + half]
    b = qh[:, cols + half] * mean[cols] - qh[:, cols] * mean[cols + half]
    row = operands["cos_sin"][blk * 64].double().cpu()
    return (a * row[cols] + b * row[cols + half]).sum(dim=1)


@pytest.mark.parametrize(("d", "g", "blk"), [(128, 4, 0), (128, 16, 37), (64, 3, 511)])
def test_key_mean_operands_give_every_key_of_a_block_its_blocks_mean(d, g, blk):
    """The decode kernel's key-mean operands, read as the kernel reads them (each head's pairs, the
    block's first table row), give every key of a block ``q·RoPE_{64b}(μ)``: the twins' mean for
    each of the block's 64 positions, within fp32 rounding."""
    hkv = 2
    km = KeyMeanCase(hkv, d, 64 * (blk + 1))
    ops = km.operands()
    assert ops["mean_pairs"].shape == (hkv, 16) and ops["mean_pairs"].dtype == torch.int32
    q = random_rows((hkv * g, d), torch.float32, 5).cpu()
    positions = blk * 64 + torch.arange(64)
    turned = km.twin.turned(positions).double()  # [64, Hkv, d]
    for h in range(hkv):
        want = turned[:, h] @ q[h * g:(h + 1) * g].double().T  # [64, g]
        assert (want - want[:1]).abs().max() == 0  # one vector for the whole block
        got = block_mean_logits_as_the_kernel_adds_them(q, ops, h, g, blk)
        assert (got - want[0]).abs().max() < 1e-5 * want.abs().max(), (got - want[0]).abs().max()


def test_key_mean_operands_refuse_a_mean_on_more_pairs_than_the_kernel_adds():
    km = KeyMeanCase(1, 128, 64)
    with pytest.raises(ValueError, match="16 RoPE pairs"):
        key_mean_operands(km.mean + 0.01, km.table)
    with pytest.raises(ValueError, match="fp32"):
        key_mean_operands(km.mean, km.table.double())


def test_supported_shapes():
    assert supports(32, 8, 128, torch.bfloat16, 64)
    assert supports(9, 3, 64, torch.float16, 64)
    assert supports(32, 2, 128, torch.bfloat16, 64)  # 16 query heads a KV head
    assert not supports(64, 2, 128, torch.bfloat16, 64)  # 32: more than one N tile
    assert not supports(32, 8, 128, torch.float32, 64)  # fp32 models take the Triton kernel
    assert not supports(32, 8, 96, torch.bfloat16, 64)
    assert not supports(16, 8, 256, torch.bfloat16, 64)  # head_dim 256 takes the Triton kernel
    assert not supports(32, 8, 128, torch.bfloat16, 4)  # pages of fewer than 8 entries


def test_decode_splits_fill_the_gpu_and_stay_bounded():
    assert decode_splits(1, 8, 132) == MAX_DECODE_SPLITS
    assert decode_splits(1024, 8, 132) == 1
    for n in (1, 3, 8, 20, 32, 33, 100, 1024):
        s = decode_splits(n, 8, 132)
        assert 1 <= s <= MAX_DECODE_SPLITS
        assert n * 8 * s >= 132 or s == MAX_DECODE_SPLITS
        assert decode_launch(n).whole_wave or s & (s - 1) == 0


def test_the_table_takes_one_whole_wave_from_8_to_32_requests():
    """Where the sweep found one wave of 12 programs an SM fastest (8 x 32K: 24 splits, 32 x 8K and
    32 x 32K: 6), the table takes it; from 33 requests, powers of two at 16 an SM (64: 8 splits)."""
    assert [decode_splits(n, 8, 132) for n in (8, 32, 33, 64)] == [24, 6, 8, 8]
    for n in range(8, 33):
        s = decode_splits(n, 8, 132)
        assert n * 8 * s <= 12 * 132 < n * 8 * (s + 1), n


def test_whole_wave_splits_fill_one_wave_of_programs():
    """At 12 one-warp programs an SM (168 registers) and 132 SMs: 8 requests of 8 KV heads take 24
    splits (1,536 programs, one wave) where the power of two takes 32 at that aim (2,048: 1.3 waves)."""
    assert decode_splits(8, 8, 132, ctas_per_sm=12, whole_wave=True) == 24
    assert decode_splits(8, 8, 132, ctas_per_sm=12, whole_wave=False) == 32
    for n in (1, 3, 8, 32, 100, 1024):
        s = decode_splits(n, 8, 132, ctas_per_sm=12, whole_wave=True)
        assert 1 <= s <= MAX_DECODE_SPLITS
        assert n * 8 * s <= 12 * 132 or s == 1, "more than one wave"
        assert n * 8 * (s + 1) > 12 * 132 or s == MAX_DECODE_SPLITS, "a split more would still fit the wave"


@pytest.mark.parametrize("ring_tiles", [1, 2, 5])
@pytest.mark.parametrize("ring_cost", [1, 3, 7])
def test_split_shares_read_every_tile_once_and_balance_the_cost(ring_tiles, ring_cost):
    for n_blocks in (1, 2, 5, 16, 63, 64, 65, 128, 512, 2048):
        for active in sorted({1, 2, 3, 4, 5, 8, 16, 21, 64, 256, ring_tiles + n_blocks} & set(
                range(1, ring_tiles + n_blocks + 1))):
            shares = split_shares(n_blocks, active, ring_tiles, ring_cost)
            tiles = [t for t_lo, t_hi, _, _ in shares for t in range(t_lo, t_hi)]
            blocks = [b for _, _, b_lo, b_hi in shares for b in range(b_lo, b_hi)]
            assert tiles == list(range(ring_tiles)) and blocks == list(range(n_blocks)), (n_blocks, active)
            per = -(-(ring_tiles * ring_cost + n_blocks) // active)
            bound = max(per, ring_cost * -(-ring_tiles // active))
            cost = max((t_hi - t_lo) * ring_cost + b_hi - b_lo for t_lo, t_hi, b_lo, b_hi in shares)
            assert cost <= bound, (n_blocks, active, shares)


def test_split_shares_at_ring_cost_one_are_the_even_division_of_tiles():
    """Counting a ring tile as one block gives the partition the kernel had before it weighed them:
    the tiles (ring, then blocks) in runs of ``ceil(tiles / splits)``."""
    for n_blocks, active in [(512, 64), (128, 16), (16, 21), (2048, 8)]:
        tiles = 5 + n_blocks
        per = -(-tiles // active)
        even = [list(range(lo, min(lo + per, tiles))) for lo in range(0, per * active, per)]
        got = [list(range(t_lo, t_hi)) + [5 + b for b in range(b_lo, b_hi)]
               for t_lo, t_hi, b_lo, b_hi in split_shares(n_blocks, active, 5, 1)]
        assert got == even


def test_a_fixed_split_count_splits_a_request_alike_in_every_batch():
    """decode_splits fixed (batch-invariant replies): a request's split boundaries, hence the order
    its partial sums merge in, are the same whatever the batch size; the launch table's ring
    weights alone would move them where the batch crosses a bucket."""
    costs = {decode_launch(n)[3] for n in range(1, 513)}
    assert len(costs) > 1 and {decode_ring_cost(n) for n in range(1, 513)} == costs
    assert {decode_ring_cost(n, fixed_splits=16) for n in range(1, 513)} == {decode_ring_cost(512, 16)}
    for n_blocks in (11, 100, 512, 2047):
        active = min(16, 5 + n_blocks)
        assert len({tuple(split_shares(n_blocks, active, 5, decode_ring_cost(n, 16))) for n in DECODE_LAUNCH}) == 1
        if n_blocks >= 100:  # from 6,400 tokens on, 16 splits of 5 ring tiles and these blocks
            assert len({tuple(split_shares(n_blocks, active, 5, c)) for c in costs}) > 1


def test_split_shares_keep_the_ring_off_the_critical_path():
    """At 8 x 32K (64 splits) and 32 x 8K (16), counting ring tiles as one put all five on split 0,
    4.3x and 3.5x the cost of the others; weighed, no split exceeds an even share."""
    for n_blocks, active in [(512, 64), (128, 16)]:
        even = split_shares(n_blocks, active, 5, 1)
        weighed = split_shares(n_blocks, active, 5, 7)
        cost = lambda shares: [7 * (t_hi - t_lo) + b_hi - b_lo for t_lo, t_hi, b_lo, b_hi in shares]  # noqa: E731
        assert max(cost(even)) > 3 * -(-(35 + n_blocks) // active)
        assert max(cost(weighed)) == -(-(35 + n_blocks) // active)
