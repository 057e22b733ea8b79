"""Per-request BF16 window rings: which ring each scheduled request owns, and which rings
must be emptied before a new request uses them.

vLLM's V2 model runner gives every live request a stable row (``req_states`` index, the
``idx_mapping`` of a batch) that is reused after the request ends. A request's ring is that
row. ``vllm_hooks`` feeds this module from the runner; the metadata builder reads it.
Torch only, no vLLM import, so it can be tested alone.
"""
from __future__ import annotations

import torch

_batch_rows: torch.Tensor | None = None  # int32 [num_reqs]: ring of each request of the batch
_pending_resets: set[int] = set()
_window_positions: list[torch.Tensor] = []  # every layer's int32 [num_rings, sink + recent]


def set_batch_rows(rows: torch.Tensor) -> None:
    global _batch_rows
    _batch_rows = rows


def batch_rows() -> torch.Tensor | None:
    return _batch_rows


def request_row_assigned(row: int) -> None:
    """A new request (or a resumed, preempted one) takes ``row``: its ring must start empty."""
    _pending_resets.add(int(row))


def register_window_positions(window_pos: torch.Tensor) -> None:
    _window_positions.append(window_pos)


def apply_resets() -> None:
    """Mark the rings of newly assigned rows empty in every layer (before the step runs).

    An emptied entry makes readers fall back to the INT2 copy: a ring left by a finished
    request can never be read as the new request's window.
    """
    if not _pending_resets or not _window_positions:
        return
    rows = torch.tensor(sorted(_pending_resets), dtype=torch.long)
    _pending_resets.clear()
    for window_pos in _window_positions:
        window_pos.index_fill_(0, rows.to(window_pos.device, non_blocking=True), -1)
