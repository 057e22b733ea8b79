"""The BF16 windows' memory, on the scheduler's side: each running request's ring lives in
blocks of vLLM's own KV cache pool, taken when the scheduler first gives the request slots and
returned with its other blocks (finished, aborted or preempted).

So the windows cost memory only for the requests actually running: a server started with
vLLM's default ``max_num_seqs`` (1024) keeps the KV capacity of one that runs 32 requests,
and vLLM's admission checks, watermark and preemption count the pages like any other block,
because the allocator adds them to the count ``allocate_slots`` checks. The workers learn a new
request's pages from the scheduler output (``SCHEDULER_OUTPUT_FIELD``); the layout inside the
pages is ``csrc_triton.paged_layout``'s: the sink's pages, then the recent window's.

Prefix-cache hits keep both windows in BF16, as a run without caching has them:

* **The sink is shared.** Once a request's first block (the sink's) is cached, its sink pages
  are cached too, under tags derived from that block's hash, and live on as evictable cached
  blocks after the request ends. A request that hits the block takes those pages as its own
  sink pages (shared, read only: it never writes positions it did not compute). vLLM evicts
  them like any cached block; a hit whose sink pages are gone is no hit.
* **The recent window is recomputed.** A hit ends at least ``recent`` tokens before the end of
  the request's tokens, so the request computes its own recent window (as the OSCAR reference
  caps prefix matches).
* **So is the ring before the first new token.** A hit also stops ``recent`` tokens (whole
  blocks) short of the cached blocks it could take, and the request computes those again: the
  chunk that computes its first uncached token then finds the ``recent - 1`` tokens before it in
  BF16 (its own chunk, or its ring), as a chunk of an uncached prefill does, instead of reading
  the cached middle of the prefix in 2-bit right up to itself. A hit costs one ring of prefill
  more (the window's tokens again) and gives the prompt's tail the reads of an uncached prefill
  that had a chunk boundary where the cached prefix ends.
* **Or a hit copies the ring an earlier request left** (``hit_ring`` ``reuse``). A request that
  ends (or is preempted) leaves its recent-window pages in the pool as evictable cached blocks,
  indexed by the hashes of the block boundaries its ring can serve: those where its ring holds
  all but at most ``block_size`` of the ``recent - 1`` positions before the boundary. A hit that
  ends at such a boundary (the same prompt again, a follow-up turn, a preempted request resuming)
  reads those pages instead of computing the ring again: the hit then ends where vLLM's does,
  and the worker marks the positions the ring holds (``ring``) as held, as it marks a shared
  sink; a position it does not hold reads its 2-bit copy, as a stale entry always does. The
  pages are copied, not taken: the worker copies them into the request's own recent pages
  before the step runs, and the ring stays cached for the next hit; a ring left
  later for the same boundary replaces it only where it holds earlier positions. So every hit
  of a prefix reads the same ring while it is cached (taken pages would serve one hit, and the
  next would compute its ring again: the same prompt sent twice would be computed two ways).
  A ring serves no position its request computed again after a hit cut short (``recomputed``):
  the next hit of the prompt would copy what the first recomputed, and be computed another way
  than the first (the same batch sent twice differed so on the H200).
* **A hit covers only blocks an earlier step wrote.** vLLM caches a block when it schedules
  it, so a request could hit blocks another request of the same step fills, and sink pages
  written in the same step; the hit ends before the first such block instead.

``WindowPageAllocator`` works on a real ``BlockPool`` and coordinator, with no GPU: the tests
drive it through vLLM's ``KVCacheManager`` on the CPU.
"""
from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from oscar_vllm.core.errors import OscarError
from oscar_vllm.serving import hooks

logger = logging.getLogger("vllm.oscar_vllm")
# {request id: (page block ids, sink shared, ring)} of the step's new requests; ``sink shared``:
# the sink pages came from the prefix cache and hold the sink already, else the request writes
# them; ``ring``: (lo, hi, source block ids), the positions a ring of an earlier request holds
# and its recent pages, to copy into the request's own before it runs, or None.
SCHEDULER_OUTPUT_FIELD = "oscar_window_pages"
SINK_TAG = b"oscar_vllm.sink"
RING_TAG = b"oscar_vllm.ring"
# The pages held are logged when they change: at once from and to 0, else at most this often
# (USAGE_LOG is the line; tests/gpu/serve_load.py reads it).
USAGE_LOG_SECONDS = 10.0
USAGE_LOG = "OSCAR window pages held: %d blocks by %d requests"


