"""Startup checks: what the OSCAR backend cannot serve, refused by name before any engine starts.

vLLM builds an engine's whole configuration in the process that starts it (``vllm serve``'s
API server, or the one that calls ``LLM(...)``), in ``EngineArgs.create_engine_config``,
before any engine process, worker or GPU memory exists. The plugin wraps that function
(:func:`check_configs_as_built`, hook ``startup-check``): an engine that names the OSCAR backend
is checked there, all problems at once, each named (:class:`OscarStartupError`), and its
rotations are loaded and validated against the model. Then its OSCAR settings are written into
the config (``additional_config["oscar"]``, the rotation path made absolute), so every process of the
engine reads the same settings, wherever it runs: vLLM copies ``VLLM_*`` and ``HF_*`` variables
to Ray workers on other nodes, not ``OSCAR_*`` ones, and a relative path means another folder
in a process started elsewhere.

Each worker runs the same checks again when it builds its first OSCAR layer (a config built
without ``EngineArgs`` skips the first ones), and loads the rotations itself, naming its host
and rank when it cannot (``rotation_source.rotations_in_process``).
"""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import fields

import torch

from oscar_vllm.core.errors import OscarError
from oscar_vllm.core.settings import ADDITIONAL_CONFIG_KEY, OscarSettings, pinned_rotation_path
from oscar_vllm.serving.gpu import gpu_problem
from oscar_vllm.serving.vllm_hooks import SUPPORTED_MODEL_TYPES, engine_uses_oscar

logger = logging.getLogger("vllm.oscar_vllm")

SUPPORTED_HEAD_DIMS = (64, 128, 256)  # what the kernels are built for (the backend's supported sizes)
WINDOW_BLOCK_TOKENS = 64  # csrc_triton.paged_layout.BLOCK_SIZE: tokens of one INT2 page
_checked: set[int] = set()  # configs a worker has checked (its layers share one)


class OscarStartupError(OscarError, ValueError):
    """An engine configuration the OSCAR backend cannot serve; the message names each problem."""


