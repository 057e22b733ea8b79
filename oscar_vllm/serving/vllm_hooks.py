"""What the OSCAR backend does where it reaches into vLLM 0.26.0 beyond the attention backend
interface: the wrappers of the hooks ``oscar_vllm.serving.hooks`` declares (each one's target, the
parameters it reads by name, and when it is installed are there), and the work they do:

* ``kv-cache-spec``, ``Attention.get_kv_cache_spec`` (``report_int2_pages``): OSCAR layers report
  INT2 pages (a ``TQFullAttentionSpec`` whose slot is ``int2_slot_bytes(d)``), so vLLM sizes the KV
  cache by the real page.
* ``scheduler-window-pages``, ``Scheduler.__init__`` (``give_window_pages_to_schedulers``): the
  scheduler of an OSCAR engine gives every request the pages of its BF16 window ring from its own
  block pool (``oscar_vllm.serving.window_pages``) and says which.
* ``new-rows-window-pages`` and ``batch-rows``, V2 model runner, ``GPUModelRunner.add_requests``
  and ``DefaultModelState.prepare_attn``: a new request's row gets its window pages and an empty
  ring; each batch's rows go to the builders.
* ``weight-fold``, ``process_weights_after_loading`` as ``BaseModelLoader.load_model`` calls it:
  load the rotations, fold the value rotation into the weights, hand each layer its key rotation.
* ``kernel-warm-up``, V2 model runner, ``GPUModelRunner.initialize_kv_cache``: once the cache
  exists, compile every kernel variant serving can launch (``warm_up_kernels``), before graph capture.

Each wrapper factory takes ``(original, read)``: ``read(args, kwargs)`` gives the arguments its
hook names, by name, from a call however vLLM passes them. Each wrapper passes a call on another
backend's layer, builder or engine through as it came.

This module never imports ``oscar_vllm.serving.backend`` (the backend imports it): it knows OSCAR
layers by their backend's name. It imports the kernels' package only where it uses it, so an
engine process that only schedules loads no Triton.
"""
from __future__ import annotations

import logging
import time

import torch

from oscar_vllm.core.fold import RotationFoldError
from oscar_vllm.core.settings import BACKEND_NAME, BACKEND_PATH, OscarSettings, OscarSettingsError
from oscar_vllm.serving.window_pages import WindowPageAllocator, attach_to_scheduler, pages_of_new_requests

# Under vLLM's logger, so its handlers show what the backend loaded.
logger = logging.getLogger("vllm.oscar_vllm")
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")


def is_oscar_layer(layer) -> bool:
    """An attention layer (or a layer's backend class) that runs on the OSCAR backend."""
    backend = getattr(layer, "attn_backend", None)
    return backend is not None and backend.get_name() == BACKEND_NAME


def oscar_builders(attn_groups) -> list:
    """``(attention group, metadata builder)`` of every OSCAR group of a model runner."""
    return [(g, b) for groups in attn_groups for g in groups if g.backend.get_name() == BACKEND_NAME
            for b in g.metadata_builders]


def engine_uses_oscar(vllm_config) -> bool:
    backend = vllm_config.attention_config.backend
    return backend is not None and backend.get_path() == BACKEND_PATH


def oscar_kv_cache_spec(layer, vllm_config):
    from vllm.v1.kv_cache_interface import TQFullAttentionSpec

    from csrc_triton.paged_layout import int2_slot_bytes

    return TQFullAttentionSpec(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=layer.num_kv_heads,
        head_size=layer.head_size,
        head_size_v=layer.head_size,
        dtype=torch.uint8,
        tq_slot_size=int2_slot_bytes(layer.head_size),
    )


