"""The package's layers: torch-only core, the Triton kernels, calibration and evaluation
(transformers), serving (vLLM). Each imports only what is below it, checked in fresh
interpreters (what a module pulls in at import time) and on the source (no import cycle,
counting imports inside functions too)."""
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORE = ["oscar_vllm.core.quant", "oscar_vllm.core.rotation", "oscar_vllm.core.rotation_io", "oscar_vllm.core.mixed_cache",
        "oscar_vllm.core.fold", "oscar_vllm.core.settings", "oscar_vllm.core.errors", "oscar_vllm.reference.oscar_attention",
        "oscar_vllm.reference.oscar_write", "oscar_vllm.reference.oscar_dense_kv", "oscar_vllm.serving.window_pages",
        "oscar_vllm.core.atomic_output"]
KERNELS = ["csrc_triton.oscar_attention", "csrc_triton.oscar_write", "csrc_triton.oscar_dense_kv",
           "csrc_triton.warm_up"]
CALIBRATION = ["oscar_vllm.calibration.fit", "oscar_vllm.calibration.calibrate", "oscar_vllm.calibration.evaluate", "oscar_vllm.calibration.models",
               "oscar_vllm.serving.rotation_source"]
HEAVY = ("vllm", "transformers", "triton", "csrc_triton")


def imported_by(module: str) -> list[str]:
    code = f"import sys, json, {module}; print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("module", CORE)
def test_core_imports_torch_only(module):
    assert not set(imported_by(module)) & set(HEAVY), module


@pytest.mark.parametrize("module", KERNELS)
def test_kernels_import_neither_vllm_nor_transformers(module):
    loaded = set(imported_by(module))
    assert not loaded & {"vllm", "transformers", "oscar_vllm"}, module


@pytest.mark.parametrize("module", CALIBRATION)
def test_calibration_and_evaluation_import_no_vllm(module):
    assert "vllm" not in imported_by(module), module


def module_imports(path: Path, package_root: Path) -> set[str]:
    """Every project module ``path`` imports, at the top or inside functions."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return {n for n in names if n.split(".")[0] in ("oscar_vllm", "csrc_triton")}


def test_no_import_cycle():
    files = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
             for root in ("oscar_vllm", "csrc_triton") for p in (REPO / root).rglob("*.py")}
    graph = {m: {n for n in module_imports(p, REPO) if n in files and n != m and not m.startswith(n + ".")}
             for m, p in files.items()}
    # Packages only re-export nothing here: an edge to "oscar_vllm" itself is the version import.
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert "oscar_vllm.serving.backend" not in graph["oscar_vllm.serving.vllm_hooks"]
