"""What Orbax and tensorstore print, made readable: an error as one line (without tensorstore's spec),
and the tracebacks and warnings an abandoned restore leaves behind filtered out (they arrive after
the failed restore has returned; the real error is the one the checkpoint manager reports).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

MAX_CAUSE = 500  # characters of an error kept in a one-line cause

# tensorstore appends its whole JSON spec, and absl its source locations, to an error message;
# Orbax a pointer to a bound method's repr.
_NOISE = re.compile(r"\s*(\[(tensorstore_spec|source locations)(\[\d+\])?=|See full TensorStore details: <bound).*$")


def one_line(err: Exception) -> str:
    """``Type: first line of the message``, without tensorstore's spec, at most MAX_CAUSE chars
    (the head and the tail, where tensorstore puts the root cause)."""
    text = str(err).strip()
    line = _NOISE.sub("", text.splitlines()[0]) if text else repr(err)
    if len(line) > MAX_CAUSE:
        line = line[: MAX_CAUSE // 2 - 3] + " ... " + line[-(MAX_CAUSE // 2 - 2):]
    return f"{type(err).__name__}: {line}"


# What Orbax leaves behind when a restore fails. It runs each restore on a fresh event loop and
# closes that loop as soon as the first tensorstore read fails (or a shape is wrong), while the
# step's other reads are still in flight, and prints one traceback for each of them:
# - a read that then finishes raises "RuntimeError: Event loop is closed" in a tensorstore
#   thread (an unraisable exception, no object);
# - a read coroutine that is then closed unfinished raises Orbax's "Encountered error while
#   reading array index" from GeneratorExit ("Exception ignored in: <coroutine ...>");
# - asyncio logs "Future (or Task) exception was never retrieved" and "Task was destroyed but it
#   is pending!" when the abandoned futures and tasks are garbage-collected, and a read that never
#   started warns "RuntimeWarning: coroutine '_read_array_index_and_device_put' was never awaited"
#   (or 'Store._get_array_metadatas', the metadata read).
# All of it arrives after the failed restore has returned, so the filters below stay installed
# once a restore has been attempted. They match only these leftovers (a coroutine in Orbax's
# code, a message naming a checkpoint directory or an Orbax coroutine) and pass on the rest;
# the real error is the one ``restore`` raises or reports.
_RESTORED_DIRECTORIES: set[str] = set()


def _abandoned_read(unraisable: Any) -> bool:
    exc, obj = unraisable.exc_value, unraisable.object
    if obj is None:
        if not isinstance(exc, RuntimeError) or str(exc) != "Event loop is closed":
            return False
        frames = traceback.extract_tb(unraisable.exc_traceback)
        return bool(frames) and frames[-1].name == "_check_closed" and "asyncio" in frames[-1].filename
    code = getattr(obj, "cr_code", None)
    closed = isinstance(exc, GeneratorExit) or isinstance(getattr(exc, "__cause__", None), GeneratorExit)
    # An abandoned write of a failed save, finalised while the interpreter shuts down.
    shutting_down = isinstance(exc, ImportError) and "shutting down" in str(exc)
    return (closed or shutting_down) and code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


class _UnraisableFilter:
    """sys.unraisablehook that drops abandoned Orbax reads and passes the rest on."""

    def __init__(self, previous: Any):
        self.previous = previous

    def __call__(self, unraisable: Any) -> None:
        if not _abandoned_read(unraisable):
            self.previous(unraisable)


# Orbax's read coroutines that an abandoned restore may leave unstarted: the array read itself and
# (seen once in a clean-clone run, 2026-12-01) its array-metadata store's read.
_UNSTARTED_READ = r"coroutine '(_read_array_index_and_device_put|Store\._get_array_metadatas)' was never awaited"
_ASYNCIO_LEFTOVERS = ("Future exception was never retrieved", "Task exception was never retrieved",
                      "Task was destroyed but it is pending!")


def _not_an_abandoned_read(record: logging.LogRecord) -> bool:
    """The asyncio logger's filter: False (drop) for garbage-collected leftovers of a restore."""
    message = record.getMessage()
    if not message.startswith(_ASYNCIO_LEFTOVERS):
        return True
    return not (f"{os.sep}orbax{os.sep}" in message or any(d in message for d in _RESTORED_DIRECTORIES))


def silence_abandoned_reads(directory: Path) -> None:
    """Installs the filters (once each; the unraisable hook chains to the one it replaces)."""
    _RESTORED_DIRECTORIES.add(str(directory))
    if not isinstance(sys.unraisablehook, _UnraisableFilter):
        sys.unraisablehook = _UnraisableFilter(sys.unraisablehook)
    asyncio_logger = logging.getLogger("asyncio")
    if _not_an_abandoned_read not in asyncio_logger.filters:
        asyncio_logger.addFilter(_not_an_abandoned_read)
    warnings.filterwarnings("ignore", message=_UNSTARTED_READ, category=RuntimeWarning)
