"""The OSCAR attention backend for vLLM 0.26.0: INT2 paged KV with BF16 sink and recent
windows, in the attention-aware rotated basis.

Order as in vLLM's own backends: metadata, builder, backend, impl. The kernels live in
``csrc_triton/``, which paths a batch's requests take through them in ``prefill``; what ties the
backend into vLLM beyond this interface (the KV spec, the request rows and their window pages,
the weight fold) is in ``vllm_hooks``.

Window state: each layer owns its ``window_pos`` (which position each ring entry holds); the
builder owns what all layers share, each request row's window pages (``window_pages``, given by
the scheduler, ``oscar_vllm.serving.window_pages``) and the batch's rows (``ring_slots``). The windows'
bytes are pages of the layer's own KV cache.
"""
from __future__ import annotations

import functools
import itertools
import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config, get_current_vllm_config_or_none
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_interface import AttentionSpec

from csrc_triton import gluon_layout
from csrc_triton import oscar_attention as triton_decode
from csrc_triton import oscar_decode as gluon_decode
from csrc_triton.oscar_decode import oscar_decode
from csrc_triton.oscar_dense_kv import KeyMeanBasis, key_mean_basis
from csrc_triton.oscar_write import decode_rotation, oscar_write, oscar_write_decode
from csrc_triton.paged_layout import (
    BLOCK_SIZE,
    KEY_MEAN_PAIRS,
    BatchLayout,
    MixedCache,
    int2_cache_shape,
    window_pages_per_request,
    windows_view,
)
from csrc_triton.warm_up import warm_up_kernels
from oscar_vllm.core.fold import RotationFoldError
from oscar_vllm.core.key_mean import served_block_mean
from oscar_vllm.core.quant import PARAM_DTYPES, clip_index
from oscar_vllm.core.settings import BACKEND_NAME, OscarSettings, OscarSettingsError
from oscar_vllm.reference.oscar_write import window_index
from oscar_vllm.serving.gpu import decode_kernel_for, gpu_problem, supports_capability
from oscar_vllm.serving.plugin import check_vllm_version
from oscar_vllm.serving.preflight import check_in_worker
from oscar_vllm.serving.prefill import (
    DecodeReadPrefill,
    DensePrefill,
    oscar_attention,
    oscar_decode_read_prefill,
    oscar_prefill_batch,
    pack_requests,
)
from oscar_vllm.serving.window_pages import WindowPagesError

check_vllm_version()

from oscar_vllm.serving import hooks  # noqa: E402  (installs the hooks once the version is right)

hooks.install()  # as register() does: a process that imports the backend without vLLM's plugins gets them too

logger = logging.getLogger("vllm.oscar_vllm")


@dataclass
class OscarAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    num_reqs: int
    num_decodes: int  # the batch's first requests, one query token each (vLLM orders them so)
    decode_splits: int  # most programs a decode request's prefix is split over
    decode_ring_cost: int  # INT2 blocks a ring tile counts as in that split (the Gluon kernel's partition)
    prefill_has_prefix: bool  # some prefill request has cached tokens (or may: an upper bound)
    # each prefill request's (query tokens, sequence length), from the host, where some has a
    # cached prefix or prefill_read is "decode" (the dense paths' groups); else ()
    prefill_shapes: tuple[tuple[int, int], ...]
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs], including this step
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    ring_slots: torch.Tensor  # int32 [num_reqs]: each request's window ring (its row)
    window_pages: torch.Tensor  # int32 [rows + 1, pages per ring]: each row's window pages
    part_out: torch.Tensor  # fp32 split-K scratch, [decode tokens * Hq * decode_splits * d] used
    part_lse: torch.Tensor  # fp32 [decode tokens * Hq * decode_splits] used


