"""csrc_triton/warm_up.py: it leaves the cache and windows as they were, and it compiles every
variant serving launches afterwards (no Triton compile while serving): on a GPU counted in
Triton's caches, on the CPU by each launch's compile key (CompiledVariants)."""
import pytest
import torch
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.runtime.jit import JITFunction, create_function_from_signature

from csrc_triton import gluon_layout
from csrc_triton import oscar_decode as gluon_decode
from csrc_triton.gluon_layout import DECODE_LAUNCH as GLUON_DECODE_LAUNCH, FIXED_SPLITS_RING_COST
from csrc_triton.merge_splits import _merge_splits_kernel
from csrc_triton.oscar_attention import _oscar_attention_kernel
from csrc_triton.oscar_dense_kv import _oscar_dense_kv_kernel, key_mean_basis, oscar_dense_kv
from csrc_triton.oscar_write import _oscar_write_decode_kernel, _oscar_write_kernel, oscar_write
from csrc_triton.paged_layout import (
    DECODE_LAUNCH,
    WRITE_LAUNCH,
    BatchLayout,
    decode_split_rows,
    decode_splits,
    launch_bucket,
)
from csrc_triton.warm_up import decode_variants, gluon_decode_variants, launch_all, warm_up_kernels
from kernel_cases import (
    CLIP_K, CLIP_V, DEVICE, ON_GPU, KeyMeanCase, prepare, random_rotation,
)
from oscar_vllm.core.quant import clip_index
from oscar_vllm.core.settings import OscarSettings
from oscar_vllm.serving.prefill import DensePrefill, oscar_attention
from paged_sim import PagedCache

KERNELS = (_oscar_attention_kernel, _merge_splits_kernel, _oscar_dense_kv_kernel, _oscar_write_kernel)
NUM_SMS = torch.cuda.get_device_properties(0).multi_processor_count if ON_GPU else 132  # an H100 SXM's, on the CPU


def test_decode_variants_cover_every_batch_size():
    for num_sms, hkv, max_seqs in [(132, 8, 1024), (132, 1, 64), (4, 2, 40)]:
        variants = decode_variants(max_seqs, hkv, num_sms)
        assert len(variants) <= 16  # a handful of compiles, not one per batch size
        for n in range(1, max_seqs + 1):
            key = (*launch_bucket(DECODE_LAUNCH, n)[:2], decode_splits(n, hkv, num_sms))
            assert variants[key] <= n
        assert min(variants.values()) == 1


def test_fixed_splits_are_the_only_split_count_warmed_up():
    """decode_splits fixed: every batch size launches that count, Triton's decode and Gluon's."""
    fixed = decode_variants(256, 8, 132, fixed_splits=16)
    assert {splits for *_, splits in fixed} == {16}
    assert {key[:2] for key in fixed} == {key[:2] for key in decode_variants(256, 8, 132)}
    assert {splits for *_, splits in gluon_decode_variants(256, 8, 132, fixed_splits=16)} == {16}
    assert len({splits for *_, splits in gluon_decode_variants(256, 8, 132)}) > 1


def test_fixed_splits_warm_up_the_one_ring_weight_they_launch():
    """The Gluon kernel's ring weight is a compile-time constant: with decode_splits fixed every
    batch takes FIXED_SPLITS_RING_COST, so that is the only weight warmed up; else the table's."""
    fixed = gluon_decode_variants(256, 8, 132, fixed_splits=16)
    assert {ring_cost for _, _, ring_cost, _ in fixed} == {FIXED_SPLITS_RING_COST}
    chosen = gluon_decode_variants(256, 8, 132)
    assert {ring_cost for _, _, ring_cost, _ in chosen} == {launch[3] for launch in GLUON_DECODE_LAUNCH.values()}


def _layer(d=64, hkv=2, g=2, sink=4, recent=8, dtype=torch.float32):
    """A used paged cache and windows (prefixes written), plus what a layer holds."""
    pc, _, _, _, _, _ = prepare(d, hkv, g, sink, recent, [70, 3], [1, 1], dtype)
    return pc, random_rotation(d).to(DEVICE)


