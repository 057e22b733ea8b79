"""Compile every kernel variant a server can launch, before it serves.

Triton compiles a kernel the first time it meets a new set of compile-time choices (the
launch table's warps and stages, split or not, merge or own keys, the split count's power of
two in the merge). Left to first use, that happens while requests wait, seconds per variant (the
Qwen3-8B shape's 15, the Gluon decode kernels' among them, took 32.9 s on the H200), and the
prefill-side variants are not reached by vLLM's own warm-up or graph capture (a prefix-cache
hit over many requests is the first to need the INT2 prefill kernel). The kernels leave the sizes
that change per step unspecialized (``do_not_specialize``), so these launches on scratch tensors of
one block compile exactly what serving launches. The logit correction λ is a runtime float
(Triton specializes no float): the launches here, at λ = 0, compile what serving runs at any λ.

Nothing here writes to the cache or the windows: the attention kernels only read them, and
the write kernel is given padding slots (``-1``), which it skips.
"""
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import triton

from csrc_triton import gluon_layout
from csrc_triton.oscar_attention import oscar_decode_attention, oscar_prefill_attention
from csrc_triton.oscar_decode import oscar_decode
from csrc_triton.oscar_dense_kv import KeyMeanBasis, oscar_dense_kv
from csrc_triton.oscar_write import decode_rotation, oscar_write, oscar_write_decode
from csrc_triton.paged_layout import DECODE_LAUNCH, WRITE_LAUNCH, BatchLayout, MixedCache, decode_splits, launch_bucket


def decode_variants(max_num_seqs: int, num_kv_heads: int, num_sms: int, fixed_splits: int = 0) -> dict[tuple, int]:
    """The decode launches a batch of 1..``max_num_seqs`` requests can take: ``{(num_warps,
    num_stages, splits): smallest batch that takes it}`` (the decode wrapper picks the same
    launch for that batch size; ``fixed_splits`` > 0: the split count of every batch)."""
    variants: dict[tuple, int] = {}
    for n in range(1, max_num_seqs + 1):
        key = (*launch_bucket(DECODE_LAUNCH, n)[:2], fixed_splits or decode_splits(n, num_kv_heads, num_sms))
        variants.setdefault(key, n)
    return variants


def gluon_decode_variants(max_num_seqs: int, num_kv_heads: int, num_sms: int,
                          fixed_splits: int = 0) -> dict[tuple, int]:
    """The same for ``oscar_decode``: ``{(maxnreg, prefetch, ring_cost, splits): smallest batch
    that takes it}``, ``splits`` rounded up to a power of two: the decode and merge kernels take
    the count at run time and compile per power of two (the merge's ``SPLITS_POW2``), so the
    launch at that count compiles what every count it rounds compiles."""
    variants: dict[tuple, int] = {}
    for n in range(1, max_num_seqs + 1):
        launch = gluon_layout.decode_launch(n)
        splits = fixed_splits or gluon_layout.decode_splits(n, num_kv_heads, num_sms)
        key = (launch.maxnreg, launch.prefetch, gluon_layout.decode_ring_cost(n, fixed_splits),
               triton.next_power_of_2(splits))
        variants.setdefault(key, n)
    return variants