class OscarAttentionMetadataBuilder(AttentionMetadataBuilder[OscarAttentionMetadata]):
    # Decode batches replay as full CUDA graphs: every tensor the kernels read lives in a
    # persistent buffer and the launch depends only on the (padded) batch size.
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Decodes first: they take the split decode kernel, the rest the prefill path.
        self._init_reorder_batch_threshold(1)
        num_heads = vllm_config.model_config.get_num_attention_heads(vllm_config.parallel_config)
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        settings = OscarSettings.from_vllm_config(vllm_config)
        d = kv_cache_spec.head_size
        attention = vllm_config.compilation_config.static_forward_context
        self.attention_layers = [attention[name] for name in layer_names]
        self.layers = [layer.impl for layer in self.attention_layers]
        # The decode kernels the layers chose (the Gluon ones on Hopper where they serve the shape):
        # the split counts and scratch are that kernel's.
        self.decode_kernel = gluon_decode if layers_use_gluon_decode(self.layers) else triton_decode
        logger.info("OSCAR decode: the %s kernels (decode_kernel %r, compute capability %s)",
                    "Gluon" if self.decode_kernel is gluon_decode else "Triton", settings.decode_kernel,
                    ".".join(map(str, torch.cuda.get_device_capability(device))))
        # Request rows are < max_num_seqs; a batch padded for a CUDA graph may count more entries.
        self.null_row = vllm_config.scheduler_config.max_num_seqs
        max_batch = max(self.null_row, vllm_config.compilation_config.max_cudagraph_capture_size or 0)
        self.fixed_splits = settings.decode_splits
        split_rows = decode_split_scratch_rows(self.decode_kernel, self.fixed_splits, max_batch, self.num_kv_heads,
                                               self.num_sms)
        self.sink, self.recent = settings.sink_size, settings.recent_size
        self.decode_read = settings.prefill_read == "decode"
        self.pages_per_ring, self.sink_pages = window_pages_per_request(settings.sink_size, settings.recent_size,
                                                                        self.num_kv_heads, d)
        # Row null_row never holds a window (its positions stay -1): padded batch entries read it.
        self.window_pages = torch.zeros(self.null_row + 1, self.pages_per_ring, dtype=torch.int32, device=device)
        self.ring_slots = torch.full((max_batch,), self.null_row, dtype=torch.int32, device=device)
        self.batch_rows: torch.Tensor | None = None  # int32 [num_reqs]: set per step by vllm_hooks
        self.part_out = torch.empty(split_rows * num_heads * d, dtype=torch.float32, device=device)
        self.part_lse = torch.empty(split_rows * num_heads, dtype=torch.float32, device=device)

    def assign_windows(self, rows: list[int], pages: list[list[int]], num_blocks: int, allow_null: bool = False,
                       sink_shared: list[bool] | None = None,
                       rings: list[tuple[int, int, list[int]] | None] | None = None) -> None:
        """New requests took ``rows``, with window ``pages`` each (block ids < ``num_blocks``; the
        null block 0 only with ``allow_null``, for vLLM's start-up warm-up): empty their rings in
        every layer before they run, so no row reads a window it did not write, but for the sink
        of rows whose sink pages came from the prefix cache (``sink_shared``), and the positions
        ``[lo, hi)`` of a ring an earlier request left in ``source`` pages (``rings``: ``(lo, hi,
        source)``): those pages are copied into the row's recent pages, in every layer, and the
        row reads those positions."""
        if not rows:
            return
        first = 0 if allow_null else 1

        def misfit(ids: list[int], count: int) -> bool:
            return len(ids) != count or not all(first <= b < num_blocks for b in ids)

        if any(misfit(p, self.pages_per_ring) for p in pages):
            raise WindowPagesError(
                f"window pages {pages} for rows {rows}: each row needs {self.pages_per_ring} block ids in "
                f"[{first}, {num_blocks})"
            )
        recent_pages = self.pages_per_ring - self.sink_pages
        copies = [(ring[2], row_pages[self.sink_pages:]) for row_pages, ring in zip(pages, rings or []) if ring]
        if any(misfit(s, recent_pages) for s, _ in copies):
            raise WindowPagesError(f"ring source pages {[s for s, _ in copies]}: each needs {recent_pages} block ids "
                                   f"in [{first}, {num_blocks})")
        # From pinned memory, without waiting: a blocking or pageable copy would synchronize the
        # stream, so every step that admits a request would wait for the step before it to finish
        # (no overlap of the host's next step with the GPU's, which vLLM's async scheduling gives).
        device = self.window_pages.device
        pinned = device.type == "cuda"

        def to_device(values, dtype):
            return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(device, non_blocking=True)

        index = to_device(rows, torch.long)
        self.window_pages.index_copy_(0, index, to_device(pages, torch.int32))
        for impl in self.layers:
            impl.window_pos.index_fill_(0, index, -1)
        shared = [r for r, c in zip(rows, sink_shared or []) if c]
        if shared and self.sink:
            shared_index = to_device(shared, torch.long)
            held = torch.arange(self.sink, dtype=torch.int32, device=index.device).expand(len(shared), -1)
            for impl in self.layers:
                impl.window_pos[shared_index, :self.sink] = held
        if copies:  # before the step's kernels, on the same stream: ahead of any write into the sources
            source = to_device([b for s, _ in copies for b in s], torch.long)
            target = to_device([b for _, t in copies for b in t], torch.long)
            for cache in self.layer_caches():
                cache.index_copy_(0, target, cache.index_select(0, source))
        taken = [(r, range(max(lo, self.sink, hi - self.recent), hi)) for r, ring in zip(rows, rings or []) if ring
                 for lo, hi in [ring[:2]]]
        if taken:  # each held position at its ring entry, as the write kernels leave it
            row_of = to_device([r for r, held in taken for _ in held], torch.long)
            positions = to_device([p for _, held in taken for p in held], torch.int32)
            at = (row_of, window_index(positions.long(), self.sink, self.recent))
            for impl in self.layers:
                impl.window_pos.index_put_(at, positions)

    def layer_caches(self) -> list[torch.Tensor]:
        """Each layer's KV cache (its blocks hold the window pages), as vLLM bound it."""
        return [layer.kv_cache for layer in self.attention_layers]

    def fill_ring_slots(self, num_entries: int) -> None:
        """Each batch entry's ring: the rows of the batch's requests, then the null row for the
        entries a CUDA graph pads the batch with (they read an empty window)."""
        rows = self.batch_rows
        if rows is None:
            raise RuntimeError(
                "OSCAR needs vLLM's V2 model runner (the default for dense models) to know each "
                "request's window ring; set VLLM_USE_V2_MODEL_RUNNER=1"
            )
        n = rows.shape[0]
        if n > num_entries or num_entries > self.ring_slots.shape[0]:
            raise RuntimeError(f"OSCAR: a batch of {num_entries} entries for {n} request rows "
                               f"(at most {self.ring_slots.shape[0]} entries)")
        self.ring_slots[:n].copy_(rows, non_blocking=True)
        if num_entries > n:
            self.ring_slots[n:num_entries].fill_(self.null_row)

    def decode_splits(self, num_decodes: int) -> int:
        """Programs each decode request's keys are split over: the ``decode_splits`` setting, or
        (0) the kernel's choice for this batch size."""
        return self.fixed_splits or self.decode_kernel.decode_splits(num_decodes, self.num_kv_heads, self.num_sms)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> OscarAttentionMetadata:
        m = common_attn_metadata
        self.fill_ring_slots(m.num_reqs)
        num_decodes, _, _, _ = split_decodes_and_prefills(m, decode_threshold=1)
        # From CPU copies (no sync): seq_lens_cpu_upper_bound is exact for prefill rows (it
        # overstates only async speculative decodes), so the dense path sizes its buffers by it.
        seq_cpu = m.seq_lens_cpu_upper_bound
        q_cpu = m.query_start_loc_cpu
        prefill_seq = None if seq_cpu is None else seq_cpu[num_decodes:m.num_reqs]
        prefill_has_prefix = (
            prefill_seq is None
            or bool((prefill_seq > q_cpu[num_decodes + 1:m.num_reqs + 1] - q_cpu[num_decodes:m.num_reqs]).any())
        )
        known = prefill_seq is not None and len(prefill_seq) > 0
        shapes = ()
        if known and (self.decode_read or prefill_has_prefix):
            q_len = (q_cpu[num_decodes + 1:m.num_reqs + 1] - q_cpu[num_decodes:m.num_reqs]).tolist()
            shapes = tuple(zip(q_len, prefill_seq.tolist()))
        return OscarAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            num_reqs=m.num_reqs,
            num_decodes=num_decodes,
            decode_splits=self.decode_splits(num_decodes),
            decode_ring_cost=gluon_layout.decode_ring_cost(num_decodes, self.fixed_splits),
            prefill_has_prefix=prefill_has_prefix,
            prefill_shapes=shapes,
            query_start_loc=m.query_start_loc,
            seq_lens=m.seq_lens,
            block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping,
            ring_slots=self.ring_slots,
            window_pages=self.window_pages,
            part_out=self.part_out,
            part_lse=self.part_lse,
        )