def model_problems(model_config) -> list[str]:
    """What in the model (its config.json, as vLLM reads it) the backend cannot serve."""
    hf = model_config.hf_text_config
    problems = []
    if model_config.use_mla:
        problems.append("multi-head latent attention (MLA, as in DeepSeek-V2/V3): its latent KV cache has no "
                        "per-head keys and values to rotate")
    attn_type = model_config.attn_type
    if attn_type == "encoder_decoder":
        problems.append("cross-attention (an encoder-decoder model): OSCAR compresses a decoder's self-attention "
                        "cache only")
    elif attn_type == "encoder_only":
        problems.append("an encoder-only model (bidirectional attention, which keeps no KV cache to compress)")
    elif attn_type in ("hybrid", "attention_free"):
        problems.append(f"a {attn_type.replace('_', '-')} model (state-space layers): OSCAR compresses attention "
                        "KV caches only")
    window = model_config.get_sliding_window()
    if window:
        problems.append(f"sliding-window attention (window {window}): OSCAR's windows assume every earlier "
                        "token stays visible")
    softcap = getattr(hf, "attn_logit_softcapping", None)
    if softcap:
        problems.append(f"attention logit soft-capping ({softcap})")
    head_dim = model_config.get_head_size()
    if not model_config.use_mla and head_dim not in SUPPORTED_HEAD_DIMS:
        problems.append(f"head_dim {head_dim}: the kernels serve head_dim 64, 128 and 256")
    if model_config.quantization is not None:
        problems.append(f"quantized weights ({model_config.quantization}): OSCAR folds its value rotation into "
                        "the unquantized v_proj and o_proj weights")
    model_type = getattr(hf, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        problems.append(f"model type {model_type!r}: the backend folds its rotations into "
                        f"{', '.join(SUPPORTED_MODEL_TYPES)} attention blocks")
    return problems


def window_problems(settings: OscarSettings, max_model_len: int) -> list[str]:
    """Sink and recent sizes that are not whole pages, or do not fit the context."""
    problems = []
    partial = [f"{name} {size}" for name, size in (("sink_size", settings.sink_size),
                                                    ("recent_size", settings.recent_size))
               if size % WINDOW_BLOCK_TOKENS]
    if partial:
        problems.append(
            f"{' and '.join(partial)}: not whole {WINDOW_BLOCK_TOKENS}-token KV blocks; a window page holds the "
            f"most ring entries that divide the sink, so other sizes leave pages part empty (sink_size 61 takes "
            f"a page per sink token); use multiples of {WINDOW_BLOCK_TOKENS} (sink_size may be 0)")
    windows = settings.sink_size + settings.recent_size
    if windows >= max_model_len:
        problems.append(
            f"sink_size {settings.sink_size} + recent_size {settings.recent_size} = {windows} tokens do not fit "
            f"in max_model_len {max_model_len}: every token would stay in BF16, in windows larger than the "
            "requests; lower them, or raise --max-model-len")
    return problems


def serving_platform():
    """vLLM's platform, which names the GPU an engine serves on (the first visible, read through
    NVML on CUDA: no CUDA context in the process vLLM forks its engine from)."""
    from vllm.platforms import current_platform

    return current_platform


def gpu_problems(settings: OscarSettings, head_dim: int | None = None) -> list[str]:
    """The GPU vLLM serves on (``serving_platform``), where the backend cannot use it for a model of
    ``head_dim`` (``oscar_vllm.serving.gpu``). Nothing on another platform than CUDA: vLLM has no
    CUDA device to serve on there."""
    platform = serving_platform()
    if not platform.is_cuda():
        return []
    capability = platform.get_device_capability()
    if capability is None:
        return []
    capability = (capability.major, capability.minor)
    if gpu_problem(capability, settings.decode_kernel, head_dim=head_dim) is None:
        return []
    return [gpu_problem(capability, settings.decode_kernel, platform.get_device_name(), head_dim)]


def v1_reason(vllm_config) -> str:
    """Why vLLM runs this engine on its V1 model runner."""
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() in ("0", "false"):
        return "VLLM_USE_V2_MODEL_RUNNER=0 is set"
    unsupported = getattr(vllm_config, "_get_v2_model_runner_unsupported_features", lambda: [])()
    if unsupported:
        return f"the V2 runner does not yet support {', '.join(unsupported)}"
    return "vLLM's default for this model"


def engine_problems(vllm_config, settings: OscarSettings) -> list[str]:
    """What in the engine's arguments the backend cannot serve."""
    problems = []
    cache = vllm_config.cache_config
    if cache.cache_dtype != "auto":
        problems.append(f"--kv-cache-dtype {cache.cache_dtype}: OSCAR is its own 2-bit KV format; leave "
                        "--kv-cache-dtype at auto")
    if cache.user_specified_block_size and cache.block_size % WINDOW_BLOCK_TOKENS:
        problems.append(f"--block-size {cache.block_size}: OSCAR's pages hold {WINDOW_BLOCK_TOKENS} tokens; give "
                        f"{WINDOW_BLOCK_TOKENS} or a multiple of it")
    spec = vllm_config.speculative_config
    if spec is not None:
        problems.append(f"speculative decoding (--speculative-config, method {spec.method!r}): draft tokens are "
                        "written into the BF16 recent window before they are verified, so rejected ones would "
                        "push accepted tokens out of it")
    if not vllm_config.use_v2_model_runner:
        problems.append(f"vLLM's V1 model runner ({v1_reason(vllm_config)}): OSCAR keys each request's windows "
                        "on the V2 runner's request rows; set VLLM_USE_V2_MODEL_RUNNER=1")
    if vllm_config.kv_transfer_config is not None:
        problems.append("a KV connector (--kv-transfer-config, or KV offloading): it moves a request's KV blocks, "
                        "not the BF16 window pages OSCAR keeps beside them")
    parallel = vllm_config.parallel_config
    dcp = getattr(parallel, "decode_context_parallel_size", 1)
    pcp = getattr(parallel, "prefill_context_parallel_size", 1)
    if dcp > 1 or pcp > 1:
        problems.append(f"context parallelism (decode {dcp}, prefill {pcp}): it splits a request's tokens over "
                        "GPUs, and its windows would have to follow them")
    dtype = vllm_config.model_config.dtype
    if settings.prefill_read == "decode" and dtype not in (torch.float16, torch.bfloat16):
        problems.append(f"prefill_read 'decode' with a {str(dtype).removeprefix('torch.')} model: it runs on "
                        "FlashAttention, which takes 16-bit models; serve in bfloat16 (--dtype bfloat16) or "
                        "with prefill_read 'chunk'")
    from vllm import envs

    if envs.VLLM_BATCH_INVARIANT and not settings.batch_invariant:
        problems.append("VLLM_BATCH_INVARIANT=1 (replies that do not depend on the batch): OSCAR reads its cache "
                        "that way only with prefill_read 'decode' and a fixed decode_splits; add "
                        "OSCAR_PREFILL_READ=decode OSCAR_DECODE_SPLITS=16 (or the --oscar-* flags)")
    return (problems + window_problems(settings, vllm_config.model_config.max_model_len)
            + gpu_problems(settings, vllm_config.model_config.get_head_size()))


def model_shape(vllm_config):
    from oscar_vllm.core.rotation_io import ModelShape

    return ModelShape.from_hf_config(vllm_config.model_config.hf_text_config, vllm_config.model_config.model)


def check_engine_config(vllm_config, rotations: bool = True) -> OscarSettings | None:
    """Refuse, naming every problem, an OSCAR engine the backend cannot serve; with
    ``rotations``, load and validate its rotations too. ``None`` for an engine on another
    backend; else the engine's settings."""
    if not engine_uses_oscar(vllm_config):
        return None
    settings = OscarSettings.from_vllm_config(vllm_config)  # unknown or out-of-range settings, by name
    problems = model_problems(vllm_config.model_config) + engine_problems(vllm_config, settings)
    if problems:
        numbered = "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
        raise OscarStartupError(f"the OSCAR attention backend cannot serve {vllm_config.model_config.model}: "
                                f"{numbered}")
    if rotations:
        from oscar_vllm.serving.rotation_source import rotations_in_process

        with torch_single_threaded():
            rotations_in_process(settings, model_shape(vllm_config))
    return settings


def warn_prefix_caching_under_batch_invariance(vllm_config, settings: OscarSettings) -> None:
    """VLLM_BATCH_INVARIANT=1 with prefix caching: say that a prefix-cache hit still changes a
    reply. The tokens after a hit find no BF16 ring for the tokens just before it and read those
    in 2 bits, where the same prompt uncached reads them in BF16; which request caches a shared
    prompt first is up to the schedule."""
    from vllm import envs

    if envs.VLLM_BATCH_INVARIANT and vllm_config.cache_config.enable_prefix_caching:
        logger.warning("OSCAR with VLLM_BATCH_INVARIANT=1 and prefix caching: the tokens after a prefix-cache hit "
                       "read the up to %d tokens just before it in 2 bits, uncached in BF16, so a reply can still "
                       "depend on which request cached its prompt first; --no-enable-prefix-caching removes this",
                       settings.recent_size)


@contextmanager
def torch_single_threaded():
    """Run torch's CPU ops on this thread only, leaving no OpenMP thread pool behind.

    vLLM forks its engine process from the one that builds the config (unless CUDA is initialized
    there). torch's OpenMP pool does not survive a fork: the child's first parallel CPU op waits
    forever for threads that are not there (tests/serving/test_preflight.py). Rotations are small
    enough that one thread loads and validates them at once."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def check_in_worker(vllm_config) -> None:
    """The startup checks (not the rotations: the worker loads those itself), once per config."""
    if id(vllm_config) not in _checked:
        check_engine_config(vllm_config, rotations=False)
        _checked.add(id(vllm_config))


def pin_settings(vllm_config, settings: OscarSettings) -> None:
    """Write every setting into the engine's config, the rotation path absolute, so that each of
    its processes, on any node, reads these and not its own environment or folder."""
    values = {f.name: getattr(settings, f.name) for f in fields(settings) if getattr(settings, f.name) is not None}
    if values.get("rotation_path"):
        values["rotation_path"] = pinned_rotation_path(values["rotation_path"])
    config = vllm_config.additional_config
    if not isinstance(config, dict):
        raise OscarStartupError(f"additional_config is a {type(config).__name__}; OSCAR reads its settings from a dict")
    config[ADDITIONAL_CONFIG_KEY] = values


def check_configs_as_built(original, read):
    """Hook ``startup-check`` (``oscar_vllm.serving.hooks``) on ``EngineArgs.create_engine_config``:
    every config it builds checked, and the settings of an OSCAR engine's pinned in it."""

    def create_engine_config(*args, **kwargs):
        vllm_config = original(*args, **kwargs)
        settings = check_engine_config(vllm_config)
        if settings is not None:
            pin_settings(vllm_config, settings)
            warn_prefix_caching_under_batch_invariance(vllm_config, settings)
        return vllm_config

    return create_engine_config
