"""Reference for ``csrc_triton/oscar_decode.py``: decode attention over the mixed paged cache,
this step's token already written (read from the ring like any window position)."""
from __future__ import annotations

import torch

from oscar_vllm.core.key_mean import KeyMean
from oscar_vllm.reference.oscar_attention import logit_correction_bias, read_int2_key_scales, read_int2_slots
from oscar_vllm.reference.oscar_write import window_index
from oscar_vllm.reference.paged import BatchLike, MixedCacheLike, block_size_of, read_ring, rotated_key_mean


def oscar_decode_reference(
    q_rot: torch.Tensor,
    *,
    cache: MixedCacheLike,
    batch: BatchLike,
    scale: float,
    logit_correction: float = 0.0,
    key_mean: KeyMean | None = None,
    rot_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 ``[num_reqs, Hq, d]``: ``batch``'s request ``r``'s query ``q_rot[r]`` (key-rotated basis) over
    positions ``[0, seq_lens[r])``: the BF16 ring's copy where the ring holds a position of the
    window (the sink and the last ``recent`` positions), the INT2 copy elsewhere, whose logits
    lose ``logit_correction_bias`` (λ = ``logit_correction``) and, with ``key_mean``, read plus
    their mean turned to their positions, rotated by ``rot_k``."""
    _, hq, d = q_rot.shape
    hkv = cache.pages.shape[1]
    g = hq // hkv
    sink, recent, param_dtype = cache.sink, cache.recent, cache.param_dtype
    bs = block_size_of(cache.pages, d)
    out = torch.zeros(batch.num_reqs, hq, d, dtype=torch.float32)
    for r in range(batch.num_reqs):
        n = int(batch.seq_lens[r])
        kp = torch.arange(n)
        slots = batch.block_table[r].long().cpu()[kp // bs] * bs + kp % bs
        k_lo, v_lo = read_int2_slots(cache.pages, slots, d, param_dtype)
        if key_mean is not None:
            k_lo = k_lo + rotated_key_mean(key_mean, rot_k, kp)
        ring = int(batch.ring_slots[r])
        idx = window_index(kp, sink, recent)
        held = cache.window_pos[ring].long().cpu()[idx] == kp
        k_hi, v_hi = read_ring(cache.windows, cache.window_pages, ring, idx, hkv, d, sink)
        hi = held & ((kp < sink) | (n - 1 - kp < recent))
        # Chosen, not masked by a product: ring entries nobody wrote may hold anything (NaN).
        k = torch.where(hi[:, None, None], k_hi, k_lo).repeat_interleave(g, dim=1).transpose(0, 1)  # [Hq, n, d]
        v = torch.where(hi[:, None, None], v_hi, v_lo).repeat_interleave(g, dim=1).transpose(0, 1)
        q = q_rot[r].float().cpu()[:, None, :]  # [Hq, 1, d]
        s = (q @ k.transpose(1, 2)) * scale
        if logit_correction:
            k_scale = read_int2_key_scales(cache.pages, slots, d, param_dtype).repeat_interleave(g, dim=1)
            s = s - torch.where(hi, 0.0, logit_correction_bias(q, k_scale, logit_correction, scale))
        p = torch.softmax(s, dim=-1)
        out[r] = (p @ v)[:, 0]
    return out
