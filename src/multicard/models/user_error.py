"""A model of the user's own that fails to import or to build: their error in one line, at their file and line,
without multicard's frames (or importlib's) around it."""

from __future__ import annotations

import sysconfig
import traceback
from pathlib import Path

# not the user's code: multicard's package, Python's own library and installed packages (torch's frames)
NOT_THEIRS = tuple({str(Path(__file__).resolve().parents[1]), "<frozen",
                    *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib"))})


def where(e: BaseException) -> str | None:
    """`file:line` of the innermost frame of `e` in the user's code: outside multicard, Python's library and
    installed packages (None: none)."""
    if isinstance(e, SyntaxError) and e.filename:
        return f"{e.filename}:{e.lineno}"
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not f.filename.startswith(NOT_THEIRS)]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None


def line(e: BaseException) -> str:
    """The error as one line: its type, its first line of text, and where in the user's code it was raised."""
    text = (e.msg if isinstance(e, SyntaxError) and e.msg else str(e)).strip().splitlines()
    at = where(e)
    return f"{type(e).__name__}: {text[0][:300] if text else ''}" + (f" (at {at})" if at else "")
