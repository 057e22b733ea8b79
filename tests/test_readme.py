"""The README and docs/: result tables are the result files, never numbers typed by hand; every
page's headings are its own (a spliced file brings none) and its links lead somewhere."""
import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")


def load_tables():
    spec = importlib.util.spec_from_file_location("readme_tables", REPO / "benchmarks" / "readme_tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    return tables


TABLES = load_tables()
PAGES = [p.relative_to(REPO).as_posix() for p in TABLES.pages()]


def outside_code(text: str) -> list[str]:
    """The page's lines outside fenced code blocks (where ``#`` starts a comment, not a heading)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def test_the_docs_pages_are_there():
    assert {"docs/method.md", "docs/backend.md", "docs/kernels.md", "docs/ab.md", "docs/fidelity.md",
            "docs/gpu-checks.md", "docs/quality.md", "docs/reliability.md"} <= set(PAGES)


@pytest.mark.parametrize("page", PAGES)
def test_tables_match_the_result_files(page):
    text = (REPO / page).read_text()
    if page == "README.md":
        assert TABLES.BLOCK.search(text), "no spliced tables found"
    assert TABLES.refreshed(text) == text, "run python benchmarks/readme_tables.py"


@pytest.mark.parametrize("page", PAGES)
def test_spliced_files_bring_no_headings(page):
    for block in TABLES.BLOCK.finditer((REPO / page).read_text()):
        headings = [line for line in outside_code(block["body"]) if line.startswith("#")]
        assert not headings, f"{block['path']} brings headings {headings}: write them as bold labels"


@pytest.mark.parametrize("page", PAGES)
def test_no_heading_twice(page):
    headings = [line for line in outside_code((REPO / page).read_text()) if re.match(r"#+ ", line)]
    twice = sorted({h for h in headings if headings.count(h) > 1})
    assert not twice, f"{page}: {twice}"


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in outside_code(page.read_text()) if re.match(r"#+ ", line)}


@pytest.mark.parametrize("page", PAGES)
def test_local_links_lead_somewhere(page):
    missing = []
    for m in LINK.finditer((REPO / page).read_text()):
        target, _, anchor = m["target"].partition("#")
        if re.match(r"[a-z]+:", target):  # a URL
            continue
        path = (REPO / page).parent / target if target else REPO / page
        if not path.exists():
            missing.append(m["target"])
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            missing.append(m["target"])
    assert not missing, f"{page} links to {missing}"


def test_readme_stays_short():
    # 250 lines when the README was written for users; room since for the A/B tables of later runs
    # and the quality table inside vLLM
    assert len((REPO / "README.md").read_text().splitlines()) <= 290


def test_a_rows_block_takes_the_first_table_and_its_marked_notes():
    full = TABLES.spliced("results/ab_memory_bound/ab.md")
    rows = TABLES.spliced("results/ab_memory_bound/ab.md", rows=True).splitlines()
    table = [line for line in full.splitlines() if line.startswith("|")]
    assert rows[:len(table)] == table and rows[0].startswith("| metric")
    assert rows[len(table):] == ["", next(line for line in full.splitlines() if line.startswith("†"))]


def test_a_without_pattern_drops_the_rows_it_finds_and_must_find_one():
    rows = TABLES.spliced("results/ab_grouped/ab.md", rows=True).splitlines()
    kept = TABLES.spliced("results/ab_grouped/ab.md", rows=True, without="^KV |same run").splitlines()
    dropped = [TABLES._cells(line)[0] for line in rows if line not in kept]
    assert dropped == ["KV cache capacity (tokens)", "KV tokens left with all max_num_seqs requests running",
                       "time per output token (ms), same run", "fresh: seconds, same run"]
    assert kept[:2] == rows[:2] and kept[-1].startswith("†")
    block = "<!-- table:results/ab_grouped/ab.md rows without /same run/ -->\nold\n<!-- end table -->"
    assert "fresh: seconds" not in TABLES.refreshed(block) and "fresh: output" in TABLES.refreshed(block)
    with pytest.raises(ValueError, match="finds no row"):
        TABLES.spliced("results/ab_grouped/ab.md", rows=True, without="no such metric")


def test_a_compared_block_drops_the_rows_its_baseline_did_not_run():
    rows = TABLES.spliced("results/ab_4k/flash_attn/ab.md", rows=True).splitlines()
    compared = TABLES.spliced("results/ab_4k/flash_attn/ab.md", compared=True).splitlines()
    dropped = [line for line in rows if line not in compared]
    baseline = TABLES._cells(rows[0]).index("FLASH_ATTN")
    assert dropped and all(line.startswith("|") and not TABLES._cells(line)[baseline] for line in dropped)
    assert any("reasoning: output tok/s" in line for line in compared) and compared[-1].startswith("†")
    assert [line for line in compared if line.startswith("|")][:2] == rows[:2]


def test_a_compared_block_needs_a_baseline_column(tmp_path, monkeypatch):
    (tmp_path / "t.md").write_text("| metric | OSCAR |\n|---|---|\n| x | 1 |\n")
    monkeypatch.setattr(TABLES, "REPO", tmp_path)
    with pytest.raises(ValueError, match="needs a FLASH_ATTN column"):
        TABLES.spliced("t.md", compared=True)
