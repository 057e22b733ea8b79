"""Reference for ``csrc_triton/oscar_dense_kv.py``: prefill requests' keys and values, dense."""
from __future__ import annotations

import torch

from oscar_vllm.reference.oscar_attention import read_int2_slots
from oscar_vllm.reference.oscar_write import window_index
from oscar_vllm.reference.paged import block_size_of, read_ring


def oscar_dense_kv_reference(
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cache: torch.Tensor,
    windows: torch.Tensor,
    window_pages: torch.Tensor,
    window_pos: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_q: torch.Tensor,
    ring_slots: torch.Tensor,
    num_reqs: int,
    sink: int,
    recent: int,
    param_dtype: torch.dtype = torch.float16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``[sum(seq_lens), Hkv, d]`` keys and values: each request's cached prefix as the
    INT2 attention kernel reads it, then its new keys/values, requests one after another."""
    d = k_new.shape[-1]
    bs = block_size_of(cache, d)
    ks, vs = [], []
    for r in range(num_reqs):
        q0, q1 = int(cu_q[r]), int(cu_q[r + 1])
        ctx = int(seq_lens[r]) - (q1 - q0)
        kp = torch.arange(ctx)
        slots = block_table[r].long().cpu()[kp // bs] * bs + kp % bs
        k, v = read_int2_slots(cache, slots, d, param_dtype)
        ring = int(ring_slots[r])
        idx = window_index(kp, sink, recent)
        use = (window_pos[ring].long().cpu()[idx] == kp) & ((kp < sink) | (ctx - kp < recent))
        k_hi, v_hi = read_ring(windows, window_pages, ring, idx, k_new.shape[1], d, sink)
        k[use] = k_hi[use]
        v[use] = v_hi[use]
        ks += [k, k_new[q0:q1].float().cpu()]
        vs += [v, v_new[q0:q1].float().cpu()]
    return torch.cat(ks), torch.cat(vs)
