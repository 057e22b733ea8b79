"""The package's layers. Read from the source, every import of every module (at the top or
inside a function), and in fresh interpreters, what importing a layer pulls in:

- ``oscar_vllm/core``: the standard library, torch, safetensors (rotation files) and core;
  never transformers, vLLM or Triton;
- ``oscar_vllm/reference``, the kernels' twins: the standard library, torch, core and reference;
- ``oscar_vllm/calibration`` and ``oscar_vllm/serving`` build on core and never import each
  other; calibration never imports vLLM;
- ``csrc_triton``: the standard library, triton and torch only;
- no import cycle; ``serving/vllm_hooks`` never imports the backend (the backend imports it);
- ``serving.plugin.register`` (what vLLM runs in every process) loads nothing heavy: the plugin
  module (with the hook table it installs from, ``serving.hooks``) is torch-free, and register()
  loads nothing beyond vLLM's backend registry."""
import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STDLIB = set(sys.stdlib_module_names)
LAYERS = ("core", "reference", "calibration", "serving")
HEAVY = {"torch", "transformers", "triton", "csrc_triton", "vllm"}

# What each package may import (ALLOWED: nothing else) or must not (FORBIDDEN), named by top-level
# package, or by layer for the project's own ("oscar_vllm" alone: the package root, __version__).
ALLOWED = {
    "oscar_vllm": STDLIB,
    "oscar_vllm.core": STDLIB | {"torch", "safetensors", "oscar_vllm", "oscar_vllm.core"},
    "oscar_vllm.reference": STDLIB | {"torch", "oscar_vllm.core", "oscar_vllm.reference"},
    "csrc_triton": STDLIB | {"triton", "torch", "csrc_triton"},
}
FORBIDDEN = {
    "oscar_vllm.calibration": {"vllm", "oscar_vllm.serving"},
    "oscar_vllm.serving": {"oscar_vllm.calibration"},
}


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def source_files() -> dict[str, Path]:
    return {module_name(p): p for root in ("oscar_vllm", "csrc_triton") for p in sorted((REPO / root).rglob("*.py"))}