class OscarAttentionBackend(AttentionBackend):
    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type["OscarAttentionImpl"]:
        return OscarAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[OscarAttentionMetadataBuilder]:
        return OscarAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        # One kernel block is one attention tile; larger --block-size values are split into it.
        return [BLOCK_SIZE]

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        """VLLM_BATCH_INVARIANT=1: only with the settings that make OSCAR's reads batch-invariant
        (``OscarSettings.batch_invariant``; the startup check names them)."""
        config = get_current_vllm_config_or_none()
        return config is not None and OscarSettings.from_vllm_config(config).batch_invariant

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        """Cards of compute capability 8.0 or newer; with ``decode_kernel`` "gluon", 9.x only
        (``oscar_vllm.serving.gpu``). vLLM asks when it selects the backend."""
        return supports_capability((capability.major, capability.minor), _engine_decode_kernel())

    @classmethod
    def supports_combination(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype: str | None,
                             block_size: int | None, use_mla: bool, has_sink: bool, use_sparse: bool,
                             use_mm_prefix: bool, device_capability: DeviceCapability) -> str | None:
        """The card refused by ``supports_compute_capability``, or one whose shared memory the Triton
        kernels exceed at ``head_size``, named, and what would serve it (vLLM lists this reason)."""
        capability, decode_kernel = (device_capability.major, device_capability.minor), _engine_decode_kernel()
        if supports_capability(capability, decode_kernel, head_size):
            return None
        return gpu_problem(capability, decode_kernel, _device_name(), head_size)

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        return BLOCK_SIZE

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [64, 128, 256]

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        if block_size != BLOCK_SIZE:
            raise ValueError(f"OSCAR kernel blocks hold {BLOCK_SIZE} tokens, vLLM asked for {block_size}")
        return int2_cache_shape(num_blocks, num_kv_heads, head_size)


