"""benchmarks/studies/noise_sensitivity.py: the perturbation is what it says and the same for every
cache, a 2-bit cache turns it into larger changes than BF16 does, and flips are counted against
the clean read."""
import pytest
import torch

from benchmarks.studies import noise_sensitivity as ns
from tiny_llama import tiny_llama, tiny_specs


def test_the_perturbation_is_bounded_and_seeded():
    seen = []

    def inner(q, k, v, scaling):
        seen.append((q, k, v))
        return q

    q, k, v = (torch.randn(3, 5, 8) for _ in range(3))
    eps = 2.0 ** -9
    for seed in (7, 7, 8):
        ns.PerturbedHook(inner, eps, seed)(q, k, v, 1.0)
    for x, y in zip((q, k, v), seen[0]):
        rel = (y.double() / x.double() - 1).abs()
        assert rel.max() <= eps * (1 + 1e-4) and rel.mean() > eps / 4  # every element moved, within eps
    assert all(torch.equal(a, b) for a, b in zip(seen[0], seen[1]))  # the same seed: the same draws
    assert not torch.equal(seen[0][1], seen[2][1])


def test_two_bits_turn_the_same_perturbation_into_larger_changes_than_bf16():
    loaded = tiny_llama()
    ids = torch.randint(0, 128, (64,), generator=torch.Generator().manual_seed(3))
    moved = {}
    for kind, (sink, recent) in (("bf16", (0, 0)), ("int2", (4, 8))):
        clean = ns.read_logprobs(loaded.model, ids, tiny_specs(kind), sink, recent, 0.0, 0)
        again = ns.read_logprobs(loaded.model, ids, tiny_specs(kind), sink, recent, 0.0, 0)
        noisy = ns.read_logprobs(loaded.model, ids, tiny_specs(kind), sink, recent, 2.0 ** -9, 1)
        assert torch.equal(clean, again) and clean.shape == (63, 128)
        moved[kind] = float((clean - noisy).abs().mean())
    # BF16 rounds the perturbed rows to a neighbouring BF16 value at most; two bits move a row
    # near a code boundary by a whole code step.
    assert 0 < 3 * moved["bf16"] < moved["int2"], moved  # 5.5x here


def test_flips_are_greedy_tokens_that_differ_from_the_clean_read():
    clean = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 0.5], [1.0, 1.1, 0.0]]), -1)
    noisy = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.4, 0.5], [1.2, 1.1, 0.0]]), -1)
    out = ns.compare(clean, noisy)
    assert out["flips"] == 2 and out["kl_sum"] > 0 and ns.compare(clean, clean)["kl_sum"] == 0
    assert out["flip_margins"] == pytest.approx([2.5, 0.1], abs=1e-5)
