"""benchmarks/profile_decode.py's count of host syncs: by the line that asks for one, nothing else."""
import warnings
from pathlib import Path

import pytest
import torch

from benchmarks import profile_decode


def ask_for_a_sync():
    warnings.warn("called a synchronizing CUDA operation")


def read_back(x: torch.Tensor) -> float:
    return x.sum().item()


def test_sync_sites_count_each_synchronizing_line_and_nothing_else():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            ask_for_a_sync()
        warnings.warn("some other warning")
        # What torch 2.11 says when the mode is turned on (inside set_sync_debug_mode): no sync.
        warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all "
                      "synchronizing operations")
    line = ask_for_a_sync.__code__.co_firstlineno + 1
    assert profile_decode.sync_sites(caught) == {f"{Path(__file__).name}:{line}": 3}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's sync debug mode needs CUDA")
def test_sync_sites_see_what_torch_calls_a_sync():
    x = torch.ones(4, device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            read_back(x)
            x.add_(1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    line = read_back.__code__.co_firstlineno + 1
    assert profile_decode.sync_sites(caught) == {f"{Path(__file__).name}:{line}": 1}