@pytest.mark.parametrize("dense,decode_read,key_mean", [(False, False, False), (True, False, False),
                                                       (True, True, False), (False, False, True),
                                                       (True, False, True)])
def test_warm_up_writes_nothing(dense, decode_read, key_mean):
    pc, rot = _layer()
    before = [t.clone() for t in (pc.cache, pc.windows, pc.window_pages, pc.window_pos)]
    km = KeyMeanCase(2, 64, 128)
    n = warm_up_kernels(cache=pc.mixed(), rot_k=rot, num_heads=4, dtype=torch.float32, max_num_seqs=9,
                        max_num_tokens=64, num_sms=4, merge_self=True, dense=dense, decode_read=decode_read,
                        key_mean=dict(key_mean=km.mean, cos_sin=km.table) if key_mean else None,
                        dense_mean_basis=key_mean_basis(km.mean, rot) if key_mean else None)
    # 64 tokens: one write bucket of WRITE_LAUNCH; the decode read's two dense fills
    assert n == len(decode_variants(9, 2, 4)) + 1 + dense + 2 * decode_read + 1
    for b, a in zip(before, (pc.cache, pc.windows, pc.window_pages, pc.window_pos)):
        assert torch.equal(b.view(torch.uint8), a.view(torch.uint8))  # bitwise: unused window rows are NaN


def test_warm_up_of_the_gluon_key_mean_variants_takes_the_layers_operands():
    """The Gluon decode's key-mean variants are warmed up with the operands the layer serves with:
    without them it would warm up the variants without the mean, so it refuses before any launch."""
    pc, rot = _layer()
    km = KeyMeanCase(2, 64, 128)
    with pytest.raises(ValueError, match="key_mean_operands"):
        warm_up_kernels(cache=pc.mixed(), rot_k=rot, num_heads=4, dtype=torch.bfloat16, max_num_seqs=9,
                        max_num_tokens=64, num_sms=4, merge_self=True, dense=False, gluon=True,
                        key_mean=dict(key_mean=km.mean, cos_sin=km.table))


def test_warm_up_of_the_dense_key_mean_variant_takes_the_layers_basis():
    """The dense fill's key-mean variant is warmed up with the basis the layer serves with (its
    size is a compile-time constant): without it the warm-up refuses before any launch."""
    pc, rot = _layer()
    km = KeyMeanCase(2, 64, 128)
    with pytest.raises(ValueError, match="key_mean_basis"):
        warm_up_kernels(cache=pc.mixed(), rot_k=rot, num_heads=4, dtype=torch.bfloat16, max_num_seqs=9,
                        max_num_tokens=64, num_sms=4, merge_self=True, dense=True,
                        key_mean=dict(key_mean=km.mean, cos_sin=km.table))


def _name(kernel) -> str:
    return kernel.fn.__qualname__


class CompiledVariants:
    """The variants of ``kernels`` a GPU would hold. On a GPU: Triton's compiled-kernel caches. On
    the CPU: the compile key of each launch (Triton's specialization of every argument, the
    constexprs and launch options, as an sm_90 backend makes them), recorded in place of running
    it. Either way a launch that adds one would have compiled. (The record found what the H100
    compiled while serving on 2026-12-05, variant for variant: the dense fill's unused mean-column
    pointer, the ring slots', specialized on their alignment.)"""

    def __init__(self, kernels, monkeypatch):
        self.kernels = kernels
        self.keys = {_name(k): set() for k in kernels}
        if ON_GPU:
            return
        backend = CUDABackend(GPUTarget("cuda", 90, 32))
        for kernel in kernels:
            # Under TRITON_INTERPRET a Triton kernel is an InterpretedFunction; its JITFunction twin
            # (same function, same specialization rules) binds the arguments. Gluon's are JITFunctions.
            jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
            binder = create_function_from_signature(jit.signature, jit.params, backend)

            def record(*args, grid, warmup, _binder=binder, _keys=self.keys[_name(kernel)], **kwargs):
                _, specialization, options = _binder(*args, **kwargs)
                _keys.add(repr((specialization, sorted(options.items()))))

            monkeypatch.setattr(kernel, "run", record)

    def counts(self) -> dict[str, int]:
        if not ON_GPU:
            return {name: len(keys) for name, keys in self.keys.items()}
        torch.cuda.synchronize()
        dev = torch.cuda.current_device()
        return {_name(k): len(k.device_caches[dev][0]) if dev in k.device_caches else 0 for k in self.kernels}


