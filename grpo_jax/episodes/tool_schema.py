"""The function-calling JSON schema of a plain Python function, read from its signature, type hints
and Google-style docstring: what a chat template's `tools=` expects.

    def add(a: int, b: int = 0) -> int:
        '''Adds two integers.

        Args:
            a: The first number.
            b: The second number.
        '''

    json_schema(add) == {"type": "function", "function": {
        "name": "add", "description": "Adds two integers.",
        "parameters": {"type": "object",
                       "properties": {"a": {"type": "integer", "description": "The first number."},
                                      "b": {"type": "integer", "description": "The second number."}},
                       "required": ["a"]},
        "return": {"type": "integer"}}}

The shape, the type mapping and the docstring rules are those of `transformers.utils.get_json_schema`
(tests/test_episode_tools.py compares the two where transformers is installed), so a tool list
renders the same text here as in TRL: int -> integer, float -> number, str -> string, bool -> boolean,
list[X] -> array of X, tuple[X, Y] -> array with prefixItems, dict[str, X] -> object with
additionalProperties, X | None -> X with "nullable", X | Y -> a list of types, Literal[...] -> an
enum, Any -> {}, anything else -> object. A description that ends in `(choices: [...])` becomes an
enum. A missing docstring, a missing type hint or an argument the docstring does not describe is a
ValueError naming the function and the argument.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable
from typing import Any

# Google-style sections: the summary runs up to the first "Args:", "Returns:" or "Raises:" line.
_SECTION_RE = re.compile(r"^\s*(Args|Returns|Raises):\s*$", re.MULTILINE)
# One argument line in "Args:": "name: text" or "name (type): text", the text continuing on
# deeper-indented lines.
_ARG_RE = re.compile(r"^(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_CHOICES_RE = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)


def docstring_sections(doc: str) -> tuple[str, dict[str, str], str | None]:
    """(summary, {arg: description}, returns text or None) of a Google-style docstring (already
    dedented, as `inspect.getdoc` gives it). An argument's description spread over several lines is
    joined with single spaces."""
    parts = _SECTION_RE.split(doc)
    # split() with one group gives [summary, name1, body1, name2, body2, ...]
    summary = parts[0].strip()
    sections = {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}
    args: dict[str, str] = {}
    name, arg_indent = None, 0
    for line in sections.get("Args", "").splitlines():
        if not line.strip():
            continue
        match = _ARG_RE.match(line.strip())
        # A new argument starts at the block's shallowest indentation; deeper lines continue the last.
        if match and (name is None or _indent(line) <= arg_indent):
            name, arg_indent = match.group(1), _indent(line)
            args[name] = match.group(2).strip()
        elif name is not None:
            args[name] = f"{args[name]} {line.strip()}".strip()
    returns = sections.get("Returns")
    returns = returns.strip() if returns is not None and returns.strip() else None  # inner newlines kept
    return summary, args, returns


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def type_schema(hint: Any, where: str) -> dict:
    """The JSON schema of one type hint; `where` ("function f, argument x") names it in errors."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return {}
    if origin is None:
        basic = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null",
                 list: "array", tuple: "array", dict: "object"}
        return {"type": basic.get(hint, "object")}  # a class of your own: an object (as transformers)
    if origin is typing.Literal:
        kinds = list(dict.fromkeys(type_schema(type(v), where)["type"] for v in args))  # first-seen order
        return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        subs = [type_schema(a, where) for a in args if a is not type(None)]
        if len(subs) == 1:
            out = dict(subs[0])
        elif all(isinstance(s.get("type"), str) and len(s) == 1 for s in subs):
            out = {"type": sorted({s["type"] for s in subs})}
        else:
            out = {"anyOf": subs}
        if type(None) in args:
            out["nullable"] = True
        return out
    if origin is list:
        return {"type": "array", "items": type_schema(args[0], where)} if args else {"type": "array"}
    if origin is tuple:
        if len(args) == 1 or Ellipsis in args:
            raise ValueError(f"{where}: type hint {hint} is a variable-length or one-element tuple; "
                             "use list[X] (or the element type itself)")
        return {"type": "array", "prefixItems": [type_schema(a, where) for a in args]} if args else {"type": "array"}
    if origin is dict:
        out = {"type": "object"}
        if len(args) == 2:
            out["additionalProperties"] = type_schema(args[1], where)
        return out
    raise ValueError(f"{where}: cannot express the type hint {hint} in JSON schema")


def json_schema(fn: Callable) -> dict:
    """{"type": "function", "function": {"name", "description", "parameters", ["return"]}} for `fn`
    (a function or a method, bound or read from its class: `self` is not a parameter)."""
    name = getattr(fn, "__name__", type(fn).__name__)
    doc = inspect.getdoc(fn)
    if not doc or not doc.strip():
        raise ValueError(f"tool {name!r} has no docstring; a tool needs one (a summary line, then 'Args:' "
                         "with one 'name: description' line per argument), the model reads it")
    summary, arg_docs, returns_doc = docstring_sections(doc.strip())
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # an annotation naming something not importable
        raise ValueError(f"tool {name!r}: cannot evaluate its type hints ({e})") from e
    properties, required = {}, []
    params = dict(inspect.signature(fn).parameters)
    first = next(iter(params.values()), None)
    # A method read from its class: `self` (or `cls`) without a hint is the receiver, not an argument.
    if first is not None and first.name in ("self", "cls") and first.annotation is first.empty:
        del params[first.name]
    for arg, param in params.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ValueError(f"tool {name!r}: argument {arg!r} is *args/**kwargs; a tool's arguments must be "
                             "named, each with a type hint and a description")
        if arg not in hints:
            raise ValueError(f"tool {name!r}: argument {arg!r} has no type hint (e.g. `{arg}: str`)")
        if arg not in arg_docs:
            raise ValueError(f"tool {name!r}: the docstring's 'Args:' section does not describe argument "
                             f"{arg!r} (add a line '{arg}: what it is')")
        schema = type_schema(hints[arg], f"tool {name!r}, argument {arg!r}")
        description = arg_docs[arg]
        choices = _CHOICES_RE.search(description)
        if choices:
            try:
                schema["enum"] = [c.strip() if isinstance(c, str) else c for c in json.loads(choices.group(1))]
            except json.JSONDecodeError as e:
                raise ValueError(f"tool {name!r}, argument {arg!r}: '(choices: {choices.group(1)})' is not a JSON "
                                 'list (write e.g. (choices: ["tea", "coffee"]))') from e
            description = description[: choices.start()].strip()
        schema["description"] = description
        properties[arg] = schema
        if param.default is inspect.Parameter.empty:
            required.append(arg)
    parameters: dict = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    function: dict = {"name": name, "description": summary, "parameters": parameters}
    if "return" in hints:
        function["return"] = type_schema(hints["return"], f"tool {name!r}, return value")
        if returns_doc is not None:
            function["return"]["description"] = returns_doc
    return {"type": "function", "function": function}