def decode_split_scratch_rows(kernel, fixed_splits: int, max_batch: int, num_kv_heads: int, num_sms: int) -> int:
    """Rows of split scratch (``requests * splits``) the largest batch needs from ``kernel``
    (``csrc_triton.oscar_decode`` or ``oscar_attention``): ``fixed_splits`` (the
    ``decode_splits`` setting) for every batch, or, 0, the kernel's choice per batch size."""
    if fixed_splits > kernel.MAX_DECODE_SPLITS:
        raise OscarSettingsError(f"decode_splits {fixed_splits}: {kernel.__name__} splits a request's keys over at "
                                 f"most {kernel.MAX_DECODE_SPLITS} programs")
    if fixed_splits:
        return max_batch * fixed_splits
    return kernel.decode_split_rows(max_batch, num_kv_heads, num_sms)


def _engine_decode_kernel() -> str:
    """The ``decode_kernel`` setting of the engine being built (else of the ``OSCAR_*`` variables)."""
    return OscarSettings.from_vllm_config(get_current_vllm_config_or_none()).decode_kernel


def _device_name() -> str | None:
    """The first visible GPU's name, as vLLM's platform reads it; None where it cannot."""
    from vllm.platforms import current_platform

    try:
        return current_platform.get_device_name()
    except (NotImplementedError, RuntimeError):
        return None


def device_capability() -> tuple[int, int] | None:
    """The compute capability of this process's CUDA device (a worker's own card); None without CUDA."""
    return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None


def uses_gluon_decode(settings: OscarSettings, num_heads: int, num_kv_heads: int, head_size: int,
                      dtype: torch.dtype, capability: tuple[int, int] | None) -> bool:
    """Whether a layer's decode batches take ``csrc_triton.oscar_decode`` (the Gluon decode write,
    then the Gluon kernel) on a card of ``capability`` (None: no CUDA device): where the card and
    the ``decode_kernel`` setting take the Gluon kernels (``gpu.decode_kernel_for``) and they serve
    the layer's shape; else the Triton decode kernel and write. ``decode_kernel`` "gluon" with a
    shape they do not serve is refused, by name."""
    if capability is None or decode_kernel_for(capability, settings.decode_kernel) != "gluon":
        return False
    if gluon_decode.supports(num_heads, num_kv_heads, head_size, dtype, settings.sink_size):
        return True
    if settings.decode_kernel == "gluon":
        raise OscarSettingsError(
            f"decode_kernel 'gluon': the Gluon decode kernel does not serve this model's layers ({num_heads} query "
            f"and {num_kv_heads} KV heads, head_dim {head_size}, {str(dtype).removeprefix('torch.')}, sink_size "
            f"{settings.sink_size}); it serves 16-bit models, head_dim 64 or 128, up to 16 query heads per KV head "
            "and sinks of a multiple of 8 tokens; leave decode_kernel at 'auto'")
    return False


def layers_use_gluon_decode(layers: list) -> bool:
    """The decode path of a metadata builder's layers (``OscarAttentionImpl.gluon_decode``): the one
    every layer chose. Its split counts and scratch are that kernel's, so layers that differ are an
    error, not a choice."""
    chosen = {impl.gluon_decode for impl in layers}
    if len(chosen) != 1:
        raise RuntimeError(f"OSCAR layers of one KV-cache group chose different decode kernels ({sorted(chosen)}): "
                           "the metadata builder serves one")
    return chosen.pop()