@pytest.mark.skipif(ON_GPU, reason="the CPU's record of compile keys (a GPU counts what it compiled)")
def test_the_record_keys_a_launch_as_triton_does(monkeypatch):
    """A pointer whose 16-byte alignment an offset breaks is a new variant; an offset on a pointer
    the kernel does not specialize on alignment (the batch metadata's) is not."""
    variants = CompiledVariants((_oscar_dense_kv_kernel,), monkeypatch)
    pc, step, _, _, k, v = prepare(64, 2, 2, 4, 8, [70, 3, 5], [1, 1, 1], torch.float32)
    cu_k = torch.nn.functional.pad(step.seq_lens.cumsum(0), (1, 0)).to(torch.int32)

    def fill(k_new, ring_slots=step.ring_slots):
        buf = [torch.empty(int(cu_k[-1]), 2, 64, device=DEVICE) for _ in range(2)]
        oscar_dense_kv(*buf, k_new, v, cache=pc.mixed(), batch=step.batch()._replace(ring_slots=ring_slots), cu_k=cu_k,
                       max_seq_len=int(step.seq_lens.max()))

    def at_offset(x, elements):  # x's values, `elements` into a fresh storage
        y = torch.empty(x.numel() + elements, dtype=x.dtype, device=x.device)[elements:].view(x.shape)
        return y.copy_(x)

    fill(k)
    fill(at_offset(k, 16))
    fill(k, at_offset(step.ring_slots, 1))
    assert variants.counts() == {_name(_oscar_dense_kv_kernel): 1}
    fill(at_offset(k, 1))
    assert variants.counts() == {_name(_oscar_dense_kv_kernel): 2}


def test_launch_all_runs_every_launch_once_in_order_on_one_thread():
    ran = []
    launch_all([lambda i=i: ran.append(i) for i in range(5)], threads=1)
    assert ran == list(range(5))
    with pytest.raises(ZeroDivisionError):
        launch_all([lambda: 1 / 0], threads=1)


WARMED_UP = KERNELS + (gluon_decode._oscar_decode_kernel, _oscar_write_decode_kernel)


@pytest.mark.skipif(not ON_GPU, reason="compiled-kernel caches exist on a GPU only")
@pytest.mark.parametrize("gluon", [True, False])
def test_warm_up_in_threads_compiles_what_one_thread_does(gluon, tmp_path, monkeypatch):
    """Each run compiles from an empty Triton cache (on disk and in memory), so the threads
    compile side by side; they must leave every kernel with the same variants, the cache as it was."""
    d, hkv, g, sink, recent = 128, 8, 4, 64, 256
    # The Gluon decode kernel reads rings of 8 entries a page, as served (the simulator defaults to 3).
    pc, _, _, _, _, _ = prepare(d, hkv, g, sink, recent, [700, 3], [1, 1], torch.bfloat16,
                                entries_per_page=8 if gluon else None)
    rot = random_rotation(d).to(DEVICE)
    before = [t.clone() for t in (pc.cache, pc.windows, pc.window_pages, pc.window_pos)]
    num_sms = NUM_SMS
    compiled = {}
    for threads in (1, 6):
        monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / f"threads{threads}"))
        for kernel in WARMED_UP:
            kernel.device_caches.clear()
        n = warm_up_kernels(cache=pc.mixed(), rot_k=rot, num_heads=hkv * g, dtype=torch.bfloat16, max_num_seqs=256,
                            max_num_tokens=8192, num_sms=num_sms, merge_self=True, dense=True, gluon=gluon,
                            decode_read=True, threads=threads)
        torch.cuda.synchronize()
        dev = torch.cuda.current_device()
        compiled[threads] = (n, {k.fn.__qualname__ + k.fn.__module__: sorted(k.device_caches[dev][0])
                                 for k in WARMED_UP})
    assert compiled[6] == compiled[1]
    assert sum(map(len, compiled[6][1].values())) >= compiled[6][0] // 2  # the launches did compile
    for b, a in zip(before, (pc.cache, pc.windows, pc.window_pages, pc.window_pos)):
        assert torch.equal(b.view(torch.uint8), a.view(torch.uint8))


