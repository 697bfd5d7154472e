"""Run-directory paths: a local directory or object storage (`gs://bucket/run`, `s3://...`) alike,
through `etils.epath`, the path library Orbax itself uses, so a run directory works wherever Orbax
checkpoints do.

`os.path.abspath("gs://bucket/run")` is `<cwd>/gs:/bucket/run`: every worker of a pod would have
written to its own local disk. `as_path` keeps URLs as they are and makes local paths absolute
(`file:///tmp/run` is the local `/tmp/run`).

Object stores have no append: `open_lines` gives a JSON-lines file that appends locally and, on an
object store, keeps the file's content and rewrites the object when flushed (at most every
`rewrite_every_s` seconds, and on close), so metrics.jsonl and samples.jsonl work on both.
"""

from __future__ import annotations

import os
import time

from etils import epath


def as_path(path: str | os.PathLike) -> epath.Path:
    """An epath.Path for a run directory or a file in one: URLs unchanged, local paths absolute."""
    text = os.fspath(path)
    if text.startswith("file://"):
        text = text[len("file://"):]
    if "://" in text:
        return epath.Path(text)
    return epath.Path(os.path.abspath(os.path.expanduser(text)))


def is_local(path: epath.Path) -> bool:
    return "://" not in os.fspath(path)


class _RewrittenLines:
    """The append-only JSON-lines file of an object store: content kept, object rewritten on flush."""

    def __init__(self, path: epath.Path, rewrite_every_s: float):
        self.path = path
        self.rewrite_every_s = rewrite_every_s
        self._content = path.read_text(encoding="utf-8") if path.exists() else ""
        self._pending = False
        self._last_write = 0.0

    def tell(self) -> int:
        return len(self._content)

    def ends_with_newline(self) -> bool:
        return not self._content or self._content.endswith("\n")

    def write(self, text: str) -> None:
        self._content += text
        self._pending = True

    def flush(self, *, force: bool = False) -> None:
        if self._pending and (force or time.monotonic() - self._last_write >= self.rewrite_every_s):
            self.path.write_text(self._content, encoding="utf-8")
            self._pending, self._last_write = False, time.monotonic()

    def close(self) -> None:
        self.flush(force=True)


class _LocalLines:
    """A local file opened for appending, flushed to the OS on every flush (a crash loses at most
    the line being written)."""

    def __init__(self, path: epath.Path):
        self.path = path
        self._fh = open(os.fspath(path), "a", encoding="utf-8")

    def tell(self) -> int:
        return self._fh.tell()

    def ends_with_newline(self) -> bool:
        if self._fh.tell() == 0:
            return True
        with open(os.fspath(self.path), "rb") as tail:
            tail.seek(-1, 2)
            return tail.read(1) == b"\n"

    def write(self, text: str) -> None:
        self._fh.write(text)

    def flush(self, *, force: bool = False) -> None:
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def open_lines(path: epath.Path, *, rewrite_every_s: float = 30.0):
    """A JSON-lines file to append to: `write`, `flush`, `close`, `tell`, `ends_with_newline`."""
    if is_local(path):
        return _LocalLines(path)
    return _RewrittenLines(path, rewrite_every_s)