def imports_of(path: Path) -> list[tuple[str, int]]:
    """``(module, line)`` for every import in ``path``, relative ones resolved; ``from P import
    name`` gives ``P.name`` as well as ``P`` (``name`` may be a submodule)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.append((base, node.lineno))
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names if alias.name != "*"]
    return found


def owner(module: str) -> str:
    """What the rules name ``module`` by: one of our layers, the package root (``oscar_vllm``,
    ``oscar_vllm.__version__``), ``csrc_triton`` or another top-level package."""
    parts = module.split(".")
    if parts[0] == "oscar_vllm" and len(parts) > 1 and parts[1] in LAYERS:
        return "oscar_vllm." + parts[1]
    return parts[0]


def breaches() -> list[str]:
    found = []
    for module, path in source_files().items():
        layer = owner(module)
        for imported, line in imports_of(path):
            target = owner(imported)
            if (layer in ALLOWED and target not in ALLOWED[layer]) or target in FORBIDDEN.get(layer, ()):
                found.append(f"{path.relative_to(REPO)}:{line} imports {imported}")
    return found


def test_every_module_is_in_a_layer():
    """A module outside the four layers would escape every rule here."""
    package = REPO / "oscar_vllm"
    assert sorted(p.name for p in package.glob("*.py")) == ["__init__.py"]
    assert sorted(p.name for p in package.iterdir() if (p / "__init__.py").exists()) == sorted(LAYERS)


def test_layers_import_only_what_their_rules_allow():
    assert breaches() == []


# Each rule broken once: (module, the line added to it, the rule).
BREACHES = [
    ("oscar_vllm/core/quant.py", "import transformers", "core-no-transformers"),
    ("oscar_vllm/core/fold.py", "    from vllm.config import VllmConfig", "core-no-vllm-inside-a-function"),
    ("oscar_vllm/core/rotation.py", "from csrc_triton.paged_layout import BLOCK_SIZE", "core-no-kernels"),
    ("oscar_vllm/core/settings.py", "import triton", "core-no-triton"),
    ("oscar_vllm/core/errors.py", "from .. import serving", "core-no-serving-relative"),
    ("oscar_vllm/reference/paged.py", "from oscar_vllm.calibration import fit", "reference-torch-and-core-only"),
    ("oscar_vllm/reference/oscar_write.py", "import numpy", "reference-no-numpy"),
    ("oscar_vllm/calibration/fit.py", "from oscar_vllm.serving.plugin import register", "calibration-no-serving"),
    ("oscar_vllm/calibration/models.py", "    import vllm", "calibration-no-vllm"),
    ("oscar_vllm/serving/preflight.py", "from ..calibration.models import load_model", "serving-no-calibration"),
    ("oscar_vllm/serving/plugin.py", "    from oscar_vllm.calibration import corpus", "serving-no-calibration-inside"),
    ("csrc_triton/paged_layout.py", "from oscar_vllm.core.quant import clip_index", "kernels-no-oscar_vllm"),
    ("csrc_triton/oscar_write.py", "    import vllm", "kernels-no-vllm"),
    ("oscar_vllm/__init__.py", "from oscar_vllm.core import quant", "root-imports-no-layer"),
]


@pytest.mark.parametrize("file, line, rule", BREACHES, ids=[b[2] for b in BREACHES])
def test_a_forbidden_import_is_caught(file, line, rule, monkeypatch):
    """The check itself: each rule, broken in the text of a real module, is reported."""
    path = REPO / file
    source = path.read_text()
    broken = source + ("\n\ndef _breach():\n" + line + "\n" if line.startswith(" ") else "\n" + line + "\n")
    read_text = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda p, *a, **k: broken if p == path else read_text(p, *a, **k))
    assert [b for b in breaches() if b.startswith(file)], rule


def test_no_import_cycle():
    files = source_files()
    graph = {}
    for m, p in files.items():
        targets = {n for n, _ in imports_of(p) if n in files}
        graph[m] = {n for n in targets if n != m and not m.startswith(n + ".")}
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


def run_python(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=True,
                         cwd=REPO, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}, timeout=300).stdout
    return json.loads(out.strip().splitlines()[-1])


MUST_NOT_LOAD = {
    "oscar_vllm.core": {"vllm", "transformers", "triton", "csrc_triton"},
    "oscar_vllm.reference": {"vllm", "transformers", "triton", "csrc_triton"},
    "oscar_vllm.calibration": {"vllm"},
    "csrc_triton": {"vllm", "transformers", "oscar_vllm"},
}


@pytest.mark.parametrize("layer, heavy", MUST_NOT_LOAD.items(), ids=list(MUST_NOT_LOAD))
def test_importing_a_layer_loads_nothing_it_must_not(layer, heavy):
    """What the modules pull in, transitively, through the packages they use."""
    modules = sorted(m for m in source_files() if m == layer or m.startswith(layer + "."))
    loaded = run_python(f"""
        import importlib, json, sys
        for m in {modules!r}:
            importlib.import_module(m)
        print(json.dumps(sorted({{m.split(".")[0] for m in sys.modules}})))
    """)
    assert sorted(set(loaded) & heavy) == []


def test_plugin_register_loads_nothing_heavy():
    """vLLM imports the plugin and calls register() in every process it starts, API server
    included: the module loads no torch, and register() nothing past vLLM's backend registry,
    which it has to import (vLLM's own registry loads torch)."""
    seen = run_python("""
        import json, sys
        start = set(sys.modules)
        from oscar_vllm.serving import plugin
        by_import = set(sys.modules) - start
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        before = set(sys.modules)
        plugin.register()
        print(json.dumps({"import": sorted(by_import), "register": sorted(set(sys.modules) - before),
                          "registered": "OSCAR" in AttentionBackendEnum.__members__}))
    """)
    assert seen["registered"]
    ours = {m for m in seen["import"] if m.startswith("oscar_vllm")}
    assert ours == {"oscar_vllm", "oscar_vllm.serving", "oscar_vllm.serving.plugin", "oscar_vllm.core",
                    "oscar_vllm.core.settings", "oscar_vllm.core.errors",
                    "oscar_vllm.serving.hooks"}  # the hook table: register() installs and arms from it
    assert {m.split(".")[0] for m in seen["import"]} - {"oscar_vllm"} <= STDLIB
    assert not {m for m in seen["register"] if m.split(".")[0] in HEAVY | {"oscar_vllm"}}, seen["register"]