class LayerLaunches:
    """A layer's kernel launches for a batch as the backend makes them: ``OscarAttentionImpl.forward``
    on the Triton kernels (attention, then the write), ``_forward_write_first`` on the Gluon ones
    (the decode write and decode, then the prefills over their slices of the batch); prefills with
    and without the dense path. Qwen3-8B's shape, with or without a key mean; ``fixed_splits``: the
    ``decode_splits`` setting (0: a count per batch size); ``merge_self``: prefills merge
    FlashAttention's pass over their own keys (16-bit models); ``decode_read``: the warm-up
    compiles the fills of ``prefill_read`` "decode"."""

    d, hkv, g, sink, recent, max_seqs, max_tokens = 128, 8, 4, 64, 256, 64, 8192

    def __init__(self, gluon: bool, km: KeyMeanCase | None = None, max_seqs: int | None = None,
                 fixed_splits: int = 0, dtype: torch.dtype = torch.bfloat16, merge_self: bool = True,
                 decode_read: bool = False):
        from csrc_triton.oscar_write import decode_rotation

        self.gluon, self.km, self.max_seqs, self.fixed_splits = gluon, km, max_seqs or self.max_seqs, fixed_splits
        self.dtype, self.merge_self, self.decode_read = dtype, merge_self, decode_read
        self.rot = random_rotation(self.d).to(DEVICE)
        self.rot_t = decode_rotation(self.rot)
        self.mean = dict(key_mean=km.mean, cos_sin=km.table) if km else {}
        self.lam = OscarSettings().logit_correction_for(key_mean=km is not None)  # what the layer serves
        self.basis = dict(mean_basis=key_mean_basis(km.mean, self.rot), cos_sin=km.table) if km else {}
        self.operands = km.operands() if km and gluon else None
        # The Gluon decode's splits fill whole waves: its scratch has more rows than the Triton one's.
        rows = self.max_seqs * fixed_splits or (gluon_layout.decode_split_rows if gluon else decode_split_rows)(
            self.max_seqs, self.hkv, NUM_SMS)
        hq = self.hkv * self.g
        self.part_out = torch.empty(rows * hq * self.d, dtype=torch.float32, device=DEVICE)
        self.part_lse = torch.empty(rows * hq, dtype=torch.float32, device=DEVICE)
        self.clips, self.scale = (clip_index(CLIP_K, self.d), clip_index(CLIP_V, self.d)), self.d ** -0.5

    def warm_up(self, pc) -> None:
        warm_up_kernels(cache=pc.mixed(), rot_k=self.rot, num_heads=self.hkv * self.g, dtype=self.dtype,
                        max_num_seqs=self.max_seqs, max_num_tokens=self.max_tokens, num_sms=NUM_SMS,
                        merge_self=self.merge_self, dense=True, gluon=self.gluon, decode_read=self.decode_read,
                        logit_correction=self.lam, key_mean=self.mean or None,
                        decode_key_mean=self.operands, dense_mean_basis=self.basis.get("mean_basis"),
                        fixed_splits=self.fixed_splits)

    def splits(self, nd: int) -> int:  # the builder's count (OscarAttentionMetadataBuilder)
        kernel = gluon_layout.decode_splits if self.gluon else decode_splits
        return self.fixed_splits or kernel(nd, self.hkv, NUM_SMS)

    def dense(self, k_prefill, rows: int, max_seq_len: int, shapes=()) -> DensePrefill:
        buf = [torch.empty(rows, self.hkv, self.d, dtype=self.dtype, device=DEVICE) for _ in range(2)]
        return DensePrefill((k_prefill.float() @ self.rot).to(self.dtype), *buf, max_seq_len,
                            lambda *args: None, shapes, **self.basis)

    def serve(self, pc, step, q, q_rot, k, v, nd: int, dense: DensePrefill | None = None) -> None:
        from csrc_triton.oscar_write import oscar_write_decode
        from oscar_vllm.serving.prefill import oscar_prefill_batch

        num_reqs, t = len(step.seq_lens), int(step.cu_q[-1])
        cache = pc.mixed()
        batch = BatchLayout(step.block_table, step.seq_lens, step.cu_q, step.ring_slots, num_reqs, nd,
                            step.max_query_len)
        clips = dict(clip_idx_k=self.clips[0], clip_idx_v=self.clips[1])
        out = torch.empty_like(q)

        def own_keys(q_p, k_p, v_p, cu, max_q, out_p):
            return torch.zeros(q_p.shape[1], q_p.shape[0], dtype=torch.float32, device=DEVICE)

        own = own_keys if self.merge_self else None
        splits = dict(part_out=self.part_out, part_lse=self.part_lse)
        if not self.gluon:
            for dense_path in (None, dense) if nd < num_reqs else (None,):
                oscar_attention(out, q, q_rot, k, v, cache=cache, batch=batch, scale=self.scale,
                                decode_splits=self.splits(nd), **splits, own_keys_attention=own,
                                prefill_has_prefix=True, dense=dense_path, logit_correction=self.lam, **self.mean)
            oscar_write(k, v, rot_k=self.rot, slot_mapping=step.slot_mapping, cache=cache, batch=batch, **clips,
                        **self.mean)
            return
        if nd:
            decodes = batch.requests(0, nd)
            oscar_write_decode(k[:nd], v[:nd], q[:nd], q_rot[:nd], rot_t=self.rot_t,
                               slot_mapping=step.slot_mapping[:nd], cache=cache, batch=decodes, **clips, **self.mean)
            gluon_decode.oscar_decode(
                out[:nd], q_rot[:nd], cache=cache, batch=decodes, scale=self.scale, num_splits=self.splits(nd),
                **splits, logit_correction=self.lam, ring_cost=gluon_layout.decode_ring_cost(nd, self.fixed_splits),
                q=q[:nd] if self.km else None, key_mean=self.operands)
        if nd < num_reqs:
            for dense_path in (None, dense):
                oscar_prefill_batch(out, q, q_rot, k, v, cache=cache, batch=batch, scale=self.scale,
                                    own_keys_attention=own, prefill_has_prefix=True, dense=dense_path,
                                    logit_correction=self.lam, **self.mean)
            oscar_write(k[nd:t], v[nd:t], rot_k=self.rot, slot_mapping=step.slot_mapping[nd:t], cache=cache,
                        batch=batch.requests(nd, num_reqs), **clips, **self.mean)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_serving_after_warm_up_compiles_nothing(dtype, monkeypatch):
    """``LayerLaunches`` on the Triton kernels in bf16 and fp32 (fp32: no FlashAttention, so no
    own-keys pass to merge) and, in bf16, the decode read's dense fills (``prefill_read``
    "decode"): decodes of many sizes (1, 16, 33: Triton's ==1 and %16 size classes), prefills over
    a prefix with and without the dense path, mixed batches; served with the logit correction on,
    warmed up without (a runtime float, no variant)."""
    layer = LayerLaunches(False, dtype=dtype, merge_self=dtype != torch.float32, decode_read=dtype != torch.float32)
    batches = [([5000 if n < 16 else 300] * n, [1] * n) for n in (1, 2, 16, 33, 48)]
    batches += [([0, 700], [1000, 37]), ([900, 3000, 16], [1, 300, 2049]), ([4095, 64, 1], [1, 1, 17])]
    pcs = [prepare(layer.d, layer.hkv, layer.g, layer.sink, layer.recent, prefix, new, dtype, seed=i)
           for i, (prefix, new) in enumerate(batches)]
    variants = CompiledVariants(KERNELS, monkeypatch)
    layer.warm_up(pcs[0][0])
    compiled = variants.counts()
    for (prefix, new), (pc, step, q, q_rot, k, v) in zip(batches, pcs):
        nd, num_reqs = next((i for i, n in enumerate(new) if n > 1), len(new)), len(new)
        max_seq = max(p + n for p, n in zip(prefix, new))
        layer.serve(pc, step, q, q_rot, k, v, nd, layer.dense(k[nd:], sum(prefix) + sum(new), max_seq))
        if layer.decode_read and nd < num_reqs:  # the decode read's fills
            pre = slice(nd, num_reqs)
            cu = step.cu_q[nd:] - step.cu_q[nd]
            seq, q_len = step.seq_lens[pre], cu[1:] - cu[:-1]
            buf = [torch.empty(2 * (sum(prefix) + sum(new)), layer.hkv, layer.d, dtype=dtype, device=DEVICE)
                   for _ in range(2)]
            fills = [(cu, dict(first_pos=(seq - torch.minimum(seq, q_len + layer.recent - 1)).to(torch.int32))),
                     (torch.zeros_like(cu), dict(drop_last=layer.recent, ring_recent=False))]
            for cu_q, kw in fills:
                batch = BatchLayout(step.block_table[pre], seq, cu_q, step.ring_slots[pre], num_reqs - nd)
                oscar_dense_kv(*buf, k[nd:], v[nd:], cache=pc.mixed(), batch=batch, cu_k=cu, max_seq_len=max_seq, **kw)
    assert variants.counts() == compiled, f"compiled while serving: {compiled} -> {variants.counts()} ({WRITE_LAUNCH=})"


