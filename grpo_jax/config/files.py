"""Configs on disk: a config file is a Python module with `get_config() -> Config` (big_vision
style), read by `load_config_file`; a run's saved config is `to_dict`'s JSON, read back by
`from_dict`, which also reads the layout before the sections were regrouped (config.moved)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import re
import traceback
import typing

from grpo_jax.config.checks import ConfigError
from grpo_jax.config.moved import old_key_message, upgrade_saved
from grpo_jax.config.root import SECTIONS, Config

_CLASS_SECTION = {factory().__class__.__name__: name for name, factory in SECTIONS.items()}


def _unknown_field_hint(error: TypeError) -> str:
    """For "XSection.__init__() got an unexpected keyword argument 'f'": where the old key went,
    else where `train --help` lists the fields."""
    match = re.search(r"(\w+)\.__init__\(\) got an unexpected keyword argument '(\w+)'", str(error))
    if match and match.group(1) in _CLASS_SECTION:
        moved = old_key_message(f"{_CLASS_SECTION[match.group(1)]}.{match.group(2)}")
        if moved is not None:
            return f" ({_CLASS_SECTION[match.group(1)]}.{match.group(2)}: {moved})"
    return " (an unknown field: `python -m grpo_jax train --help` lists every section's fields)"


@contextlib.contextmanager
def _config_file_errors(path: str):
    """A config file that does not parse or raises: one ConfigError line with its file and line
    (a syntax error's own, else the deepest frame in that file), not a traceback through importlib."""
    try:
        yield
    except SyntaxError as e:
        raise ConfigError(f"{path}, line {e.lineno}: syntax error: {e.msg}") from None
    except Exception as e:  # noqa: BLE001 - whatever the user's file raised, named with its line
        frames = [f for f in traceback.extract_tb(e.__traceback__)
                  if os.path.abspath(f.filename) == os.path.abspath(path)]
        where = f"{path}, line {frames[-1].lineno}" if frames else path
        hint = ""
        if isinstance(e, TypeError) and "unexpected keyword argument" in str(e):
            hint = _unknown_field_hint(e)
        raise ConfigError(f"{where}: {type(e).__name__}: {e}{hint}") from None


def load_config_file(path: str | os.PathLike) -> Config:
    """Imports a config file and calls its `get_config()`."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"_grpo_jax_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    with _config_file_errors(path):
        spec.loader.exec_module(module)  # the user's own config file, not model output
    if not hasattr(module, "get_config"):
        raise ConfigError(f"config file {path!r} has no get_config() function")
    with _config_file_errors(path):
        config = module.get_config()
    if not isinstance(config, Config):
        raise ConfigError(f"{path}: get_config() returned {type(config).__name__}, expected grpo_jax.config.Config")
    return config


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def from_dict(data: dict, where: str = "the saved config") -> Config:
    """Inverse of `to_dict` (JSON round trip: lists become tuples where the field is a tuple). A
    config saved before the sections were regrouped is read in today's layout (config.moved)."""
    data = upgrade_saved(data, where)
    unknown_sections = set(data) - set(SECTIONS)
    if unknown_sections:
        raise ConfigError(f"{where}: unknown sections {sorted(unknown_sections)}; sections are {sorted(SECTIONS)}")
    sections = {}
    for name, factory in SECTIONS.items():
        cls = factory().__class__
        values = dict(data.get(name, {}))
        hints = typing.get_type_hints(cls)
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"{where}: section {name!r} has unknown fields {sorted(unknown)}")
        for k, v in values.items():
            if typing.get_origin(hints[k]) is tuple and isinstance(v, list):
                values[k] = tuple(v)
        sections[name] = cls(**values)
    return Config(**sections)
