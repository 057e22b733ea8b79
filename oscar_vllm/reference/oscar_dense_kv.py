"""Reference for ``csrc_triton/oscar_dense_kv.py``: prefill requests' keys and values, dense."""
from __future__ import annotations

import torch

from oscar_vllm.core.key_mean import KeyMean
from oscar_vllm.reference.oscar_attention import read_int2_slots
from oscar_vllm.reference.oscar_write import window_index
from oscar_vllm.reference.paged import BatchLike, MixedCacheLike, block_size_of, read_ring, rotated_key_mean


def oscar_dense_kv_reference(
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    *,
    cache: MixedCacheLike,
    batch: BatchLike,
    first_pos: torch.Tensor | None = None,
    drop_last: int = 0,
    ring_recent: bool = True,
    key_mean: KeyMean | None = None,
    rot_k: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``[sum(seq_lens), Hkv, d]`` keys and values: each of ``batch``'s requests' cached prefix
    as the INT2 attention kernel reads it, then its new keys/values, requests one after another.
    ``first_pos``/``drop_last``: each request's positions ``[first_pos[r], seq_len - drop_last)``
    only; ``ring_recent=False``: the ring replaces INT2 copies in the sink only. ``key_mean``: the
    INT2 keys read plus their mean turned to their positions, rotated by ``rot_k``."""
    d = k_new.shape[-1]
    sink, recent = cache.sink, cache.recent
    bs = block_size_of(cache.pages, d)
    ks, vs = [], []
    for r in range(batch.num_reqs):
        q0, q1 = int(batch.cu_q[r]), int(batch.cu_q[r + 1])
        ctx = int(batch.seq_lens[r]) - (q1 - q0)
        kp = torch.arange(ctx)
        slots = batch.block_table[r].long().cpu()[kp // bs] * bs + kp % bs
        k, v = read_int2_slots(cache.pages, slots, d, cache.param_dtype)
        if key_mean is not None:
            k = k + rotated_key_mean(key_mean, rot_k, kp)
        ring = int(batch.ring_slots[r])
        idx = window_index(kp, sink, recent)
        in_window = (kp < sink) | ((ctx - kp < recent) if ring_recent else (kp < 0))
        use = (cache.window_pos[ring].long().cpu()[idx] == kp) & in_window
        k_hi, v_hi = read_ring(cache.windows, cache.window_pages, ring, idx, k_new.shape[1], d, sink)
        k[use] = k_hi[use]
        v[use] = v_hi[use]
        lo = 0 if first_pos is None else int(first_pos[r])
        hi = max(int(batch.seq_lens[r]) - drop_last, 0)
        ks.append(torch.cat([k, k_new[q0:q1].float().cpu()])[lo:hi])
        vs.append(torch.cat([v, v_new[q0:q1].float().cpu()])[lo:hi])
    return torch.cat(ks), torch.cat(vs)