@pytest.mark.parametrize("key_mean", [False, True], ids=["plain", "key_mean"])
@pytest.mark.parametrize("gluon", [False, True], ids=["triton", "gluon"])
def test_serving_each_decode_path_after_warm_up_compiles_nothing(gluon, key_mean, monkeypatch):
    """``LayerLaunches`` on each decode path, with and without a key mean (its KEY_MEAN variants):
    decodes of many batch sizes, prefills over a prefix, mixed batches. The warm-up compiled all
    of them."""
    layer = LayerLaunches(gluon, KeyMeanCase(8, 128, 16384) if key_mean else None)
    batches = [([5000 if n < 16 else 300] * n, [1] * n) for n in (1, 2, 16, 33, 48)]
    batches += [([900, 3000, 16], [1, 300, 2049]), ([4095, 64, 1], [1, 1, 17])]
    pcs = [prepare(layer.d, layer.hkv, layer.g, layer.sink, layer.recent, prefix, new, layer.dtype, seed=i,
                   key_mean=layer.km, entries_per_page=8 if gluon else None) for i, (prefix, new) in enumerate(batches)]
    variants = CompiledVariants(WARMED_UP, monkeypatch)
    layer.warm_up(pcs[0][0])
    compiled = variants.counts()
    for (prefix, new), (pc, step, q, q_rot, k, v) in zip(batches, pcs):
        nd = next((i for i, n in enumerate(new) if n > 1), len(new))
        dense = layer.dense(k[nd:], sum(prefix) + sum(new), max(p + n for p, n in zip(prefix, new)))
        layer.serve(pc, step, q, q_rot, k, v, nd, dense)
    assert variants.counts() == compiled, f"compiled while serving: {compiled} -> {variants.counts()}"


