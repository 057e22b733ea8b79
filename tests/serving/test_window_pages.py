"""Window pages from vLLM's own block pool: vLLM's real KV cache manager (CPU, no model) with
the OSCAR allocator installed, driven as the scheduler drives it."""
import pytest
import torch

from csrc_triton.paged_layout import window_pages_per_request
from oscar_vllm.serving.window_pages import (
    SCHEDULER_OUTPUT_FIELD,
    WindowPageAllocator,
    WindowPagesError,
    attach_to_scheduler,
    pages_of_new_requests,
)

vllm = pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from oscar_vllm.core.settings import OscarSettings  # noqa: E402
from oscar_vllm.serving.vllm_hooks import oscar_kv_cache_spec, window_pages_of_group  # noqa: E402

BLOCK = 64
SINK, RECENT = 64, 100  # tokens: the sink is block 0, a hit leaves the last 100 tokens to compute
RING_BLOCKS = 2  # and the 100 before where it ends, in whole blocks: the first new chunk's ring
SINK_PAGES, RECENT_PAGES = 1, 2  # small, so that the pool's arithmetic is easy to follow
PAGES = SINK_PAGES + RECENT_PAGES


def config(num_blocks: int, block_size: int = BLOCK) -> KVCacheConfig:
    layer = type("Layer", (), {"num_kv_heads": 8, "head_size": 128})()
    spec = oscar_kv_cache_spec(layer, type("C", (), {"cache_config": type("CC", (), {"block_size": block_size})()})())
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[KVCacheTensor(size=1, shared_by=["l0"])],
                         kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])


def manager(num_blocks: int, caching: bool = True, install: bool = True, requests: dict | None = None,
            reuse_rings: bool = False) -> tuple[KVCacheManager, WindowPageAllocator]:
    init_none_hash(sha256)
    kv = KVCacheManager(config(num_blocks), max_model_len=100 * BLOCK, scheduler_block_size=BLOCK,
                        hash_block_size=BLOCK, enable_caching=caching)
    allocator = WindowPageAllocator(kv.block_pool, SINK_PAGES, RECENT_PAGES, BLOCK, SINK, RECENT,
                                    {} if requests is None else requests, reuse_rings)
    if install:
        allocator.install(kv.coordinator)
    return kv, allocator


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), None,
                   block_hasher=get_request_block_hasher(BLOCK, sha256))


def admit(kv: KVCacheManager, req: Request, alloc: WindowPageAllocator | None = None, chunk: int | None = None):
    """What the scheduler does for a waiting request: prefix-cache lookup, then slots (for the
    whole prompt, or its first ``chunk`` tokens)."""
    if alloc is not None:
        alloc.requests[req.request_id] = req
    hit, n_hit, _ = kv.get_computed_blocks(req)
    blocks = kv.allocate_slots(req, min(req.num_tokens - n_hit, chunk or req.num_tokens), n_hit, hit)
    if blocks is not None:
        req.num_computed_tokens = n_hit  # as the scheduler does once the request is scheduled
    return blocks, n_hit


def end_step(kv: KVCacheManager, alloc: WindowPageAllocator) -> None:
    """What the scheduler hook does between two ``schedule()`` calls."""
    alloc.end_step(lambda r: kv.coordinator.get_blocks(r)[0])
    alloc.begin_step()


def test_a_request_takes_its_pages_with_its_blocks_and_returns_them():
    kv, alloc = manager(20)
    free0 = kv.block_pool.get_num_free_blocks()
    req = request("a", list(range(130)))  # 3 blocks of tokens
    blocks, _ = admit(kv, req, alloc)
    assert blocks is not None
    assert kv.block_pool.get_num_free_blocks() == free0 - 3 - PAGES
    pages = alloc.page_ids("a")
    own = set(kv.get_block_ids("a")[0])
    assert list(alloc.held) == ["a"] and len(pages) == PAGES and not own & set(pages)
    assert 0 not in pages, "never the null block"
    # More slots for the same request (decode): no new pages.
    req.append_output_token_ids(5)
    kv.allocate_slots(req, 1)
    assert alloc.pages_in_use == PAGES and alloc.page_ids("a") == pages
    kv.free(req)
    assert kv.block_pool.get_num_free_blocks() == free0 and alloc.pages_in_use == 0


