"""Field checks every section shares: the error type, a value against its annotation, and ranges.

A section's `validate()` calls `check_fields(self)` for the types its annotations declare, then
`positive` / `nonnegative` for the ranges; each error names the key as `--set` spells it.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal


class ConfigError(ValueError):
    """A config key or value that is not allowed; the message names it and what would be right."""


def check_type(key: str, value: Any, hint: Any) -> None:
    """ConfigError unless `value` has the annotated type (Literal, X | None, tuple[X, ...], ...)."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not allowed; choose one of {list(allowed)}")
        return
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                check_type(key, value, arg)
                return
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}={value!r} has the wrong type")
    if origin is tuple:
        if not isinstance(value, tuple):
            raise ConfigError(f"{key}={value!r} must be a tuple")
        (elem,) = typing.get_args(hint)[:1]
        for v in value:
            check_type(key, v, elem)
        return
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and not math.isfinite(value):
            # `nan < 0` is False, so a NaN learning rate would pass every range check.
            raise ConfigError(f"{key}={value!r} must be a finite number")
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is dict:
        ok = isinstance(value, dict)
    else:
        ok = isinstance(value, hint)
    if not ok:
        raise ConfigError(f"{key}={value!r} must be of type {getattr(hint, '__name__', hint)}")


def check_fields(section) -> None:
    """Every field of `section` (a dataclass with a `NAME`) against its annotation."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        check_type(f"{section.NAME}.{f.name}", getattr(section, f.name), hints[f.name])


def positive(section, *names: str) -> None:
    """ConfigError unless each named field of `section` is > 0."""
    for name in names:
        value = getattr(section, name)
        if value <= 0:
            raise ConfigError(f"{section.NAME}.{name}={value!r} must be > 0")


def nonnegative(section, *names: str) -> None:
    """ConfigError unless each named field of `section` is >= 0."""
    for name in names:
        value = getattr(section, name)
        if value < 0:
            raise ConfigError(f"{section.NAME}.{name}={value!r} must be >= 0")
