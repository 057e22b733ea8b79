"""The few places where the OSCAR backend reaches into vLLM 0.26.0 beyond the attention
backend interface. Each hook wraps one function, checks that it found what it expects,
and is installed once, when the backend module is imported in a vLLM process:

* ``Attention.get_kv_cache_spec``: OSCAR layers report INT2 pages (a ``TQFullAttentionSpec``
  whose slot is ``int2_slot_bytes(d)``), so vLLM sizes the KV cache by the real page.
* V2 model runner, ``RequestState.add_request`` and ``DefaultModelState.prepare_attn``: the
  stable row of each request (its window ring) and when a row changes hands.
* ``process_weights_after_loading`` as ``BaseModelLoader.load_model`` calls it: load the
  rotations, fold the value rotation into the weights, hand each layer its key rotation.
* V2 model runner, ``GPUModelRunner.initialize_kv_cache``: once the cache exists, compile
  every kernel variant serving can launch (``warm_up_kernels``), before graph capture.
"""
from __future__ import annotations

import functools
import logging
import time

import torch

from oscar_vllm import window_store

# Under vLLM's logger, so its handlers show what the backend loaded.
logger = logging.getLogger("vllm.oscar_vllm")
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
_installed = False


def _wrap(owner, name: str, make):
    original = getattr(owner, name, None)
    if original is None:
        raise RuntimeError(f"oscar_vllm: vLLM has no {owner.__name__}.{name}; is this vLLM 0.26.0?")
    if getattr(original, "__oscar_wrapped__", False):
        return
    wrapper = functools.wraps(original)(make(original))
    wrapper.__oscar_wrapped__ = True
    setattr(owner, name, wrapper)


def _is_oscar(impl) -> bool:
    from oscar_vllm.backend import OscarAttentionImpl

    return isinstance(impl, OscarAttentionImpl)


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


def install() -> None:
    global _installed
    if _installed:
        return
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.model_loader import base_loader
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState
    from vllm.v1.worker.gpu.states import RequestState

    def make_spec(original):
        def get_kv_cache_spec(self, vllm_config):
            if _is_oscar(getattr(self, "impl", None)):
                return oscar_kv_cache_spec(self, vllm_config)
            return original(self, vllm_config)
        return get_kv_cache_spec

    def make_add_request(original):
        def add_request(self, req_id, *args, **kwargs):
            out = original(self, req_id, *args, **kwargs)
            window_store.request_row_assigned(self.req_id_to_index[req_id])
            return out
        return add_request

    def make_prepare_attn(original):
        def prepare_attn(self, input_batch, *args, **kwargs):
            window_store.set_batch_rows(input_batch.idx_mapping)
            return original(self, input_batch, *args, **kwargs)
        return prepare_attn

    def make_process_weights(original):
        def process_weights_after_loading(model, model_config, target_device):
            original(model, model_config, target_device)
            prepare_model(model)
        return process_weights_after_loading

    def make_initialize_kv_cache(original):
        def initialize_kv_cache(self, kv_cache_config):
            original(self, kv_cache_config)
            warm_up_layers(self.compilation_config.static_forward_context.values(), self.vllm_config)
        return initialize_kv_cache

    _wrap(Attention, "get_kv_cache_spec", make_spec)
    _wrap(GPUModelRunner, "initialize_kv_cache", make_initialize_kv_cache)
    _wrap(RequestState, "add_request", make_add_request)
    _wrap(DefaultModelState, "prepare_attn", make_prepare_attn)
    _wrap(base_loader, "process_weights_after_loading", make_process_weights)
    _installed = True


