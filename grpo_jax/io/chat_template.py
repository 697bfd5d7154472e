"""Chat templates as Hugging Face ships them: the checkpoint's own Jinja template, rendered the way
transformers' `apply_chat_template` renders it, without transformers.

    templates = read_chat_templates("/ckpt/Qwen2.5-0.5B-Instruct", tokenizer_config)  # or None
    text = render_chat_template(templates.select(), [{"role": "user", "content": "2+2?"}],
                                add_generation_prompt=True, special_tokens={"eos_token": "<|im_end|>"})
    # '<|im_start|>system\\nYou are Qwen, ...<|im_end|>\\n<|im_start|>user\\n2+2?<|im_end|>\\n<|im_start|>assistant\\n'

Where a checkpoint keeps its templates (transformers reads all three; the .jinja files win):
  chat_template.jinja          the default template (what transformers >= 4.50 writes)
  chat_templates/<name>.jinja  more named templates
  tokenizer_config.json        "chat_template": a string, or a list of {"name": ..., "template": ...}

The dialect is transformers': a sandboxed environment (`ImmutableSandboxedEnvironment`: templates
come from the Hub and are untrusted code) with trim_blocks and lstrip_blocks, the loop controls
extension (`{% break %}`, `{% continue %}`) and `{% generation %}` blocks (rendered as their body;
transformers uses them for assistant masks). Globals: `raise_exception(message)`,
`strftime_now(format)`, `namespace(...)` (no underscore-prefixed attributes) and `dict(...)`; the
`tojson` filter is json.dumps with ensure_ascii=False (plus indent, separators, sort_keys), not
Jinja's HTML-escaping one. Rendering is bounded in time, size, powers and range() items
(`grpo_jax.io.chat_template_bounds.RenderLimits`: 2 s and 4,000,000 characters by default). Variables: `messages`, `add_generation_prompt`, `tools` and `documents`
(None unless given), the tokenizer's special tokens as strings (`bos_token`, `eos_token`,
`pad_token`, ...: only those it has, so `bos_token is defined` means something) and any extra keyword.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

from grpo_jax.io import chat_template_bounds as bounds
from grpo_jax.io.chat_template_bounds import RenderLimits

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "chat_templates"


class ChatTemplateError(ValueError):
    """A template that is missing, does not parse, raised (`raise_exception`) or failed while
    rendering, or went past its bounds (`grpo_jax.io.chat_template_bounds`: time, size, powers, range)."""


@dataclasses.dataclass(frozen=True)
class ChatTemplates:
    """A tokenizer's chat templates: name -> Jinja source ("default" is used when none is named),
    and `source`, the file(s) they came from, for error messages."""

    templates: Mapping[str, str]
    source: str

    def select(self, *, tools: Sequence | None = None) -> str:
        """The template to render when the caller names none, as transformers picks it: "tool_use"
        when `tools` are given and the checkpoint has one, else "default"."""
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise ChatTemplateError(f"{self.source} has several chat templates and none is named 'default'; "
                                f"pass chat_template= one of {sorted(self.templates)}")


def choose_template(templates: ChatTemplates | None, chat_template: str | None = None, *,
                    tools: Sequence | None = None, home: str = "this tokenizer") -> tuple[str, str]:
    """(the Jinja source to render, what to call it in errors) for a tokenizer whose templates
    are `templates` (None: it has none; `home` says where they were looked for) and a caller's
    `chat_template` (a name of one of them, a template, or None: the tokenizer's own)."""
    if chat_template is not None:
        if templates is not None and chat_template in templates.templates:
            return templates.templates[chat_template], f"chat template {chat_template!r} of {templates.source}"
        return chat_template, "the chat_template argument"
    if templates is None:
        raise ChatTemplateError(
            f"{home} has no chat template (looked for {TEMPLATE_FILE}, {TEMPLATE_DIR}/*.jinja and "
            "\"chat_template\" in tokenizer_config.json); give the prompt as a plain string "
            "(encode_prompt) or pass chat_template= a Jinja template")
    return templates.select(tools=tools), templates.source


def _read_text(path: pathlib.Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ChatTemplateError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def read_chat_templates(directory: str | pathlib.Path,
                        tokenizer_config: Mapping[str, Any] | None = None) -> ChatTemplates | None:
    """The chat templates of checkpoint `directory`, or None when it has none.

    `tokenizer_config` is its tokenizer_config.json, already read (None: no such file). A
    "chat_template" entry of the wrong shape is an error naming the file.
    """
    directory = pathlib.Path(directory)
    files: dict[str, str] = {}
    if (directory / TEMPLATE_FILE).is_file():
        files["default"] = _read_text(directory / TEMPLATE_FILE)
    if (directory / TEMPLATE_DIR).is_dir():
        for path in sorted((directory / TEMPLATE_DIR).glob("*.jinja")):
            files[path.name.removesuffix(".jinja")] = _read_text(path)
    if files:
        where = directory / TEMPLATE_FILE if list(files) == ["default"] else directory
        return ChatTemplates(files, str(where))
    entry = (tokenizer_config or {}).get("chat_template")
    where = str(directory / "tokenizer_config.json")
    if entry is None:
        return None
    if isinstance(entry, str):
        return ChatTemplates({"default": entry}, where)
    if isinstance(entry, list) and all(isinstance(t, Mapping) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in entry):
        return ChatTemplates({t["name"]: t["template"] for t in entry}, where)
    raise ChatTemplateError(f"{where}: \"chat_template\" must be a string or a list of "
                            f"{{\"name\": ..., \"template\": ...}} objects, got {str(entry)[:80]!r}")


# ---------------------------------------------------------------- the environment


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' filter: plain JSON (Jinja's own escapes <, >, & and ' for HTML).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _dict(*args, **kwargs) -> dict:
    # A function, not the `dict` type: a type object is one attribute away from the type system.
    return dict(*args, **kwargs)


@functools.cache
def _environment():
    """The one sandboxed environment every template compiles in (built on first use: jinja2 is
    imported only by tokenizers that render a template)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    version = tuple(int(p) for p in re.findall(r"\d+", jinja2.__version__)[:3])
    if version < (3, 1, 6):  # 3.1.5 and 3.1.6 closed sandbox escapes; templates are untrusted code
        raise ImportError(f"chat templates need jinja2>=3.1.6 (its sandbox fixes), found {jinja2.__version__}; "
                          "pip install -U 'jinja2>=3.1.6,<4'")

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`, rendered as its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """`namespace(...)` whose attributes never start with "_" (no route to dunders), and never
        hold a value over the size bounds (the one place a loop can grow a value step by step)."""

        def __setitem__(self, name, value):
            _check_name(name)
            super().__setitem__(name, bounds.check_size(value, f"namespace attribute {name!r}"))

    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set namespace attribute {name!r}")

    def namespace(*args, **kwargs):
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_name(name)
        return Namespace(attrs)

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        """The sandbox, with every call, power, product and sum checked against the bounds."""

        intercepted_binops = frozenset({"**", "*", "+", "%"})  # also stops their constant folding

        def call_binop(self, context, operator, left, right):
            bounds.check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's signature
            what = f"call of {getattr(__obj, '__name__', type(__obj).__name__)}"
            bounds.check_arguments(args, kwargs, what)
            return bounds.check_size(super().call(__context, __obj, *args, **kwargs), f"the result of the {what}")

        def wrap_str_format(self, value):
            bounds.check_format_string(getattr(value, "__self__", None), "str.format")
            return super().wrap_str_format(value)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=[jinja2.ext.loopcontrols, GenerationBlock])
    env.filters["tojson"] = _tojson
    for name, fn in list(env.filters.items()):  # filters are called directly, not through `call`
        env.filters[name] = _bounded_filter(name, fn)
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       namespace=namespace, dict=_dict, range=bounds.bounded_range)
    return env


def _bounded_filter(name: str, fn):
    @functools.wraps(fn)  # keeps Jinja's pass_context / pass_environment marker
    def bounded_filter(*args, **kwargs):
        bounds.check_arguments(args, kwargs, f"filter {name!r}")
        if name == "format" and args:
            bounds.check_format_string(args[0], "filter 'format'")  # do_format(value, *args)
        return bounds.check_size(fn(*args, **kwargs), f"the result of filter {name!r}")

    return bounded_filter


@functools.lru_cache(maxsize=32)
def _compile(template: str):
    return _environment().from_string(template)


def _plain(value, where: str):
    """A copy of `value` made of JSON types only (str, int, float, bool, None, dict, list, tuple):
    the sandbox guards attribute access, but an object's own methods are the caller's code."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind in (bool, str, int, float):  # subclasses (enums, numpy scalars) back to the base type
        if isinstance(value, kind):
            return kind(value)
    if hasattr(value, "dtype") and hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        return _plain(value.item(), where)
    if isinstance(value, Mapping):
        return {_plain(k, where): _plain(v, where) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        kind = tuple if isinstance(value, tuple) else list
        return kind(_plain(v, where) for v in value)
    raise TypeError(f"{where} holds a {type(value).__name__}; chat templates see JSON values only "
                    "(str, int, float, bool, None, dict, list)")


def render_chat_template(template: str, conversation: Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool = False,
                         special_tokens: Mapping[str, str] | None = None,
                         tools: Sequence | None = None, documents: Sequence | None = None,
                         source: str = "the chat template", limits: RenderLimits | None = None,
                         **kwargs) -> str:
    """`template` (Jinja source) rendered over one conversation, as transformers renders it.

    `conversation`: [{"role": "system" | "user" | "assistant" | ..., "content": str, ...}, ...];
    keys whose value is None are dropped (as transformers does: many templates print "None").
    `special_tokens`: {"bos_token": "<s>", ...}, strings, visible as template variables; `kwargs`
    too (e.g. `enable_thinking=False` for Qwen3) and they win over special tokens of the same name.
    `source` names the template in errors; `limits` bounds the render (None: `DEFAULT_LIMITS`).
    Returns the text, special tokens spelled out.
    """
    import jinja2

    if isinstance(conversation, (str, bytes)) or not isinstance(conversation, Sequence):
        raise TypeError(f"conversation must be a list of {{'role', 'content'}} dicts, got "
                        f"{type(conversation).__name__}")
    if not conversation:
        raise ValueError("cannot apply a chat template to an empty conversation; give at least one message")
    messages = []
    for i, message in enumerate(conversation):
        if not isinstance(message, Mapping):
            raise TypeError(f"conversation[{i}] must be a {{'role', 'content'}} dict, got {message!r}")
        messages.append(_plain({k: v for k, v in message.items() if v is not None}, f"conversation[{i}]"))
    try:
        compiled = _compile(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{source}: not a valid Jinja template ({e.message} at line {e.lineno})") from None
    variables = {**dict(special_tokens or {}), **_plain(kwargs, "a chat template keyword")}
    variables.update(messages=messages, add_generation_prompt=add_generation_prompt,
                     tools=_plain(tools, "tools"), documents=_plain(documents, "documents"))
    return _render_bounded(compiled, variables, limits or bounds.DEFAULT_LIMITS, source)


def _render_bounded(compiled, variables: dict, limits: RenderLimits, source: str) -> str:
    """The text, streamed and counted; every failure a one-line ChatTemplateError naming `source`."""
    import jinja2

    chunks, size = [], 0
    try:
        with bounds.bounded(limits):
            for chunk in compiled.generate(**variables):
                size += len(chunk)
                if size > limits.max_chars:
                    raise bounds.TemplateBoundError(
                        f"its output passed {limits.max_chars:,} characters (model.chat_template_max_chars)")
                chunks.append(chunk)
    except bounds.TemplateTimeout:
        raise ChatTemplateError(f"{source} took longer than {limits.max_seconds:g} s to render; a chat template "
                                "normally takes milliseconds (raise model.chat_template_max_seconds only for a "
                                "template you trust)") from None
    except bounds.TemplateBoundError as e:
        raise ChatTemplateError(f"{source} was stopped: {e}") from None
    except jinja2.TemplateError as e:  # raise_exception(...), an undefined call, a sandbox refusal
        raise ChatTemplateError(f"{source} refused the conversation: {e}") from None
    except RecursionError:
        raise ChatTemplateError(f"{source} recursed too deep (a macro that calls itself without end?)") from None
    except MemoryError:
        raise ChatTemplateError(f"{source} ran out of memory while rendering") from None
    except Exception as e:  # noqa: BLE001 - a template's own error (1/0, a too-big range) is the template's fault
        raise ChatTemplateError(f"{source} failed while rendering: {type(e).__name__}: {e}") from None
    return "".join(chunks)
