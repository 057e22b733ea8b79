"""Refresh the result tables of README.md and docs/*.md from the files the benchmarks wrote.

Every block between ``<!-- table:PATH -->`` and ``<!-- end table -->`` is replaced by the
file PATH (relative to the repository, less its ``# title`` line: the page gives the
headings), so numbers in the README and the docs are never typed by hand. ``<!-- table:PATH
rows -->`` takes only the file's first table and the notes marked † under it, for a page that
links to the whole file elsewhere; ``<!-- table:PATH compared -->`` the same, less the rows
whose baseline cell (the table's last column named ``FLASH_ATTN``) is empty: a run split over
invocations whose baseline ran only some of the scenarios. Either may end in ``without
/REGEX/``: less the rows whose first cell the pattern finds (rows a later block on the page shows
from a newer run).

    python benchmarks/readme_tables.py [--check]
"""
import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- table:(?P<path>[^ ]+)(?: (?P<mode>rows|compared)(?: without /(?P<without>[^/]+)/)?)? -->\n)"
                   r"(?P<body>.*?)(?P<end><!-- end table -->)", re.S)
BASELINE = "FLASH_ATTN"


def pages() -> list[Path]:
    """The pages whose tables are spliced: the README, then every page of docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def spliced(path: str, rows: bool = False, compared: bool = False, without: str | None = None) -> str:
    """What a block for the result file ``path`` holds: the file less its ``# title`` line, or
    (``rows``) its first table and the † notes after it, or (``compared``) those less the rows
    with no baseline value; either less the rows whose metric ``without`` finds."""
    body = (REPO / path).read_text()
    if body.startswith("# "):
        body = body.split("\n", 1)[1].lstrip("\n")
    if rows or compared:
        lines = body.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("|"))
        end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
        notes = [line for line in lines[end:] if line.startswith("†")]
        table = lines[start:end]
        if compared:
            table = table[:2] + [line for line in table[2:] if _cells(line)[_baseline_column(table[0], path)]]
        if without:
            kept = [line for line in table[2:] if not re.search(without, _cells(line)[0])]
            if len(kept) == len(table) - 2:
                raise ValueError(f"{path}: 'without /{without}/' finds no row")
            table = table[:2] + kept
        body = "\n".join(table + ["", *notes] * bool(notes))
    return body.rstrip("\n") + "\n"


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _baseline_column(header: str, path: str) -> int:
    cells = _cells(header)
    if BASELINE not in cells:
        raise ValueError(f"{path}: a 'compared' block needs a {BASELINE} column, the header has {cells}")
    return len(cells) - 1 - cells[::-1].index(BASELINE)


def refreshed(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + spliced(m["path"], m["mode"] == "rows", m["mode"] == "compared",
                                                    m["without"]) + m["end"], text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="fail if a page is out of date")
    args = p.parse_args()
    stale = []
    for page in pages():
        old = page.read_text()
        new = refreshed(old)
        if new != old:
            stale.append(str(page.relative_to(REPO)))
            if not args.check:
                page.write_text(new)
    if args.check and stale:
        sys.exit(f"tables out of date in {', '.join(stale)}: run python benchmarks/readme_tables.py")
    if stale and not args.check:
        print("refreshed " + ", ".join(stale))


if __name__ == "__main__":
    main()
