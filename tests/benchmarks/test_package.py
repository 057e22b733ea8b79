"""benchmarks/ is one package: every folder of modules has its __init__.py (each module runs as
``python -m benchmarks...``), nothing edits sys.path to find another, and no benchmark imports from
tests/ (what the serving tests and a benchmark share lives in benchmarks/, ``benchmarks.vllm_cpu``)."""
import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
# The helpers beside tests/conftest.py, which the tests import by their bare names.
TEST_HELPERS = {p.stem for p in (REPO / "tests").glob("*.py")} | {"tests"}


def modules() -> list[Path]:
    return sorted(p for p in BENCHMARKS.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_folder_of_modules_is_a_package():
    folders = {p.parent for p in modules()}
    assert sorted(str(f.relative_to(REPO)) for f in folders if not (f / "__init__.py").exists()) == []


def test_nothing_edits_sys_path():
    edits = re.compile(r"sys\.path\.(insert|append|extend)|sys\.path\s*[+]?=")
    files = modules() + sorted((REPO / "tests" / "benchmarks").glob("*.py"))
    found = [f"{p.relative_to(REPO)}:{n}" for p in files if p != Path(__file__)
             for n, line in enumerate(p.read_text().splitlines(), 1) if edits.search(line)]
    assert found == []


def test_no_benchmark_imports_from_tests():
    found = []
    for p in modules():
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            found += [f"{p.relative_to(REPO)}:{node.lineno} imports {n}" for n in names
                      if n.split(".")[0] in TEST_HELPERS]
    assert found == []


def test_no_folder_of_benchmarks_hides_an_installed_package():
    """``python benchmarks/X.py`` puts benchmarks/ first on sys.path, where a folder named like an
    installed package takes its place: ``benchmarks/kernels`` hid Hugging Face's ``kernels``, and
    transformers failed to import inside the quality study."""
    import importlib.metadata

    installed = {name for dist in importlib.metadata.distributions()
                 for name in (dist.read_text("top_level.txt") or "").split()}
    installed |= {d.metadata["Name"].lower().replace("-", "_") for d in importlib.metadata.distributions()}
    folders = {p.name for p in BENCHMARKS.iterdir() if (p / "__init__.py").exists()}
    assert sorted(folders & installed) == []


def test_a_benchmark_run_as_a_script_imports_transformers():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(BENCHMARKS / "quality_study.py"), "--help"], capture_output=True,
                          text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