def warm_up_kernels(
    *,
    cache: MixedCache,
    rot_k: torch.Tensor,
    num_heads: int,
    dtype: torch.dtype,
    max_num_seqs: int,
    max_num_tokens: int,
    num_sms: int,
    merge_self: bool,
    dense: bool,
    gluon: bool = False,
    decode_read: bool = False,
    fixed_splits: int = 0,
    threads: int = 1,
    logit_correction: float = 0.0,
    key_mean: dict[str, torch.Tensor] | None = None,
    decode_key_mean: dict[str, torch.Tensor] | None = None,
    dense_mean_basis: KeyMeanBasis | None = None,
) -> int:
    """Launch each kernel variant once on one-block scratch inputs; returns the launches.

    ``cache``, ``rot_k``: a layer's own (read, never written). ``dtype``: the
    model's; ``merge_self``: prefill merges FlashAttention's own-keys pass (else the INT2
    kernel attends to the chunk itself); ``dense``: the dense-prefix prefill path exists;
    ``gluon``: decode batches write first and take ``oscar_decode`` (else the Triton decode kernel);
    ``decode_read``: prefills read as decode does (the dense fills of ``oscar_decode_read_prefill``);
    ``fixed_splits`` > 0: every decode batch splits its requests that many ways (``decode_splits``).
    ``max_num_seqs`` and ``max_num_tokens`` bound the batches (requests, tokens per step).
    ``threads`` > 1: launch (so compile) that many variants at a time (``launch_all``).
    ``logit_correction``: the layer's λ (the Gluon decode compiles a variant with and without it).
    ``key_mean``: the layer's ``{"key_mean": mean, "cos_sin": table}``, the keyword arguments its Triton
    kernels take (their ``KEY_MEAN`` variants, the Gluon ones' with ``gluon``); ``decode_key_mean``:
    the layer's ``oscar_decode`` operands of it (``key_mean_operands``), which the Gluon decode takes;
    ``dense_mean_basis``: its dense fill's basis of it (``key_mean_basis``), which that fill takes with
    ``dense``.
    """
    dev = cache.pages.device
    hkv, d = cache.pages.shape[1], rot_k.shape[-1]
    i32 = dict(dtype=torch.int32, device=dev)
    mean = key_mean or {}
    if gluon and mean and decode_key_mean is None:
        raise ValueError("the Gluon decode's key-mean variants need the layer's key_mean_operands (decode_key_mean)")
    if dense and mean and dense_mean_basis is None:
        raise ValueError("the dense fill's key-mean variant needs the layer's key_mean_basis (dense_mean_basis)")

    def rows(n: int, heads: int) -> torch.Tensor:
        return torch.zeros(n, heads, d, dtype=dtype, device=dev)

    def batch(n: int, q_len: int) -> BatchLayout:
        """``n`` requests of ``q_len`` new tokens after one cached token, all in block 0, ring 0."""
        return BatchLayout(torch.zeros(n, 1, **i32), torch.full((n,), q_len + 1, **i32),
                           torch.arange(0, n * q_len + 1, q_len, **i32), torch.zeros(n, **i32), n,
                           num_decodes=n if q_len == 1 else 0, max_query_len=q_len)

    def split_parts(n: int, splits: int) -> dict:
        return dict(part_out=torch.empty(n * num_heads * splits * d, dtype=torch.float32, device=dev),
                    part_lse=torch.empty(n * num_heads * splits, dtype=torch.float32, device=dev))

    def decode_write(t: int) -> None:  # padding slots: it writes nothing
        padding = torch.full((t,), -1, dtype=torch.int64, device=dev)
        q = rows(t, num_heads)
        oscar_write_decode(rows(t, hkv), rows(t, hkv), q, q.clone(), rot_t=decode_rotation(rot_k), slot_mapping=padding,
                           cache=cache, batch=batch(t, 1), clip_idx_k=0, clip_idx_v=0, **mean)

    def gluon_decode_attention(n: int, splits: int, ring_cost: int) -> None:
        q = rows(n, num_heads)
        oscar_decode(q.clone(), q, cache=cache, batch=batch(n, 1), scale=1.0, num_splits=splits,
                     **split_parts(n, splits), logit_correction=logit_correction, ring_cost=ring_cost,
                     q=q if mean else None, key_mean=decode_key_mean if mean else None)

    def triton_decode_attention(n: int, splits: int) -> None:
        q = rows(n, num_heads)
        oscar_decode_attention(q.clone(), q, q, rows(n, hkv), rows(n, hkv), cache=cache, batch=batch(n, 1), scale=1.0,
                               num_splits=splits, **split_parts(n, splits), **mean)

    q_len = 2

    def prefill_attention() -> None:
        q = rows(q_len, num_heads)
        self_lse = torch.zeros(num_heads, q_len, dtype=torch.float32, device=dev) if merge_self else None
        oscar_prefill_attention(q.clone(), q, q, rows(q_len, hkv), rows(q_len, hkv), cache=cache, batch=batch(1, q_len),
                                scale=1.0, self_lse=self_lse, **mean)

    def dense_fill(**kw) -> None:
        cu_k = torch.tensor([0, q_len + 1], **i32)
        oscar_dense_kv(rows(q_len + 1, hkv), rows(q_len + 1, hkv), rows(q_len, hkv), rows(q_len, hkv), cache=cache,
                       batch=batch(1, q_len), cu_k=cu_k, max_seq_len=q_len + 1, **kw)

    def prefill_write(t: int) -> None:  # padding slots: it writes nothing
        padding = torch.full((t,), -1, dtype=torch.int64, device=dev)
        oscar_write(rows(t, hkv), rows(t, hkv), rot_k=rot_k, slot_mapping=padding, cache=cache, batch=batch(t, 1),
                    clip_idx_k=0, clip_idx_v=0, **mean)

    launches: list[Callable[[], None]] = []
    if gluon:
        launches += [functools.partial(decode_write, t)
                     for t in sorted(k for k in gluon_layout.DECODE_WRITE_LAUNCH if k <= max_num_seqs)]
        launches += [functools.partial(gluon_decode_attention, n, splits, ring_cost) for (_, _, ring_cost, splits), n
                     in gluon_decode_variants(max_num_seqs, hkv, num_sms, fixed_splits).items()]
    else:
        launches += [functools.partial(triton_decode_attention, n, splits)
                     for (*_, splits), n in decode_variants(max_num_seqs, hkv, num_sms, fixed_splits).items()]
    launches.append(prefill_attention)
    if dense:  # with a key mean, its variant that adds the mean back
        launches.append(functools.partial(dense_fill, mean_basis=dense_mean_basis, cos_sin=mean["cos_sin"])
                        if mean else dense_fill)
    if decode_read:  # its window's rows, and the INT2 rows after the write
        launches += [functools.partial(dense_fill, first_pos=torch.zeros(1, **i32)),
                     functools.partial(dense_fill, drop_last=cache.recent, ring_recent=False)]
    launches += [functools.partial(prefill_write, t)
                 for t in sorted(k for k in WRITE_LAUNCH if k <= max(1, max_num_tokens))]
    launch_all(launches, threads if dev.type == "cuda" else 1)
    return len(launches)


def launch_all(launches: list[Callable[[], None]], threads: int) -> None:
    """Run ``launches``, ``threads`` at a time where > 1. Triton compiles a variant mostly outside
    the GIL (its compiler passes, ptxas), so a start's variants compile side by side. Every
    thread launches on the caller's device and stream: the scratch inputs are then allocated,
    used and freed in one stream's order, as with one thread. (Triton's interpreter is not
    thread-safe: tensors on the CPU take one thread.)"""
    if threads <= 1 or len(launches) < 2:
        for launch in launches:
            launch()
        return
    device, stream = torch.cuda.current_device(), torch.cuda.current_stream()

    def on_callers_stream(launch: Callable[[], None]) -> None:
        with torch.cuda.device(device), torch.cuda.stream(stream):
            launch()

    with ThreadPoolExecutor(min(threads, len(launches)), thread_name_prefix="oscar-warm-up") as pool:
        for done in [pool.submit(on_callers_stream, launch) for launch in launches]:
            done.result()
