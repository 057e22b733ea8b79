"""Shapes and inputs shared by the kernel tests: small under the Triton interpreter (CPU),
real model shapes and long contexts on a GPU."""
from __future__ import annotations

import os

import torch

from oscar_vllm.reference.oscar_attention import causal_attention_reference
from csrc_triton.paged_layout import BLOCK_SIZE, KEY_MEAN_PAIRS
from oscar_vllm.core.key_mean import KeyMean, served_pairs
from oscar_vllm.reference.oscar_write import oscar_write_reference, token_positions
from paged_sim import PagedCache

ON_GPU = torch.cuda.is_available()
CLIP_K, CLIP_V = 0.96, 0.92
DEVICE = "cuda" if ON_GPU else "cpu"
# tl.dot on bf16 operands is wrong under the interpreter: the CPU runs fp32 inputs only.
DTYPES = [torch.float32, torch.bfloat16] if ON_GPU else [torch.float32]


def random_rotation(d: int, heads: int | None = None, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (heads, d, d) if heads else (d, d)
    q, _ = torch.linalg.qr(torch.randn(*shape, generator=g, dtype=torch.float64))
    return q.float()


def padded(x: torch.Tensor, count: int, fill) -> torch.Tensor:
    """``x`` with ``count`` rows of ``fill`` after its own, as a full CUDA graph pads a batch's
    metadata (slot -1, sequence length 0, ...)."""
    return torch.cat([x, torch.full((count, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)])


def random_rows(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows with a few outlier channels, like real keys."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x[..., :: max(1, shape[-1] // 8)] *= 6.0
    return x.to(dtype).to(DEVICE)


CASES = [
    # head_dim, kv heads, query heads per kv head, sink, recent, prefix lens, new tokens
    (64, 1, 3, 4, 8, [37, 0, 140], [1, 9, 17]),
    (64, 2, 1, 0, 5, [200, 33], [1, 1]),
    (128, 1, 4, 6, 7, [65, 1], [20, 1]),
    (64, 1, 2, 70, 90, [300, 129], [1, 1]),
]
# The GPU's cases, also on the CPU with OSCAR_GPU_CASES=1 (the interpreter: minutes a case).
if ON_GPU or os.environ.get("OSCAR_GPU_CASES") == "1":
    CASES += [
        (128, 8, 4, 64, 256, [8191, 300, 0, 4097], [1, 256, 700, 1]),
        (64, 3, 3, 64, 256, [32767, 1023], [1, 1]),
        (128, 1, 8, 64, 256, [1000] * 64, [1] * 64),
        (128, 4, 1, 64, 256, [513, 257, 255], [256, 1, 64]),
        (128, 4, 7, 64, 256, [20000, 64, 65], [1, 1, 1]),
        (256, 2, 4, 64, 256, [3000, 10], [1, 40]),
    ]
case_id = lambda c: f"d{c[0]}-h{c[1]}x{c[2]}-s{c[3]}-r{c[4]}-n{len(c[5])}-{max(c[5])}"  # noqa: E731


def fp32_atol(case) -> float:
    """fp32 tolerance for a case: beyond 16K keys the kernel's and the reference's fp32 sums, in
    other orders, drift apart by about 1e-4 (1.1e-4 seen at 32K on the H200, with and without the
    logit correction's extra term)."""
    return 2e-4 if max(case[5]) > 16384 else 1e-4


# Key-mean reads against their fp32 twins. The mean (three times the keys' spread here) triples the
# logits' scale and sharpens the softmax, so the fp16/TF32 products' rounding weighs more: on the
# H200 (2026-12-05, results/gpu/key_mean_gluon/) the worst output element of head_dim 64 at 32K,
# bf16, was 1.09% of the output's scale off on the Gluon kernel and 2.06% on the Triton one (their
# means within bf16_mean), and one fp32 element of 3.9M 1.4e-4 off at 8K. A read that leaves the
# mean out is off by far more (the tests check that too).
KEY_MEAN_BF16_MAX = 2.5e-2
KEY_MEAN_FP32_ATOL = 2e-4


def vllm_rope_table(positions: int, d: int, base: float = 10_000.0) -> torch.Tensor:
    """fp32 ``[P, d]`` as vLLM's ``RotaryEmbedding.cos_sin_cache`` holds it: d/2 cosines, d/2 sines."""
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * base ** (-torch.arange(0, d, 2) / d)[None]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


class KeyMeanCase:
    """A key mean for a case as the backend serves one: fp32 ``mean`` ``[Hkv, d]`` (a block mean)
    on each head's ``KEY_MEAN_PAIRS`` strongest pairs and ``table`` ``[P, d]`` (vLLM's layout) on
    the kernels' device, the twins' ``KeyMean`` of the same numbers (one vector a cache block), and
    the decode kernel's operands."""

    def __init__(self, hkv: int, d: int, positions: int, seed: int = 99):
        self.mean = served_pairs(3 * random_rows((hkv, d), torch.float32, seed), KEY_MEAN_PAIRS)
        self.table = vllm_rope_table(max(positions, BLOCK_SIZE), d).to(DEVICE)
        self.twin = KeyMean.from_cos_sin_cache(self.mean.cpu(), self.table.cpu(), block=BLOCK_SIZE)
        self.model = KeyMean.from_cos_sin_cache(self.mean.cpu(), self.table.cpu())

    def operands(self) -> dict:
        """What ``oscar_decode`` takes as ``key_mean``."""
        from csrc_triton.oscar_decode import key_mean_operands

        return key_mean_operands(self.mean, self.table)

    def keys_at(self, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Keys ``k`` ``[N, Hkv, d]`` at ``positions`` with the mean turned to each position added, as
        a model's would have it (the cache takes off its block's mean, not this)."""
        return (k.float() + self.model.turned(positions).to(k.device)).to(k.dtype)


def prepare(d, hkv, g, sink, recent, prefix, new, dtype, seed=0, entries_per_page=None,
            key_mean: KeyMeanCase | None = None):
    n = len(prefix)
    pc = PagedCache(n, max(prefix) + max(new) + 1, hkv, d, sink, recent, DEVICE, seed,
                    **({"entries_per_page": entries_per_page} if entries_per_page else {}))
    rot = random_rotation(d, seed=seed).to(DEVICE)
    todo = {r: p for r, p in enumerate(prefix) if p}
    if todo:
        st = pc.schedule(todo)
        t = int(st.cu_q[-1])
        k, v = random_rows((t, hkv, d), dtype, 10), random_rows((t, hkv, d), dtype, 11)
        if key_mean is not None:
            k = key_mean.keys_at(k, token_positions(st.cu_q, st.seq_lens, len(st.reqs))[1])
        oscar_write_reference(k, v, rot_k=rot, slot_mapping=st.slot_mapping, cache=pc.mixed(), batch=st.batch(),
                              clip_ratio_k=CLIP_K, clip_ratio_v=CLIP_V, key_mean=key_mean and key_mean.twin)
    step = pc.schedule(dict(enumerate(new)))
    t = int(step.cu_q[-1])
    q = random_rows((t, hkv * g, d), dtype, 12)
    k, v = random_rows((t, hkv, d), dtype, 13), random_rows((t, hkv, d), dtype, 14)
    q_rot = (q.float() @ rot).to(dtype)
    return pc, step, q, q_rot, k, v


def dense_twin(scale):
    """What FlashAttention does for the backend's dense path, from the PyTorch twin."""
    def run(q, k, v, cu_q, cu_k, max_query_len, max_seq_len, out):
        o, _ = causal_attention_reference(q, k, v, cu_q, cu_k, len(cu_q) - 1, scale)
        out.copy_(o.to(out.dtype))
    return run


def decode_read_twins(scale):
    """What FlashAttention and vLLM's ``merge_attn_states`` do for the decode-read prefill, from
    the PyTorch twins: ``(attention, merge)`` as ``DecodeReadPrefill`` takes them."""
    def attention(q, k, v, cu_q, cu_k, max_query_len, max_seq_len, out, return_lse, window_left):
        o, lse = causal_attention_reference(q, k, v, cu_q, cu_k, len(cu_q) - 1, scale, window_left)
        out.copy_(o.to(out.dtype))
        return lse.to(out.device) if return_lse else None

    def merge(out, out_a, lse_a, out_b, lse_b):
        top = torch.maximum(lse_a, lse_b)
        w_a, w_b = (lse_a - top).exp().T[..., None], (lse_b - top).exp().T[..., None]  # [T, Hq, 1]
        out.copy_(((out_a.float() * w_a + out_b.float() * w_b) / (w_a + w_b)).to(out.dtype))

    return attention, merge


def assert_close_to_reference(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, fp32_atol: float = 1e-4,
                              bf16_max: float = 1e-2, bf16_mean: float = 5e-3) -> None:
    """No NaN left (every row written); fp32: elementwise; bf16 inputs, fp16 probabilities and
    codes in the products and a bf16 output against an fp32 reference: the error relative to
    the output's scale, worst case (``bf16_max``) and mean (``bf16_mean``)."""
    got = got.float().cpu()
    assert not got.isnan().any(), "a query row was never written"
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=fp32_atol)
    else:
        err = (got - want).abs()
        assert err.max() <= bf16_max * want.abs().max(), (err.max(), want.abs().max())
        assert err.mean() <= bf16_mean * want.abs().mean(), (err.mean(), want.abs().mean())
