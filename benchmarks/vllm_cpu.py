"""vLLM's engine configs built on a machine without a GPU, for the tests of what the plugin
checks when vLLM builds them (``EngineArgs.create_engine_config``), and vLLM's scheduler run on
them with the plugin's window-page hooks (``oscar_scheduler_on_cpu``, ``serve_on_cpu``): what the
serving tests (tests/serving) and ``benchmarks.studies.prefix_check_reads`` share, here so that no
benchmark imports from tests/.

Three things let vLLM's config code run here, none of them part of what is tested: a device
type for ``DeviceConfig`` (nothing runs on it), Triton counted as present (vLLM allows its V2
model runner only with Triton, which the GPU machines have), and model classes inspected in
this process (vLLM does it in a subprocess per architecture, 10-30 s each, to keep CUDA
uninitialized; there is no CUDA here)."""
import os
from contextlib import contextmanager

import pytest

# SmolLM2-135M-Instruct's config.json (the model of the committed rotations), weights not needed.
SMOLLM2_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
                  "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                  "num_key_value_heads": 3, "max_position_embeddings": 8192, "vocab_size": 49152,
                  "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
                  "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "dtype": "float32"}


class Card:
    """vLLM's CUDA platform as the plugin's startup check reads the GPU from it
    (``preflight.serving_platform``), for a card this machine does not have."""

    def __init__(self, name: str, capability: tuple[int, int]):
        self.name, self.capability = name, capability

    def is_cuda(self) -> bool:
        return True

    def get_device_capability(self, device_id: int = 0):
        from vllm.platforms.interface import DeviceCapability

        return DeviceCapability(*self.capability)

    def get_device_name(self, device_id: int = 0) -> str:
        return self.name


@contextmanager
def vllm_configs_on_cpu():
    """Yield vLLM's ``EngineArgs`` with the plugin loaded; undo the three changes after."""
    import vllm.config.vllm as vllm_config_module
    import vllm.model_executor.models.registry as registry
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    from oscar_vllm.serving.plugin import register

    patch = pytest.MonkeyPatch()
    patch.setattr(current_platform, "device_type", "cpu")
    patch.setattr(vllm_config_module, "HAS_TRITON", True)
    patch.setattr(registry, "_run_in_subprocess", lambda fn: fn())
    patch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    for name in [n for n in os.environ if n.startswith("OSCAR_")]:
        patch.delenv(name)
    # As vLLM's plugin loader does when EngineArgs is first built (tests/serving/test_bad_input.py checks that).
    register()
    try:
        yield EngineArgs
    finally:
        patch.undo()


@contextmanager
def oscar_scheduler_on_cpu(work, chunk: int, caching: bool = True, oscar: dict | None = None,
                           num_blocks: int = 20000):
    """vLLM's V1 ``Scheduler`` for a SmolLM2-shaped OSCAR engine (no model, prefill chunks of
    ``chunk``, ``oscar`` settings beside the committed rotations), with the plugin's window-page
    hooks installed as the engine installs them: yields ``(scheduler, its WindowPageAllocator)``.
    ``num_blocks`` of the kernel's block size: the default is roomy, nothing evicted or preempted."""
    import json
    from pathlib import Path

    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.structured_output import StructuredOutputManager

    from csrc_triton.paged_layout import BLOCK_SIZE
    from oscar_vllm.serving.vllm_hooks import give_scheduler_window_pages, oscar_kv_cache_spec

    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    rotations = Path(__file__).resolve().parents[1] / "tests" / "data" / "smollm2_rotations"
    with vllm_configs_on_cpu() as engine_args:
        config = engine_args(model=str(work), attention_backend="OSCAR", skip_tokenizer_init=True,
                             load_format="dummy", max_model_len=4096, max_num_batched_tokens=chunk, max_num_seqs=32,
                             enable_prefix_caching=caching,
                             additional_config={"oscar": {"rotation_path": str(rotations), **(oscar or {})}}
                             ).create_engine_config()
        config.cache_config.block_size = BLOCK_SIZE  # what the backend asks vLLM for on a GPU
        config.cache_config.num_gpu_blocks = num_blocks
        layer = type("Layer", (), {"num_kv_heads": 3, "head_size": 64})()
        kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[KVCacheTensor(size=1, shared_by=["l0"])],
                                  kv_cache_groups=[KVCacheGroupSpec(["l0"], oscar_kv_cache_spec(layer, config))])
        init_none_hash(sha256)
        scheduler = Scheduler(config, kv_config, StructuredOutputManager(config), block_size=BLOCK_SIZE)
        yield scheduler, give_scheduler_window_pages(scheduler)


def serve_on_cpu(scheduler, prompts: list[list[int]], tag: str, max_tokens: int = 2) -> list[dict]:
    """``prompts`` (token ids) sent together to ``oscar_scheduler_on_cpu``'s scheduler and run to
    the end, every request sampling one token (7) a step once its prefill is done, ``max_tokens``
    in all: each request's ``{"len", "chunks": [(first token, tokens), ...] of its prompt, "ring":
    the window pages' ring_of, (lo, hi, source pages) or None}``, in the prompts' order."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    from csrc_triton.paged_layout import BLOCK_SIZE

    pages = scheduler.oscar_window_pages
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    requests = {}
    for i, prompt in enumerate(prompts):
        r = Request(f"{tag}-{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                    block_hasher=hasher)
        requests[r.request_id] = {"request": r, "len": len(prompt), "chunks": [], "ring": None}
        scheduler.add_request(r)
    while scheduler.has_requests():
        out = scheduler.schedule()
        for new in out.scheduled_new_reqs:
            requests[new.req_id]["ring"] = pages.ring_of(new.req_id)
        ids = list(out.num_scheduled_tokens)
        for rid in ids:
            r = requests[rid]
            start = r["request"].num_computed_tokens - out.num_scheduled_tokens[rid]  # counted at schedule()
            if start < r["len"]:
                r["chunks"].append((start, out.num_scheduled_tokens[rid]))
        sampled = [[7] if requests[rid]["request"].num_computed_tokens >= requests[rid]["len"] else [] for rid in ids]
        scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)}, sampled_token_ids=sampled))
    return [{"len": r["len"], "chunks": r["chunks"], "ring": r["ring"]} for r in requests.values()]
