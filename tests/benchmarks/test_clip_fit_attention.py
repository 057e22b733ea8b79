"""benchmarks/studies/clip_fit_attention.py: the KL sees only the keys a query reads from INT2, and
the keys come back as the cache rounds them."""
import pytest
import torch

from benchmarks.studies import clip_fit_attention as cfa
from oscar_vllm.core.quant import fake_quantize_int2


def test_int2_mask_is_past_the_sink_and_older_than_the_recent_window():
    m = cfa.int2_mask(10, sink=2, recent=3)
    assert m[7].tolist() == [False, False, True, True, True, False, False, False, False, False]
    assert not m[:5].any()  # position 4's window (2, 3, 4) leaves only the sink before it
    assert m.sum() == sum(max(0, i - 4) for i in range(10))


def qk(t=40, hq=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, hq, d, generator=g), torch.randn(t, hkv, d, generator=g)


def test_kl_is_zero_for_exact_keys_and_blind_to_the_windows():
    q, k = qk()
    kl = cfa.AttentionKL(q, k, 0.5, sink=4, recent=8)
    assert kl(k) == pytest.approx(0.0, abs=1e-7)
    windows = k.clone()
    windows[:4] += 3.0  # the sink: BF16 for every query
    windows[-8:] += 3.0  # the last 8 keys: in the recent window of every query that sees them
    assert kl(windows) == pytest.approx(0.0, abs=1e-7)
    middle = k.clone()
    middle[20] += 3.0  # read from INT2 by the queries from position 28 on
    assert kl(middle) > 1e-3


def test_served_keys_round_in_the_rotated_basis_and_add_the_mean_back():
    _, k = qk(d=16)
    r = torch.linalg.qr(torch.randn(16, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64))[0]
    got = cfa.served_keys(k, r.float(), 0.9, None)
    want = torch.einsum("the,de->thd", fake_quantize_int2(torch.einsum("thd,de->the", k.double(), r), 0.9, None,
                                                          torch.float16).double(), r)
    torch.testing.assert_close(got, want)
    mean = torch.full_like(k, 5.0)
    torch.testing.assert_close(cfa.served_keys(k + mean, r.float(), 0.9, mean), want + 5.0)
