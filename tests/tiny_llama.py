"""A tiny random Llama and reference-cache specs for it: enough for the reference cache's reads
to be real attention over real rows, in a second on the CPU."""
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from oscar_vllm.calibration.models import LoadedModel
from oscar_vllm.core.mixed_cache import LayerCacheSpec, RowQuantizer
from oscar_vllm.core.rotation_io import ModelShape


def tiny_llama() -> LoadedModel:
    """2 layers, 4 query and 2 KV heads of 16 dims, 128 tokens of vocabulary, seeded."""
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return LoadedModel(model, None, "tiny-llama", ModelShape.from_hf_config(config))


def tiny_specs(kind: str) -> dict[int, LayerCacheSpec]:
    """Seeded random orthogonal K and V rotations for each layer, rows stored as ``kind``."""
    g = torch.Generator().manual_seed(1)
    rotation = [torch.linalg.qr(torch.randn(16, 16, generator=g))[0] for _ in range(4)]
    return {i: LayerCacheSpec(rotation[2 * i], rotation[2 * i + 1], RowQuantizer(kind), RowQuantizer(kind))
            for i in range(2)}
