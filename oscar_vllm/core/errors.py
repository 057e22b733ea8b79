"""The project's own errors, and how its command lines report them.

An :class:`OscarError` is a problem the user can fix from its message alone (a bad file,
setting, path or input), so a CLI prints it as one line, ``error: <message>``, and exits
with status 1. Any other exception is a bug and keeps its traceback. ``--debug`` shows the
traceback of an :class:`OscarError` too. Plain Python: every module may import it.
"""
from __future__ import annotations

import functools
import sys
from typing import Callable, Sequence

DEBUG_FLAG = "--debug"
DEBUG_HELP = "on an error, show its traceback too (default: one line)"


class OscarError(Exception):
    """An error whose message says what is wrong and how to fix it."""


def cli(main: Callable[[list[str] | None], None]) -> Callable[[Sequence[str] | None], None]:
    """Wrap a CLI's ``main(argv)``: :class:`OscarError` -> ``error: <message>``, exit 1."""

    @functools.wraps(main)
    def wrapped(argv: Sequence[str] | None = None) -> None:
        argv = list(sys.argv[1:] if argv is None else argv)
        try:
            main(argv)
        except OscarError as e:
            if DEBUG_FLAG in argv:
                raise
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(1) from None

    return wrapped
