"""Window pages from vLLM's own block pool: vLLM's real KV cache manager (CPU, no model) with
the OSCAR allocator installed, driven as the scheduler drives it."""
import pytest
import torch

from csrc_triton.paged_layout import window_pages_per_request
from oscar_vllm.window_pages import (
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

from oscar_vllm.vllm_hooks import oscar_kv_cache_spec, window_pages_of_group  # noqa: E402
from oscar_vllm.settings import OscarSettings  # noqa: E402

BLOCK = 64
PAGES = 3  # small, so that the pool's arithmetic is easy to follow


def manager(num_blocks: int, caching: bool = True, install: bool = True) -> tuple[KVCacheManager, WindowPageAllocator]:
    layer = type("Layer", (), {"num_kv_heads": 8, "head_size": 128})()
    spec = oscar_kv_cache_spec(layer, type("C", (), {"cache_config": type("CC", (), {"block_size": BLOCK})()})())
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[KVCacheTensor(size=1, shared_by=["l0"])],
                           kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    init_none_hash(sha256)
    kv = KVCacheManager(config, max_model_len=100 * BLOCK, scheduler_block_size=BLOCK, hash_block_size=BLOCK,
                        enable_caching=caching)
    allocator = WindowPageAllocator(kv.block_pool, PAGES)
    if install:
        allocator.install(kv.coordinator)
    return kv, allocator


def request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), None, block_hasher=get_request_block_hasher(BLOCK, sha256))


def admit(kv: KVCacheManager, req: Request):
    """What the scheduler does for a waiting request: prefix-cache lookup, then slots."""
    hit, n_hit, _ = kv.get_computed_blocks(req)
    return kv.allocate_slots(req, req.num_tokens - n_hit, n_hit, hit), n_hit


def test_a_request_takes_its_pages_with_its_blocks_and_returns_them():
    kv, alloc = manager(20)
    free0 = kv.block_pool.get_num_free_blocks()
    req = request("a", list(range(130)))  # 3 blocks of tokens
    blocks, _ = admit(kv, req)
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
    blocks, _ = admit(kv, request("a", list(range(4 * BLOCK))))
    assert blocks is None and alloc.pages_in_use == 0 and not alloc.held
    kv2, alloc2 = manager(1 + 4 + PAGES)
    assert admit(kv2, request("a", list(range(4 * BLOCK))))[0] is not None and alloc2.pages_in_use == PAGES


def test_preemption_and_abort_return_the_pages_and_resuming_takes_new_ones():
    kv, alloc = manager(40)
    free0 = kv.block_pool.get_num_free_blocks()
    reqs = [request(str(i), list(range(100 * i, 100 * i + 200))) for i in range(3)]
    for r in reqs:
        assert admit(kv, r)[0] is not None
    first = {r: alloc.page_ids(r) for r in alloc.held}
    kv.free(reqs[1])  # preempted (the scheduler frees all its blocks)
    deferred = kv.pop_blocks_for_free(reqs[2])  # aborted while a step may still write its blocks
    assert set(first["2"]) <= {b.block_id for b in deferred}, "the pages wait with the request's blocks"
    kv.block_pool.free_blocks(reversed(deferred))
    assert alloc.pages_in_use == PAGES
    assert admit(kv, reqs[1])[0] is not None  # resumed: recomputed from its prompt, new pages
    assert sorted(alloc.held) == ["0", "1"]
    with pytest.raises(WindowPagesError, match="holds no window pages"):
        alloc.page_ids("2")
    kv.free(reqs[0])
    kv.free(reqs[1])
    assert kv.block_pool.get_num_free_blocks() == free0 and alloc.pages_in_use == 0


def test_pages_never_alias_cached_blocks_of_a_prefix_hit():
    """A hit's cached blocks are claimed before the pages are taken: no page is a hit block."""
    kv, alloc = manager(1 + 4 + PAGES + 2)
    a = request("a", list(range(4 * BLOCK)))
    assert admit(kv, a)[0] is not None
    kv.free(a)  # its blocks stay cached (evictable), its pages are free
    b = request("b", list(range(4 * BLOCK)) + [7])
    blocks, hit = admit(kv, b)
    assert blocks is not None and hit == 4 * BLOCK
    pages = alloc.page_ids("b")
    assert not set(pages) & set(kv.get_block_ids("b")[0])


def test_scheduler_output_names_the_pages_of_its_new_requests():
    """What a worker reads: the pages of every request the step sends as new (resumed ones too)."""
    kv, _ = manager(30, install=False)
    reqs = {r: request(r, list(range(i * 70, i * 70 + 100))) for i, r in enumerate("ab")}

    class Scheduler:
        kv_cache_manager = kv

        def schedule(self):
            for r in reqs.values():
                admit(kv, r)
            return type("Output", (), {"scheduled_new_reqs": [type("New", (), {"req_id": r})() for r in reqs]})()

    scheduler = Scheduler()
    alloc = attach_to_scheduler(scheduler, PAGES)
    out = scheduler.schedule()
    given = pages_of_new_requests(out, ["a", "b"])
    assert given == {r: alloc.page_ids(r) for r in "ab"} and all(len(p) == PAGES for p in given.values())
    assert not set(given["a"]) & set(given["b"])


def test_worker_side_reads_the_pages_and_names_a_missing_request():
    class Output:
        pass

    out = Output()
    assert pages_of_new_requests(out, ["_warmup_0_"]) is None, "vLLM's start-up warm-up: no scheduler"
    setattr(out, SCHEDULER_OUTPUT_FIELD, {"r1": [4, 5]})
    assert pages_of_new_requests(out, ["r1"]) == {"r1": [4, 5]}
    with pytest.raises(WindowPagesError, match=r"\['r2'\] without their OSCAR window pages"):
        pages_of_new_requests(out, ["r1", "r2"])


@pytest.mark.parametrize("block_size,ratio", [(64, 1), (128, 2)])
def test_pages_per_request_follow_the_scheduler_block_size(block_size, ratio):
    """Qwen3-8B's ring (8 KV heads x 128, 64 + 256 entries): 36 kernel pages of 9 entries."""
    layer = type("Layer", (), {"num_kv_heads": 8, "head_size": 128})()
    spec = oscar_kv_cache_spec(layer, type("C", (), {"cache_config": type("CC", (), {"block_size": block_size})()})())
    assert window_pages_per_request(320, 8, 128) == 36
    assert window_pages_of_group(spec, OscarSettings()) == (-(-36 // ratio), ratio)
    # A ring costs what 320 BF16 tokens of K and V cost, within a page: 36 pages of 64 INT2 tokens.
    assert 36 * spec.page_size_bytes // ratio == 36 * 64 * 8 * 72
    assert 36 * 64 * 8 * 72 >= 320 * 8 * 128 * 2 * 2 > 35 * 64 * 8 * 72
