"""Tools as an environment: the model calls plain Python functions (TRL's `tools=`) or the public
methods of an environment object (TRL's `environment_factory=`), and reads their results.

    def multiply(a: float, b: float) -> float:
        '''Multiplies two numbers.

        Args:
            a: The first factor.
            b: The second factor.
        '''
        return a * b

    env = ToolEnvironment(tools=[multiply])            # family: tool_calls.tool_family_for(template)
    env.tools_schema                                    # -> the chat template's tools=[...]
    env.step('<tool_call>\\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\\n</tool_call>')
    # Reply(messages=[{"role": "tool", "name": "multiply", "content": "42"}],
    #       text="<tool_response>\\n42\\n</tool_response>\\n", done=False)
    env.step("The answer is 42.")                       # no call: Reply(done=True)

A tool's failure is the model's to read, not the run's to stop on: an unknown tool, arguments that do
not fit the signature or the type hints, a malformed call and an exception raised inside the tool each
become the tool message "Error: ..." and count in `tool_errors`.

`make_environment_factory(spec)` turns the command line's import path(s) into the per-episode factory.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from grpo_jax.config.import_paths import import_object
from grpo_jax.episodes.environment import Environment, Reply
from grpo_jax.episodes.tool_calls import ToolCall, parse_tool_calls
from grpo_jax.episodes.tool_schema import json_schema

_JSON_TYPES = {"integer": int, "number": (int, float), "string": str, "boolean": bool, "array": list,
               "object": dict, "null": type(None)}


def tool_method_names(cls: type) -> list[str]:
    """The names of `cls`'s public methods (not starting with "_"), `reset` excluded: TRL's
    environment_factory exposes exactly these to the model as tools."""
    return [name for name in dir(cls) if not name.startswith("_") and name != "reset"
            and inspect.isfunction(inspect.getattr_static(cls, name, None))]


class ToolEnvironment:
    """An `Environment` whose step runs the tool calls in the model's turn.

    tools: plain functions (each with type hints and a Google-style docstring).
    env: an environment object (TRL's environment_factory product): its public methods are tools too,
      its `reset(**row)` (if any) starts each episode, and reward functions read its state via `.env`.
    family: the tool-call format, "hermes" or "llama3" (`tool_calls.tool_family_for`).
    Counters (this episode): `tool_calls` (calls made, malformed ones included), `tool_errors`.
    """

    def __init__(self, tools: Sequence[Callable] = (), env: object | None = None, family: str = "hermes"):
        self.env = env
        self.family = family
        self.tools: dict[str, Callable] = {}
        methods = [getattr(env, n) for n in tool_method_names(type(env))] if env is not None else []
        for fn in [*tools, *methods]:
            name = getattr(fn, "__name__", type(fn).__name__)
            if name in self.tools:
                raise ValueError(f"two tools are named {name!r}; tool names must be unique (the model calls them "
                                 "by name)")
            self.tools[name] = fn
        if not self.tools:
            raise ValueError(f"no tools: pass functions as tools=, or an environment object with public methods "
                             f"(got env={type(env).__name__ if env is not None else None})")
        self.tools_schema: list[dict] = [json_schema(fn) for fn in self.tools.values()]
        self._params = {s["function"]["name"]: s["function"]["parameters"] for s in self.tools_schema}
        self.tool_calls = 0
        self.tool_errors = 0

    def reset(self, **row) -> str | None:
        self.tool_calls = self.tool_errors = 0
        reset = getattr(self.env, "reset", None)
        return reset(**row) if callable(reset) else None

    def close(self) -> None:
        """The wrapped environment's `close`, if it has one (the episode is over and scored)."""
        close = getattr(self.env, "close", None)
        if callable(close):
            close()

    def step(self, turn: str) -> Reply:
        calls = parse_tool_calls(turn, self.family)
        if not calls:
            return Reply(done=True)
        messages = []
        for call in calls:
            self.tool_calls += 1
            content, failed = self._run(call)
            self.tool_errors += failed
            messages.append({"role": "tool", "name": call.name or "invalid_tool_call", "content": content})
        # A text prompt has no chat template to render the tool messages: Qwen / Hermes's block, which
        # tool-tuned models of either family read.
        text = "".join(f"<tool_response>\n{m['content']}\n</tool_response>\n" for m in messages)
        return Reply(messages=messages, text=text)

    def _run(self, call: ToolCall) -> tuple[str, bool]:
        """(the tool message's content, whether it is an error)."""
        if not call.ok:
            return f"Error: {call.error}", True
        fn = self.tools.get(call.name)
        if fn is None:
            return f"Error: unknown tool {call.name!r}; the tools are {', '.join(self.tools)}", True
        problem = argument_problem(call.arguments, self._params[call.name])
        if problem:
            return f"Error: {call.name}: {problem}", True
        try:
            result = fn(**call.arguments)
        except Exception as e:  # the tool's own failure is an observation for the model
            return f"Error: {type(e).__name__}: {e}", True
        return str(result), False


def argument_problem(arguments: dict[str, Any], parameters: dict) -> str | None:
    """What is wrong with `arguments` for a tool with JSON schema `parameters` (None: nothing):
    unknown or missing names, or a value whose JSON type the schema does not allow."""
    properties = parameters.get("properties", {})
    unknown = [a for a in arguments if a not in properties]
    if unknown:
        return f"unknown argument {unknown[0]!r} (the arguments are {', '.join(properties) or 'none'})"
    missing = [a for a in parameters.get("required", []) if a not in arguments]
    if missing:
        return f"missing required argument {missing[0]!r}"
    for name, value in arguments.items():
        if not value_fits(value, properties[name]):
            want = properties[name].get("type", "any")
            return f"argument {name!r} must be {want}, got {type(value).__name__} {value!r:.60}"
    return None


def value_fits(value: Any, schema: dict) -> bool:
    """Whether a decoded JSON value fits a schema from `tool_schema.type_schema` (the subset it writes)."""
    if value is None and schema.get("nullable"):
        return True
    if "enum" in schema and value not in schema["enum"]:
        return False
    if "anyOf" in schema:
        return any(value_fits(value, s) for s in schema["anyOf"])
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        # JSON has one boolean type; Python's bool is also an int, so it is kept out of integer/number.
        if not any(isinstance(value, _JSON_TYPES.get(k, object)) and not (isinstance(value, bool) and k in
                                                                          ("integer", "number")) for k in kinds):
            return False
    if isinstance(value, list) and "items" in schema:
        return all(value_fits(v, schema["items"]) for v in value)
    if isinstance(value, list) and "prefixItems" in schema:
        items = schema["prefixItems"]
        return len(value) == len(items) and all(value_fits(v, s) for v, s in zip(value, items))
    if isinstance(value, dict) and "additionalProperties" in schema:
        return all(value_fits(v, schema["additionalProperties"]) for v in value.values())
    return True


def make_environment_factory(spec: str | Callable | Sequence[str | Callable],
                             family: str = "hermes") -> Callable[[], Environment]:
    """The per-episode environment factory for `spec`:

    - one import path (or callable) of a class / callable with no required arguments, producing an
      `Environment` (has `reset` and `step`) or a TRL-style environment object (public tool methods,
      wrapped in a `ToolEnvironment`);
    - a list of tool functions' import paths (or functions): each episode gets a `ToolEnvironment`.

    Anything that cannot work is a one-line ValueError naming the path and what is wrong.
    """
    if isinstance(spec, (list, tuple)):
        if not spec:
            raise ValueError("environment tools=[]: expected at least one tool function (import path or function)")
        fns = [import_object(s, "tool function") if isinstance(s, str) else s for s in spec]
        for s, fn in zip(spec, fns):
            if not callable(fn) or inspect.isclass(fn):
                raise ValueError(f"tool function {s!r} is a {type(fn).__name__}, not a function")
        ToolEnvironment(tools=fns, family=family)  # schemas checked now, before any model is loaded
        return lambda: ToolEnvironment(tools=fns, family=family)
    factory = import_object(spec, "environment") if isinstance(spec, str) else spec
    if not callable(factory):
        raise ValueError(f"environment {spec!r} is a {type(factory).__name__}, not a class or a function")
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: it is tried when called
        signature = None
    if signature is not None:
        required = [p.name for p in signature.parameters.values() if p.default is p.empty
                    and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if required:
            raise ValueError(f"environment {spec!r} needs argument(s) {', '.join(required)}; the factory is called "
                             "with none, once per episode (give them defaults, or wrap it in a function)")
    if inspect.isclass(factory):
        _environment_kind(factory, spec)  # fails now on a class that could never work

    def make() -> Environment:
        obj = factory()
        if _environment_kind(type(obj), spec) == "environment":
            return obj
        return ToolEnvironment(env=obj, family=family)

    return make


def _environment_kind(cls: type, spec: Any) -> str:
    """"environment" (has callable reset and step) or "tools" (public tool methods, each with a valid
    schema); else ValueError."""
    if callable(getattr(cls, "step", None)) and callable(getattr(cls, "reset", None)):
        return "environment"
    names = tool_method_names(cls)
    if not names:
        raise ValueError(f"environment {spec!r}: {cls.__name__} has neither reset() and step(turn) (an Environment) "
                         "nor public tool methods (a TRL environment: methods with type hints and docstrings)")
    for name in names:
        try:
            json_schema(getattr(cls, name))
        except ValueError as e:
            raise ValueError(f"environment {spec!r}: {e}") from e
    return "tools"
