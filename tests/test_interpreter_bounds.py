"""The interpreter's bounds check (tests/interpreter_bounds.py, installed by conftest.py for every
interpreted kernel): a masked-in access outside the launch's arguments fails the launch; masked-out
lanes and accesses anywhere inside an argument's storage pass."""
import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="checks the interpreter")


@triton.jit
def _shifted_copy(x_ptr, y_ptr, shift, n, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y_ptr + i, tl.load(x_ptr + i + shift, mask=i < n, other=0.0), mask=i < n)


def test_a_read_before_its_tensor_fails_the_launch():
    x, y = torch.arange(8.0), torch.zeros(8)
    with pytest.raises(Exception, match="_shifted_copy: a load of 1 masked-in elements outside every tensor"):
        _shifted_copy[(1,)](x, y, -1, 8, N=8)


def test_a_write_into_an_empty_tensor_fails_the_launch():
    # (An access that lands inside another argument's storage passes: the check knows storages.)
    x, empty = torch.arange(8.0), torch.empty(0)
    with pytest.raises(Exception, match="a store of 8 masked-in elements outside every tensor"):
        _shifted_copy[(1,)](x, empty, 0, 8, N=8)


def test_masked_lanes_and_views_inside_their_storage_pass():
    base = torch.arange(16.0)
    x, y = base[4:12], torch.zeros(8)
    _shifted_copy[(1,)](x, y, -4, 8, N=8)  # reaches the storage's first 4 elements, outside the view
    assert y.tolist() == list(range(8))
    _shifted_copy[(1,)](base[12:], y, 0, 4, N=8)  # lanes 4-7 masked out, past the storage
    assert y[:4].tolist() == [12.0, 13.0, 14.0, 15.0]
