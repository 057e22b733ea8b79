"""Shapes and inputs shared by the kernel tests: small under the Triton interpreter (CPU),
real model shapes and long contexts on a GPU."""
from __future__ import annotations

import torch

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
# tl.dot on bf16 operands is wrong under the interpreter: the CPU runs fp32 inputs only.
DTYPES = [torch.float32, torch.bfloat16] if ON_GPU else [torch.float32]


def random_rotation(d: int, heads: int | None = None, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (heads, d, d) if heads else (d, d)
    q, _ = torch.linalg.qr(torch.randn(*shape, generator=g, dtype=torch.float64))
    return q.float()


def random_rows(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows with a few outlier channels, like real keys."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x[..., :: max(1, shape[-1] // 8)] *= 6.0
    return x.to(dtype).to(DEVICE)