class WindowPagesError(OscarError, RuntimeError):
    """The scheduler and the workers disagree about a request's window pages."""


@dataclass
class RequestPages:
    sink: list = field(default_factory=list)  # KVCacheBlocks of the sink, maybe shared
    recent: list = field(default_factory=list)  # KVCacheBlocks of the recent window, its own
    shared: bool = False  # the sink pages came from the prefix cache, holding the sink already
    start: int = 0  # the first position its ring holds: what it computed, or a copied ring's
    # Positions below this one were in the prefix cache when it was admitted and it computed them
    # again (its hit cut short): not the values the prefill that cached them left, so no ring it
    # leaves serves them (0: none).
    recomputed: int = 0
    # (lo, hi, pages): the positions [lo, hi) a ring copied from an earlier request holds, and
    # that ring's pages (cached blocks, read once), or None
    ring: tuple[int, int, list] | None = None


@dataclass(eq=False)  # compared and hashed as itself: the allocator keys the step's reserved rings by it
class CachedRing:
    """An ended request's recent-window pages, evictable cached blocks of the pool whose entries
    for the positions from ``lo`` up to where it ended hold those positions (``tags``: the pages'
    keys in vLLM's map)."""
    pages: list
    tags: list
    lo: int

    def evicted(self) -> bool:
        """Whether vLLM reused a page (it drops a page's key when it does)."""
        return any(p.block_hash != t for p, t in zip(self.pages, self.tags))

    def intact(self) -> bool:
        """Not evicted, and held by no one (a deferred free may hold it a step longer)."""
        return not self.evicted() and all(p.ref_cnt == 0 for p in self.pages)


