"""A tiny stand-in for vLLM's scheduler and block manager, to drive the OSCAR kernels and
their references through the same steps vLLM would: requests with random block tables,
chunked prefill, decode, mixed batches."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from csrc_triton.paged_layout import BLOCK_SIZE, BatchLayout, MixedCache, int2_cache_shape, window_pages_per_ring


@dataclass
class Step:
    """One scheduled batch: ``tokens[r]`` new tokens for request ``reqs[r]``."""

    reqs: list[int]
    cu_q: torch.Tensor  # int32 [R + 1]
    seq_lens: torch.Tensor  # int32 [R]
    block_table: torch.Tensor  # int32 [R, max_blocks]
    slot_mapping: torch.Tensor  # int64 [T]
    ring_slots: torch.Tensor  # int32 [R]
    token_index: torch.Tensor  # int64 [T]: position of each token in its request's sequence
    max_query_len: int

    def batch(self, num_decodes: int = 0) -> BatchLayout:
        """The step as the kernels and their twins take it (its first ``num_decodes`` requests decodes)."""
        return BatchLayout(self.block_table, self.seq_lens, self.cu_q, self.ring_slots, len(self.reqs), num_decodes,
                           self.max_query_len)


WINDOW_ENTRIES_PER_PAGE = 3  # few, so that rings span many pages and entries cross page edges


class PagedCache:
    """Paged INT2 cache + BF16 rings for ``num_reqs`` requests of at most ``max_len`` tokens.

    The rings live in pages of their own tensor (in serving they are pages of the cache), in
    random order, with padding after each page's values: a kernel that ignores the page table
    or the page stride fails."""

    def __init__(self, num_reqs: int, max_len: int, hkv: int, d: int, sink: int, recent: int,
                 device: str = "cpu", seed: int = 0, entries_per_page: int = WINDOW_ENTRIES_PER_PAGE):
        block_size = BLOCK_SIZE
        g = torch.Generator().manual_seed(seed)
        blocks_per_req = -(-max_len // block_size)
        num_blocks = num_reqs * blocks_per_req + 3
        # Random physical blocks, so a kernel that ignores the block table fails.
        perm = torch.randperm(num_blocks, generator=g)[: num_reqs * blocks_per_req]
        self.block_table = perm.view(num_reqs, blocks_per_req).to(torch.int32).to(device)
        self.ring_slots = (torch.randperm(num_reqs + 2, generator=g)[:num_reqs]).to(torch.int32)
        # Random bytes, NaN parameters included: a kernel that reads an unwritten slot shows.
        self.cache = torch.randint(0, 256, int2_cache_shape(num_blocks, hkv, d), dtype=torch.uint8,
                                   generator=g).to(device)
        rings, per_page = num_reqs + 2, entries_per_page
        page_elems = 2 * per_page * hkv * d + 8
        pages_per_ring = window_pages_per_ring(sink, recent, page_elems, hkv, d)
        perm = torch.randperm(rings * pages_per_ring + 1, generator=g)[: rings * pages_per_ring]
        self.window_pages = perm.view(rings, pages_per_ring).to(torch.int32).to(device)
        self.windows = torch.full((rings * pages_per_ring + 1, page_elems), float("nan"), dtype=torch.bfloat16,
                                  device=device)
        self.window_pos = torch.full((rings, sink + recent), -1, dtype=torch.int32, device=device)
        self.block_size = block_size
        self.sink, self.recent = sink, recent
        self.done = [0] * num_reqs
        self.device = device

    def mixed(self, param_dtype: torch.dtype = torch.float16) -> MixedCache:
        """The cache as the kernels and their twins take it (the tensors themselves: writes land here)."""
        return MixedCache(self.cache, self.windows, self.window_pages, self.window_pos, self.sink, self.recent,
                          param_dtype)

    def clone(self) -> "PagedCache":
        other = object.__new__(PagedCache)
        other.__dict__.update(self.__dict__)
        for name in ("cache", "windows", "window_pos"):
            setattr(other, name, getattr(self, name).clone())
        other.done = list(self.done)
        return other

    def schedule(self, new_tokens: dict[int, int]) -> Step:
        """A batch that appends ``new_tokens[r]`` tokens to request ``r``; advances it."""
        reqs = list(new_tokens)
        q_lens = [new_tokens[r] for r in reqs]
        cu = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
        seq = torch.tensor([self.done[r] + new_tokens[r] for r in reqs], dtype=torch.int32)
        pos = torch.cat([torch.arange(self.done[r], self.done[r] + new_tokens[r]) for r in reqs])
        bt = self.block_table[reqs].cpu()
        row = torch.repeat_interleave(torch.arange(len(reqs)), torch.tensor(q_lens))
        slots = bt[row, pos // self.block_size].long() * self.block_size + pos % self.block_size
        for r in reqs:
            self.done[r] += new_tokens[r]
        dev = self.device
        return Step(reqs, cu.to(dev), seq.to(dev), bt.to(dev), slots.to(dev),
                    self.ring_slots[reqs].to(dev), pos, max(q_lens))
