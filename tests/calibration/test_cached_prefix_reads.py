"""The cached-prefix workload and the reference cache's reads of it (``oscar_vllm.calibration.evaluate``),
on a tiny random model."""
import pytest
import torch
from oscar_vllm.calibration.evaluate import (
    CACHED_PREFIX_TOKENS,
    cached_prefix_reads,
    cached_prefix_tokens,
    cached_prefix_workload,
)
from oscar_vllm.calibration.models import LoadedModel, MixedCacheHook, attention_hooks
from tiny_llama import tiny_llama, tiny_specs

PREFIX, CUTS, LENGTH = 24, (10, 21, 37), 64


def test_workload_shares_the_system_prompt_and_the_prefix():
    ids = list(range(CACHED_PREFIX_TOKENS + 5))
    chats, shared, windows = cached_prefix_workload(ids)
    assert len(chats) == 16 and all(c[:1536] == ids[:1536] and len(c) == 1736 for c in chats)
    questions = [t for c in chats for t in c[1536:]]
    assert questions == ids[1536:1536 + 3200]  # distinct, in order
    assert shared == ids[4736:5248]
    assert len(windows) == 23 and all(w[:512] == shared and len(w) == 2048 for w in windows)
    assert [t for w in windows for t in w[512:]] == ids[5248:CACHED_PREFIX_TOKENS]
    with pytest.raises(ValueError, match=f"of 23 windows needs {CACHED_PREFIX_TOKENS} tokens, got 100"):
        cached_prefix_workload(ids[:100])
    # More windows (a check that can decide a 1% gap): the same chats, prefix and first windows.
    more = list(range(cached_prefix_tokens(160)))
    chats160, shared160, windows160 = cached_prefix_workload(more, windows=160)
    assert (chats160, shared160, windows160[:23]) == (chats, shared, windows) and len(windows160) == 160
    assert windows160[-1][512:] == more[-1536:]
    with pytest.raises(ValueError, match=f"of 160 windows needs {cached_prefix_tokens(160)} tokens"):
        cached_prefix_workload(ids, windows=160)


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