def test_admission_counts_the_pages():
    """A request that fits without its pages but not with them is not admitted (vLLM's own check)."""
    kv, alloc = manager(1 + 4 + PAGES - 1)  # the null block, 4 blocks of tokens, one page short
    blocks, _ = admit(kv, request("a", list(range(4 * BLOCK))), alloc)
    assert blocks is None and alloc.pages_in_use == 0 and not alloc.held
    kv2, alloc2 = manager(1 + 4 + PAGES)
    assert admit(kv2, request("a", list(range(4 * BLOCK))), alloc2)[0] is not None and alloc2.pages_in_use == PAGES


def test_preemption_and_abort_return_the_pages_and_resuming_takes_new_ones():
    kv, alloc = manager(40)
    free0 = kv.block_pool.get_num_free_blocks()
    reqs = [request(str(i), list(range(100 * i, 100 * i + 200))) for i in range(3)]
    for r in reqs:
        assert admit(kv, r, alloc)[0] is not None
    first = {r: alloc.page_ids(r) for r in alloc.held}
    kv.free(reqs[1])  # preempted (the scheduler frees all its blocks)
    deferred = kv.pop_blocks_for_free(reqs[2])  # aborted while a step may still write its blocks
    assert set(first["2"]) <= {b.block_id for b in deferred}, "the pages wait with the request's blocks"
    kv.block_pool.free_blocks(reversed(deferred))
    assert alloc.pages_in_use == PAGES
    reqs[1].num_computed_tokens = 0
    assert admit(kv, reqs[1], alloc)[0] is not None  # resumed: recomputed from its prompt, new pages
    assert sorted(alloc.held) == ["0", "1"]
    with pytest.raises(WindowPagesError, match="holds no window pages"):
        alloc.page_ids("2")
    kv.free(reqs[0])
    kv.free(reqs[1])
    assert kv.block_pool.get_num_free_blocks() == free0 and alloc.pages_in_use == 0


def test_pages_never_alias_cached_blocks_of_a_prefix_hit():
    """A hit's cached blocks are claimed before the pages are taken: no page is a hit block."""
    kv, alloc = manager(1 + 5 + PAGES + 3)
    a = request("a", list(range(5 * BLOCK)))
    assert admit(kv, a, alloc)[0] is not None
    end_step(kv, alloc)
    kv.free(a)  # its blocks stay cached (evictable), its recent pages are free, its sink page cached
    b = request("b", list(range(5 * BLOCK)) + [7])
    blocks, hit = admit(kv, b, alloc)
    assert blocks is not None and hit == (3 - RING_BLOCKS) * BLOCK, "the last 100 tokens and a ring are left"
    pages = alloc.page_ids("b")
    assert not set(pages) & set(kv.get_block_ids("b")[0])


