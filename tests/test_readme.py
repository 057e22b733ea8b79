"""The README's result tables are the result files, never numbers typed by hand."""
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_readme_tables_match_the_result_files():
    spec = importlib.util.spec_from_file_location("readme_tables", REPO / "benchmarks" / "readme_tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    readme = (REPO / "README.md").read_text()
    assert tables.BLOCK.search(readme), "no spliced tables found"
    assert tables.refreshed(readme) == readme, "run python benchmarks/readme_tables.py"