def oscar_attention_blocks(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """``(layer id, self-attention block)`` for every OSCAR layer; refuses layers it cannot fold."""
    from vllm.model_executor.models.utils import extract_layer_index

    blocks, seen = [], set()
    for module in model.modules():
        attn = getattr(module, "attn", None)
        if attn is not None and _is_oscar(getattr(attn, "impl", None)):
            if not (hasattr(module, "qkv_proj") and hasattr(module, "o_proj")):
                raise NotImplementedError(
                    f"OSCAR cannot fold the value rotation into {type(module).__name__}: "
                    "it needs a fused qkv_proj and an o_proj (Llama, Qwen2, Qwen3, Qwen3-MoE)"
                )
            blocks.append((extract_layer_index(attn.layer_name), module))
            seen.add(id(attn.impl))
    for module in model.modules():
        if _is_oscar(getattr(module, "impl", None)) and id(module.impl) not in seen:
            raise NotImplementedError(f"OSCAR layer {module.layer_name} is not inside a self-attention block it can fold")
    return sorted(blocks, key=lambda b: b[0])


def prepare_model(model: torch.nn.Module) -> None:
    """Give every OSCAR layer its key rotation and clip ratios; fold the value rotations."""
    from vllm.config import get_current_vllm_config
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    from oscar_vllm.fold import fold_value_rotation, kv_heads_of_shard, per_head
    from oscar_vllm.rotation_io import KEY, VALUE, ModelShape
    from oscar_vllm.rotation_source import rotations_for_model
    from oscar_vllm.settings import OscarSettings

    blocks = oscar_attention_blocks(model)
    if not blocks:
        return
    vllm_config = get_current_vllm_config()
    hf_config = vllm_config.model_config.hf_text_config
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(
            f"the OSCAR backend serves {', '.join(SUPPORTED_MODEL_TYPES)} models, not {hf_config.model_type!r}"
        )
    settings = OscarSettings.from_vllm_config(vllm_config)
    shape = ModelShape.from_hf_config(hf_config, vllm_config.model_config.model)
    rotations = rotations_for_model(settings, shape)
    tp_size, tp_rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    kv_heads = kv_heads_of_shard(shape.num_kv_heads, tp_size, tp_rank)
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
    dense_bytes = give_dense_prefill_buffers([b.attn.impl for _, b in blocks], vllm_config)
    window_bytes = sum(
        b.attn.impl.window_k.nbytes + b.attn.impl.window_v.nbytes + b.attn.impl.window_pos.nbytes for _, b in blocks
    )
    logger.info(
        "OSCAR: %d layers, rotations %s (%s), sink %d, recent %d, scales %s; BF16 windows for %d "
        "requests take %.2f GiB (lower --max-num-seqs to give it to the KV cache); dense prefill buffers %.2f GiB",
        len(blocks), settings.rotation_path, rotations.source_format, settings.sink_size,
        settings.recent_size, settings.scale_dtype, blocks[0][1].attn.impl.window_pos.shape[0], window_bytes / 2**30,
        dense_bytes / 2**30,
    )


def give_dense_prefill_buffers(impls: list, vllm_config) -> int:
    """One pair of dense K/V buffers for every layer (layers run one after another), sized for a
    longest request plus a full chunk of others: ``max_model_len + max_num_batched_tokens``
    rows. Allocated at load time, so vLLM's memory profiler counts them. Returns their bytes."""
    shapes = {(impl.num_kv_heads, impl.head_size) for impl in impls}
    if any(impl.flash_attention is None for impl in impls) or len(shapes) != 1:
        return 0  # no FlashAttention (fp32 models), or layers of different shapes: the INT2 kernel
    (hkv, d), = shapes
    rows = vllm_config.model_config.max_model_len + vllm_config.scheduler_config.max_num_batched_tokens
    device = impls[0].window_k.device
    dtype = vllm_config.model_config.dtype
    buffers = tuple(torch.empty(rows, hkv, d, dtype=dtype, device=device) for _ in range(2))
    for impl in impls:
        impl.dense_kv = buffers
    return sum(b.nbytes for b in buffers)


def warm_up_layers(layers, vllm_config) -> None:
    """Compile the kernels' serving variants once per distinct layer shape, and log the cost:
    a one-time startup cost instead of stalls of seconds for whichever requests meet a variant first."""
    done, launches, t0 = set(), 0, time.perf_counter()
    for layer in layers:
        impl = getattr(layer, "impl", None)
        if not _is_oscar(impl):
            continue
        shape = (impl.num_heads, impl.num_kv_heads, impl.head_size, impl.rot_k.dim(), layer.kv_cache.shape[1:])
        if shape not in done:
            done.add(shape)
            launches += impl.warm_up(layer.kv_cache, vllm_config)
    if launches:
        torch.cuda.synchronize()
        logger.info("OSCAR: compiled the kernels' %d serving variants in %.1f s", launches, time.perf_counter() - t0)