class WindowPageAllocator:
    """Window pages of every request that holds KV blocks, from ``block_pool``.

    ``sink_pages`` + ``recent_pages`` blocks per request (``paged_layout.window_pages_per_request``
    in scheduler blocks of ``block_size`` tokens); ``sink``/``recent`` in tokens; ``requests``:
    the scheduler's requests by id (their block hashes name a cached sink).
    """

    def __init__(self, block_pool, sink_pages: int, recent_pages: int, block_size: int, sink: int, recent: int,
                 requests: Mapping[str, object], reuse_rings: bool = False):
        if recent_pages < 1 or sink_pages < 0 or (sink > 0) != (sink_pages > 0):
            raise ValueError(f"a ring of {sink} + {recent} entries cannot take {sink_pages} + {recent_pages} pages")
        self.block_pool = block_pool
        self.sink_pages, self.recent_pages = sink_pages, recent_pages
        self.block_size, self.sink, self.recent = block_size, sink, recent
        self.requests = requests
        # The block whose hash names the sink: the last one the sink touches.
        self.sink_block = -(-sink // block_size) - 1
        # Cached blocks a hit leaves to be computed again, so that the first uncached token's
        # chunk reads the recent - 1 tokens before it in BF16 (its ring) and not 2-bit.
        self.ring_blocks = -(-recent // block_size)
        self.held: dict[str, RequestPages] = {}
        # Requests that write their own sink, not cached yet (in admission order: the first
        # to have its sink block cached provides the prefix's cached sink).
        self.unregistered: dict[str, None] = {}
        self.fresh: set[int] = set()  # blocks cached in the current schedule() call
        self.reuse_rings = reuse_rings
        # Ended requests' rings by the hash of the block before a boundary each can serve, and the
        # ones a hit of this step reserved.
        self.rings: dict[bytes, CachedRing] = {}
        self.reserved: dict[CachedRing, None] = {}  # in the order reserved: unpinned in that order
        self.rings_cached = 0  # a counter that makes every ring's page keys its own
        # Hits cut short in this step, by the id of the request's block hash list: the blocks
        # vLLM offered (read when the request takes its pages, in the same schedule() call).
        self.offered: dict[int, int] = {}
        self.logged_pages, self.logged_at = 0, float("-inf")  # the last usage line

    @property
    def pages_per_request(self) -> int:
        return self.sink_pages + self.recent_pages

    @property
    def pages_in_use(self) -> int:
        """Page blocks the running requests hold (a shared sink counted once per holder)."""
        return sum(len(p.sink) + len(p.recent) for p in self.held.values())

    def sink_tags(self, block_hashes) -> list[bytes]:
        """The sink pages' keys in vLLM's cached-block map, one per page, derived from the sink
        block's hash: a hash, then the KV cache group (0) in 4 bytes, as vLLM's own keys."""
        base = bytes(block_hashes[self.sink_block])
        return [hashlib.sha256(SINK_TAG + base + i.to_bytes(4, "big")).digest() + bytes(4)
                for i in range(self.sink_pages)]

    def cached_sink(self, block_hashes) -> list | None:
        """The cached sink pages of the prefix whose block hashes these are, or None."""
        if self.sink_pages == 0 or len(block_hashes) <= self.sink_block:
            return None
        pages = [self.block_pool.cached_block_hash_to_block.get_one_block(t) for t in self.sink_tags(block_hashes)]
        return None if any(p is None for p in pages) else pages

    def hit_blocks(self, hit: list, num_tokens: int, block_hashes) -> int:
        """How many of a prefix-cache hit's blocks (``hit``, vLLM's longest hit for a request of
        ``num_tokens`` tokens) the request may use: none the current step fills; then, at the
        longest boundary an ended request's ring serves, all up to it; else none of its last
        ``recent`` tokens, and ``ring_blocks`` fewer than that (see the module's docstring)."""
        offered = n = next((i for i, b in enumerate(hit) if b.block_id in self.fresh), len(hit))
        trimmed = max(0, min(n, max(0, num_tokens - self.recent) // self.block_size) - self.ring_blocks)
        n = next((b for b in range(n, trimmed, -1) if self.reserve_ring(block_hashes, b)), trimmed)
        if self.sink_pages and n > 0 and (n <= self.sink_block or self.cached_sink(block_hashes) is None):
            n = 0
        if n < offered and self.reuse_rings:
            self.offered[id(block_hashes)] = offered
        return n

    def new_pages(self, request_id: str, start: int = 0) -> RequestPages:
        """The pages record of a request admitted now, computing from ``start``."""
        request = self.requests.get(request_id)
        offered = self.offered.pop(id(request.block_hashes), 0) if request is not None else 0
        pages = self.held[request_id] = RequestPages(start=start, recomputed=offered * self.block_size)
        return pages

    def ring_key(self, block_hashes, blocks: int) -> bytes | None:
        """The key of the boundary after ``blocks`` blocks of the prefix these hashes name."""
        return bytes(block_hashes[blocks - 1]) if 0 < blocks <= len(block_hashes) else None

    def reserve_ring(self, block_hashes, blocks: int) -> bool:
        """Whether an intact ring serves a hit of ``blocks`` blocks of this prefix. The first hit
        of a step that finds it pins its pages (off the free list) until the step's end, so that
        no block this step allocates evicts them before the worker copies them."""
        key = self.ring_key(block_hashes, blocks) if self.reuse_rings and blocks > self.sink_block else None
        ring = self.rings.get(key) if key is not None else None
        if ring is None:
            return False
        if ring not in self.reserved:
            if not ring.intact():
                return False
            self.block_pool.touch(ring.pages)
            self.reserved[ring] = None
        return True

    def take_ring(self, request_id: str, hit_blocks: int) -> None:
        """Give a request admitted with a hit of ``hit_blocks`` blocks the ring reserved for it:
        the worker copies its pages into the request's own recent pages, and it stays cached."""
        request = self.requests[request_id]
        ring = self.rings.get(self.ring_key(request.block_hashes, hit_blocks))
        if ring is None or ring not in self.reserved:
            return
        pages = self.held[request_id]
        pages.start, pages.ring = ring.lo, (ring.lo, hit_blocks * self.block_size, ring.pages)

    def cache_ring(self, request_id: str, pages: RequestPages) -> None:
        """Leave an ending request's recent pages to later hits (``reuse_rings``): indexed by the
        boundaries where its ring holds all but at most ``block_size`` of the ``recent - 1``
        positions before it, and no cached ring holds more of them. A ring already cached for a
        boundary stays where the new one holds no earlier position: a request that copied it holds
        the same values there, or fewer of them (its own writes moved its ring on), and a hit of
        the same prompt should read what the hits before it read."""
        request = self.requests.get(request_id)
        if not (self.reuse_rings and self.block_pool.enable_caching and pages.recent and request is not None):
            return  # (without prefix caching no hit would find it)
        hi = request.num_computed_tokens
        lo = max(pages.start, pages.recomputed, hi - self.recent, self.sink)
        bs = self.block_size
        keys = [self.ring_key(request.block_hashes, b // bs)
                for b in range(hi // bs * bs, max(lo, hi - bs - 1) - 1, -bs)
                if b > max(lo, self.sink_block * bs) and lo - (b - self.recent + 1) <= bs]
        keys = [k for k in keys if k is not None and (k not in self.rings or self.rings[k].lo > lo
                                                      or self.rings[k].evicted())]
        if not keys:
            return
        self.rings_cached += 1
        base = RING_TAG + self.rings_cached.to_bytes(8, "big")
        tags = [hashlib.sha256(base + i.to_bytes(4, "big")).digest() + bytes(4) for i in range(len(pages.recent))]
        for page, tag in zip(pages.recent, tags):
            page.set_block_hash(tag)
            self.block_pool.cached_block_hash_to_block.insert(tag, page)
        ring = CachedRing(list(pages.recent), tags, lo)
        for key in keys:
            self.rings[key] = ring
        if len(self.rings) > 2 * self.block_pool.num_gpu_blocks // self.recent_pages + 16:
            # Evicted rings leave their keys behind: at most this many rings fit the pool at once.
            self.rings = {k: r for k, r in self.rings.items() if not r.evicted()}

    def pages_needed(self, request_id: str, new_computed_blocks) -> int:
        if request_id in self.held:
            return 0
        sink = self.shared_sink_of(request_id, new_computed_blocks)
        if sink is None:
            return self.pages_per_request
        return self.recent_pages + sum(b.ref_cnt == 0 for b in sink)  # the rest is in use already

    def shared_sink_of(self, request_id: str, new_computed_blocks) -> list | None:
        """The cached sink pages a request starting with hit blocks ``new_computed_blocks`` shares."""
        if self.sink_pages == 0 or len(new_computed_blocks[0]) <= self.sink_block:
            return None
        request = self.requests[request_id]
        if request.num_computed_tokens:
            return None
        sink = self.cached_sink(request.block_hashes)
        if sink is None:
            raise WindowPagesError(f"request {request_id} hit the sink block of a prefix whose sink pages are gone")
        return sink

    def take_hit_pages(self, request_id: str, new_computed_blocks) -> None:
        """What a request admitted with hit blocks ``new_computed_blocks`` takes from the prefix
        cache: its cached sink pages (shared) and a ring reserved for it (to copy)."""
        sink = self.shared_sink_of(request_id, new_computed_blocks)
        if request_id in self.held:
            return
        pages = self.new_pages(request_id, len(new_computed_blocks[0]) * self.block_size)
        if sink is not None:
            self.block_pool.touch(sink)
            pages.sink, pages.shared = list(sink), True
        self.take_ring(request_id, len(new_computed_blocks[0]))

    def take(self, request_id: str) -> None:
        pages = self.held.get(request_id)
        if pages is not None and pages.recent and (pages.sink or not self.sink_pages):
            return  # a running request: called every step
        if pages is None:
            pages = self.new_pages(request_id)
        if not pages.sink:
            pages.sink = self.block_pool.get_new_blocks(self.sink_pages)
            if self.sink_pages:
                self.unregistered[request_id] = None
        if not pages.recent:
            pages.recent = self.block_pool.get_new_blocks(self.recent_pages)

    def release(self, request_id: str) -> list:
        """The request's page blocks, no longer held (the caller returns them to the pool), the
        sink last: cached sink pages outlive the request's other blocks in vLLM's LRU order."""
        self.unregistered.pop(request_id, None)
        pages = self.held.pop(request_id, None)
        if not self.held:
            self.log_usage()
        if pages is None:
            return []
        self.cache_ring(request_id, pages)
        return pages.recent + pages.sink

    def page_ids(self, request_id: str) -> list[int]:
        pages = self.held.get(request_id)
        if pages is None or not pages.recent:
            raise WindowPagesError(f"request {request_id} is scheduled but holds no window pages")
        return [b.block_id for b in pages.sink + pages.recent]

    def ring_of(self, request_id: str) -> tuple[int, int, list[int]] | None:
        """``(lo, hi, source pages)``: the positions ``[lo, hi)`` of the ring the request copies
        from an earlier one and that ring's recent pages (block ids), or None."""
        ring = self.held[request_id].ring
        return None if ring is None else (ring[0], ring[1], [b.block_id for b in ring[2]])

    def sink_shared(self, request_id: str) -> bool:
        """Whether the request's sink pages came from the prefix cache (it reads, never writes them)."""
        return self.held[request_id].shared

    def sink_cached(self, request_id: str) -> bool:
        """Whether the request's sink pages are in the prefix cache (shared, or cached since):
        only cached pages carry a block hash, the tags ``end_step`` gives them."""
        sink = self.held[request_id].sink
        return bool(sink) and sink[0].block_hash is not None

    def log_usage(self) -> None:
        """Log the pages held (USAGE_LOG) if they changed: at once when they leave or reach 0, else
        at most every USAGE_LOG_SECONDS. So the last line of an idle server says 0, and a request
        whose pages never came back keeps it from saying so."""
        held, now = self.pages_in_use, time.monotonic()
        if held == self.logged_pages or (held and self.logged_pages and now - self.logged_at < USAGE_LOG_SECONDS):
            return
        logger.info(USAGE_LOG, held, len(self.held))
        self.logged_pages, self.logged_at = held, now

    def begin_step(self) -> None:
        self.fresh.clear()
        self.offered.clear()

    def end_step(self, blocks_of) -> None:
        """Unpin the rings this step's hits reserved: the worker copies them before the step
        runs, ahead of any write into blocks a later step allocates. Cache the sink pages of
        requests whose sink block got cached in this step (``blocks_of(request_id)``: its KV
        blocks). Their sink is written by the end of the step, so later steps can read it; a
        prefix cached already keeps its first copy."""
        for ring in self.reserved:
            self.block_pool.free_blocks(ring.pages)
        self.reserved.clear()
        for request_id in list(self.unregistered):
            blocks = blocks_of(request_id)
            if len(blocks) <= self.sink_block or blocks[self.sink_block].block_hash is None:
                continue
            del self.unregistered[request_id]
            request = self.requests[request_id]
            if self.cached_sink(request.block_hashes) is not None:
                continue
            for tag, page in zip(self.sink_tags(request.block_hashes), self.held[request_id].sink):
                page.set_block_hash(tag)
                self.block_pool.cached_block_hash_to_block.insert(tag, page)

    def install(self, coordinator) -> None:
        """Wrap this coordinator's (one instance's) methods, and its block pool's, as
        ``allocate_slots``, the scheduler and ``get_computed_blocks`` call them: hits are trimmed,
        the pages enter the free-block check, are taken once any hit blocks are claimed, and leave
        with the request's blocks (the ``window-pages-*`` hooks of ``oscar_vllm.serving.hooks``)."""
        for name in COORDINATOR_HOOKS:
            hooks.wrap_instance(name, coordinator, self)
        hooks.wrap_instance("window-pages-fresh-blocks", self.block_pool, self)


# The hooks WindowPageAllocator.install puts on a coordinator; each wrapper's factory takes
# (original, read, allocator).
COORDINATOR_HOOKS = ("window-pages-hits", "window-pages-count", "window-pages-hit-pages", "window-pages-take",
                     "window-pages-free", "window-pages-deferred-free")


def trim_cache_hits(original, read, allocator: WindowPageAllocator):
    """``find_longest_cache_hit``: a hit ends where the allocator's ``hit_blocks`` says."""

    def find_longest_cache_hit(*args, **kwargs):
        block_hashes, max_cache_hit_length = read(args, kwargs)
        # vLLM asks for at most num_tokens - 1 (the last token is always computed).
        blocks, hit, uncached = original(*args, **kwargs)
        n = allocator.hit_blocks(blocks[0], max_cache_hit_length + 1, block_hashes)
        if n == len(blocks[0]):
            return blocks, hit, uncached
        return tuple(group[:n] for group in blocks), n * allocator.block_size, 0

    return find_longest_cache_hit


def count_pages(original, read, allocator: WindowPageAllocator):
    """``get_num_blocks_to_allocate``: a new request's pages count with its blocks."""

    def get_num_blocks_to_allocate(*args, **kwargs):
        return original(*args, **kwargs) + allocator.pages_needed(*read(args, kwargs))

    return get_num_blocks_to_allocate


def claim_hit_pages(original, read, allocator: WindowPageAllocator):
    """``allocate_new_computed_blocks``: once a hit's blocks are claimed, its cached sink and ring."""

    def allocate_new_computed_blocks(*args, **kwargs):
        original(*args, **kwargs)
        allocator.take_hit_pages(*read(args, kwargs))

    return allocate_new_computed_blocks


def take_pages(original, read, allocator: WindowPageAllocator):
    """``allocate_new_blocks``: the request's own pages, after its new blocks."""

    def allocate_new_blocks(*args, **kwargs):
        new_blocks = original(*args, **kwargs)
        allocator.take(*read(args, kwargs))
        return new_blocks

    return allocate_new_blocks


def free_pages(original, read, allocator: WindowPageAllocator):
    """``free``: the pages go back to the pool with the request's blocks."""

    def free(*args, **kwargs):
        original(*args, **kwargs)
        allocator.block_pool.free_blocks(allocator.release(*read(args, kwargs)))

    return free


def pop_pages(original, read, allocator: WindowPageAllocator):
    """``pop_blocks_for_free``: deferred frees (an in-flight step may still write the blocks): the
    pages go back with the request's blocks, when the scheduler frees those."""

    def pop_blocks_for_free(*args, **kwargs):
        return original(*args, **kwargs) + allocator.release(*read(args, kwargs))

    return pop_blocks_for_free


def note_cached_blocks(original, read, allocator: WindowPageAllocator):
    """``BlockPool.cache_full_blocks``: the blocks cached in this ``schedule()`` call (no hit covers them)."""

    def cache_full_blocks(*args, **kwargs):
        blocks, num_cached_blocks, num_full_blocks = read(args, kwargs)
        allocator.fresh.update(b.block_id for b in blocks[num_cached_blocks:num_full_blocks])
        return original(*args, **kwargs)

    return cache_full_blocks


def schedule_with_pages(original, read, allocator: WindowPageAllocator, blocks_of):
    """``Scheduler.schedule``: each step begins and ends the allocator's step, and its output names
    the pages of the requests it sends as new (``SCHEDULER_OUTPUT_FIELD``)."""

    def schedule(*args, **kwargs):
        allocator.begin_step()
        output = original(*args, **kwargs)
        allocator.end_step(blocks_of)
        allocator.log_usage()
        setattr(output, SCHEDULER_OUTPUT_FIELD, {
            r.req_id: (allocator.page_ids(r.req_id), allocator.sink_shared(r.req_id), allocator.ring_of(r.req_id))
            for r in output.scheduled_new_reqs
        })
        return output

    return schedule


def attach_to_scheduler(scheduler, sink_pages: int, recent_pages: int, sink: int, recent: int,
                        reuse_rings: bool = False) -> WindowPageAllocator:
    """Give ``scheduler`` (vLLM's V1 ``Scheduler``) window pages: its KV cache manager counts and
    allocates them and trims prefix-cache hits, and every ``schedule()`` output names the pages
    of the requests it sends the workers as new (new, resumed after preemption, or re-sent).
    A scheduler that has its pages already keeps them: a second allocator over the same manager
    would trim every prefix-cache hit twice."""
    if getattr(scheduler, "oscar_window_pages", None) is not None:
        return scheduler.oscar_window_pages
    manager = scheduler.kv_cache_manager
    block_size = scheduler.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
    allocator = WindowPageAllocator(manager.block_pool, sink_pages, recent_pages, block_size, sink, recent,
                                    scheduler.requests, reuse_rings)
    allocator.install(manager.coordinator)

    def blocks_of(request_id):
        return manager.coordinator.get_blocks(request_id)[0]

    hooks.wrap_instance("window-pages-schedule", scheduler, allocator, blocks_of)
    scheduler.oscar_window_pages = allocator
    return allocator


def pages_of_new_requests(scheduler_output, req_ids) -> dict[str, tuple[list[int], bool, tuple | None]] | None:
    """The window pages of the requests a worker adds this step, whether their sink pages hold a
    cached sink, and the ring it copies from an earlier request: (lo, hi, source pages) or None.

    ``None`` for an output no scheduler built: vLLM's start-up warm-up runs made-up requests
    through the model before the scheduler exists; their rings go to the null block (no request
    reads it, and their rows are emptied before a real request takes them). An output from the
    OSCAR scheduler that lacks a request it sends is a named error.
    """
    given = getattr(scheduler_output, SCHEDULER_OUTPUT_FIELD, None)
    if given is None:
        return None
    missing = [r for r in req_ids if r not in given]
    if missing:
        raise WindowPagesError(f"the scheduler sent request(s) {missing[:4]} without their OSCAR window pages")
    return {r: given[r] for r in req_ids}