def scheduler_blocks(pages: int, ratio: int) -> int:
    """Scheduler blocks that hold ``pages`` kernel blocks, ``ratio`` to a scheduler block."""
    return -(-pages // ratio)


def window_pages_of_group(spec, settings: OscarSettings) -> tuple[int, int, int]:
    """``(sink, recent, ratio)``: scheduler blocks of a ring's sink and of its recent window, and
    kernel blocks (pages) per scheduler block (a ``--block-size`` above 64 splits each scheduler
    block into several)."""
    from csrc_triton.paged_layout import BLOCK_SIZE, window_pages_per_request

    ratio = spec.block_size // BLOCK_SIZE
    pages, sink = window_pages_per_request(settings.sink_size, settings.recent_size, spec.num_kv_heads,
                                           spec.head_size)
    return scheduler_blocks(sink, ratio), scheduler_blocks(pages - sink, ratio), ratio


def give_scheduler_window_pages(scheduler) -> WindowPageAllocator:
    """The scheduler of an OSCAR engine allocates each request's window pages; logs their cost."""
    groups = scheduler.kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise NotImplementedError("OSCAR serves models whose attention layers form one KV cache group, "
                                  f"not {len(groups)}")
    spec = groups[0].kv_cache_spec
    settings = OscarSettings.from_vllm_config(scheduler.vllm_config)
    sink_pages, recent_pages, _ = window_pages_of_group(spec, settings)
    allocator = attach_to_scheduler(scheduler, sink_pages, recent_pages, settings.sink_size, settings.recent_size,
                                    reuse_rings=settings.hit_ring == "reuse")
    pages = sink_pages + recent_pages
    blocks = scheduler.kv_cache_config.num_blocks
    max_seqs = scheduler.vllm_config.scheduler_config.max_num_seqs
    page_bytes = spec.page_size_bytes * len(groups[0].layer_names)

    def tokens_with(n: int) -> int:
        return max(0, blocks - 1 - n * pages) * spec.block_size

    logger.info(
        "OSCAR: each running request's BF16 windows (sink %d + recent %d) take %d KV blocks (%.1f MiB), from the "
        "KV cache pool while it runs (the sink's %d are shared by requests that hit its prefix in the prefix cache); "
        "the pool's %d blocks hold %d tokens with 32 requests running, %d with 256, %d with all %d (max_num_seqs)",
        settings.sink_size, settings.recent_size, pages, pages * page_bytes / 2**20, sink_pages, blocks,
        tokens_with(32), tokens_with(256), tokens_with(max_seqs), max_seqs,
    )
    return allocator


def give_window_pages_to_schedulers(original, read):
    """Hook ``scheduler-window-pages``: an OSCAR engine's scheduler, once built, gives its requests
    window pages (``give_scheduler_window_pages``)."""

    def __init__(*args, **kwargs):
        original(*args, **kwargs)
        scheduler, = read(args, kwargs)
        if engine_uses_oscar(scheduler.vllm_config):
            give_scheduler_window_pages(scheduler)

    return __init__


def report_int2_pages(original, read):
    """Hook ``kv-cache-spec``: an OSCAR layer's KV-cache spec is its INT2 page (``oscar_kv_cache_spec``)."""

    def get_kv_cache_spec(*args, **kwargs):
        layer, vllm_config = read(args, kwargs)
        if is_oscar_layer(layer):
            return oscar_kv_cache_spec(layer, vllm_config)
        return original(*args, **kwargs)

    return get_kv_cache_spec


def assign_new_rows_window_pages(original, read):
    """Hook ``new-rows-window-pages``: the rows of the requests a step adds get their window pages
    (``assign_window_pages``)."""

    def add_requests(*args, **kwargs):
        original(*args, **kwargs)
        assign_window_pages(*read(args, kwargs))

    return add_requests


def give_builders_batch_rows(original, read):
    """Hook ``batch-rows``: every OSCAR metadata builder learns the request rows of the batch it
    builds for (``batch_rows``), before vLLM builds its metadata."""

    def prepare_attn(*args, **kwargs):
        input_batch, attn_groups = read(args, kwargs)
        for _, builder in oscar_builders(attn_groups):
            builder.batch_rows = input_batch.idx_mapping
        return original(*args, **kwargs)

    return prepare_attn


def fold_rotations_after_loading(original, read):
    """Hook ``weight-fold``: once vLLM has processed the loaded weights, ``prepare_model``."""

    def process_weights_after_loading(*args, **kwargs):
        original(*args, **kwargs)
        model, = read(args, kwargs)
        prepare_model(model)

    return process_weights_after_loading


def warm_up_after_kv_cache(original, read):
    """Hook ``kernel-warm-up``: once the KV cache exists, ``warm_up_layers``."""

    def initialize_kv_cache(*args, **kwargs):
        original(*args, **kwargs)
        runner, = read(args, kwargs)
        warm_up_layers(runner)

    return initialize_kv_cache


def kernel_pages(blocks: list[int], ratio: int, count: int) -> list[int]:
    """The first ``count`` kernel blocks of scheduler ``blocks`` of ``ratio`` kernel blocks each."""
    return [b * ratio + i for b in blocks for i in range(ratio)][:count]


def assign_window_pages(runner, scheduler_output) -> None:
    """Give the rows of this step's new (and resumed) requests their window pages, as kernel
    block ids, in every OSCAR builder; their rings start empty but for a cached sink and the
    positions a ring copied from an earlier request holds."""
    from csrc_triton.paged_layout import BLOCK_SIZE

    builders = oscar_builders(runner.attn_groups)
    new = [r.req_id for r in scheduler_output.scheduled_new_reqs]
    if not builders or not new:
        return
    given = pages_of_new_requests(scheduler_output, new)
    rows = [runner.req_states.req_id_to_index[r] for r in new]
    for group, builder in builders:
        ratio = group.kv_cache_spec.block_size // BLOCK_SIZE
        if given is None:  # vLLM's start-up warm-up: the null block
            pages, shared, rings = [[0] * builder.pages_per_ring for _ in new], [False] * len(new), None
        else:
            sink_blocks = scheduler_blocks(builder.sink_pages, ratio)
            recent_pages = builder.pages_per_ring - builder.sink_pages
            pages = [kernel_pages(given[r][0][:sink_blocks], ratio, builder.sink_pages)
                     + kernel_pages(given[r][0][sink_blocks:], ratio, recent_pages) for r in new]
            shared = [given[r][1] for r in new]
            rings = [None if given[r][2] is None
                     else (*given[r][2][:2], kernel_pages(given[r][2][2], ratio, recent_pages))
                     for r in new]
        builder.assign_windows(rows, pages, runner.kv_cache_config.num_blocks * ratio, allow_null=given is None,
                               sink_shared=shared, rings=rings)


def oscar_attention_blocks(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """``(layer id, self-attention block)`` for every OSCAR layer; refuses layers it cannot fold."""
    from vllm.model_executor.models.utils import extract_layer_index

    blocks, seen = [], set()
    for module in model.modules():
        attn = getattr(module, "attn", None)
        if attn is not None and is_oscar_layer(attn):
            if not (hasattr(module, "qkv_proj") and hasattr(module, "o_proj")):
                raise NotImplementedError(
                    f"OSCAR cannot fold the value rotation into {type(module).__name__}: "
                    "it needs a fused qkv_proj and an o_proj (Llama, Qwen2, Qwen3, Qwen3-MoE)"
                )
            blocks.append((extract_layer_index(attn.layer_name), module))
            seen.add(id(attn.impl))
    for module in model.modules():
        if is_oscar_layer(module) and id(module.impl) not in seen:
            raise NotImplementedError(f"OSCAR layer {module.layer_name} is not inside a self-attention block "
                                      "it can fold")
    return sorted(blocks, key=lambda b: b[0])


def prepare_model(model: torch.nn.Module) -> None:
    """Give every OSCAR layer its key rotation and clip ratios; fold the value rotations."""
    from vllm.config import get_current_vllm_config
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    from oscar_vllm.core.fold import fold_value_rotation, kv_heads_of_shard, per_head
    from oscar_vllm.core.rotation_io import KEY, VALUE, ModelShape
    from oscar_vllm.serving.rotation_source import rotations_in_process

    blocks = oscar_attention_blocks(model)
    if not blocks:
        return
    prepared = [layer_id for layer_id, block in blocks if block.attn.impl.rot_k is not None]
    if prepared:
        raise RotationFoldError(
            f"OSCAR layers {prepared[:4]} already hold their rotations: folding the value rotation again would "
            "rotate the weights twice (vLLM reloading weights into a running OSCAR engine is not supported)"
        )
    vllm_config = get_current_vllm_config()
    hf_config = vllm_config.model_config.hf_text_config
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"the OSCAR backend serves {', '.join(SUPPORTED_MODEL_TYPES)} models, not {hf_config.model_type!r}"
        )
    settings = OscarSettings.from_vllm_config(vllm_config)
    shape = ModelShape.from_hf_config(hf_config, vllm_config.model_config.model)
    tp_size, tp_rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    rotations = rotations_in_process(settings, shape, worker=f"vLLM worker (tensor-parallel rank {tp_rank})")
    kv_heads = kv_heads_of_shard(shape.num_kv_heads, tp_size, tp_rank)
    rope_tables = rope_tables_for_key_means(settings, rotations.key_means is not None, blocks)
    for layer_id, block in blocks:
        qkv, o = block.qkv_proj, block.o_proj
        for proj in (qkv, o):
            if type(proj.quant_method).__name__ != "UnquantizedLinearMethod":
                raise NotImplementedError(
                    f"OSCAR folds the value rotation into bf16/fp16 weights; layer {layer_id} "
                    f"{type(proj).__name__} is quantized ({type(proj.quant_method).__name__})"
                )
        impl = block.attn.impl
        fold_value_rotation(qkv.weight.data, None if qkv.bias is None else qkv.bias.data, o.weight.data,
                            per_head(rotations.value.rotations[layer_id], kv_heads), impl.num_heads,
                            impl.head_size)
        rot_k = rotations.key.rotations[layer_id]
        if rot_k.dim() == 3:
            rot_k = rot_k[kv_heads]
        impl.set_layer(
            layer_id,
            rot_k,
            settings.clip_ratio_k or rotations.clip_ratio(KEY, layer_id),
            settings.clip_ratio_v or rotations.clip_ratio(VALUE, layer_id),
        )
        if rope_tables is not None:
            impl.set_key_mean(rotations.key_means[layer_id][kv_heads], rope_tables[layer_id])
    dense_bytes = give_dense_prefill_buffers([b.attn.impl for _, b in blocks], vllm_config)
    if settings.prefill_read == "decode" and not dense_bytes:
        raise OscarSettingsError(
            "prefill_read 'decode' runs on FlashAttention over dense prefill buffers, which this model does not "
            "get (layers of different shapes, or no FlashAttention build); serve it with prefill_read 'chunk'")
    logger.info(
        "OSCAR: %d layers, rotations %s (%s), sink %d, recent %d, scales %s, key means %s, logit correction %g; "
        "dense prefill buffers %.2f GiB", len(blocks), settings.rotation_path, rotations.source_format,
        settings.sink_size, settings.recent_size, settings.scale_dtype, "on" if rope_tables is not None else "off",
        settings.logit_correction_for(key_mean=rope_tables is not None), dense_bytes / 2**30,
    )


def rope_tables_for_key_means(settings: OscarSettings, have_means: bool,
                              blocks: list) -> dict[int, torch.Tensor] | None:
    """Each layer's RoPE table (``rope_table_of``) where the model serves key means: with
    ``key_mean`` "on" (a model whose RoPE cannot take them is refused), or "auto" where the
    rotations have means (``have_means``), ``prefill_read`` is "chunk" and every layer's RoPE takes
    them; else None (the keys as they are)."""
    if settings.key_mean == "off":
        return None
    if settings.key_mean == "auto" and not have_means:
        logger.warning("OSCAR: the rotations %s have no key means (published RotationZoo files have none), so the "
                       "INT2 keys are rounded as they are, at about a point more perplexity (docs/quality.md); "
                       "`oscar-calibrate --model-path MODEL --from-rotations %s --output-dir DIR` adds them (and "
                       "fitted clip ratios) in minutes",
                       settings.rotation_path, settings.rotation_path)
        return None
    if settings.key_mean == "auto" and settings.prefill_read != "chunk":
        logger.info("OSCAR: key_mean 'auto' serves the keys as they are with prefill_read %r", settings.prefill_read)
        return None
    shared: dict[int, torch.Tensor] = {}
    try:
        return {layer_id: rope_table_of(block, layer_id, block.attn.impl.head_size, shared)
                for layer_id, block in blocks}
    except OscarSettingsError as e:
        if settings.key_mean == "on":
            raise
        logger.info("OSCAR: key_mean 'auto' serves the keys as they are: %s", e)
        return None


def rope_table_of(block: torch.nn.Module, layer_id: int, head_size: int,
                  cache: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """fp32 ``[P, d]``: the RoPE table a self-attention block turns its keys with, from vLLM's own
    fp32 computation of its ``cos_sin_cache`` (each position's d/2 cosines, then its sines: the
    buffer itself is in the model's dtype), where it is the rotate-half form over the whole head
    that key means take; else an error naming the layer. The kernels read its rows at blocks'
    first positions and the block mean its first block's rows (``served_block_mean``). ``cache``:
    tables already built, by rotary embedding (vLLM shares one among the layers that have the same)."""
    rotary = getattr(block, "rotary_emb", None)
    table = getattr(rotary, "cos_sin_cache", None)
    if (table is None or not getattr(rotary, "is_neox_style", False) or getattr(rotary, "rotary_dim", None) != head_size
            or table.dim() != 2 or table.shape[-1] != head_size):
        raise OscarSettingsError(
            f"key_mean 'on' needs rotate-half RoPE over all {head_size} dims of a head, with vLLM's cos_sin_cache; "
            f"layer {layer_id}'s {type(rotary).__name__} is not that (serve this model with key_mean 'off')")
    if cache is not None and id(rotary) in cache:
        return cache[id(rotary)]
    exact = rotary._compute_cos_sin_cache() if hasattr(rotary, "_compute_cos_sin_cache") else table
    if exact.shape != table.shape:
        exact = table
    exact = exact.float().to(table.device).contiguous()
    if not bool((exact[0, : head_size // 2].abs() > 0).all()):
        raise OscarSettingsError(f"key_mean 'on': layer {layer_id}'s {type(rotary).__name__} table has a zero in its "
                                 "first row, where each pair's scale must be (serve this model with key_mean 'off')")
    if cache is not None:
        cache[id(rotary)] = exact
    return exact


def give_dense_prefill_buffers(impls: list, vllm_config) -> int:
    """One pair of dense K/V buffers for every layer (layers run one after another), sized for a
    longest request plus a full chunk of others: ``max_model_len + max_num_batched_tokens``
    rows. Allocated at load time, so vLLM's memory profiler counts them. Returns their bytes."""
    shapes = {(impl.num_kv_heads, impl.head_size) for impl in impls}
    if any(impl.flash_attention is None for impl in impls) or len(shapes) != 1:
        return 0  # no FlashAttention (fp32 models) or layers of different shapes: the INT2 kernel
    (hkv, d), = shapes
    rows = vllm_config.model_config.max_model_len + vllm_config.scheduler_config.max_num_batched_tokens
    device = impls[0].window_pos.device
    dtype = vllm_config.model_config.dtype
    # Zeros, not empty: whatever FlashAttention loads past a batch's rows must be finite.
    buffers = tuple(torch.zeros(rows, hkv, d, dtype=dtype, device=device) for _ in range(2))
    for impl in impls:
        impl.dense_kv = buffers
    return sum(b.nbytes for b in buffers)


def warm_up_layers(runner) -> None:
    """Compile the kernels' serving variants once per distinct layer shape, and log the cost:
    a one-time startup cost instead of stalls of seconds for whichever requests meet a variant first."""
    done, launches, t0 = set(), 0, time.perf_counter()
    context = runner.compilation_config.static_forward_context
    for group, builder in oscar_builders(runner.attn_groups):
        for name in group.layer_names:
            layer = context[name]
            impl = layer.impl
            shape = (impl.num_heads, impl.num_kv_heads, impl.head_size, impl.rot_k.dim(), layer.kv_cache.shape[1:])
            if shape not in done:
                done.add(shape)
                launches += impl.warm_up(layer.kv_cache, builder.window_pages, runner.vllm_config)
    if launches:
        torch.cuda.synchronize()
        logger.info("OSCAR: compiled the kernels' %d serving variants in %.1f s", launches, time.perf_counter() - t0)