@pytest.mark.skipif(ON_GPU, reason="the CPU record of compile keys (its launches read no cache it wrote)")
@pytest.mark.parametrize("gluon", [False, True], ids=["triton", "gluon"])
def test_every_prefill_chunk_size_after_warm_up_compiles_nothing(gluon, monkeypatch):
    """Chunks of every size class up to vLLM's 8,192 batched tokens (the write's launch buckets,
    Triton's ==1 and %16 classes, block and window edges), three prefills a batch with and without
    decodes before them, the dense path in groups of requests as the backend cuts it (buffers for
    the longest sequence: each group reads its own slice of the metadata, at any int32 offset)."""
    layer = LayerLaunches(gluon)
    prefix = [700, 64, 5000]
    pc = PagedCache(8, max(prefix) + 8192 + 1, layer.hkv, layer.d, layer.sink, layer.recent, DEVICE,
                    **({"entries_per_page": 8} if gluon else {}))
    variants = CompiledVariants(WARMED_UP, monkeypatch)
    layer.warm_up(pc)
    compiled = variants.counts()
    chunks = [(c, 3) for c in (1, 2, 15, 16, 17, 63, 64, 65, 255, 256, 257, 320, 321, 1000, 2047, 2048, 2049, 2700)]
    chunks += [(8192, 1), (8187, 1)]
    for chunk, prefills in chunks:
        for nd in (0, 5):
            if nd + chunk * prefills > layer.max_tokens:
                continue
            pc.done = [300] * nd + prefix[:prefills] + [0] * (8 - nd - prefills)
            step = pc.schedule({**{r: 1 for r in range(nd)}, **{nd + r: chunk for r in range(prefills)}})
            t = int(step.cu_q[-1])
            q = torch.empty(t, layer.hkv * layer.g, layer.d, dtype=layer.dtype, device=DEVICE)
            k, v = (torch.empty(t, layer.hkv, layer.d, dtype=layer.dtype, device=DEVICE) for _ in range(2))
            shapes = tuple((chunk, p + chunk) for p in prefix[:prefills])
            dense = layer.dense(k[nd:], max(s for _, s in shapes), max(s for _, s in shapes), shapes)
            layer.serve(pc, step, q, q.clone(), k, v, nd, dense)
    assert variants.counts() == compiled, f"compiled while serving: {compiled} -> {variants.counts()}"


