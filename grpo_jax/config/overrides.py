"""`--set section.field=value` overrides: each value parsed by its field's declared type (JSON
syntax for dicts and tuples), an unknown key or a bad value a ConfigError naming the key, the value
and what is allowed, an old key its new place; and the field list `train --help` shows."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, Literal

from grpo_jax.config.checks import ConfigError
from grpo_jax.config.moved import old_key_message
from grpo_jax.config.root import SECTIONS, Config


def _parse_value(key: str, text: str, hint: Any) -> Any:
    """Parses `text` by the field's type; JSON syntax for dicts and tuples."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if text.lower() in ("none", "null") and type(None) in typing.get_args(hint):
            return None
        errors = []
        for arg in args:
            try:
                return _parse_value(key, text, arg)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1:  # X | None: X's own message ("choose one of ...")
            raise errors[0]
        raise ConfigError(f"--set {key}={text!r}: cannot read it as {hint}")
    if origin is Literal:
        allowed = typing.get_args(hint)
        if text not in allowed:
            raise ConfigError(f"--set {key}={text!r} is not allowed; choose one of {list(allowed)}")
        return text
    try:
        if hint is bool:
            if text.lower() in ("true", "1", "yes"):
                return True
            if text.lower() in ("false", "0", "no"):
                return False
            raise ValueError
        if hint is int:
            return int(text)
        if hint is float:
            return float(text)
        if hint is str:
            return text
        if origin is tuple:
            return _parse_tuple(key, text, hint)
        if hint is dict:
            value = json.loads(text)
            if not isinstance(value, dict):
                raise ValueError
            return value
    except (ValueError, json.JSONDecodeError):
        pass
    raise ConfigError(f"--set {key}={text!r}: expected {_accepted_example(key, hint)}")


_EXAMPLES = {int: "8", float: "0.5", bool: "true", str: "text"}
_PAIRS = {int: (1, 8), float: (1.0, 0.5), str: ("a", "b")}


def _accepted_example(key: str, hint: Any) -> str:
    """What `--set key=...` takes, with an example, for a type error."""
    if typing.get_origin(hint) is tuple:
        item = typing.get_args(hint)[0]
        one, two = ("tensorboard", "wandb") if key == "train.report_to" else _PAIRS.get(item, ("a", "b"))
        return (f"a comma list of {item.__name__} (e.g. {key}={one},{two}; {key}= for none) or a JSON list "
                f"(e.g. {key}='{json.dumps([one, two])}')")
    if hint is dict:
        return f"a JSON object (e.g. {key}='{{\"name\": 1}}')"
    name = getattr(hint, "__name__", str(hint))
    return f"a value of type {name} (e.g. {key}={_EXAMPLES.get(hint, '...')})"


def _parse_tuple(key: str, text: str, hint: Any) -> tuple:
    """A tuple field: a JSON list, or a comma list (`a,b`; empty for none), items by the item type."""
    item = typing.get_args(hint)[0]
    stripped = text.strip()
    if stripped.startswith("["):
        value = json.loads(stripped)
        if not isinstance(value, list):
            raise ValueError
        return tuple(value)
    parts = [p.strip() for p in stripped.split(",")] if stripped else []
    if any(not p for p in parts):
        raise ValueError  # "a,,b"
    return tuple(_parse_value(key, p, item) for p in parts)


def apply_overrides(config: Config, overrides: list[str]) -> Config:
    """Returns `config` with each `section.field=value` (or `task.options.name=value`) applied.

    All overrides are applied first and the result is validated once, so the order of the flags
    does not matter (`eval.num_samples=2` then `eval.ks=[1,2]` is the same as the reverse)."""
    sections = {name: getattr(config, name) for name in SECTIONS}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected section.field=value")
        key, text = item.split("=", 1)
        key = key.strip()
        parts = key.split(".")
        if parts[:2] == ["task", "options"] and len(parts) == 3:
            # Task options are checked by the task itself; values are read as JSON when they parse.
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                value = text
            sections["task"] = dataclasses.replace(sections["task"], options={**sections["task"].options,
                                                                             parts[2]: value})
            continue
        name, field = _field_of(key, parts)
        hint = typing.get_type_hints(SECTIONS[name]().__class__)[field]
        sections[name] = dataclasses.replace(sections[name], **{field: _parse_value(key, text, hint)})
    return Config(**sections)  # validates once


def _field_of(key: str, parts: list[str]) -> tuple[str, str]:
    """(section, field) of a `--set` key; an old key names its new place, an unknown one the choices."""
    moved = old_key_message(key)
    if moved is not None:
        raise ConfigError(f"--set {key}: {moved}")
    if parts[0] not in SECTIONS:
        raise ConfigError(f"--set {key}: unknown section {parts[0]!r}; sections are {sorted(SECTIONS)}")
    if len(parts) != 2:
        raise ConfigError(f"--set {key}: expected section.field (or task.options.name)")
    fields = sorted(f.name for f in dataclasses.fields(SECTIONS[parts[0]]()))
    if parts[1] not in fields:
        raise ConfigError(f"--set {key}: unknown field {parts[1]!r} in section {parts[0]!r}; fields are {fields}")
    return parts[0], parts[1]


# What each section is for, one line each, as `train --help` heads its fields.
SECTION_HELP = {
    "model": "the policy: a Hugging Face checkpoint (hf_path) or a fresh shape, its tokenizer and kernels",
    "lora": "LoRA adapters over a frozen base (r > 0); TRL's lora_* names without the prefix",
    "task": "the prompts: a built-in generator or a JSONL file, and its options",
    "sampling": "the sampling engine and its decoding settings",
    "rewards": "your reward functions (TRL's reward_funcs / reward_weights), truncation, workers, time limit",
    "grpo": "the GRPO objective, batch and update counts, reference, distillation (TRL's GRPOConfig names)",
    "off_policy": "asynchronous rollouts, the sampler's own devices, the sampler correction, pi_old's source",
    "optim": "AdamW and its schedule",
    "sft": "the supervised warm-up (steps=0 skips it)",
    "eval": "held-out pass@k / maj@k / greedy accuracy",
    "train": "steps, seed, run directory, checkpoints, logging",
    "mesh": "the trainer's device mesh: data x fsdp x tensor (-1: the devices left over)",
}


def describe_fields() -> str:
    """Every `--set` key with its type and default, one per line, section by section (for --help)."""
    lines = []
    for name, factory in SECTIONS.items():
        defaults = factory()
        cls = defaults.__class__
        hints = typing.get_type_hints(cls)
        lines.append(f"  {name}: {SECTION_HELP[name]}")
        for f in dataclasses.fields(cls):
            hint = hints[f.name]
            args = typing.get_args(hint)
            if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args and any(
                    typing.get_origin(a) is Literal for a in args):  # Literal[...] | None
                literal = next(a for a in args if typing.get_origin(a) is Literal)
                kind = "one of " + ", ".join(repr(a) for a in typing.get_args(literal) + (None,))
            elif typing.get_origin(hint) is Literal:
                kind = "one of " + ", ".join(repr(a) for a in args)
            else:
                kind = getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
            lines.append(f"    {name}.{f.name} = {getattr(defaults, f.name)!r}  ({kind})")
    return "\n".join(lines)
