"""Reference for ``csrc_triton/oscar_write.py``: quantize-on-write into the paged cache."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from oscar_vllm.core.key_mean import KeyMean
from oscar_vllm.core.quant import quantize_int2
from oscar_vllm.reference.paged import (
    BatchLike,
    MixedCacheLike,
    layout_views,
    ring_index,
    rotate_keys,
    rotated_key_mean,
    v_column,
    window_views,
)


def window_index(pos: torch.Tensor, sink: int, recent: int) -> torch.Tensor:
    """Index of each position in a request's window ring (see ``paged_layout``)."""
    return torch.where(pos < sink, pos, sink + (pos - sink) % recent)


def token_positions(cu_q: torch.Tensor, seq_lens: torch.Tensor, num_reqs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(request, position)`` of every scheduled token, each ``[T]`` int64."""
    cu = cu_q[: num_reqs + 1].long().cpu()
    q_lens = cu[1:] - cu[:-1]
    req = torch.repeat_interleave(torch.arange(num_reqs), q_lens)
    ctx = seq_lens[:num_reqs].long().cpu() - q_lens
    pos = ctx[req] + torch.arange(int(cu[-1])) - cu[:-1][req]
    return req, pos


def oscar_write_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    rot_k: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache: MixedCacheLike,
    batch: BatchLike,
    clip_ratio_k: float,
    clip_ratio_v: float,
    key_mean: KeyMean | None = None,
) -> None:
    """What :func:`csrc_triton.oscar_write.oscar_write` does, in place, with ``quantize_int2``
    (``batch``'s block table unread). ``key_mean``: the INT2 rows are the keys less their mean
    turned to their positions; the ring keeps the keys as they are."""
    t, hkv, d = key.shape
    sink, recent, param_dtype, num_reqs = cache.sink, cache.recent, cache.param_dtype, batch.num_reqs
    live = slot_mapping[:t].long().cpu() >= 0
    k_rot = rotate_keys(key, rot_k).to(key.device)
    req, pos = token_positions(batch.cu_q, batch.seq_lens, num_reqs)
    k_int2 = k_rot
    if key_mean is not None:
        k_int2 = k_rot.clone()
        k_int2[: len(pos)] -= rotated_key_mean(key_mean, rot_k, pos).to(k_rot.device)
    qk = quantize_int2(k_int2, clip_ratio_k, None, param_dtype)
    qv = quantize_int2(value.float(), clip_ratio_v, None, param_dtype)
    k_codes, v_codes, params = layout_views(cache.pages, d, param_dtype)
    bs = k_codes.shape[2]
    slots = slot_mapping[:t].long().cpu()[live].to(cache.pages.device)
    blk, tok = slots // bs, slots % bs
    dev = lambda x: x[live].to(cache.pages.device)  # noqa: E731
    k_codes[blk, :, tok] = dev(qk.packed)
    v_codes[blk, :, :, v_column(tok)] = dev(qv.packed)
    for i, x in enumerate((qk.scale, qk.bias, qv.scale, qv.bias)):
        params[blk, :, i, tok] = dev(x[..., 0])

    end = batch.seq_lens[:num_reqs].long().cpu()[req]
    keep = live[: len(req)] & ((pos < sink) | (pos >= end - recent))
    ring = batch.ring_slots[:num_reqs].long().cpu()[req][keep]
    idx = window_index(pos[keep], sink, recent)
    windows, window_pos = cache.windows, cache.window_pos
    k_views, v_views = window_views(windows, hkv, d, sink)
    page, slot = ring_index(cache.window_pages, ring, idx, k_views.shape[1])
    k_views[page, slot] = k_rot[: len(req)][keep].to(windows.dtype).to(windows.device)
    v_views[page, slot] = value[: len(req)][keep].to(windows.dtype).to(windows.device)
    window_pos[ring, idx] = pos[keep].to(window_pos.dtype).to(window_pos.device)


def oscar_write_decode_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    query: torch.Tensor,
    *,
    rot_k: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache: MixedCacheLike,
    batch: BatchLike,
    clip_ratio_k: float,
    clip_ratio_v: float,
    key_mean: KeyMean | None = None,
) -> torch.Tensor:
    """What :func:`csrc_triton.oscar_write.oscar_write_decode` does: a decode batch's tokens
    (token ``t`` is request ``t``: ``batch``'s ``seq_lens`` and ``ring_slots`` are read) written as
    ``oscar_write_reference`` writes them (with ``key_mean``, the pages less it); returns the
    queries ``[T, Hq, d]`` rotated (fp32, per KV head when the rotation is)."""
    t, hkv, d = key.shape
    decodes = SimpleNamespace(cu_q=torch.arange(t + 1, dtype=torch.int32), seq_lens=batch.seq_lens,
                              ring_slots=batch.ring_slots, num_reqs=t)
    oscar_write_reference(key, value, rot_k=rot_k, slot_mapping=slot_mapping, cache=cache, batch=decodes,
                          clip_ratio_k=clip_ratio_k, clip_ratio_v=clip_ratio_v, key_mean=key_mean)
    q = query.float().cpu().view(t, hkv, -1, d)
    rot = rot_k.float().cpu()
    q_rot = q @ rot if rot.dim() == 2 else torch.einsum("thgi,hij->thgj", q, rot)
    return q_rot.reshape(t, -1, d)
