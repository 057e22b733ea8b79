"""Output folders written whole or not at all.

``oscar-calibrate --output-dir DIR`` and ``oscar-rotations convert SRC DIR`` write into a
temporary folder beside ``DIR`` and rename it into place::

    with atomic_output_dir(target) as tmp:
        save_rotations(rot, tmp)

A process killed at any moment leaves one of:

* the previous ``DIR`` as it was (killed while writing, or before the swap);
* no ``DIR`` (killed between the two renames that swap an existing ``DIR`` out and the new one
  in); the previous one waits beside it, and the next write to ``DIR`` puts it back first;
* the new ``DIR``, complete.

Never a half-written ``DIR``. The leftovers (``.DIR.oscar-partial-HOST-PID`` and
``.DIR.oscar-replaced-HOST-PID``) are hidden, named as what they are, refused by the rotation
loaders (:func:`is_partial_output`), and cleared by the next write to the same ``DIR`` once the
process that left them is gone. Plain Python: the core may import it.
"""
from __future__ import annotations

import fnmatch
import logging
import os
import shutil
import socket
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from oscar_vllm.core.errors import OscarError

logger = logging.getLogger(__name__)

PARTIAL_MARK = ".oscar-partial-"  # a folder being written
REPLACED_MARK = ".oscar-replaced-"  # the previous output, between the two renames of a swap
# What an output folder of ours may already hold for it to be replaced whole.
ROTATION_FILES = ("oscar_rotations.json", "k_rotation.safetensors", "v_rotation.safetensors",
                  "k_rotation_*.pt", "v_rotation_*.pt")


class OutputDirError(OscarError, ValueError):
    """An output folder that cannot be replaced safely; the message says why."""


def is_partial_output(path: str | Path) -> bool:
    """A temporary folder of :func:`atomic_output_dir`: never an output to load."""
    name = Path(path).name
    return name.startswith(".") and (PARTIAL_MARK in name or REPLACED_MARK in name)


def check_replaceable(target: str | Path, replaceable: Sequence[str] = ROTATION_FILES) -> Path:
    """``target`` as an absolute path, if it can be written (absent, or a folder holding only
    files matching ``replaceable``); call it early, before long work, to fail at once."""
    target = Path(target).expanduser().absolute()
    if target.exists() and not target.is_dir():
        raise OutputDirError(f"{target}: exists and is not a folder")
    cwd = Path.cwd().resolve()
    if target.exists() and (target.resolve() == cwd or target.resolve() in cwd.parents):
        raise OutputDirError(f"{target}: is the current folder or holds it; give a folder of its own for the output")
    if target.is_dir():
        others = sorted(p.name for p in target.iterdir()
                        if not p.is_file() or not any(fnmatch.fnmatch(p.name, pat) for pat in replaceable))
        if others:
            raise OutputDirError(
                f"{target}: holds {', '.join(others[:5])}{', ...' if len(others) > 5 else ''}, which are not "
                f"rotation files; the output replaces the whole folder, so give a new folder or one holding "
                f"only an earlier output"
            )
    return target


def _tag() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def _leftovers(parent: Path, name: str, mark: str) -> list[tuple[Path, str, int]]:
    """``(path, host, pid)`` of the leftovers of writes to ``parent/name`` with ``mark``."""
    prefix = f".{name}{mark}"
    found = []
    for p in parent.glob(f"{prefix}*"):
        host, _, pid = p.name[len(prefix):].rpartition("-")
        if host and pid.isdigit():
            found.append((p, host, int(pid)))
    return found


def _gone(host: str, pid: int) -> bool:
    """The process that left a folder no longer runs (only known for this host's processes)."""
    if host != socket.gethostname():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def recover(target: Path) -> None:
    """Put back a previous output whose swap was killed half-way, and clear the temporary
    folders of killed writers to ``target``."""
    parent, name = target.parent, target.name
    for path, host, pid in _leftovers(parent, name, REPLACED_MARK):
        if not _gone(host, pid):
            continue
        if not target.exists():
            os.rename(path, target)
            logger.warning("%s: put back the previous output (a write that replaced it was killed half-way)", target)
        else:
            shutil.rmtree(path, ignore_errors=True)
    for path, host, pid in _leftovers(parent, name, PARTIAL_MARK):
        if _gone(host, pid):
            shutil.rmtree(path, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on folders: the renames are still atomic
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_output_dir(target: str | Path, replaceable: Sequence[str] = ROTATION_FILES) -> Iterator[Path]:
    """Yield an empty temporary folder beside ``target``; when the block ends without an error,
    its files are flushed to disk and the folder is renamed to ``target`` (an existing
    ``target`` moved aside first and removed last). On an error the temporary folder goes and
    ``target`` is left as it was."""
    target = check_replaceable(target, replaceable)
    target.parent.mkdir(parents=True, exist_ok=True)
    recover(target)
    tmp = target.parent / f".{target.name}{PARTIAL_MARK}{_tag()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                _fsync(f)
        _fsync(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    check_replaceable(target, replaceable)  # nothing else moved in while the output was made
    old = None
    if target.exists():
        old = target.parent / f".{target.name}{REPLACED_MARK}{_tag()}"
        os.rename(target, old)
    os.rename(tmp, target)
    _fsync(target.parent)
    if old is not None:
        shutil.rmtree(old)
