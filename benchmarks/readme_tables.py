"""Refresh the README's result tables from the files the benchmarks wrote.

Every block between ``<!-- table:PATH -->`` and ``<!-- end table -->`` is replaced by the
file PATH (relative to the repository, less its ``# title`` line), so numbers in the README are never typed by hand.

    python benchmarks/readme_tables.py [--check]
"""
import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- table:(?P<path>[^ ]+) -->\n)(?P<body>.*?)(<!-- end table -->)", re.S)


def refreshed(text: str) -> str:
    def fill(m: re.Match) -> str:
        body = (REPO / m["path"]).read_text()
        if body.startswith("# "):  # the file's own title: the README has its heading
            body = body.split("\n", 1)[1].lstrip("\n")
        return m.group(1) + body.rstrip("\n") + "\n" + m.group(4)

    return BLOCK.sub(fill, text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="fail if the README is out of date")
    args = p.parse_args()
    readme = REPO / "README.md"
    old = readme.read_text()
    new = refreshed(old)
    if args.check:
        sys.exit(0 if new == old else "README tables are out of date: run python benchmarks/readme_tables.py")
    readme.write_text(new)


if __name__ == "__main__":
    main()
