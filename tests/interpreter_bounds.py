"""Under Triton's interpreter (``TRITON_INTERPRET=1``), fail any load or store a mask lets through
whose bytes do not lie inside one of the launch's tensor arguments.

On a GPU such an access reads or writes whatever memory lies there, or, where nothing is mapped,
kills the process with an illegal address (the key-mean decode write's read before its RoPE table
for the entries a full CUDA graph pads a batch with, 2026-12-05). The interpreter reads host memory
through raw addresses and checks nothing, so a kernel test would pass over such a read. With
:func:`install` every masked-in address of every ``tl.load`` and ``tl.store`` is checked against
the storages of the launch's arguments (their whole storages: a view may reach the rest of its
storage), and an access outside all of them raises ``AssertionError`` naming the kernel, the
access and the first address. An access that strays into another argument's storage passes.
"""
from __future__ import annotations

import numpy as np

_spans: tuple[np.ndarray, np.ndarray, str] | None = None  # starts, ends (sorted), kernel of the running launch


def _tensors(x):
    if isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)
    elif hasattr(x, "untyped_storage"):
        yield x
    elif hasattr(x, "base") and hasattr(x.base, "untyped_storage"):  # a TensorDescriptor
        yield x.base


def _check(addresses: np.ndarray, mask: np.ndarray, itemsize: int, what: str) -> None:
    if _spans is None:
        return
    starts, ends, kernel = _spans
    at = addresses[np.broadcast_to(mask, addresses.shape)].astype(np.uint64)
    if not at.size:
        return
    i = np.searchsorted(starts, at, side="right") - 1
    inside = (i >= 0) & (at + np.uint64(itemsize) <= ends[np.maximum(i, 0)])
    if not inside.all():
        bad = int(at[~inside][0])
        raise AssertionError(f"{kernel}: a {what} of {int((~inside).sum())} masked-in elements outside every "
                             f"tensor argument (first at {bad:#x}; arguments span "
                             f"{[(hex(int(s)), int(e - s)) for s, e in zip(starts, ends)]})")


def install() -> None:
    """Patch the interpreter (once per process): launches record their arguments' storages, and
    masked loads and stores check against them."""
    from triton.runtime import interpreter as ti

    if getattr(ti.GridExecutor, "_oscar_bounds", False):
        return
    init_args = ti.GridExecutor._init_args_hst
    masked_load = ti.InterpreterBuilder.create_masked_load
    masked_store = ti.InterpreterBuilder.create_masked_store

    def init_args_hst(self, args_dev, kwargs):
        global _spans
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        spans = {}
        for t in _tensors([*args_hst, *kwargs_hst.values()]):
            storage = t.untyped_storage()
            if storage.nbytes():
                spans[storage.data_ptr()] = storage.data_ptr() + storage.nbytes()
        starts = np.array(sorted(spans), dtype=np.uint64)
        _spans = (starts, np.array([spans[int(s)] for s in starts], dtype=np.uint64),
                  getattr(self.fn, "__name__", str(self.fn)))
        return args_hst, kwargs_hst

    def create_masked_load(self, ptrs, mask, other, *args):
        _check(ptrs.data, mask.data, np.dtype(ti._get_np_dtype(ptrs.get_element_ty())).itemsize, "load")
        return masked_load(self, ptrs, mask, other, *args)

    def create_masked_store(self, ptrs, value, mask, *args):
        _check(ptrs.data, mask.data, np.dtype(ti._get_np_dtype(ptrs.get_element_ty())).itemsize, "store")
        return masked_store(self, ptrs, value, mask, *args)

    ti.GridExecutor._init_args_hst = init_args_hst
    ti.InterpreterBuilder.create_masked_load = create_masked_load
    ti.InterpreterBuilder.create_masked_store = create_masked_store
    ti.GridExecutor._oscar_bounds = True
