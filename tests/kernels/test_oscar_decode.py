"""csrc_triton/oscar_decode.py (Gluon) against its PyTorch reference on the GPU; on the CPU, the
reference against the attention reference it must agree with (Gluon has no interpreter: the
kernel's CPU check is the sm_90 compile in test_kernels_compile.py)."""
import math

import pytest
import torch

from csrc_triton.oscar_decode import MAX_SPLITS, decode_splits, supports
from oscar_vllm.core.quant import clip_index
from oscar_vllm.reference.oscar_attention import oscar_attention_reference
from oscar_vllm.reference.oscar_decode import oscar_decode_reference
from oscar_vllm.reference.oscar_write import oscar_write_reference
from kernel_cases import CASES, CLIP_K, CLIP_V, ON_GPU, assert_close_to_reference, cache_args, case_id, prepare, random_rotation

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


def decode_step(case, dtype, write):
    """A decode step of ``case`` whose tokens ``write`` put into the cache first, as the backend
    does before decode attention."""
    d, hkv, g, sink, recent, prefix = case
    pc, step, q, q_rot, k, v = prepare(d, hkv, g, sink, recent, prefix, [1] * len(prefix), dtype,
                                       entries_per_page=8)
    rot = random_rotation(d, seed=0).to(q.device)
    write(k, v, rot, step, pc)
    return pc, step, q, q_rot


@pytest.mark.skipif(not ON_GPU, reason="Gluon kernels run on a GPU only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("splits", [1, 4, MAX_SPLITS])
@pytest.mark.parametrize("case", GPU_CASES, ids=gpu_case_id)
def test_decode_kernel_matches_reference(case, splits, dtype):
    from csrc_triton.oscar_decode import oscar_decode
    from csrc_triton.oscar_write import oscar_write

    d, hkv, g, sink, recent, prefix = case
    if dtype == torch.float16 and case is not GPU_CASES[0]:
        pytest.skip("fp16 models: one case")

    def write(k, v, rot, step, pc):
        oscar_write(k, v, rot, step.slot_mapping, step.cu_q, step.seq_lens, step.ring_slots, len(prefix), pc.cache,
                    pc.windows, pc.window_pages, pc.window_pos, clip_index(CLIP_K, d), clip_index(CLIP_V, d), sink,
                    recent, num_decodes=len(prefix))

    pc, step, q, q_rot = decode_step(case, dtype, write)
    n, hq, scale = len(prefix), hkv * g, 1 / math.sqrt(d)
    out = torch.full_like(q, float("nan"))
    part_out = torch.full((n * hq * splits * d,), float("nan"), device=q.device)
    part_lse = torch.full((n * hq * splits,), float("nan"), device=q.device)
    oscar_decode(out, q_rot, pc.cache, pc.windows, pc.window_pages, pc.window_pos, step.block_table, step.seq_lens,
                 step.ring_slots, n, scale, sink, recent, num_splits=splits, part_out=part_out, part_lse=part_lse)
    want = oscar_decode_reference(q_rot, pc.cache, pc.windows, pc.window_pages, pc.window_pos, step.block_table,
                                  step.seq_lens, step.ring_slots, n, scale, sink, recent)
    assert_close_to_reference(out, want, torch.bfloat16)


@pytest.mark.parametrize("case", [c for c in CASES if max(c[6]) == 1], ids=case_id)
def test_reference_reads_the_written_token_as_attention_reads_it_unwritten(case):
    """Writing the decode token first and reading it from the ring (this kernel) gives what the
    attention reference gives with the token in hand (the prefill path's order): they differ
    only by the BF16 rounding of the token's rotated key."""
    d, hkv, g, sink, recent, prefix, new = case
    pc, step, q, q_rot, k, v = prepare(*case, torch.float32)
    # Gentle queries, so that no key's weight rounds to zero (the token's included).
    q, q_rot = q * 0.05, q_rot * 0.05
    n, scale = len(prefix), 1 / math.sqrt(d)
    before = oscar_attention_reference(q, q_rot, k, v, *cache_args(pc, step), n, scale, sink, recent)
    rot = random_rotation(d, seed=0).to(q.device)
    oscar_write_reference(k, v, rot, step.slot_mapping, step.cu_q, step.seq_lens, step.ring_slots, n, pc.cache,
                          pc.windows, pc.window_pages, pc.window_pos, CLIP_K, CLIP_V, sink, recent)
    after = oscar_decode_reference(q_rot, pc.cache, pc.windows, pc.window_pages, pc.window_pos, step.block_table,
                                   step.seq_lens, step.ring_slots, n, scale, sink, recent)
    assert_close_to_reference(after, before, torch.bfloat16)
    # Not the same function: the token's key is rounded to BF16 in the ring.
    assert not torch.equal(after, before)


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
    assert decode_splits(1, 8, 132) == MAX_SPLITS
    assert decode_splits(1024, 8, 132) == 1
    for n in (1, 3, 32, 100, 1024):
        s = decode_splits(n, 8, 132)
        assert 1 <= s <= MAX_SPLITS and s & (s - 1) == 0
        assert n * 8 * s >= 132 or s == MAX_SPLITS
