"""The BF16 windows' memory, on the scheduler's side: each running request's ring lives in
blocks of vLLM's own KV cache pool, taken when the scheduler first gives the request slots and
returned with its other blocks (finished, aborted or preempted).

So the windows cost memory only for the requests actually running: a server started with
vLLM's default ``max_num_seqs`` (1024) keeps the KV capacity of one that runs 32 requests,
and vLLM's admission checks, watermark and preemption count the pages like any other block,
because the allocator adds them to the count ``allocate_slots`` checks. The workers learn a new
request's pages from the scheduler output (``SCHEDULER_OUTPUT_FIELD``); the layout inside the
pages is ``csrc_triton.paged_layout``'s.

``WindowPageAllocator`` works on a real ``BlockPool`` and coordinator, with no GPU: the tests
drive it through vLLM's ``KVCacheManager`` on the CPU.
"""
from __future__ import annotations

import functools
import logging

from oscar_vllm.errors import OscarError

logger = logging.getLogger("vllm.oscar_vllm")
SCHEDULER_OUTPUT_FIELD = "oscar_window_pages"  # {request id: page block ids} of the step's new requests


class WindowPagesError(OscarError, RuntimeError):
    """The scheduler and the workers disagree about a request's window pages."""


class WindowPageAllocator:
    """Window pages of every request that holds KV blocks, from ``block_pool``.

    ``pages_per_request`` blocks per request (``paged_layout.window_pages_per_ring``).
    """

    def __init__(self, block_pool, pages_per_request: int):
        if pages_per_request < 1:
            raise ValueError(f"a window ring takes at least one page, got {pages_per_request}")
        self.block_pool = block_pool
        self.pages_per_request = pages_per_request
        self.held: dict[str, list] = {}  # request id -> its page blocks

    def pages_needed(self, request_id: str) -> int:
        return 0 if request_id in self.held else self.pages_per_request

    def take(self, request_id: str) -> None:
        if request_id in self.held:
            return
        self.held[request_id] = self.block_pool.get_new_blocks(self.pages_per_request)

    def release(self, request_id: str) -> list:
        """The request's page blocks, no longer held (the caller returns them to the pool)."""
        return self.held.pop(request_id, [])

    def page_ids(self, request_id: str) -> list[int]:
        blocks = self.held.get(request_id)
        if blocks is None:
            raise WindowPagesError(f"request {request_id} is scheduled but holds no window pages")
        return [b.block_id for b in blocks]

    @property
    def pages_in_use(self) -> int:
        return len(self.held) * self.pages_per_request

    def install(self, coordinator) -> None:
        """Wrap this coordinator's (one instance's) allocation methods, as ``allocate_slots``
        and the scheduler call them: the pages enter the free-block check, are taken right
        after the request's own new blocks, and leave with them."""

        def request_id_of(args, kwargs) -> str:
            return kwargs["request_id"] if "request_id" in kwargs else args[0]

        def wrap(name, make):
            original = getattr(coordinator, name)
            setattr(coordinator, name, functools.wraps(original)(make(original)))

        def count(original):
            def get_num_blocks_to_allocate(*args, **kwargs):
                return original(*args, **kwargs) + self.pages_needed(request_id_of(args, kwargs))
            return get_num_blocks_to_allocate

        def allocate(original):
            def allocate_new_blocks(*args, **kwargs):
                new_blocks = original(*args, **kwargs)
                self.take(request_id_of(args, kwargs))
                return new_blocks
            return allocate_new_blocks

        def free(original):
            def free_request(request_id, *args, **kwargs):
                original(request_id, *args, **kwargs)
                self.block_pool.free_blocks(self.release(request_id))
            return free_request

        def pop(original):
            def pop_blocks_for_free(request_id, *args, **kwargs):
                # Deferred frees (an in-flight step may still write the blocks): the pages go
                # back with the request's blocks, when the scheduler frees those.
                return original(request_id, *args, **kwargs) + self.release(request_id)
            return pop_blocks_for_free

        wrap("get_num_blocks_to_allocate", count)
        wrap("allocate_new_blocks", allocate)
        wrap("free", free)
        wrap("pop_blocks_for_free", pop)


def attach_to_scheduler(scheduler, pages_per_request: int) -> WindowPageAllocator:
    """Give ``scheduler`` (vLLM's V1 ``Scheduler``) window pages: its KV cache manager counts and
    allocates them, and every ``schedule()`` output names the pages of the requests it sends the
    workers as new (new, resumed after preemption, or re-sent with more input)."""
    manager = scheduler.kv_cache_manager
    allocator = WindowPageAllocator(manager.block_pool, pages_per_request)
    allocator.install(manager.coordinator)
    original = scheduler.schedule

    @functools.wraps(original)
    def schedule(*args, **kwargs):
        output = original(*args, **kwargs)
        setattr(output, SCHEDULER_OUTPUT_FIELD,
                {r.req_id: allocator.page_ids(r.req_id) for r in output.scheduled_new_reqs})
        return output

    scheduler.schedule = schedule
    scheduler.oscar_window_pages = allocator
    return allocator


def pages_of_new_requests(scheduler_output, req_ids) -> dict[str, list[int]] | None:
    """The window pages of the requests a worker adds this step.

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
