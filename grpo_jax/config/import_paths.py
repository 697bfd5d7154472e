"""Objects a config names by import path ("package.module:Name"): reward functions, environments,
tools. One resolver, so every such field fails the same way: one line naming the field's kind, the
path and what went wrong."""

from __future__ import annotations

import importlib
from typing import Any


def import_object(path: str, what: str) -> Any:
    """The object at `path`, "package.module:Name" (or "package.module.Name", TRL's CLI form;
    "Name.attr" reaches into a class). Raises ValueError naming `what`, the path and the problem."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"{what} import path {path!r}: expected 'package.module:Name'")
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{what} import path {path!r}: expected 'package.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {path!r}: cannot import module {module_name!r} ({e}); is it on PYTHONPATH "
                         "(or in the current directory)?") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {path!r}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj
