"""Host orchestration of a batch's attention over the OSCAR mixed cache: which requests take which
kernels, and the FlashAttention passes around them.

``oscar_attention`` runs a batch as vLLM orders it: its decodes through the Triton decode kernel
(``csrc_triton.oscar_attention``), its prefill chunks through ``oscar_prefill_batch``, which takes
for each chunk over a cached prefix one of two paths:

* the dense path (``DensePrefill``, ``oscar_dense_prefill_attention``), where the backend can
  run FlashAttention: the prefix dequantized (``csrc_triton.oscar_dense_kv``) beside the chunk's
  own keys, one causal FlashAttention pass over both, in groups of requests that fit the buffers
  (``pack_requests``). That pass takes no per-key, per-query bias: no logit correction, whatever λ is;
* the INT2 prefill kernel (``oscar_prefill_attention``), merged with FlashAttention's pass over
  the chunk's own keys where the backend gives one.

``oscar_decode_read_prefill`` reads prefill chunks as decode reads the cache
(``prefill_read="decode"``): two FlashAttention passes over dense rows, merged. The Gluon decode
path (``csrc_triton.oscar_decode``) is the backend's own (``OscarAttentionImpl._forward_write_first``).
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from csrc_triton.oscar_attention import oscar_decode_attention, oscar_prefill_attention
from csrc_triton.oscar_dense_kv import KeyMeanBasis, oscar_dense_kv
from csrc_triton.paged_layout import BatchLayout, MixedCache


def oscar_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    q_rot: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cache: MixedCache,
    batch: BatchLayout,
    scale: float,
    decode_splits: int = 1,
    part_out: torch.Tensor | None = None,
    part_lse: torch.Tensor | None = None,
    own_keys_attention=None,
    prefill_has_prefix: bool = True,
    dense: DensePrefill | None = None,
    logit_correction: float = 0.0,
    key_mean: torch.Tensor | None = None,
    cos_sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """A batch as vLLM orders it: ``batch.num_decodes`` requests of one query token, then prefills.

    The decode requests go through the split decode kernel (``decode_splits``, ``part_out``,
    ``part_lse``: ``oscar_decode_attention``'s ``num_splits`` and scratch), the rest through
    ``oscar_prefill_batch`` (``own_keys_attention``, ``prefill_has_prefix``, ``dense``: its own).
    ``logit_correction``: λ for the INT2 kernels (``logit_coef``); the dense path takes none.
    ``key_mean``, ``cos_sin``: the INT2 keys' mean before RoPE and the RoPE table
    (``oscar_decode_attention``); with ``dense``, its ``mean_basis`` of the same mean.
    """
    d = batch.num_decodes  # decode requests come first and hold one token each
    if d:
        dec = slice(None, d) if d < batch.num_reqs else slice(None)
        oscar_decode_attention(
            out[dec], q[dec], q_rot[dec], k[dec], v[dec], cache=cache, batch=batch.requests(0, d), scale=scale,
            num_splits=decode_splits, part_out=part_out, part_lse=part_lse, logit_correction=logit_correction,
            key_mean=key_mean, cos_sin=cos_sin,
        )
    oscar_prefill_batch(out, q, q_rot, k, v, cache=cache, batch=batch, scale=scale,
                        own_keys_attention=own_keys_attention, prefill_has_prefix=prefill_has_prefix, dense=dense,
                        logit_correction=logit_correction, key_mean=key_mean, cos_sin=cos_sin)
    return out


def oscar_prefill_batch(
    out: torch.Tensor,
    q: torch.Tensor,
    q_rot: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cache: MixedCache,
    batch: BatchLayout,
    scale: float,
    own_keys_attention=None,
    prefill_has_prefix: bool = True,
    dense: DensePrefill | None = None,
    logit_correction: float = 0.0,
    key_mean: torch.Tensor | None = None,
    cos_sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """The prefill requests of a batch, ``[batch.num_decodes, batch.num_reqs)`` (tensors indexed as
    the whole batch's), as :func:`oscar_attention` runs them. ``own_keys_attention(q, k, v, cu_q,
    max_query_len, out) -> lse`` (FlashAttention in the backend) computes the chunks' attention to
    their own keys into ``out`` and returns its natural-log LSE ``[Hq, T]``; without it the prefill
    kernel does that part. ``prefill_has_prefix=False`` (no prefill request has cached tokens) skips
    the prefix kernel when ``own_keys_attention`` already did all there is. With ``dense``, chunks
    over a cached prefix take the dense path (``oscar_dense_prefill_attention``) instead.
    ``logit_correction``: λ for the INT2 prefill kernel; chunks that take the dense path get none
    (FlashAttention takes no per-key bias). ``key_mean``, ``cos_sin``: as for :func:`oscar_attention`."""
    if dense is not None and (key_mean is None) != (dense.mean_basis is None):
        raise ValueError("the dense prefix path reads the INT2 keys plus a key mean exactly when the INT2 kernels do: "
                         "give DensePrefill the mean's basis (oscar_dense_kv.key_mean_basis) with key_mean, or neither")
    d, num_reqs = batch.num_decodes, batch.num_reqs
    if d < num_reqs:
        pre = slice(d, None)
        prefills = batch.requests(d, num_reqs)
        if prefills.max_query_len is None and (dense is not None or own_keys_attention is not None):
            raise ValueError("FlashAttention's passes need the batch's max_query_len")
        out_p, q_p, k_p, v_p = out[pre], q[pre], k[pre], v[pre]
        if dense is not None and prefill_has_prefix:
            oscar_dense_prefill_attention(out_p, q_rot[pre], v_p, cache=cache, batch=prefills, dense=dense)
            return out
        lse = None
        if own_keys_attention is not None:
            lse = own_keys_attention(q_p, k_p, v_p, prefills.cu_q, prefills.max_query_len, out_p)
            if not prefill_has_prefix:
                return out
        oscar_prefill_attention(
            out_p, q_p, q_rot[pre], k_p, v_p, cache=cache, batch=prefills, scale=scale, self_lse=lse,
            logit_correction=logit_correction, key_mean=key_mean, cos_sin=cos_sin,
        )
    return out


@dataclass
class DensePrefill:
    """The dense path for prefill chunks over a cached prefix (``oscar_dense_kv``), from the
    backend: K/V buffers and the attention that runs over them. With ``shapes`` (the backend's)
    the buffers need only hold the longest prefill sequence, and each group of requests cuts
    them at its own rows; without, they hold ``sum(seq_lens)`` rows and are read as they are
    (exactly that long under FlashAttention: see ``oscar_dense_prefill_attention``)."""

    k_rot: torch.Tensor  # [T - num_decodes, Hkv, d] the prefill tokens' keys, rotated
    k_buf: torch.Tensor  # [rows, Hkv, d] model dtype, contiguous
    v_buf: torch.Tensor  # [rows, Hkv, d]
    max_seq_len: int  # at least the longest prefill sequence
    # (q, k, v, cu_q, cu_k, max_query_len, max_seq_len, out): causal varlen attention into out
    attention: Callable[..., None]
    # (query tokens, sequence length) of each prefill request, on the host: given, the batch runs
    # in groups of requests that fit the buffers, each cutting them at its own rows
    shapes: tuple[tuple[int, int], ...] = ()
    # key_mean "on": oscar_dense_kv's mean_basis (key_mean_basis) and RoPE table [P, d], so the
    # INT2 prefix rows are read plus their mean
    mean_basis: KeyMeanBasis | None = None
    cos_sin: torch.Tensor | None = None


def pack_requests(rows: Sequence[int], capacity: int) -> list[tuple[int, int]]:
    """Consecutive request ranges ``[lo, hi)`` covering ``rows`` (request r needs ``rows[r]``
    buffer rows), each needing at most ``capacity``: greedy, so as few launches as that order
    allows."""
    groups, lo, used = [], 0, 0
    for r, n in enumerate(rows):
        if n > capacity:
            raise ValueError(f"request {r} needs {n} dense rows, the buffers hold {capacity}")
        if used + n > capacity:
            groups.append((lo, r))
            lo, used = r, 0
        used += n
    if lo < len(rows):
        groups.append((lo, len(rows)))
    return groups


def oscar_dense_prefill_attention(
    out: torch.Tensor,
    q_rot: torch.Tensor,
    v: torch.Tensor,
    *,
    cache: MixedCache,
    batch: BatchLayout,
    dense: DensePrefill,
) -> torch.Tensor:
    """Prefill chunks as the OSCAR reference runs them: the cached prefix dequantized into
    ``dense``'s buffers beside the chunk's own keys, then one causal attention over both. Plain
    attention over dequantized keys: no logit correction (it needs a per-key, per-query bias).
    With ``dense.shapes`` the batch runs in groups of consecutive requests whose sequences fit
    the buffers (one group where all do), one after another: many prefix hits of long prompts in
    one step (a multi-turn chat's users, a hit's recomputed rings) stay on this path, not the
    INT2 kernel's."""
    if not dense.shapes:
        return _dense_prefill_group(out, q_rot, v, cache, batch, dense)
    seqs = [s for _, s in dense.shapes]
    starts = list(itertools.accumulate((q_len for q_len, _ in dense.shapes), initial=0))
    for lo, hi in pack_requests(seqs, dense.k_buf.shape[0]):
        t0, t1, rows = starts[lo], starts[hi], sum(seqs[lo:hi])
        # FlashAttention-3 loads whole 128-row key tiles and masks the rows past a sequence only in
        # the scores: their values still meet p = 0 in p @ v, and 0 * NaN is NaN. vLLM orders the
        # longest chunk last, so its last tile reaches past the group's rows: the buffers are cut
        # there (the tiles' loads then fill zeros), never left to what was written before.
        group = dataclasses.replace(dense, k_rot=dense.k_rot[t0:t1], k_buf=dense.k_buf[:rows],
                                    v_buf=dense.v_buf[:rows], max_seq_len=max(seqs[lo:hi]), shapes=())
        max_q = max(q for q, _ in dense.shapes[lo:hi])
        whole = (lo, hi) == (0, batch.num_reqs)
        part = batch._replace(max_query_len=max_q) if whole else batch.requests(lo, hi, max_q)
        _dense_prefill_group(out[t0:t1], q_rot[t0:t1], v[t0:t1], cache, part, group)
    return out


def _dense_prefill_group(out, q_rot, v, cache: MixedCache, batch: BatchLayout, dense: DensePrefill) -> torch.Tensor:
    """One launch of the dense path: ``dense``'s buffers hold every sequence of the batch."""
    cu_k = torch.zeros(batch.num_reqs + 1, dtype=torch.int32, device=batch.seq_lens.device)
    torch.cumsum(batch.seq_lens[:batch.num_reqs], 0, dtype=torch.int32, out=cu_k[1:])
    oscar_dense_kv(dense.k_buf, dense.v_buf, dense.k_rot, v, cache=cache, batch=batch, cu_k=cu_k,
                   max_seq_len=dense.max_seq_len, mean_basis=dense.mean_basis, cos_sin=dense.cos_sin)
    dense.attention(q_rot, dense.k_buf, dense.v_buf, batch.cu_q, cu_k, batch.max_query_len, dense.max_seq_len, out)
    return out


@dataclass
class DecodeReadPrefill:
    """A batch's prefill chunks read as decode reads the cache (``prefill_read="decode"``), from
    the backend: the query at position ``p`` reads the sink and ``(p - recent, p]`` in BF16 and
    everything else from the INT2 pages, its own chunk's older tokens included, so what it reads
    does not depend on where vLLM cut the prompt. Sizes are the host's (no sync)."""

    k_rot: torch.Tensor  # [T - num_decodes, Hkv, d] the prefill tokens' keys, rotated
    k_buf: torch.Tensor  # [>= rows_int2 + rows_window, Hkv, d] model dtype, contiguous
    v_buf: torch.Tensor
    rows_int2: int  # sum over requests of max(seq_len - recent, 0)
    max_int2: int  # the largest of those
    rows_window: int  # sum over requests of min(seq_len, query_len + recent - 1)
    max_window: int  # the largest min(seq_len, query_len + recent - 1)
    max_seq_len: int  # at least the longest prefill sequence
    write: Callable[[], None]  # the chunks' cache write (INT2 pages and ring)
    # (q, k, v, cu_q, cu_k, max_query_len, max_seq_len, out, return_lse, window_left) -> natural-log LSE [Hq, T]
    attention: Callable[..., torch.Tensor]
    merge: Callable[..., None]  # (out, out_a, lse_a, out_b, lse_b): two partial attentions by their LSE


def _cumulative(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape[0] + 1, dtype=torch.int32, device=x.device)
    torch.cumsum(x, 0, dtype=torch.int32, out=out[1:])
    return out


def oscar_decode_read_prefill(
    out: torch.Tensor,
    q_rot: torch.Tensor,
    v: torch.Tensor,
    *,
    cache: MixedCache,
    batch: BatchLayout,
    plan: DecodeReadPrefill,
) -> torch.Tensor:
    """Prefill chunks (the batch's prefill part, tensors indexed from its first prefill request)
    as decode reads the cache, and their write. Two FlashAttention passes over dense rows:

    1. the window: BF16 rows of positions ``[seq_len - n_b, seq_len)``, ``n_b = min(seq_len,
       query_len + recent - 1)`` (ring and chunk), filled before the write overwrites ring
       entries the chunk's first queries read; causal with ``window_left = recent - 1``: keys
       ``(p - recent, p]``;
    2. the rest, after the write: positions ``[0, seq_len - recent)`` from the INT2 pages (the
       chunk's own included), the sink from the ring; causal over those keys, which
       FlashAttention's bottom-right alignment turns into keys ``[0, p - recent]``.

    The two sets of keys never meet, so merging the passes by their LSE is one softmax over
    decode's read. Neither pass takes the logit correction (no per-key bias in FlashAttention).
    """
    num_reqs, recent, max_query_len = batch.num_reqs, cache.recent, batch.max_query_len
    if num_reqs == 0:
        return out
    if plan.rows_int2 + plan.rows_window > plan.k_buf.shape[0]:
        raise ValueError(f"the decode read needs {plan.rows_int2} + {plan.rows_window} dense rows, "
                         f"the buffers hold {plan.k_buf.shape[0]}")
    cu_q = batch.cu_q
    q_len = cu_q[1:num_reqs + 1] - cu_q[:num_reqs]
    seq = batch.seq_lens[:num_reqs]
    n_window = torch.minimum(seq, q_len + (recent - 1))
    n_int2 = (seq - recent).clamp_(min=0)
    cu_window, cu_int2 = _cumulative(n_window), _cumulative(n_int2)
    k_int2, v_int2 = plan.k_buf[:plan.rows_int2], plan.v_buf[:plan.rows_int2]
    # Each pass's buffers end at its last row: FlashAttention loads whole key tiles, and rows
    # past the batch must be out of bounds (zero-filled), never another pass's or step's rows.
    window_rows = slice(plan.rows_int2, plan.rows_int2 + plan.rows_window)
    k_win, v_win = plan.k_buf[window_rows], plan.v_buf[window_rows]
    oscar_dense_kv(k_win, v_win, plan.k_rot, v, cache=cache, batch=batch, cu_k=cu_window, max_seq_len=plan.max_seq_len,
                   first_pos=(seq - n_window).to(torch.int32))
    plan.write()
    cu = cu_q[:num_reqs + 1]
    if plan.max_int2 == 0:  # no request reaches past its window: nothing is read in 2 bits
        plan.attention(q_rot, k_win, v_win, cu, cu_window, max_query_len, plan.max_window, out, False, recent - 1)
        return out
    no_chunk = torch.zeros_like(cu)  # every position now reads as cached
    oscar_dense_kv(k_int2, v_int2, plan.k_rot, v, cache=cache, batch=batch._replace(cu_q=no_chunk), cu_k=cu_int2,
                   max_seq_len=plan.max_seq_len, drop_last=recent, ring_recent=False)
    out_win, out_int2 = torch.empty_like(out), torch.empty_like(out)
    lse_win = plan.attention(q_rot, k_win, v_win, cu, cu_window, max_query_len, plan.max_window, out_win, True,
                             recent - 1)
    lse_int2 = plan.attention(q_rot, k_int2, v_int2, cu, cu_int2, max_query_len, plan.max_int2, out_int2, True, -1)
    plan.merge(out, out_int2, lse_int2, out_win, lse_win)
    return out
