"""What multicard.launch sends to the processes it starts: the function and its arguments, pickled.

multiprocessing's spawn has each new process run this program's `__main__` again, to find there what it
defined. A notebook, the REPL, `python -` and `python -c` have no file to run again, so what they defined (a
function in a cell, a model class, what those refer to) travels by value instead (cloudpickle), and the new
processes are started as if there were no `__main__` to run. A script (a file, or `python -m module`) keeps
plain pickling by reference, as before. What cannot be sent even by value (an open file, a lock, a generator)
is one clear error, before any process starts.
"""

from __future__ import annotations

import contextlib
import io
import linecache
import os
import pickle
import sys
import types
from collections import ChainMap
from collections.abc import Iterable, Iterator
from typing import Any

import cloudpickle

from ..errors import UsageError


def main_runs_again() -> bool:
    """Whether a new process can import this program's `__main__` again: a script file, or `python -m name`.
    Not so for a notebook's kernel, the REPL, `python -` (its file is "<stdin>") or `python -c`."""
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None):
        return True
    path = getattr(main, "__file__", None)
    return isinstance(path, str) and os.path.isfile(path)


def dumps(obj: Any) -> bytes:
    """`obj` pickled for another process of this job. What `__main__` defined goes by value where that process
    cannot import it; elsewhere by reference (plain pickle), except what plain pickle refuses (a lambda)."""
    if not main_runs_again():
        return _by_value(obj)
    try:
        return pickle.dumps(obj)
    except (pickle.PicklingError, AttributeError, TypeError):
        return _by_value(obj)


def _refuse_file(file: io.TextIOWrapper) -> None:
    raise TypeError(f"cannot pickle '{type(file).__module__}.{type(file).__name__}' object")


def _code_reduce(code: types.CodeType) -> tuple:
    """cloudpickle's reduction of a code object, less its one loss: it names every file "<dynamic-code>", so a
    failing rank's traceback shows no file and no source. The cell's file name is kept, and its lines (what
    IPython keeps for a cell in linecache) travel along, for the rank's traceback to show."""
    rebuild, args = cloudpickle.cloudpickle._code_reduce(code)
    args = tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)
    entry = linecache.cache.get(code.co_filename)
    return _with_source, (rebuild, args, code.co_filename, entry[2] if entry else None)


def _with_source(rebuild: Any, args: tuple, filename: str, lines: list[str] | None) -> types.CodeType:
    if lines and filename not in linecache.cache:
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)  # mtime None: kept, not checked
    return rebuild(*args)


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, less its copy of a text file open for reading (each process would get a snapshot of its
    contents, read whole into memory): an open file is refused, as plain pickle refuses it. Code keeps its
    file name and source lines (_code_reduce)."""

    dispatch_table = ChainMap({io.TextIOWrapper: _refuse_file,
                               **({types.CodeType: _code_reduce} if hasattr(cloudpickle.cloudpickle, "_code_reduce")
                                  else {})}, cloudpickle.Pickler.dispatch_table)


def _by_value(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def pack(work: Any, named: Iterable[tuple[str, Any]]) -> bytes:
    """`work` pickled (see dumps). Where that fails, a UsageError names the first of `named` (what the user
    passed: "fn", "argument 2") that cannot be sent, and its type."""
    try:
        return dumps(work)
    except Exception as e:  # pickling fails with many kinds: TypeError, PicklingError, AttributeError, ...
        reason = _reason(e)
        for name, obj in named:
            try:
                dumps(obj)
            except Exception as inner:
                what = "something it refers to" if isinstance(obj, types.FunctionType) else "it"
                raise UsageError(f"{name} ({_kind(obj)}) cannot be sent to the other processes: {_reason(inner)}; "
                                 f"make {what} inside the function instead, from what it is made of (a path, "
                                 f"a number)") from None
        raise UsageError(f"what launch sends to the other processes cannot be pickled: {reason}") from None


def return_refused(out: Any, error: Exception) -> str:
    """The line for a return value `out` that dumps refused with `error`: which part of it cannot be sent back."""
    where, part, error = unsendable(out) or ("", out, error)
    what = f"its {where} ({_kind(part)})" if where else f"it ({_kind(part)})"
    return (f"fn's return value on rank 0 cannot come back from its process: {what} cannot be pickled "
            f"({_reason(error)}); return what it is made of instead (numbers, tensors, a state_dict); what fn did "
            f"(its files) is kept")


def unsendable(obj: Any, path: str = "", seen: set[int] | None = None) -> tuple[str, Any, Exception] | None:
    """Where in `obj` the first part lies that cannot be sent to another process (a path such as "['lock']" or
    "[2].cache"; "" for `obj` itself), that part, and why; None where all of `obj` can be sent."""
    try:
        dumps(obj)
        return None
    except Exception as e:
        error = e
    seen = (seen or set()) | {id(obj)}  # a structure that holds itself is looked into once
    for step, part in _parts(obj):
        if id(part) not in seen and (found := unsendable(part, path + step, seen)):
            return found
    return path, obj, error


def _parts(obj: Any) -> list[tuple[str, Any]]:
    """The parts of a container or a plain object, each with the step that reaches it from `obj`."""
    if isinstance(obj, dict):
        return [(f"[{key!r}]", value) for key, value in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [(f"[{i}]", value) for i, value in enumerate(obj)]
    if isinstance(getattr(obj, "__dict__", None), dict) and not isinstance(obj, (type, types.ModuleType)):
        return [(f".{name}", value) for name, value in vars(obj).items()]
    return []


@contextlib.contextmanager
def main_left_out() -> Iterator[None]:
    """While processes are started with multiprocessing's spawn: where `__main__` cannot run again, they are
    started as if there were none (they need nothing from it: what it defined goes by value). The user's
    `__main__` module itself is not touched: only the name in sys.modules points elsewhere, for that moment."""
    if main_runs_again():
        yield
        return
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")  # no __file__, no __spec__: nothing to run
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def workers_by_fork() -> None:
    """In a process started from a notebook (its `__main__` a stand-in): processes it starts itself (DataLoader
    workers) are forked, as a one-process script's are on Linux, so a Dataset class a cell defined reaches them
    (spawn would look it up in a `__main__` that never defined it). Elsewhere the start method is left as it is."""
    import multiprocessing

    if not main_runs_again() and sys.platform.startswith("linux"):
        multiprocessing.set_start_method("fork", force=True)


def _kind(obj: Any) -> str:
    if isinstance(obj, types.FunctionType):
        return f"the function {obj.__qualname__}"
    name = type(obj).__name__
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"


def _reason(error: Exception) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__
