"""Folding the value rotation into qkv_proj / o_proj leaves the layer's output unchanged and
makes the projection emit rotated values."""
import pytest
import torch

from oscar_vllm.core.fold import fold_value_rotation, kv_heads_of_shard, per_head
from kernel_cases import random_rotation


def attention_block(x, w_qkv, b_qkv, w_o, hq, hkv, d, probs):
    """Projection -> (fixed) attention weights per query head -> o_proj; also returns V."""
    qkv = x @ w_qkv.T + (0 if b_qkv is None else b_qkv)
    v = qkv[:, (hq + hkv) * d:].view(-1, hkv, d)
    g = hq // hkv
    o = torch.einsum("hts,shd->thd", probs, v.repeat_interleave(g, dim=1))  # [T, Hq, d]
    return o.reshape(-1, hq * d) @ w_o.T, v


@pytest.mark.parametrize("hq,hkv,per_head_rot,bias", [(4, 4, False, False), (9, 3, True, True), (8, 2, False, True)])
def test_fold_preserves_the_output(hq, hkv, per_head_rot, bias):
    torch.manual_seed(0)
    d, hidden, t = 16, 40, 7
    x = torch.randn(t, hidden, dtype=torch.float64)
    w_qkv = torch.randn((hq + 2 * hkv) * d, hidden, dtype=torch.float64)
    b_qkv = torch.randn((hq + 2 * hkv) * d, dtype=torch.float64) if bias else None
    w_o = torch.randn(hidden, hq * d, dtype=torch.float64)
    probs = torch.softmax(torch.randn(hq, t, t, dtype=torch.float64), dim=-1)
    rot = random_rotation(d, hkv if per_head_rot else None, seed=1)
    y, v = attention_block(x, w_qkv, b_qkv, w_o, hq, hkv, d, probs)

    fw_qkv, fb, fw_o = w_qkv.clone(), None if b_qkv is None else b_qkv.clone(), w_o.clone()
    fold_value_rotation(fw_qkv, fb, fw_o, per_head(rot, list(range(hkv))).double(), hq, d)
    y2, v2 = attention_block(x, fw_qkv, fb, fw_o, hq, hkv, d, probs)
    torch.testing.assert_close(y2, y, rtol=1e-5, atol=1e-5)
    want_v = v @ rot.double() if rot.dim() == 2 else torch.einsum("thi,hij->thj", v, rot.double())
    torch.testing.assert_close(v2, want_v, rtol=1e-5, atol=1e-5)
    # q and k rows are untouched.
    assert torch.equal(fw_qkv[: (hq + hkv) * d], w_qkv[: (hq + hkv) * d])


def test_fold_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="cannot fold"):
        fold_value_rotation(torch.zeros(10, 4), None, torch.zeros(4, 8), torch.eye(4)[None], 2, 4)


@pytest.mark.parametrize("total,tp,rank,want", [(8, 1, 0, list(range(8))), (8, 4, 3, [6, 7]), (2, 8, 5, [1]),
                                                (4, 8, 0, [0])])
def test_kv_heads_of_shard(total, tp, rank, want):
    assert kv_heads_of_shard(total, tp, rank) == want
