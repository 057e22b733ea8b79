"""csrc_triton/oscar_attention.py against its PyTorch reference, and the whole paged
pipeline (write + attention, step by step) against the core issue's mixed-cache reference."""
import math

import pytest
import torch
import triton
import triton.language as tl

from csrc_triton.oscar_attention import _codes, oscar_decode_attention, oscar_prefill_attention
from csrc_triton.oscar_write import oscar_write
from csrc_triton.paged_layout import (
    MAX_DECODE_SPLITS,
    BatchLayout,
    decode_splits,
    window_args,
    window_entries_per_page,
)
from oscar_vllm.core.mixed_cache import LayerCacheSpec, RowQuantizer, mixed_cache_attention
from oscar_vllm.core.quant import clip_index
from oscar_vllm.reference.oscar_attention import causal_attention_reference, oscar_attention_reference
from oscar_vllm.serving.prefill import DensePrefill, oscar_attention
from kernel_cases import (
    CASES, CLIP_K, CLIP_V, DEVICE, KEY_MEAN_BF16_MAX, KEY_MEAN_FP32_ATOL, ON_GPU, KeyMeanCase,
    assert_close_to_reference, case_id, dense_twin, fp32_atol, padded, prepare, random_rotation,
    random_rows,
)
from paged_sim import PagedCache

# The kernels feed fp16 (or fp32) into tl.dot, never bf16, so bf16 models run on the CPU too.
DTYPES = [torch.float32, torch.bfloat16]
# The logit correction λ: off, and the serving default.
LAMBDAS = [0.0, 1.0]


def own_keys_twin(scale):
    """What FlashAttention does for the backend, from the PyTorch twin."""
    def run(q, k, v, cu_q, max_query_len, out):
        o, lse = causal_attention_reference(q, k, v, cu_q, cu_q, len(cu_q) - 1, scale)
        out.copy_(o.to(out.dtype))
        return lse.to(q.device)
    return run


