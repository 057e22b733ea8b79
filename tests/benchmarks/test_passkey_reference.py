"""benchmarks/studies/passkey_reference.py: the teacher-forced verdict is greedy decoding's, token
for token, through BF16 attention and through a mixed cache alike."""
import torch

from benchmarks.studies import passkey_reference as pr
from oscar_vllm.calibration.models import MixedCacheHook, attention_hooks
from tiny_llama import tiny_llama, tiny_specs


@torch.no_grad()
def greedy(loaded, specs, ids: list[int], steps: int) -> list[int]:
    """Greedy decoding, one full forward a token (the cache read as ``found`` reads it)."""
    out = list(ids)
    for _ in range(steps):
        seq = torch.tensor([out])
        if specs is None:
            logits = loaded.model(seq, use_cache=False).logits
        else:
            with attention_hooks(loaded.model, lambda i: MixedCacheHook(specs[i], 4, 8, pr.CHUNK)):
                logits = loaded.model(seq, use_cache=False).logits
        out.append(int(logits[0, -1].argmax()))
    return out[len(ids):]


def test_found_is_greedys_verdict_on_the_answer(monkeypatch):
    monkeypatch.setattr(pr, "SINK", 4)
    monkeypatch.setattr(pr, "RECENT", 8)
    monkeypatch.setattr(pr, "CHUNK", 16)  # the answer's positions read INT2 rows of earlier chunks
    loaded = tiny_llama()
    ids = torch.randint(0, loaded.model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    for specs in (None, tiny_specs("int2")):
        answer = greedy(loaded, specs, ids, 4)
        assert pr.found(loaded, specs, ids, answer, "cpu") == (True, 4)
        wrong = answer[:2] + [(answer[2] + 1) % loaded.model.config.vocab_size] + answer[3:]
        assert pr.found(loaded, specs, ids, wrong, "cpu") == (False, 2)