@pytest.mark.skipif(ON_GPU, reason="the CPU record of compile keys (its launches share rings: a GPU would race)")
@pytest.mark.parametrize("fixed_splits", [0, 16], ids=["per-batch-splits", "fixed-splits"])
@pytest.mark.parametrize("gluon", [False, True], ids=["triton", "gluon"])
def test_every_decode_batch_size_after_warm_up_compiles_nothing(gluon, fixed_splits, monkeypatch):
    """Decode batches of every size from 1 to vLLM's default max_num_seqs (1,024), through
    ``LayerLaunches``, take only variants the warm-up compiled: each size's launch bucket, split
    count and ring weight among them, or with ``decode_splits`` fixed (batch-invariant serving) its
    one count and ring weight. The record runs no kernel, so the requests share four rings and
    their blocks."""
    from types import SimpleNamespace

    layer = LayerLaunches(gluon, max_seqs=1024, fixed_splits=fixed_splits)
    n_max = layer.max_seqs
    pc = PagedCache(4, 130, layer.hkv, layer.d, layer.sink, layer.recent, DEVICE,
                    **({"entries_per_page": 8} if gluon else {}))
    variants = CompiledVariants(WARMED_UP, monkeypatch)
    layer.warm_up(pc)
    compiled = variants.counts()
    q = torch.empty(n_max, layer.hkv * layer.g, layer.d, dtype=layer.dtype, device=DEVICE)
    k, v = (torch.empty(n_max, layer.hkv, layer.d, dtype=layer.dtype, device=DEVICE) for _ in range(2))
    which = torch.arange(n_max, device=DEVICE) % 4
    block_table = pc.block_table[which]
    batch = dict(block_table=block_table, seq_lens=torch.full((n_max,), 129, dtype=torch.int32, device=DEVICE),
                 slot_mapping=block_table[:, 2].long() * pc.block_size, ring_slots=pc.ring_slots.to(DEVICE)[which])
    cu_q = torch.arange(n_max + 1, dtype=torch.int32, device=DEVICE)
    for n in range(1, n_max + 1):
        step = SimpleNamespace(cu_q=cu_q[:n + 1], max_query_len=1, **{key: x[:n] for key, x in batch.items()})
        layer.serve(pc, step, q[:n], q[:n], k[:n], v[:n], n)
    assert variants.counts() == compiled, f"compiled while serving: {compiled} -> {variants.counts()}"
