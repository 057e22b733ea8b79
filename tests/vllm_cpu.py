"""vLLM's engine configs built on a machine without a GPU, for the tests of what the plugin
checks when vLLM builds them (``EngineArgs.create_engine_config``).

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
                  "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                  "max_position_embeddings": 8192, "vocab_size": 49152, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
                  "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "dtype": "float32"}


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
    register()  # as vLLM's plugin loader does when EngineArgs is first built (tests/serving/test_bad_input.py checks that)
    try:
        yield EngineArgs
    finally:
        patch.undo()
