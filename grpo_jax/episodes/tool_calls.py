"""Tool calls read from a model turn's text, in the format its chat template taught it.

Two families:

  "hermes" (Qwen2.5, Qwen3, Hermes): one or more blocks, anywhere in the turn,
      <tool_call>
      {"name": "add", "arguments": {"a": 1, "b": 2}}
      </tool_call>
    Reasoning is not a call: text up to the last </think> (Qwen3; its template may open <think> in
    the prompt, so the turn holds only the closing tag) and after an unclosed <think> is skipped.
  "llama3" (Llama 3.1 / 3.2 JSON tool calling): the whole turn is the call, optionally after
    <|python_tag|>:  {"name": "add", "parameters": {"a": 1, "b": 2}}  (several objects may follow one
    another, separated by ";" or white space; "arguments" is accepted for "parameters").
    A turn that does not start with "{" (or <|python_tag|>) is a plain answer, not a call.

A call the model meant but wrote wrongly (bad JSON, no "name", arguments that are not an object, an
unclosed <tool_call>) is still returned, with `error` set: the tool environment answers it with the
error as text, so the model sees its mistake, and nothing raises.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Literal

ToolFamily = Literal["hermes", "llama3"]
TOOL_FAMILIES = ("hermes", "llama3")

_HERMES_RE = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call: `name` and `arguments` (a dict) when well formed; `error` (what is wrong) when not,
    with whatever name could be read ("" if none). `raw` is the call's text as the model wrote it."""

    name: str
    arguments: dict[str, Any]
    raw: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def tool_family_for(chat_template: str | None, override: str | None = None) -> ToolFamily:
    """The tool-call family a chat template's text teaches: "<tool_call>" -> "hermes"; "<|python_tag|>"
    or an "ipython" role -> "llama3". `override` ("hermes" | "llama3") wins; no template (a text
    prompt) -> "hermes". A template with neither marker is a ValueError asking for the override."""
    if override is not None and override != "auto":
        if override not in TOOL_FAMILIES:
            raise ValueError(f"tool call format {override!r}: expected one of {', '.join(TOOL_FAMILIES)} (or auto)")
        return override  # type: ignore[return-value]
    if chat_template is None:
        return "hermes"
    if "<tool_call>" in chat_template:
        return "hermes"
    if _PYTHON_TAG in chat_template or "ipython" in chat_template:
        return "llama3"
    raise ValueError("the chat template shows no tool-call format this trainer reads (no '<tool_call>' as in "
                     "Qwen / Hermes, no '<|python_tag|>' or 'ipython' as in Llama 3.1); name one explicitly: "
                     f"{' or '.join(TOOL_FAMILIES)}")


def parse_tool_calls(text: str, family: str) -> list[ToolCall]:
    """The calls in one model turn, in order ([] when the turn calls no tool)."""
    match family:
        case "hermes":
            return _hermes_calls(text)
        case "llama3":
            return _llama3_calls(text)
    raise ValueError(f"tool call format {family!r}: expected one of {', '.join(TOOL_FAMILIES)}")


def _hermes_calls(text: str) -> list[ToolCall]:
    calls = []
    for match in _HERMES_RE.finditer(_after_reasoning(text)):
        body, closed = match.group(1).strip(), bool(match.group(2))
        if not closed:  # the turn ended (stop token, token budget) inside the block
            calls.append(ToolCall(_name_guess(body), {}, body, "the <tool_call> block is not closed by </tool_call>"))
            continue
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(_name_guess(body), {}, body, f"the tool call is not valid JSON ({e})"))
            continue
        calls.append(_call_from_object(obj, body, "arguments"))
    return calls


def _after_reasoning(text: str) -> str:
    """`text` less its reasoning: what precedes the last </think>, and an unclosed <think> onwards."""
    end = text.rfind("</think>")
    text = text[end + len("</think>"):] if end >= 0 else text
    start = text.find("<think>")
    return text[:start] if start >= 0 else text


def _llama3_calls(text: str) -> list[ToolCall]:
    body = text.strip()
    tagged = body.startswith(_PYTHON_TAG)
    body = body.removeprefix(_PYTHON_TAG).strip()
    if not body or (not tagged and not body.startswith("{")):
        return []
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as e:
            rest = body[pos:]
            calls.append(ToolCall(_name_guess(rest), {}, rest, f"the tool call is not valid JSON ({e})"))
            break
        calls.append(_call_from_object(obj, body[pos:end], "parameters"))
        pos = end
        while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
            pos += 1
    return calls


def _call_from_object(obj: Any, raw: str, arguments_key: str) -> ToolCall:
    """A ToolCall from a decoded JSON value: {"name": str, arguments_key: {...}}; "arguments" and
    "parameters" are both accepted, and arguments written as a JSON string (OpenAI's form) are decoded."""
    expected = f'{{"name": ..., "{arguments_key}": {{...}}}}'
    if not isinstance(obj, dict):
        return ToolCall("", {}, raw, f"the tool call is a JSON {type(obj).__name__}, expected an object {expected}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", {}, raw, f'the tool call has no "name" (expected {expected})')
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return ToolCall(name, {}, raw, f"the arguments of {name!r} are a string that is not JSON ({e})")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCall(name, {}, raw,
                        f"the arguments of {name!r} are a JSON {type(args).__name__}, expected an object")
    return ToolCall(name, args, raw)


def _name_guess(body: str) -> str:
    """The "name" of a call whose JSON is broken, when it can be read, so the error names the tool."""
    match = re.search(r'"name"\s*:\s*"([^"]*)"', body)
    return match.group(1) if match else ""