def test_a_hit_shares_the_cached_sink_and_recomputes_its_recent_window():
    kv, alloc = manager(40)
    free0 = kv.block_pool.get_num_free_blocks()
    prompt = list(range(5 * BLOCK))
    a = request("a", prompt)
    admit(kv, a, alloc)
    assert not alloc.sink_cached("a"), "a writes its own sink"
    end_step(kv, alloc)
    assert alloc.sink_cached("a"), "cached once its sink block is"
    sink_page = alloc.page_ids("a")[0]
    for rid, extra in (("b", [1, 2]), ("c", list(range(40)))):
        r = request(rid, prompt + extra)
        blocks, hit = admit(kv, r, alloc)
        assert blocks is not None
        # The hit ends a ring before where the last RECENT tokens start (block-aligned), so the
        # request writes its own recent window, and the ring before its first new token; it reads
        # the sink from a's pages, which it never writes.
        assert hit == ((len(prompt) + len(extra) - RECENT) // BLOCK - RING_BLOCKS) * BLOCK
        assert alloc.page_ids(rid)[0] == sink_page and alloc.sink_shared(rid)
        assert not set(alloc.page_ids(rid)[1:]) & set(alloc.page_ids("a")[1:])
    assert kv.block_pool.blocks[sink_page].ref_cnt == 3
    for rid in "abc":
        kv.free(alloc.requests[rid])
    block = kv.block_pool.blocks[sink_page]
    assert block.ref_cnt == 0 and block.block_hash is not None, "the sink page stays cached, evictable"
    assert kv.block_pool.get_num_free_blocks() == free0 and alloc.pages_in_use == 0
    d = request("d", prompt + [9])
    assert admit(kv, d, alloc)[1] > 0 and alloc.page_ids("d")[0] == sink_page, "a hit after all ended"
    kv.free(d)
    assert kv.reset_prefix_cache() and block.block_hash is None, "a prefix-cache reset drops the sinks too"
    assert kv.block_pool.get_num_free_blocks() == free0
    assert admit(kv, request("e", prompt + [9]), alloc)[1] == 0


def cached_prefix(prompt_blocks: int):
    """A 40-block pool in which request "a" of ``prompt_blocks`` blocks ran a step: its sink is cached."""
    kv, alloc = manager(40)
    prompt = list(range(prompt_blocks * BLOCK))
    a = request("a", prompt)
    admit(kv, a, alloc)
    end_step(kv, alloc)
    return kv, alloc, prompt, a


def test_a_shared_sink_counts_only_what_it_takes_from_the_free_blocks():
    kv, alloc, prompt, a = cached_prefix(6)
    free = kv.block_pool.get_num_free_blocks()
    admit(kv, request("b", prompt + [1]), alloc)  # 7 blocks, 2 of them hit; a holds them and the sink page
    assert kv.block_pool.get_num_free_blocks() == free - 5 - RECENT_PAGES
    kv.free(a)
    kv.free(alloc.requests["b"])
    free = kv.block_pool.get_num_free_blocks()
    admit(kv, request("c", prompt + [1]), alloc)  # the sink page and the hit blocks come off the free list
    assert kv.block_pool.get_num_free_blocks() == free - 7 - PAGES


def test_a_hit_ends_before_blocks_the_same_step_fills():
    """vLLM caches a block when it schedules it; a hit on it in that step would read it unwritten."""
    kv, alloc = manager(60)
    prompt = list(range(8 * BLOCK))
    a = request("a", prompt)
    admit(kv, a, alloc, chunk=4 * BLOCK)  # step 1: the first 4 blocks
    b = request("b", prompt[:4 * BLOCK] + [1] * 200)
    assert admit(kv, b, alloc)[1] == 0, "a's blocks of this step, sink unwritten"
    end_step(kv, alloc)
    a.num_computed_tokens = 4 * BLOCK
    kv.allocate_slots(a, 4 * BLOCK)  # step 2: the rest of a
    assert admit(kv, request("c", prompt + [1]), alloc)[1] == (4 - RING_BLOCKS) * BLOCK, "what step 1 wrote"
    end_step(kv, alloc)
    assert (admit(kv, request("d", prompt + [1]), alloc)[1]
            == ((len(prompt) + 1 - RECENT) // BLOCK - RING_BLOCKS) * BLOCK)
    assert alloc.page_ids("b")[0] != alloc.page_ids("a")[0], "b wrote a sink of its own"
    assert alloc.page_ids("c")[0] == alloc.page_ids("d")[0] == alloc.page_ids("a")[0]


def test_a_hit_leaves_the_ring_before_the_first_new_token_to_compute():
    """Where the cached prefix, not the request's end, bounds the hit, the request still computes
    the RECENT tokens before the first token nothing cached: that token's chunk reads them in BF16,
    as an uncached prefill's chunk reads its ring, not 2-bit from the cache."""
    kv, alloc, prompt, a = cached_prefix(6)
    b = request("b", prompt + [1] * 600)
    assert admit(kv, b, alloc)[1] == (6 - RING_BLOCKS) * BLOCK <= len(prompt) - RECENT
    assert alloc.sink_shared("b")
    # A cached prefix one block longer than the ring gives a hit on the sink block alone; one no
    # longer than the ring, nothing.
    for blocks, hit in ((1 + RING_BLOCKS, BLOCK), (RING_BLOCKS, 0)):
        kv, alloc, short, _ = cached_prefix(blocks)
        c = request("c", short + [1] * 600)
        assert admit(kv, c, alloc)[1] == hit and alloc.sink_shared("c") == (hit > 0)


def test_a_hit_whose_sink_pages_were_evicted_is_no_hit():
    kv, alloc, prompt, a = cached_prefix(5)
    sink_page = alloc.page_ids("a")[0]
    kv.free(a)
    kv.block_pool.evict_blocks({sink_page})  # as vLLM evicts a cached block it reuses
    b = request("b", prompt + [1])
    assert admit(kv, b, alloc)[1] == 0 and not alloc.sink_shared("b"), "recomputed, sink included"
    end_step(kv, alloc)
    assert alloc.sink_cached("b")
    assert admit(kv, request("c", prompt + [1]), alloc)[1] > 0 and alloc.page_ids("c")[0] == alloc.page_ids("b")[0]


def test_a_second_copy_of_a_cached_sink_is_not_cached_again():
    kv, alloc = manager(60)
    prompt = list(range(5 * BLOCK))
    a, b = request("a", prompt), request("b", prompt)
    admit(kv, a, alloc)
    admit(kv, b, alloc)  # the same step: no hit, b writes a sink of its own
    end_step(kv, alloc)
    assert alloc.sink_cached("a") and not alloc.sink_cached("b")
    b_sink = alloc.page_ids("b")[0]
    kv.free(b)
    assert kv.block_pool.blocks[b_sink].block_hash is None, "b's copy went back as a plain free block"
    assert "b" not in alloc.unregistered


def test_scheduler_output_names_the_pages_of_its_new_requests():
    """What a worker reads: the pages of every request the step sends as new (resumed ones too),
    and whether their sink pages hold a cached sink."""
    requests = {}
    kv, _ = manager(40, install=False, requests=requests)
    prompt = list(range(5 * BLOCK))
    waiting = [request("a", prompt)]

    class Scheduler:
        kv_cache_manager = kv
        kv_cache_config = config(40)

        def __init__(self):
            self.requests = requests

        def schedule(self):
            new = []
            while waiting:
                r = waiting.pop()
                self.requests[r.request_id] = r
                admit(kv, r)
                new.append(type("New", (), {"req_id": r.request_id})())
            return type("Output", (), {"scheduled_new_reqs": new})()

    scheduler = Scheduler()
    alloc = attach_to_scheduler(scheduler, SINK_PAGES, RECENT_PAGES, SINK, RECENT)
    given = pages_of_new_requests(scheduler.schedule(), ["a"])
    assert given == {"a": (alloc.page_ids("a"), False, None)} and len(given["a"][0]) == PAGES
    waiting.append(request("b", prompt + [3]))
    given_b = pages_of_new_requests(scheduler.schedule(), ["b"])["b"]
    assert given_b[1] and given_b[0][0] == given["a"][0][0], "b shares a's sink, cached after a's step"
    assert not set(given_b[0][1:]) & set(given["a"][0][1:])
    schedule = scheduler.schedule
    assert attach_to_scheduler(scheduler, SINK_PAGES, RECENT_PAGES, SINK, RECENT) is alloc
    assert scheduler.schedule is schedule, "attached once: the hook's scheduler, then a caller's call"


def ended(kv, alloc, rid: str, tokens: list[int], computed: int | None = None, preempt: bool = False) -> Request:
    """Request ``rid`` admitted, ``computed`` of its tokens (all) computed over a step, then
    freed: it finished (or was preempted)."""
    r = request(rid, tokens)
    assert admit(kv, r, alloc)[0] is not None
    end_step(kv, alloc)
    r.num_computed_tokens = len(tokens) if computed is None else computed
    kv.free(r)
    if preempt:
        r.num_computed_tokens = 0
    return r


def test_hits_copy_the_ring_an_ended_request_of_its_prefix_left():
    """With ``reuse_rings``, the same prompt again hits every block vLLM's hit does (not a
    recent window and a ring fewer) and names the ended request's recent pages to copy, with the
    positions they hold: the last RECENT of what it computed, up to where the hit ends. The ring
    stays cached: two hits of one step copy it, and so does a hit of a later step."""
    kv, alloc = manager(40, reuse_rings=True)
    free0 = kv.block_pool.get_num_free_blocks()
    prompt = list(range(5 * BLOCK))
    ended(kv, alloc, "a", prompt)
    assert kv.block_pool.get_num_free_blocks() == free0, "a's pages are back, evictable"
    (ring,) = {id(r): r for r in alloc.rings.values()}.values()
    source = [p.block_id for p in ring.pages]
    b, c = request("b", prompt + [7]), request("c", prompt + [8])
    for r in (b, c):
        blocks, hit = admit(kv, r, alloc)
        assert blocks is not None and hit == len(prompt), "vLLM's whole hit"
        assert alloc.ring_of(r.request_id) == (len(prompt) - RECENT, len(prompt), source)
        assert alloc.sink_shared(r.request_id)
        own = alloc.page_ids(r.request_id)[SINK_PAGES:]
        assert not set(own) & set(source), "its own recent pages, the copy's target"
    assert all(p.ref_cnt == 1 for p in ring.pages), "pinned until the step ends: no block of the step evicts them"
    end_step(kv, alloc)
    assert ring.intact() and all(p.block_hash == t for p, t in zip(ring.pages, ring.tags)), "still cached"
    d = request("d", prompt + [9])
    assert admit(kv, d, alloc)[1] == len(prompt) and alloc.ring_of("d")[2] == source, "the next step's hit too"
    end_step(kv, alloc)
    for r in (b, c, d):
        kv.free(r)
    assert kv.block_pool.get_num_free_blocks() == free0 and alloc.pages_in_use == 0


def test_without_reuse_a_hit_computes_its_ring_again():
    kv, alloc = manager(40)
    prompt = list(range(5 * BLOCK))
    ended(kv, alloc, "a", prompt)
    assert admit(kv, request("b", prompt + [7]), alloc)[1] == (5 - RECENT // BLOCK - 1 - RING_BLOCKS) * BLOCK
    assert alloc.ring_of("b") is None and not alloc.rings
    kv, alloc = manager(40, caching=False, reuse_rings=True)  # no prefix caching: no hit would find a ring
    ended(kv, alloc, "a", prompt)
    assert not alloc.rings and all(b.block_hash is None for b in kv.block_pool.blocks)


def test_a_ring_serves_only_hits_it_holds_nearly_all_of_the_ring_before():
    """A ring of positions [hi - RECENT, hi) serves a hit ending at a block boundary b only where
    it holds all but at most a block of the RECENT - 1 positions before b: b in [hi - BLOCK - 1, hi]."""
    kv, alloc = manager(40, reuse_rings=True)
    prompt = list(range(5 * BLOCK + 10))  # hi = 330: boundaries 320 (10 short of hi) and 256 (74 short)
    ended(kv, alloc, "a", prompt)
    assert admit(kv, request("b", prompt[:4 * BLOCK] + [1] * 300), alloc)[1] < 4 * BLOCK, "256: too far back"
    assert alloc.ring_of("b") is None
    b2 = request("b2", prompt + [1])
    assert admit(kv, b2, alloc)[1] == 5 * BLOCK and alloc.ring_of("b2")[:2] == (330 - RECENT, 5 * BLOCK)


def test_an_evicted_ring_is_no_hit_and_a_reserved_one_is_not_evicted():
    kv, alloc = manager(40, reuse_rings=True)
    prompt = list(range(5 * BLOCK))
    ended(kv, alloc, "a", prompt)
    (ring,) = {id(r): r for r in alloc.rings.values()}.values()
    kv.block_pool.evict_blocks({ring.pages[-1].block_id})  # as vLLM evicts a cached block it reuses
    assert admit(kv, request("b", prompt + [7]), alloc)[1] < len(prompt) - RECENT
    kv2, alloc2 = manager(12, reuse_rings=True)
    ended(kv2, alloc2, "a", prompt)  # 5 blocks and 3 pages, all cached, in a pool of 11
    (ring2,) = {id(r): r for r in alloc2.rings.values()}.values()
    hit, _, _ = kv2.get_computed_blocks(request("b", prompt + [7]))  # reserved by b, which is not admitted
    assert len(hit.blocks[0]) == 5
    assert all(p.ref_cnt == 1 for p in ring2.pages), "pinned by the hit that found it"
    cached = {b.block_id: b.block_hash for b in kv2.block_pool.blocks if b.block_hash is not None}
    other = request("o", list(range(1000, 1000 + 3 * BLOCK)))
    assert admit(kv2, other, alloc2)[0] is not None
    evicted = [i for i, h in cached.items() if kv2.block_pool.blocks[i].block_hash != h]
    assert evicted, "3 blocks and 3 pages evict cached ones"
    assert all(p.block_hash == t for p, t in zip(ring2.pages, ring2.tags)), "none of the pinned ring's pages"
    end_step(kv2, alloc2)
    assert ring2.intact(), "unpinned at the step's end, cached"


def test_a_preempted_request_resumes_on_its_own_ring():
    kv, alloc = manager(40, reuse_rings=True)
    prompt = list(range(6 * BLOCK))
    a = ended(kv, alloc, "a", prompt, computed=5 * BLOCK + 20, preempt=True)  # mid-prefill, 340 computed
    blocks, hit = admit(kv, a, alloc)
    assert blocks is not None and hit == 5 * BLOCK and alloc.ring_of("a")[:2] == (340 - RECENT, 5 * BLOCK)


def test_rings_of_ended_requests_are_forgotten_once_evicted():
    kv, alloc = manager(40, reuse_rings=True)
    for i in range(60):  # more rings than the pool holds: most are evicted by the later requests
        ended(kv, alloc, str(i), list(range(1000 * i, 1000 * i + 3 * BLOCK)))
    assert len(alloc.rings) <= 2 * kv.block_pool.num_gpu_blocks // RECENT_PAGES + 16
    assert kv.block_pool.get_num_free_blocks() == 39 and alloc.pages_in_use == 0


def test_worker_side_reads_the_pages_and_names_a_missing_request():
    class Output:
        pass

    out = Output()
    assert pages_of_new_requests(out, ["_warmup_0_"]) is None, "vLLM's start-up warm-up: no scheduler"
    setattr(out, SCHEDULER_OUTPUT_FIELD, {"r1": ([4, 5], True, (100, 320, [9]))})
    assert pages_of_new_requests(out, ["r1"]) == {"r1": ([4, 5], True, (100, 320, [9]))}
    with pytest.raises(WindowPagesError, match=r"\['r2'\] without their OSCAR window pages"):
        pages_of_new_requests(out, ["r1", "r2"])


def test_workers_give_each_new_row_its_pages_and_ring_in_kernel_blocks():
    """The worker's hook (vllm_hooks.assign_window_pages): scheduler blocks of 128 tokens are two
    kernel blocks each; a row's sink page, its recent pages and the pages of the ring it copies
    reach the builder as kernel block ids, the ring's positions unchanged."""
    from types import SimpleNamespace

    from oscar_vllm.serving.vllm_hooks import assign_window_pages

    calls = []
    builder = SimpleNamespace(pages_per_ring=5, sink_pages=1, assign_windows=lambda *a, **k: calls.append((a, k)))
    group = SimpleNamespace(backend=SimpleNamespace(get_name=lambda: "OSCAR"), metadata_builders=[builder],
                            kv_cache_spec=SimpleNamespace(block_size=128))
    runner = SimpleNamespace(attn_groups=[[group]], kv_cache_config=SimpleNamespace(num_blocks=50),
                             req_states=SimpleNamespace(req_id_to_index={"a": 3, "b": 0}))
    out = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="a"), SimpleNamespace(req_id="b")])
    setattr(out, SCHEDULER_OUTPUT_FIELD, {"a": ([4, 7, 8], True, (100, 320, [20, 21])),
                                          "b": ([9, 10, 11], False, None)})
    assign_window_pages(runner, out)
    (args, kwargs), = calls
    assert args == ([3, 0], [[8, 14, 15, 16, 17], [18, 20, 21, 22, 23]], 100)
    assert kwargs == {"allow_null": False, "sink_shared": [True, False], "rings": [(100, 320, [40, 41, 42, 43]), None]}


@pytest.mark.parametrize("block_size,ratio", [(64, 1), (128, 2)])
def test_pages_per_request_follow_the_scheduler_block_size(block_size, ratio):
    """Qwen3-8B's ring (8 KV heads x 128, 64 + 256 entries): a kernel page fits 9 entries and
    holds 8, so the sink fills 8 pages of its own and the recent window 32."""
    layer = type("Layer", (), {"num_kv_heads": 8, "head_size": 128})()
    spec = oscar_kv_cache_spec(layer, type("C", (), {"cache_config": type("CC", (), {"block_size": block_size})()})())
    assert window_pages_per_request(64, 256, 8, 128) == (40, 8)
    assert window_pages_per_request(0, 256, 8, 128) == (29, 0), "no sink: pages filled"
    assert window_pages_of_group(spec, OscarSettings()) == (-(-8 // ratio), -(-32 // ratio), ratio)
    # A page (64 INT2 tokens of 8 heads) holds 9 entries' K and V in BF16, not 10.
    assert 9 * 8 * 128 * 2 * 2 <= 64 * 8 * 72 < 10 * 8 * 128 * 2 * 2
    assert spec.page_size_bytes == ratio * 64 * 8 * 72


@pytest.mark.parametrize("load_tokens", [1, 300], ids=["load-ends-at-prompt", "load-decodes-past-ring"])
@pytest.mark.parametrize("hit_ring", ["recompute", "reuse"])
def test_a_batch_sent_again_is_scheduled_alike_every_time(tmp_path, hit_ring, load_tokens):
    """On the H200 (2026-12-04) the load check's 24 prompts, cached by a load pass, sent 20 times
    gave 9 of 24 replies identical every time with rings reused, taken or copied (22 computing
    them), every later run differing from the first. On vLLM's scheduler (CPU): a pass that ends
    every request one token past its prompt (a ring at the prompt's end for later hits to copy) or
    300 past it (its ring moved on: none), then the same batch four times, 48 tokens out: each
    repeat schedules every request alike, its hit, its chunks and the ring it copies. With
    ``reuse``, after the short pass every hit copies the pass's ring; after the long pass none does,
    the first repeat included: the ring a repeat leaves holds positions it computed again after its
    hit was cut short, and copied by the next repeat it made that repeat's prefill differ from the
    first's (what the H200 run showed)."""
    from benchmarks.vllm_cpu import oscar_scheduler_on_cpu, serve_on_cpu

    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (n,), generator=rng).tolist() for n in (700, 901, 1300, 2047, 3000)]
    with oscar_scheduler_on_cpu(tmp_path, chunk=2048, oscar={"hit_ring": hit_ring}) as (scheduler, _):
        serve_on_cpu(scheduler, prompts, "load", max_tokens=load_tokens)
        repeats = [serve_on_cpu(scheduler, prompts, f"repeat{k}", max_tokens=48) for k in range(4)]
    assert all(r == repeats[0] for r in repeats[1:])
    hits = [r["chunks"][0][0] for r in repeats[0]]
    if hit_ring == "reuse" and load_tokens == 1:
        assert all(r["ring"] is not None and r["ring"][1] == hit == (n - 1) // 64 * 64
                   for r, hit, n in zip(repeats[0], hits, map(len, prompts))), "vLLM's whole hit, every time"
    else:
        assert all(r["ring"] is None and hit <= len(p) - 256 - 256 for r, hit, p in zip(repeats[0], hits, prompts))