@pytest.mark.parametrize("lam", LAMBDAS, ids=lambda x: f"lambda{x:g}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("own_keys", ["kernel", "merged"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_prefill_kernel_matches_reference(case, own_keys, dtype, lam):
    d, hkv, g, sink, recent, prefix, new = case
    pc, step, q, q_rot, k, v = prepare(*case, dtype)
    scale = 1 / math.sqrt(d)
    out = torch.full_like(q, float("nan"))
    lse = None
    if own_keys == "merged":
        lse = own_keys_twin(scale)(q, k, v, step.cu_q, step.max_query_len, out)
    cache, batch = pc.mixed(), step.batch()
    oscar_prefill_attention(out, q, q_rot, k, v, cache=cache, batch=batch, scale=scale, self_lse=lse,
                            logit_correction=lam)
    want = oscar_attention_reference(q, q_rot, k, v, cache=cache, batch=batch, scale=scale, logit_correction=lam)
    assert_close_to_reference(out, want, dtype, fp32_atol=fp32_atol(case))


@pytest.mark.parametrize("lam", LAMBDAS, ids=lambda x: f"lambda{x:g}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 4, MAX_DECODE_SPLITS])
@pytest.mark.parametrize("case", [c for c in CASES if max(c[6]) == 1], ids=case_id)
def test_decode_kernel_matches_reference(case, splits, dtype, lam):
    d, hkv, g, sink, recent, prefix, new = case
    pc, step, q, q_rot, k, v = prepare(*case, dtype)
    t, hq, n, scale = q.shape[0], hkv * g, len(new), 1 / math.sqrt(d)
    out = torch.full_like(q, float("nan"))
    part_out = torch.full((t * hq * splits * d,), float("nan"), device=DEVICE)
    part_lse = torch.full((t * hq * splits,), float("nan"), device=DEVICE)
    cache, batch = pc.mixed(), step.batch(num_decodes=n)
    oscar_decode_attention(out, q, q_rot, k, v, cache=cache, batch=batch, scale=scale, num_splits=splits,
                           part_out=part_out, part_lse=part_lse, logit_correction=lam)
    want = oscar_attention_reference(q, q_rot, k, v, cache=cache, batch=batch, scale=scale, logit_correction=lam)
    assert_close_to_reference(out, want, dtype, fp32_atol=fp32_atol(case))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_kernels_read_int2_keys_plus_their_mean(case, dtype):
    """Prefix keys written less their mean before RoPE (``oscar_write``'s ``key_mean``): the
    decode kernel (split) and the prefill kernel (own keys merged, as the backend runs it) add it
    back as the twin does, at λ = 1; read without it they are far off."""
    d, hkv, g, sink, recent, prefix, new = case
    km = KeyMeanCase(hkv, d, max(prefix) + max(new) + 1)
    pc, step, q, q_rot, k, v = prepare(*case, dtype, key_mean=km)
    t, hq, scale = q.shape[0], hkv * g, 1 / math.sqrt(d)
    rot = random_rotation(d).to(DEVICE)  # prepare's rotation (seed 0)
    cache, batch = pc.mixed(), step.batch()
    want = oscar_attention_reference(q, q_rot, k, v, cache=cache, batch=batch, scale=scale, logit_correction=1.0,
                                     key_mean=km.twin, rot_k=rot)
    out = torch.full_like(q, float("nan"))
    if max(new) == 1:
        splits = 4
        part_out = torch.full((t * hq * splits * d,), float("nan"), device=DEVICE)
        part_lse = torch.full((t * hq * splits,), float("nan"), device=DEVICE)
        oscar_decode_attention(out, q, q_rot, k, v, cache=cache, batch=batch, scale=scale, num_splits=splits,
                               part_out=part_out, part_lse=part_lse, logit_correction=1.0, key_mean=km.mean,
                               cos_sin=km.table)
    else:
        lse = own_keys_twin(scale)(q, k, v, step.cu_q, step.max_query_len, out)
        oscar_prefill_attention(out, q, q_rot, k, v, cache=cache, batch=batch, scale=scale, self_lse=lse,
                                logit_correction=1.0, key_mean=km.mean, cos_sin=km.table)
    assert_close_to_reference(out, want, dtype, fp32_atol=KEY_MEAN_FP32_ATOL, bf16_max=KEY_MEAN_BF16_MAX)
    without = oscar_attention_reference(q, q_rot, k, v, cache=cache, batch=batch, scale=scale, logit_correction=1.0)
    assert (without - want).abs().max() > 100 * KEY_MEAN_FP32_ATOL


def test_the_key_mean_coefficients_give_the_querys_product_with_the_turned_mean():
    from csrc_triton.oscar_attention import key_mean_coefficients

    km = KeyMeanCase(2, 64, 300)
    q = random_rows((5, 6, 64), torch.float32, 3)
    pos = torch.tensor([0, 1, 77, 299, 150])
    got = (key_mean_coefficients(q, km.mean).cpu() * km.table.cpu()[pos][:, None]).sum(-1)
    want = (q.cpu().view(5, 2, 3, 64) * km.model.turned(pos)[:, :, None]).sum(-1).view(5, 6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("lam", LAMBDAS, ids=lambda x: f"lambda{x:g}")
def test_mixed_batch_splits_decodes_from_prefills(lam):
    """vLLM's order, decodes first: each part through its own kernel, own keys merged, λ
    reaching both."""
    case = (64, 2, 2, 4, 8, [90, 150, 0, 70], [1, 1, 33, 5])
    d, hkv, g, sink, recent, prefix, new = case
    pc, step, q, q_rot, k, v = prepare(*case, torch.bfloat16)
    hq, scale = hkv * g, 1 / math.sqrt(d)
    out = torch.full_like(q, float("nan"))
    splits = 4
    part_out = torch.full((2 * hq * splits * d,), float("nan"), device=DEVICE)
    part_lse = torch.full((2 * hq * splits,), float("nan"), device=DEVICE)
    cache, batch = pc.mixed(), step.batch(num_decodes=2)
    oscar_attention(out, q, q_rot, k, v, cache=cache, batch=batch, scale=scale, decode_splits=splits,
                    part_out=part_out, part_lse=part_lse, own_keys_attention=own_keys_twin(scale),
                    logit_correction=lam)
    want = oscar_attention_reference(q, q_rot, k, v, cache=cache, batch=batch, scale=scale, logit_correction=lam)
    assert_close_to_reference(out, want, torch.bfloat16)


@pytest.mark.parametrize("key_mean", [False, True], ids=["plain", "key-mean"])
def test_a_decode_batch_padded_as_full_cuda_graphs_pad_it(key_mean):
    """vLLM's full CUDA graphs pad a decode batch to a captured size with entries of sequence
    length 0, slot -1 and (in the backend) a ring row no request holds. The write stores nothing
    for them, and the decode gives the real requests bit for bit what it gives them unpadded; under
    the interpreter neither kernel reaches outside its arguments for them (tests/interpreter_bounds.py:
    the Gluon decode write with a key mean read its RoPE table's row -1 there, 2026-12-05)."""
    case = (64, 2, 2, 4, 8, [90, 300], [1, 1])
    d, hkv, g, sink, recent, prefix, new = case
    km = KeyMeanCase(hkv, d, max(prefix) + 2) if key_mean else None
    pc, step, q, q_rot, k, v = prepare(*case, torch.float32, key_mean=km)
    if km:
        k = km.keys_at(k, step.seq_lens.long().cpu() - 1)
    n, pad, hq, scale, splits = len(new), 3, hkv * g, 1 / math.sqrt(d), 4
    rot = random_rotation(d).to(DEVICE)  # prepare's rotation (seed 0)
    null_row = next(r for r in range(pc.window_pos.shape[0]) if r not in step.ring_slots.tolist())
    mean = dict(key_mean=km.mean, cos_sin=km.table) if km else {}

    def step_on(pages: PagedCache, rows: int, q, q_rot, k, v, block_table, seq_lens, slots, rings) -> torch.Tensor:
        cu = torch.arange(rows + 1, dtype=step.cu_q.dtype, device=DEVICE)
        cache, batch = pages.mixed(), BatchLayout(block_table, seq_lens, cu, rings, rows, num_decodes=rows)
        oscar_write(k, v, rot_k=rot, slot_mapping=slots, cache=cache, batch=batch, clip_idx_k=clip_index(CLIP_K, d),
                    clip_idx_v=clip_index(CLIP_V, d), **mean)
        out = torch.full_like(q, float("nan"))
        oscar_decode_attention(out, q, q_rot, k, v, cache=cache, batch=batch, scale=scale, num_splits=splits,
                               part_out=torch.full((rows * hq * splits * d,), float("nan"), device=DEVICE),
                               part_lse=torch.full((rows * hq * splits,), float("nan"), device=DEVICE), **mean)
        return out

    alone, together = pc.clone(), pc.clone()
    want = step_on(alone, n, q, q_rot, k, v, step.block_table, step.seq_lens, step.slot_mapping, step.ring_slots)
    extra = lambda x, seed: torch.cat([x, random_rows((pad, *x.shape[1:]), x.dtype, seed)])  # noqa: E731
    got = step_on(together, n + pad, extra(q, 20), extra(q_rot, 21), extra(k, 22), extra(v, 23),
                  padded(step.block_table, pad, 0), padded(step.seq_lens, pad, 0), padded(step.slot_mapping, pad, -1),
                  padded(step.ring_slots, pad, null_row))
    assert torch.equal(got[:n], want)
    assert torch.equal(together.cache, alone.cache) and torch.equal(together.window_pos, alone.window_pos)
    assert torch.equal(together.windows.nan_to_num(7.0), alone.windows.nan_to_num(7.0))


def test_fixed_splits_decode_a_request_alike_in_any_batch():
    """decode_splits fixed: a request's split boundaries and merge follow its own length, so its
    output is bit for bit the same alone as in a batch; another split count (what a count chosen
    per batch size gives) changes the last bits, which the comparison sees."""
    case = (64, 2, 2, 4, 8, [90, 1000, 17], [1, 1, 1])
    d, hkv, g, sink, recent, prefix, new = case
    pc, step, q, q_rot, k, v = prepare(*case, torch.bfloat16)
    hq, scale = hkv * g, 1 / math.sqrt(d)
    cache = pc.mixed()

    def decode(rows: slice, splits: int) -> torch.Tensor:
        n = len(range(*rows.indices(len(prefix))))
        out = torch.full_like(q[rows], float("nan"))
        part_out = torch.full((n * hq * splits * d,), float("nan"), device=DEVICE)
        part_lse = torch.full((n * hq * splits,), float("nan"), device=DEVICE)
        batch = BatchLayout(step.block_table[rows], step.seq_lens[rows],
                            torch.arange(n + 1, dtype=step.cu_q.dtype, device=DEVICE), step.ring_slots[rows], n, n)
        oscar_decode_attention(out, q[rows], q_rot[rows], k[rows], v[rows], cache=cache, batch=batch, scale=scale,
                               num_splits=splits, part_out=part_out, part_lse=part_lse)
        return out

    for splits in (4, 16):
        batch = decode(slice(None), splits)
        for r in range(len(prefix)):
            assert torch.equal(decode(slice(r, r + 1), splits)[0], batch[r]), (splits, r)
    assert not torch.equal(decode(slice(1, 2), 1)[0], decode(slice(None), 4)[1])


def test_decode_splits_fill_the_gpu_and_stay_bounded():
    assert decode_splits(1, 8, 132) == MAX_DECODE_SPLITS
    assert decode_splits(1024, 8, 132) == 1
    for n in (1, 3, 32, 100, 1024):
        s = decode_splits(n, 8, 132)
        assert 1 <= s <= MAX_DECODE_SPLITS and s & (s - 1) == 0
        assert n * 8 * s >= 132 or s == MAX_DECODE_SPLITS


def test_window_values_must_start_16_byte_aligned():
    """The kernels compile the ring's value pointer as aligned as its keys; a layout that breaks
    that is refused, not served by a slower variant compiled mid-run."""
    pages, pos = torch.zeros(2, 8, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int32)
    assert window_entries_per_page(48, 1, 4, 3) == 3
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        window_args(torch.zeros(9, 48, dtype=torch.bfloat16), pages, pos, 1, 4, 3, 1)
    args = window_args(torch.zeros(9, 64, dtype=torch.bfloat16), pages, pos, 1, 8, 2, 2)
    assert args["window_v_ptr"].data_ptr() - args["window_k_ptr"].data_ptr() == 2 * 8 * 2


@pytest.mark.parametrize("use_asm", [False, True] if ON_GPU else [False])
def test_codes_are_exact_for_every_byte(use_asm):
    """Every byte value unpacks to its four 2-bit codes c, as the exact numbers c·4^i·2^-24."""

    @triton.jit
    def unpack(src, dst, DOT_DT: tl.constexpr, USE_ASM: tl.constexpr):
        i = tl.arange(0, 256)
        b = tl.load(src + i)
        tl.store(dst + i, _codes(b, 0, DOT_DT, USE_ASM).to(tl.float32))
        tl.store(dst + 256 + i, _codes(b, 1, DOT_DT, USE_ASM).to(tl.float32))
        tl.store(dst + 512 + i, _codes(b, 2, DOT_DT, USE_ASM).to(tl.float32))
        tl.store(dst + 768 + i, _codes(b, 3, DOT_DT, USE_ASM).to(tl.float32))

    src = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    want = torch.stack([((src.long().cpu() >> s) & 3) * 2.0 ** (s - 24) for s in (0, 2, 4, 6)]).float()
    for dt in ([tl.float16] if use_asm else [tl.float16, tl.float32]):
        dst = torch.full((4, 256), float("nan"), device=DEVICE)
        unpack[(1,)](src, dst, DOT_DT=dt, USE_ASM=use_asm)
        assert torch.equal(dst.cpu(), want), dt


def test_products_with_subnormal_codes_are_exact():
    """The matrix products take the codes' fp16 subnormals as they are (no flush to zero)."""

    @triton.jit
    def product(a_ptr, b_ptr, out_ptr, USE_ASM: tl.constexpr):
        r = tl.arange(0, 16)
        c = tl.arange(0, 64)
        a = tl.load(a_ptr + r[:, None] * 64 + c[None, :])
        b = _codes(tl.load(b_ptr + c[:, None] * 16 + r[None, :]), 3, tl.float16, USE_ASM)
        tl.store(out_ptr + r[:, None] * 16 + r[None, :], tl.dot(a, b))

    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 64, generator=g).half()
    packed = torch.randint(0, 256, (64, 16), dtype=torch.uint8, generator=g)
    out = torch.full((16, 16), float("nan"), device=DEVICE)
    product[(1,)](a.to(DEVICE), packed.to(DEVICE), out, USE_ASM=ON_GPU)
    want = a.double() @ (((packed.long() >> 6) & 3) * 2.0 ** -18).double()
    torch.testing.assert_close(out.cpu().double(), want, rtol=1e-6, atol=0)


def test_reference_reads_the_ring_only_where_it_holds_the_position():
    """Emptying the ring turns every window key into its INT2 copy: the output moves."""
    case = (64, 1, 2, 4, 8, [40], [1])
    pc, step, q, q_rot, k, v = prepare(*case, torch.float32)
    cache, batch = pc.mixed(), step.batch()
    full = oscar_attention_reference(q, q_rot, k, v, cache=cache, batch=batch, scale=0.125)
    empty = cache._replace(window_pos=torch.full_like(pc.window_pos, -1))
    lo = oscar_attention_reference(q, q_rot, k, v, cache=empty, batch=batch, scale=0.125)
    assert (full - lo).abs().max() > 1e-3


PIPELINES = [
    # head_dim, kv heads, q heads per kv head, sink, recent, prompt lens, chunk
    (64, 1, 3, 4, 8, [29, 140], 8),
    (64, 2, 2, 3, 16, [70], 16),
    (64, 1, 2, 4, 8, [50], 24),  # chunks longer than the recent window
]
if ON_GPU:
    PIPELINES += [(64, 3, 3, 64, 256, [2048, 1500, 700], 256), (128, 8, 4, 64, 256, [1300], 256)]


def run_batch(out, q, q_rot, k, v, pc, step, scale, sink, recent, dense_k_rot=None, lam=0.0):
    """The backend's dispatch: decodes first (vLLM orders them so), split decode kernel; with
    ``dense_k_rot`` (the step's keys, rotated) prefills take the dense path. ``lam``: λ."""
    q_lens = (step.cu_q[1:] - step.cu_q[:-1]).tolist()
    num_decodes = next((i for i, n in enumerate(q_lens) if n > 1), len(q_lens))
    assert all(n > 1 for n in q_lens[num_decodes:]), "decodes must come first"
    t, hq, d = q.shape
    part_out = torch.empty(t * hq * 4 * d, device=q.device)
    part_lse = torch.empty(t * hq * 4, device=q.device)
    dense = None
    if dense_k_rot is not None:
        rows = int(step.seq_lens.sum())
        dense = DensePrefill(dense_k_rot[num_decodes:], torch.full((rows, *k.shape[1:]), float("nan"), device=q.device),
                             torch.full((rows, *k.shape[1:]), float("nan"), device=q.device),
                             int(step.seq_lens.max()), dense_twin(scale))
    oscar_attention(out, q, q_rot, k, v, cache=pc.mixed(), batch=step.batch(num_decodes), scale=scale,
                    decode_splits=4, part_out=part_out, part_lse=part_lse, dense=dense, logit_correction=lam)


# The dense path has no logit correction (FlashAttention takes no per-key bias): λ with the INT2 kernels only.
@pytest.mark.parametrize("prefill,lam", [("int2-kernel", 0.0), ("dense", 0.0), ("int2-kernel", 1.0)],
                         ids=["int2-kernel", "dense", "int2-kernel-lambda1"])
@pytest.mark.parametrize("case", PIPELINES, ids=lambda c: f"d{c[0]}-h{c[1]}x{c[2]}-s{c[3]}-r{c[4]}-c{c[6]}")
def test_pipeline_matches_mixed_cache_reference(case, prefill, lam):
    """Chunked prefill then decode, through the kernels, equals ``mixed_cache_attention``
    told where each chunk starts (own keys BF16, the prefix's window as the chunk found it),
    with the same logit correction λ."""
    d, hkv, g, sink, recent, prompts, chunk = case
    decode_steps = 5
    lens = [p + decode_steps for p in prompts]
    n = len(lens)
    pc = PagedCache(n, max(lens), hkv, d, sink, recent, DEVICE)
    rot = random_rotation(d).to(DEVICE)
    # The reference rounds this step's keys to bf16, the kernel reads them as given (fp32
    # here): softer queries keep that by-design difference below the tolerance.
    qs = [0.25 * random_rows((L, hkv * g, d), torch.float32, 100 + r) for r, L in enumerate(lens)]
    ks = [random_rows((L, hkv, d), torch.float32, 200 + r) for r, L in enumerate(lens)]
    vs = [random_rows((L, hkv, d), torch.float32, 300 + r) for r, L in enumerate(lens)]
    outs = [torch.full((L, hkv * g, d), float("nan")) for L in lens]
    scale = 1 / math.sqrt(d)
    while any(pc.done[r] < lens[r] for r in range(n)):
        todo = {r: min(chunk if pc.done[r] < prompts[r] else 1, lens[r] - pc.done[r])
                for r in range(n) if pc.done[r] < lens[r]}
        new = dict(sorted(todo.items(), key=lambda kv: (kv[1] > 1, kv[1])))  # vLLM's order
        starts = {r: pc.done[r] for r in new}
        step = pc.schedule(new)
        cat = lambda xs: torch.cat([xs[r][starts[r]: starts[r] + new[r]] for r in new])  # noqa: E731
        q, k, v = cat(qs), cat(ks), cat(vs)
        out = torch.full_like(q, float("nan"))
        run_batch(out, q, q @ rot, k, v, pc, step, scale, sink, recent, k @ rot if prefill == "dense" else None, lam)
        oscar_write(k, v, rot_k=rot, slot_mapping=step.slot_mapping, cache=pc.mixed(), batch=step.batch(),
                    clip_idx_k=clip_index(CLIP_K, d), clip_idx_v=clip_index(CLIP_V, d))
        for i, r in enumerate(new):
            a, b = int(step.cu_q[i]), int(step.cu_q[i + 1])
            outs[r][starts[r]: starts[r] + new[r]] = out[a:b].cpu()
    spec = LayerCacheSpec(rot.cpu(), None, RowQuantizer("int2", CLIP_K), RowQuantizer("int2", CLIP_V),
                          logit_correction=lam)
    for r in range(n):
        pos = torch.arange(lens[r])
        starts = torch.where(pos // chunk * chunk < prompts[r], pos // chunk * chunk, pos)
        want = mixed_cache_attention(qs[r].cpu(), ks[r].cpu(), vs[r].cpu(), spec, sink, recent, scale,
                                     chunk_starts=starts)
        # Window keys are bf16 in both, but this step's keys are exact in the kernel and
        # bf16 in the reference. And k @ R summed in another order than the reference can
        # flip an INT2 code at a rounding tie, which every later query then sees: on the
        # H200 up to 0.64% of outputs moved by more than 0.02 (the CPU: none), never 0.1.
        err = (outs[r] - want).abs()
        assert not outs[r].isnan().any()
        assert err.max() <= 0.1, err.max()
        assert (err > 2e-2).float().mean() <= 1e-2, (err > 2e-2).float().mean()


def _request_zero_written(d, hkv, sink, recent):
    """Two requests' paged cache in which request 0 has prefilled 192 tokens (three full blocks)."""
    pc = PagedCache(2, 200, hkv, d, sink, recent, DEVICE)
    rot = random_rotation(d).to(DEVICE)
    step = pc.schedule({0: 192})
    k, v = random_rows((192, hkv, d), torch.float32, 1), random_rows((192, hkv, d), torch.float32, 2)
    oscar_write(k, v, rot_k=rot, slot_mapping=step.slot_mapping, cache=pc.mixed(), batch=step.batch(),
                clip_idx_k=clip_index(CLIP_K, d), clip_idx_v=clip_index(CLIP_V, d))
    return pc, rot


def _prefill_request_one(pc, rot, done, hkv, g, sink, recent):
    """Request 1, ``done`` tokens cached, prefills 5 more: the kernel against its twin. Returns
    the step's inputs and the twin's output, for a second read of the same step."""
    d = rot.shape[0]
    pc.done[1] = done
    step = pc.schedule({1: 5})
    q = random_rows((5, hkv * g, d), torch.float32, 3)
    k, v = random_rows((5, hkv, d), torch.float32, 4), random_rows((5, hkv, d), torch.float32, 5)
    out = torch.full_like(q, float("nan"))
    cache, batch = pc.mixed(), step.batch()
    oscar_prefill_attention(out, q, q @ rot, k, v, cache=cache, batch=batch, scale=0.125)
    want = oscar_attention_reference(q, q @ rot, k, v, cache=cache, batch=batch, scale=0.125)
    torch.testing.assert_close(out.float().cpu(), want, rtol=1e-4, atol=1e-4)
    return q, k, v, (cache, batch), want


def test_prefix_cache_hit_never_reads_another_requests_window():
    """A request that reuses another's cached blocks (vLLM prefix caching) and gets a ring row
    a finished request left behind reads the shared prefix from INT2 where its own ring is
    empty: exactly the paged reference, whose ring is as the runner leaves it (emptied)."""
    d, hkv, g, sink, recent = 64, 1, 2, 4, 8
    pc, rot = _request_zero_written(d, hkv, sink, recent)
    # Request 1 hits the first two blocks and takes request 0's ring row after it finished
    # (the runner empties the row: the builder's assign_windows).
    pc.block_table[1, :2] = pc.block_table[0, :2]
    pc.ring_slots[1] = pc.ring_slots[0]
    pc.window_pos[pc.ring_slots[1]] = -1
    q, k, v, args, want = _prefill_request_one(pc, rot, 128, hkv, g, sink, recent)
    # The same query with request 0's stale ring entries left in place would differ: the
    # emptied row is what keeps request 0's data out.
    stale = pc.window_pos.clone()
    stale[pc.ring_slots[1], : sink + recent] = torch.arange(sink + recent, dtype=torch.int32)
    cache, batch = args
    other = oscar_attention_reference(q, q @ rot, k, v, cache=cache._replace(window_pos=stale), batch=batch,
                                      scale=0.125)
    assert (other - want).abs().max() > 1e-3


@pytest.mark.parametrize("new", [5, 1], ids=["prefill", "decode"])
def test_a_hit_reads_the_shared_sink_pages_in_bf16(new):
    """A request that hits a cached prefix shares the sink pages of the request that wrote
    them (oscar_vllm.serving.window_pages): its row names those pages and trusts the sink positions.
    Kernel and twin read the same BF16 sink, which differs from the INT2 copy."""
    d, hkv, g, sink, recent = 64, 1, 2, 4, 8
    pc, rot = _request_zero_written(d, hkv, sink, recent)
    ring0, ring1 = int(pc.ring_slots[0]), int(pc.ring_slots[1])
    sink_pages = sink // window_entries_per_page(pc.windows.shape[1], hkv, d, sink)
    pc.block_table[1, :2] = pc.block_table[0, :2]
    pc.window_pages[ring1, :sink_pages] = pc.window_pages[ring0, :sink_pages]
    pc.window_pos[ring1] = -1
    pc.window_pos[ring1, :sink] = torch.arange(sink, dtype=torch.int32)
    pc.done[1] = 128
    step = pc.schedule({1: new})
    q = random_rows((new, hkv * g, d), torch.float32, 3)
    k, v = random_rows((new, hkv, d), torch.float32, 4), random_rows((new, hkv, d), torch.float32, 5)
    out = torch.full_like(q, float("nan"))
    cache, batch = pc.mixed(), step.batch(num_decodes=1 if new == 1 else 0)
    if new == 1:
        part_out = torch.full((hkv * g * 4 * d,), float("nan"), device=DEVICE)
        part_lse = torch.full((hkv * g * 4,), float("nan"), device=DEVICE)
        oscar_decode_attention(out, q, q @ rot, k, v, cache=cache, batch=batch, scale=0.125, num_splits=4,
                               part_out=part_out, part_lse=part_lse)
    else:
        oscar_prefill_attention(out, q, q @ rot, k, v, cache=cache, batch=batch, scale=0.125)
    want = oscar_attention_reference(q, q @ rot, k, v, cache=cache, batch=batch, scale=0.125)
    torch.testing.assert_close(out.float().cpu(), want, rtol=1e-4, atol=1e-4)
    int2_sink = pc.window_pos.clone()
    int2_sink[ring1] = -1
    other = oscar_attention_reference(q, q @ rot, k, v, cache=cache._replace(window_pos=int2_sink), batch=batch,
                                      scale=0.125)
    assert (other - want).abs().max() > 1e-3


def test_a_hit_reads_the_ring_it_copied_from_an_ended_request():
    """``hit_ring`` ``reuse``: request 1 hits request 0's three blocks, shares its sink pages and
    copies its recent pages into its own (oscar_vllm.serving.window_pages); the builder copies them
    and marks the positions they hold, the positions request 0's own writes left there. Kernel and
    twin then read them in BF16, and request 0's pages are as they were."""
    from types import SimpleNamespace

    from oscar_vllm.serving.backend import OscarAttentionMetadataBuilder
    from oscar_vllm.serving.window_pages import WindowPagesError

    d, hkv, g, sink, recent = 64, 1, 2, 4, 8
    pc, rot = _request_zero_written(d, hkv, sink, recent)
    ring0, ring1 = int(pc.ring_slots[0]), int(pc.ring_slots[1])
    sink_pages = sink // window_entries_per_page(pc.windows.shape[1], hkv, d, sink)
    source = pc.window_pages[ring0, sink_pages:].tolist()
    own = pc.window_pages[ring1, sink_pages:].tolist()
    assert not set(source) & set(own)
    bits = pc.windows.view(torch.int16)  # compared bit for bit: unwritten entries are NaN
    before = bits[source].clone()
    pc.window_pos[ring1] = 7  # what an earlier request left in the row
    pc.block_table[1, :3] = pc.block_table[0, :3]
    builder = SimpleNamespace(pages_per_ring=pc.window_pages.shape[1], sink_pages=sink_pages,
                              window_pages=pc.window_pages, sink=sink, recent=recent,
                              layers=[SimpleNamespace(window_pos=pc.window_pos)], layer_caches=lambda: [pc.windows])
    OscarAttentionMetadataBuilder.assign_windows(builder, [ring1], [pc.window_pages[ring0, :sink_pages].tolist() + own],
                                                 num_blocks=pc.windows.shape[0], sink_shared=[True],
                                                 rings=[(0, 192, source)])
    assert pc.window_pages[ring1].tolist() == pc.window_pages[ring0, :sink_pages].tolist() + own
    assert torch.equal(bits[own], before) and torch.equal(bits[source], before), "copied, not moved"
    assert torch.equal(pc.window_pos[ring1], pc.window_pos[ring0])
    assert sorted(pc.window_pos[ring1, sink:].tolist()) == list(range(192 - recent, 192)), "the last 8 written"
    q, k, v, args, want = _prefill_request_one(pc, rot, 192, hkv, g, sink, recent)
    int2 = pc.window_pos.clone()
    int2[ring1, sink:] = -1
    cache, batch = args
    other = oscar_attention_reference(q, q @ rot, k, v, cache=cache._replace(window_pos=int2), batch=batch,
                                      scale=0.125)
    assert (other - want).abs().max() > 1e-3, "the ring's BF16 positions differ from their INT2 copies"
    with pytest.raises(WindowPagesError, match="ring source pages"):
        OscarAttentionMetadataBuilder.assign_windows(builder, [ring1], [pc.window_pages[ring1].tolist()],
                                                     num_blocks=pc.windows.shape[0], rings=[(0, 192, source[:1])])


@pytest.mark.parametrize("num_splits", [1, 3, 4, 24, 64, 100, 256])
def test_merge_splits_weighs_partials_by_their_log_sum_exp(num_splits):
    """The split merge against log-sum-exp weighting in PyTorch: splits without keys (lse -inf)
    leave NaN partial outputs that must not be read, whole chunks of them included, and a row
    whose splits all lack keys gives zeros. Counts that are not powers of two (a split count
    sized to whole waves of programs) read no split past their own: the next row's follows."""
    from csrc_triton.merge_splits import merge_splits

    t, hq, d = 3, 2, 64
    g = torch.Generator().manual_seed(num_splits)
    lse = torch.randn(t, hq, num_splits, generator=g) * 4
    used = torch.rand(t, hq, num_splits, generator=g) < 0.6
    used[0, 0] = False
    used[1, 0] = torch.arange(num_splits) == num_splits - 1  # one used split, in the last chunk
    used[1, 1, 0] = True
    lse[~used] = float("-inf")
    part_out = torch.randn(t, hq, num_splits, d, generator=g)
    part_out[~used] = float("nan")
    w = torch.where(used, torch.exp2(lse - lse.amax(-1, keepdim=True).clamp_min(-1e30)), 0.0)
    want = (w[..., None] * torch.nan_to_num(part_out)).sum(2) / w.sum(2, keepdim=True).clamp_min(1e-30)
    out = torch.full((t, hq, d), float("nan"), dtype=torch.float32, device=DEVICE)
    # One more row's splits after the last, used, with a log-sum-exp that would swamp the
    # maximum and NaN outputs: a read past a row shows.
    pad_lse = torch.cat([lse.flatten(), torch.full((hq * num_splits,), 200.0)])
    pad_out = torch.cat([part_out.flatten(), torch.full((hq * num_splits * d,), float("nan"))])
    merge_splits(out, pad_out.to(DEVICE), pad_lse.to(DEVICE), t, num_splits)
    torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(out[0, 0].cpu(), torch.zeros(d))
