"""A `gs://` that lives in a local folder, for tests: etils.epath's own mock (`mock_epath`) with
every file operation redirected, so code that goes through epath runs unchanged and nothing calls
the network. (Orbax's array I/O goes through tensorstore, not epath: checkpoints are tested on
local and file:// paths instead.)"""

from __future__ import annotations

import contextlib
import os

from etils.epath import testing as epath_testing

_OPS = ("copy", "exists", "glob", "isdir", "listdir", "makedirs", "mkdir", "open", "remove", "rename", "replace",
        "rmtree", "stat", "walk")


@contextlib.contextmanager
def fake_gcs(root):
    """Inside: gs://bucket/a/b is root/bucket/a/b."""
    root = os.fspath(root)

    def local(path):
        text = os.fspath(path)
        return os.path.join(root, text[len("gs://"):]) if text.startswith("gs://") else text

    def redirect(op):
        def fn(original, path, *args, **kwargs):
            args = tuple(local(a) if isinstance(a, (str, os.PathLike)) and os.fspath(a).startswith("gs://") else a
                         for a in args)
            return original(local(path), *args, **kwargs)
        return fn

    with epath_testing.mock_epath(**{op: redirect(op) for op in _OPS}):
        yield