def _flash_attention(scale: float, dtype: torch.dtype, unsplit: bool = False, head_size: int | None = None):
    """Varlen causal attention through vLLM's FlashAttention, or None where it cannot run (fp32
    models, no CUDA build): ``(q, k, v, cu_q, cu_k, max_query_len, max_seq_len, out,
    return_lse=False, window_left=-1) -> natural-log LSE [Hq, T] or None``, queries the last
    positions of keys; ``window_left >= 0``: each query sees that many keys before its own.
    ``unsplit``: no split-KV, whose count FlashAttention-3 picks from the whole batch's size, so
    a sequence's sums do not depend on the others (as ``VLLM_BATCH_INVARIANT=1`` asks too).
    The version is vLLM's choice for the card and ``head_size`` (FA2 on 8.x, FA3 on Hopper, FA4 on
    Blackwell but for head sizes its FA4 does not take), as its FlashAttention backend makes it."""
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version, is_flash_attn_varlen_func_available

    if dtype not in (torch.float16, torch.bfloat16) or not is_flash_attn_varlen_func_available():
        return None
    from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func

    from vllm import envs

    fa_version = get_flash_attn_version(head_size=head_size)
    options = {} if fa_version is None else {"fa_version": fa_version}
    if unsplit or envs.VLLM_BATCH_INVARIANT:  # as vLLM's FlashAttention backend in that mode
        options["num_splits"] = 1

    def attend(q, k, v, cu_q, cu_k, max_query_len, max_seq_len, out, return_lse=False, window_left=-1):
        res = flash_attn_varlen_func(
            q=q, k=k, v=v, max_seqlen_q=max_query_len, cu_seqlens_q=cu_q, max_seqlen_k=max_seq_len,
            cu_seqlens_k=cu_k, softmax_scale=scale, causal=True, return_softmax_lse=return_lse, out=out,
            window_size=[window_left, 0] if window_left >= 0 else None, **options,
        )
        return res[1] if return_lse else None

    return attend


def _own_keys(attend, q, k, v, cu_q, max_query_len, out):
    """A prefill chunk's attention to its own keys only, with its LSE (for the INT2 kernel's merge)."""
    return attend(q, k, v, cu_q, cu_q, max_query_len, max_query_len, out, return_lse=True)