def windows(n: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(0, 128, (PREFIX,), generator=g).tolist()
    return [shared + torch.randint(0, 128, (LENGTH - PREFIX,), generator=g).tolist() for _ in range(n)]


def plain_nll(loaded: LoadedModel, ws: list[list[int]], after: bool) -> list[float]:
    out = []
    for w in ws:
        ids = torch.tensor(w)
        with torch.no_grad():
            logp = torch.log_softmax(loaded.model(ids[None], use_cache=False).logits[0], -1)
        out += [-logp[PREFIX + c - 1 + after, w[PREFIX + c + after]].item() for c in CUTS]
    return out


def test_bf16_read_scores_the_tokens_at_and_after_each_cut(tiny):
    ws = windows()
    nll = cached_prefix_reads(tiny, ws, PREFIX, tiny_specs("int2"), sink=4, recent=8, cuts=CUTS)
    assert set(nll) == {"bf16", "one_chunk", "chunked", "hit", "hit_chunked", "deep_hit", "deep_hit_ring",
                        "deep_hit_ring_chunked", "decode"}
    for name, after in (("cut", False), ("after", True)):
        assert len(nll["bf16"][name]) == len(ws) * len(CUTS)
        torch.testing.assert_close(torch.tensor(nll["bf16"][name]), torch.tensor(plain_nll(tiny, ws, after)),
                                   atol=2e-2, rtol=0)


def test_lossless_rows_make_every_read_the_same(tiny):
    nll = cached_prefix_reads(tiny, windows(), PREFIX, tiny_specs("bf16"), sink=4, recent=8, cuts=CUTS)
    for read in ("one_chunk", "chunked", "hit", "hit_chunked", "deep_hit", "deep_hit_ring", "deep_hit_ring_chunked",
                 "decode"):
        for name in ("cut", "after"):
            torch.testing.assert_close(torch.tensor(nll[read][name]), torch.tensor(nll["bf16"][name]),
                                       atol=2e-2, rtol=0)


def test_a_hit_quantizes_only_the_prefix_past_the_sink(tiny):
    ws = windows()
    # A sink that covers the whole prefix leaves nothing 2-bit for the chunk after the hit.
    whole = cached_prefix_reads(tiny, ws, PREFIX, tiny_specs("int2"), sink=PREFIX, recent=8, cuts=CUTS)
    assert whole["hit"]["cut"] == whole["one_chunk"]["cut"]
    part = cached_prefix_reads(tiny, ws, PREFIX, tiny_specs("int2"), sink=4, recent=8, cuts=CUTS)
    gap = (torch.tensor(part["hit"]["cut"]) - torch.tensor(part["one_chunk"]["cut"])).abs().max()
    assert gap > 1e-3
    # A hit brings no recent window: the keys just before the hit are 2-bit whatever `recent` is.
    wider = cached_prefix_reads(tiny, ws, PREFIX, tiny_specs("int2"), sink=4, recent=16, cuts=CUTS)
    assert wider["hit"] == part["hit"] and wider["decode"] != part["decode"]
    # Decode reads 2-bit keys from further back than `recent`; with a window over the whole
    # sequence it reads every key in BF16, as one chunk does.
    full = cached_prefix_reads(tiny, ws, PREFIX, tiny_specs("int2"), sink=4, recent=LENGTH, cuts=CUTS)
    assert full["decode"]["after"] == full["one_chunk"]["after"]


def test_chunked_reads_after_a_hit_find_a_ring_from_the_second_chunk(tiny):
    ws, kw = windows(), dict(sink=4, recent=8, cuts=CUTS)
    # A chunk longer than the window is one chunk, with caching off and after the hit.
    whole = cached_prefix_reads(tiny, ws, PREFIX, tiny_specs("int2"), chunk=LENGTH, **kw)
    assert whole["chunked"] == whole["one_chunk"] and whole["hit_chunked"] == whole["hit"]
    # Chunks of PREFIX tokens: the prefix is one chunk either way. Cuts 10 and 21 end in the
    # first chunk after the hit, which reads as `hit` does; cut 37 ends in the second, whose
    # ring holds the first chunk's last keys in BF16.
    part = cached_prefix_reads(tiny, ws, PREFIX, tiny_specs("int2"), chunk=PREFIX, **kw)
    hit, hit_chunked = (torch.tensor(part[r]["cut"]).view(len(ws), len(CUTS)) for r in ("hit", "hit_chunked"))
    torch.testing.assert_close(hit_chunked[:, :2], hit[:, :2], atol=1e-6, rtol=0)
    assert (hit_chunked[:, 2] - hit[:, 2]).abs().max() > 1e-3
    one, chunked = (torch.tensor(part[r]["cut"]).view(len(ws), len(CUTS)) for r in ("one_chunk", "chunked"))
    assert (chunked[:, 1:] - one[:, 1:]).abs().max() > 1e-3


def test_chunk_starts_on_a_grid_are_prefill_chunks(tiny):
    ids = torch.tensor(windows(1)[0])[None]
    spec = tiny_specs("int2")

    def logits(**kw):
        with attention_hooks(tiny.model, lambda i: MixedCacheHook(spec[i], 4, 8, **kw)), torch.no_grad():
            return tiny.model(ids, use_cache=False).logits

    grid = torch.arange(LENGTH) // 16 * 16
    assert torch.equal(logits(chunk_starts=grid), logits(prefill_chunk=16))
    assert not torch.equal(logits(chunk_starts=grid), logits())
    with pytest.raises(ValueError, match="not both"):
        MixedCacheHook(spec[0], 4, 8, prefill_chunk=16, chunk_starts=grid)


def test_a_deep_hit_reads_2_bit_up_to_itself_and_the_trimmed_hit_its_ring_in_bf16(tiny):
    """Cuts of a 64-token window after a 24-token prefix, in blocks of 8 and a window of 8: the
    deepest hit of a prompt ending at e is (e - 8) // 8 * 8, never under the prefix; the trimmed
    hit a block shorter, which moves what the prompt's last position reads. With a sink over the
    whole window every read is the one-chunk read."""
    ws, kw = windows(), dict(sink=4, recent=8, cuts=CUTS, block=8)
    part = cached_prefix_reads(tiny, ws, PREFIX, tiny_specs("int2"), chunk=LENGTH, **kw)
    for read in ("deep_hit", "deep_hit_ring"):
        gap = (torch.tensor(part[read]["cut"]) - torch.tensor(part["one_chunk"]["cut"])).abs().max()
        assert gap > 1e-3, read  # 2-bit keys between the sink and the hit
    assert part["deep_hit_ring"]["cut"] != part["deep_hit"]["cut"]
    # One chunk after the trimmed hit: its ring is its own chunk, so chunking in chunks longer
    # than the rest of the window changes nothing.
    assert part["deep_hit_ring_chunked"] == part["deep_hit_ring"]
    # A sink over the whole window: every read is the one-chunk read.
    whole = cached_prefix_reads(tiny, ws, PREFIX, tiny_specs("int2"), chunk=LENGTH, sink=LENGTH, recent=8, cuts=CUTS,
                                block=8)
    assert whole["deep_hit"]["cut"] == whole["deep_hit_ring"]["cut"] == whole["one_chunk"]["cut"]