class OscarAttentionImpl(AttentionImpl[OscarAttentionMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, **unsupported) -> None:
        problems = [
            (alibi_slopes is not None, "ALiBi"),
            (sliding_window is not None, "sliding-window attention"),
            (bool(logits_soft_cap), "logit soft-capping"),
            (attn_type != AttentionType.DECODER, f"{attn_type} attention"),
            (kv_sharing_target_layer_name is not None, "cross-layer KV sharing"),
            (kv_cache_dtype != "auto", f"--kv-cache-dtype {kv_cache_dtype} (OSCAR is its own KV format)"),
            (unsupported.get("sinks") is not None, "learned attention sinks"),
        ]
        refused = [what for bad, what in problems if bad]
        if refused:
            raise NotImplementedError(f"the OSCAR backend does not serve models with {', '.join(refused)}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype

        vllm_config = get_current_vllm_config()
        check_in_worker(vllm_config)  # the startup checks, also for configs EngineArgs did not build
        self.settings = OscarSettings.from_vllm_config(vllm_config)
        self.sink = self.settings.sink_size
        self.recent = self.settings.recent_size
        self.param_dtype = PARAM_DTYPES[self.settings.scale_dtype]
        # λ for the INT2 kernels (decode, and prefill chunks over a cached prefix that take the
        # INT2 kernel); chunks on the dense FlashAttention path take none (oscar_dense_kv).
        self.logit_correction = self.settings.logit_correction_for(key_mean=False)  # set_key_mean changes it
        # Set by vllm_hooks.prepare_model once the model's weights are loaded.
        self.layer_id: int | None = None
        self.rot_k: torch.Tensor | None = None
        self.clip_idx_k = self.clip_idx_v = -1
        # The position each ring entry holds, per request row (and the builder's empty null row
        # last). The rings' bytes are pages of the KV cache, taken per running request.
        rows = vllm_config.scheduler_config.max_num_seqs + 1
        self.window_pos = torch.full((rows, self.sink + self.recent), -1, dtype=torch.int32)
        # Prefill runs through FlashAttention where it can: over a cached prefix dequantized
        # into dense_kv (shared by all layers, given by vllm_hooks.prepare_model; a batch that
        # needs more rows, in groups of requests), or, where the host does not know the batch's
        # lengths, over the chunk's own keys with the INT2 kernel adding the prefix.
        # prefill_read="decode" reads so that no schedule changes a request's sums: no split-KV either.
        self.decode_read = self.settings.prefill_read == "decode"
        self.flash_attention = _flash_attention(self.scale, vllm_config.model_config.dtype, unsplit=self.decode_read,
                                                head_size=head_size)
        self.own_keys_attention = None
        if self.flash_attention is not None:
            self.own_keys_attention = functools.partial(_own_keys, self.flash_attention)
        self.dense_kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self.gluon_decode = uses_gluon_decode(self.settings, num_heads, num_kv_heads, head_size,
                                              vllm_config.model_config.dtype, device_capability())
        # prefill_read="decode": prefill queries read as decode does (oscar_decode_read_prefill),
        # over dense_kv, merging FlashAttention's two passes with vLLM's merge_attn_states.
        self.merge_attention = None
        if self.decode_read:
            from vllm.v1.attention.ops.merge_attn_states import merge_attn_states

            self.merge_attention = merge_attn_states
        self.rot_t: torch.Tensor | None = None  # R as the decode write takes it (decode_rotation)
        # key_mean "on": the layer's mean key before RoPE, fp32 [Hkv, d], and the RoPE table [P, d]
        # it is turned with, given by vllm_hooks.prepare_model; the Gluon decode's operands of them
        self.key_mean: dict[str, torch.Tensor] = {}
        self.decode_key_mean: dict[str, torch.Tensor] | None = None
        self.dense_mean_basis: KeyMeanBasis | None = None  # the dense prefill's (oscar_dense_kv.key_mean_basis)

    def set_layer(self, layer_id: int, rot_k: torch.Tensor, clip_ratio_k: float, clip_ratio_v: float) -> None:
        """The layer's key rotation ``[d, d]`` or ``[Hkv, d, d]`` and clip ratios."""
        if self.rot_k is not None:
            raise RotationFoldError(f"OSCAR layer {self.layer_id} was prepared twice")
        self.layer_id = layer_id
        self.rot_k = rot_k.to(device=self.window_pos.device, dtype=torch.float32).contiguous()
        self.rot_t = decode_rotation(self.rot_k)
        self.clip_idx_k = clip_index(clip_ratio_k, self.head_size)
        self.clip_idx_v = clip_index(clip_ratio_v, self.head_size)

    def set_key_mean(self, mean: torch.Tensor, cos_sin: torch.Tensor) -> None:
        """Keys are written less their block's mean and read plus it (``key_mean``): ``mean``
        ``[Hkv, d]`` is the layer's mean key before RoPE (this shard's KV heads), ``cos_sin`` fp32
        ``[P, d]`` the RoPE table the model turns its keys with (vLLM's, ``d/2`` cosines then
        sines). The kernels serve its average over a cache block's positions on each head's
        ``KEY_MEAN_PAIRS`` strongest RoPE pairs (``served_block_mean``; the study's 16 do what all
        do), turned to each block's first position: the decode and INT2 kernels add its logit,
        the dense prefill's fill its rows through a basis under this layer's rotation
        (``key_mean_basis``; after ``set_layer``)."""
        if self.decode_read:
            raise OscarSettingsError("key_mean 'on' needs prefill_read 'chunk'")
        device = self.window_pos.device
        mean = served_block_mean(mean.float(), cos_sin, BLOCK_SIZE, KEY_MEAN_PAIRS).to(device)
        self.logit_correction = self.settings.logit_correction_for(key_mean=True)
        self.key_mean = dict(key_mean=mean.contiguous(),
                             cos_sin=cos_sin.to(device=device, dtype=torch.float32).contiguous())
        if self.gluon_decode:
            self.decode_key_mean = gluon_decode.key_mean_operands(**self.key_mean)
        self.dense_mean_basis = key_mean_basis(mean, self.rot_k)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ R_K`` in fp32 for queries ``[T, Hq, d]`` or keys ``[T, Hkv, d]`` (per KV head
        when the rotation is per head)."""
        rot = self.rot_k
        if rot.dim() == 2:
            return (x.float() @ rot).to(x.dtype)
        n, heads, d = x.shape
        xg = x.float().view(n, self.num_kv_heads, heads // self.num_kv_heads, d)
        return torch.einsum("thgi,hij->thgj", xg, rot).reshape(x.shape).to(x.dtype)

    def warm_up(self, kv_cache: torch.Tensor, window_pages: torch.Tensor, vllm_config: VllmConfig) -> int:
        """Compile every kernel variant this layer can launch while serving (``csrc_triton.warm_up``),
        on scratch inputs over its own cache and windows, which it leaves as they are."""
        if self.rot_k is None:
            raise RuntimeError("OSCAR layer has no rotation: the model was not prepared")
        sched = vllm_config.scheduler_config
        return warm_up_kernels(
            cache=MixedCache(kv_cache, windows_view(kv_cache), window_pages, self.window_pos, self.sink, self.recent,
                             self.param_dtype),
            rot_k=self.rot_k,
            num_heads=self.num_heads, dtype=vllm_config.model_config.dtype, max_num_seqs=sched.max_num_seqs,
            max_num_tokens=sched.max_num_batched_tokens,
            num_sms=torch.cuda.get_device_properties(kv_cache.device).multi_processor_count,
            merge_self=self.own_keys_attention is not None, dense=self.dense_kv is not None, gluon=self.gluon_decode,
            decode_read=self.decode_read, fixed_splits=self.settings.decode_splits,
            threads=self.settings.warm_up_threads, logit_correction=self.logit_correction,
            key_mean=self.key_mean, decode_key_mean=self.decode_key_mean, dense_mean_basis=self.dense_mean_basis,
        )

    def dense_prefill(self, md: OscarAttentionMetadata, k: torch.Tensor) -> DensePrefill | None:
        """The dense path for this batch's prefills, when some has a cached prefix and the host
        knows their lengths: in groups of requests that fit the buffers (one where all do)."""
        if (self.dense_kv is None or not md.prefill_has_prefix or md.num_decodes == md.num_reqs
                or not md.prefill_shapes):
            return None
        k_buf, v_buf = self.dense_kv
        return DensePrefill(self.rotate(k[md.num_decodes:]), k_buf, v_buf, max(s for _, s in md.prefill_shapes),
                            self.flash_attention, md.prefill_shapes, self.dense_mean_basis,
                            self.key_mean.get("cos_sin"))

    def forward(self, layer: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: OscarAttentionMetadata, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("the OSCAR backend does not fuse output quantization")
        if attn_metadata is None:  # memory-profiling run
            return output.fill_(0)
        if self.rot_k is None:
            raise RuntimeError(f"OSCAR layer {layer.layer_name} has no rotation: the model was not prepared")
        md = attn_metadata
        n = md.num_actual_tokens
        q = query[:n].view(n, self.num_heads, self.head_size)
        k = key[:n].view(n, self.num_kv_heads, self.head_size)
        v = value[:n].view(n, self.num_kv_heads, self.head_size)
        out = output[:n].view(n, self.num_heads, self.head_size)
        # The layer's cache (its pages, their bf16 view holding the rings, the builder's ring pages and
        # the layer's ring positions) and the batch, as every kernel takes them.
        cache = MixedCache(kv_cache, windows_view(kv_cache), md.window_pages, self.window_pos, self.sink, self.recent,
                           self.param_dtype)
        batch = BatchLayout(md.block_table, md.seq_lens, md.query_start_loc, md.ring_slots, md.num_reqs,
                            md.num_decodes, md.max_query_len)
        if self.gluon_decode:
            return self._forward_write_first(md, batch, q, k, v, out, cache, output)
        if self.decode_read and md.num_decodes < md.num_reqs:
            return self._forward_decode_read(md, batch, q, k, v, out, cache, output)
        # Attention first, then the write: this step reads the windows as they were (a ring entry
        # it overwrites may still be in a query's window). No request reads blocks another
        # request of its batch fills: the scheduler's prefix-cache hits end before them
        # (oscar_vllm.serving.window_pages).
        oscar_attention(out, q, self.rotate(q), k, v, cache=cache, batch=batch, scale=self.scale,
                        decode_splits=md.decode_splits, part_out=md.part_out, part_lse=md.part_lse,
                        own_keys_attention=self.own_keys_attention, prefill_has_prefix=md.prefill_has_prefix,
                        dense=self.dense_prefill(md, k), logit_correction=self.logit_correction, **self.key_mean)
        oscar_write(k, v, rot_k=self.rot_k, slot_mapping=md.slot_mapping[:n], cache=cache, batch=batch,
                    clip_idx_k=self.clip_idx_k, clip_idx_v=self.clip_idx_v, **self.key_mean)
        return output

    def _forward_write_first(self, md: OscarAttentionMetadata, batch: BatchLayout, q, k, v, out, cache: MixedCache,
                             output):
        """Decode tokens are written first (their queries rotated in the same launch), so the
        decode kernel finds each step's token in its ring; a decode token only overwrites the ring
        entry of the position that just left its window. Prefill chunks still attend first, then
        write: a chunk's tokens would overwrite entries its own first queries read."""
        n, nd, num_reqs = md.num_actual_tokens, batch.num_decodes, batch.num_reqs
        q_rot = torch.empty_like(q)
        if nd:
            decodes = batch.requests(0, nd)
            oscar_write_decode(k[:nd], v[:nd], q[:nd], q_rot[:nd], rot_t=self.rot_t, slot_mapping=md.slot_mapping[:nd],
                               cache=cache, batch=decodes, clip_idx_k=self.clip_idx_k, clip_idx_v=self.clip_idx_v,
                               **self.key_mean)
            oscar_decode(out[:nd], q_rot[:nd], cache=cache, batch=decodes, scale=self.scale,
                         num_splits=md.decode_splits, part_out=md.part_out, part_lse=md.part_lse,
                         logit_correction=self.logit_correction, ring_cost=md.decode_ring_cost,
                         q=q[:nd] if self.key_mean else None, key_mean=self.decode_key_mean)
        if nd < num_reqs:
            # Prefill queries read the INT2 cache only over a cached prefix (or, without
            # FlashAttention, for their own keys too): a fresh prompt's chunk skips the rotation,
            # an fp32 GEMM with its copies over every prompt token in every layer.
            if md.prefill_has_prefix or self.own_keys_attention is None or self.decode_read:
                q_rot[nd:] = self.rotate(q[nd:])
            if self.decode_read:
                self.decode_read_prefill(md, batch, q_rot, k, v, out, cache)
                return output
            oscar_prefill_batch(out, q, q_rot, k, v, cache=cache, batch=batch, scale=self.scale,
                                own_keys_attention=self.own_keys_attention, prefill_has_prefix=md.prefill_has_prefix,
                                dense=self.dense_prefill(md, k), logit_correction=self.logit_correction,
                                **self.key_mean)
            oscar_write(k[nd:n], v[nd:n], rot_k=self.rot_k, slot_mapping=md.slot_mapping[nd:n], cache=cache,
                        batch=batch.requests(nd, num_reqs), clip_idx_k=self.clip_idx_k, clip_idx_v=self.clip_idx_v,
                        **self.key_mean)
        return output

    def _forward_decode_read(self, md: OscarAttentionMetadata, batch: BatchLayout, q, k, v, out, cache: MixedCache,
                             output):
        """The Triton decode path with prefill_read="decode": decodes attend, then are written (as
        in ``forward``); prefills read as decode does and write themselves."""
        nd = batch.num_decodes
        q_rot = self.rotate(q)
        if nd:
            decodes = batch.requests(0, nd, max_query_len=1)
            # The decodes' own rows: the split scratch is sized by the tokens it is given.
            oscar_attention(out[:nd], q[:nd], q_rot[:nd], k[:nd], v[:nd], cache=cache, batch=decodes, scale=self.scale,
                            decode_splits=md.decode_splits, part_out=md.part_out, part_lse=md.part_lse,
                            logit_correction=self.logit_correction)
            oscar_write(k[:nd], v[:nd], rot_k=self.rot_k, slot_mapping=md.slot_mapping[:nd], cache=cache,
                        batch=decodes, clip_idx_k=self.clip_idx_k, clip_idx_v=self.clip_idx_v)
        self.decode_read_prefill(md, batch, q_rot, k, v, out, cache)
        return output

    def decode_read_prefill(self, md: OscarAttentionMetadata, batch: BatchLayout, q_rot, k, v, out,
                            cache: MixedCache) -> None:
        """The batch's prefill requests, read as decode reads the cache and written
        (``oscar_decode_read_prefill``): in as few groups of consecutive requests as the dense
        buffers hold (one request always fits: they hold ``max_model_len +
        max_num_batched_tokens`` rows)."""
        if self.dense_kv is None or self.flash_attention is None:
            raise RuntimeError("OSCAR prefill_read 'decode' needs FlashAttention and the dense prefill buffers")
        nd, num_reqs, n = batch.num_decodes, batch.num_reqs, md.num_actual_tokens
        shapes = md.prefill_shapes
        if not shapes:  # no host copy of the lengths this step: read them (a sync)
            cu = batch.cu_q[nd:num_reqs + 1]
            shapes = tuple(zip((cu[1:] - cu[:-1]).tolist(), batch.seq_lens[nd:num_reqs].tolist()))
        recent = self.recent
        rows = [max(s - recent, 0) + min(s, q + recent - 1) for q, s in shapes]
        groups = pack_requests(rows, self.dense_kv[0].shape[0])
        k_rot = self.rotate(k[nd:n])
        starts = list(itertools.accumulate((q_len for q_len, _ in shapes), initial=0))
        for lo, hi in groups:
            part = shapes[lo:hi]
            toks = slice(nd + starts[lo], nd + starts[hi])
            group = batch.requests(nd + lo, nd + hi, max_query_len=max(q for q, _ in part))
            write = functools.partial(
                oscar_write, k[toks], v[toks], rot_k=self.rot_k, slot_mapping=md.slot_mapping[toks], cache=cache,
                batch=group, clip_idx_k=self.clip_idx_k, clip_idx_v=self.clip_idx_v)
            n_int2 = [max(s - recent, 0) for _, s in part]
            n_window = [min(s, q + recent - 1) for q, s in part]
            plan = DecodeReadPrefill(
                k_rot=k_rot[starts[lo]:starts[hi]], k_buf=self.dense_kv[0], v_buf=self.dense_kv[1],
                rows_int2=sum(n_int2), max_int2=max(n_int2), rows_window=sum(n_window), max_window=max(n_window),
                max_seq_len=max(s for _, s in part), write=write, attention=self.flash_attention,
                merge=self.merge_attention)
            oscar_decode_read_prefill(out[toks], q_rot[toks], v[toks], cache=cache, batch=group, plan=plan)
