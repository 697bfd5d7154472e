"""Tools as an environment (grpo_jax/episodes/tool_schema.py, tool_calls.py, tools.py), as worked
examples: a function's schema, a model turn's calls, the tool messages that answer them, and the
command line's import paths."""

import textwrap
from typing import Any, Literal, Optional

import pytest

from grpo_jax.episodes.environment import Environment, Reply
from grpo_jax.episodes.tool_calls import ToolCall, parse_tool_calls, tool_family_for
from grpo_jax.episodes.tool_schema import json_schema
from grpo_jax.episodes.tools import ToolEnvironment, argument_problem, make_environment_factory


def calculator(a: float, b: float, op: Literal["+", "-", "*", "/"] = "+") -> float:
    """Computes `a op b`.

    Args:
        a: The left operand.
        b: The right operand.
        op: The operation.

    Returns:
        The result.
    """
    return {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op]


def search(query: str, tags: list[str], limit: Optional[int] = None, weights: dict[str, float] | None = None,
           lang: str = "en", anything: Any = None, pair: tuple[int, str] = (0, "")) -> list[str]:
    """Searches the notes.

    Returns what matched, best first.

    Args:
        query: The words to look for,
            over several lines.
        tags: Only notes with these tags.
        limit: At most this many results.
        weights: A weight per field.
        lang: The language (choices: ["en", "fr"])
        anything: Passed through.
        pair: A number and a label.
    """
    return [query]


def hermes(*calls: str) -> str:
    return "".join(f"<tool_call>\n{c}\n</tool_call>\n" for c in calls)


# --- json_schema -----------------------------------------------------------------------------------

def test_the_calculators_schema_is_what_a_chat_templates_tools_expects():
    assert json_schema(calculator) == {"type": "function", "function": {
        "name": "calculator",
        "description": "Computes `a op b`.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "number", "description": "The left operand."},
            "b": {"type": "number", "description": "The right operand."},
            "op": {"type": "string", "enum": ["+", "-", "*", "/"], "description": "The operation."}},
            "required": ["a", "b"]},  # op has a default: not required
        "return": {"type": "number", "description": "The result."}}}


def test_lists_dicts_optionals_unions_tuples_any_and_choices():
    props = json_schema(search)["function"]["parameters"]["properties"]
    assert json_schema(search)["function"]["description"] == "Searches the notes.\n\nReturns what matched, best first."
    assert props["query"] == {"type": "string", "description": "The words to look for, over several lines."}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}, "description": "Only notes with these tags."}
    assert props["limit"] == {"type": "integer", "nullable": True, "description": "At most this many results."}
    assert props["weights"] == {"type": "object", "additionalProperties": {"type": "number"}, "nullable": True,
                                "description": "A weight per field."}
    assert props["lang"] == {"type": "string", "enum": ["en", "fr"], "description": "The language"}
    assert props["anything"] == {"description": "Passed through."}  # Any: no type constraint
    assert props["pair"] == {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
                             "description": "A number and a label."}
    assert json_schema(search)["function"]["parameters"]["required"] == ["query", "tags"]


def test_a_tool_without_docstring_or_description_or_hint_is_an_error_naming_it():
    def bare(x: int):
        return x

    def half_documented(x: int, y: int):
        """Adds.

        Args:
            x: The first.
        """

    def unhinted(x):
        """Echoes.

        Args:
            x: Anything.
        """

    with pytest.raises(ValueError, match="tool 'bare' has no docstring"):
        json_schema(bare)
    with pytest.raises(ValueError, match="tool 'half_documented'.*does not describe argument 'y'"):
        json_schema(half_documented)
    with pytest.raises(ValueError, match="tool 'unhinted': argument 'x' has no type hint"):
        json_schema(unhinted)


@pytest.mark.vllm
def test_json_schema_matches_transformers_get_json_schema():
    # The vllm venv has transformers; the default one does not (then this is skipped).
    transformers_utils = pytest.importorskip("transformers.utils")

    def no_args() -> str:
        """Tells the time."""
        return "noon"

    def union(x: int | str, flag: bool = False):
        """Takes either.

        Args:
            x: An id or a name.
            flag: Whether to shout.
        """

    def nested(rows: list[dict[str, int]], mode: Literal["fast", 1]) -> dict:
        """Sums rows.

        Args:
            rows: The rows, each a mapping
                from column to value.
            mode: How.

        Returns:
            The totals,
            per column.
        """

    def raises(x: int, note: str = "") -> None:
        """Checks x: carefully.

        Args:
            x: The value. Note: a colon inside.
            note: A note.

        Raises:
            ValueError: when x is negative.
        """

    for fn in (calculator, search, no_args, union, nested, raises, Counter().increment):
        assert json_schema(fn) == transformers_utils.get_json_schema(fn), fn.__name__


# --- parsing tool calls ----------------------------------------------------------------------------

def test_a_qwen_turn_with_two_calls_after_its_reasoning():
    turn = ("<think>I could call <tool_call>{\"name\": \"nope\"}</tool_call> but no.</think>\nLet me compute.\n"
            + hermes('{"name": "calculator", "arguments": {"a": 6, "b": 7, "op": "*"}}',
                     '{"name": "calculator", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}'))  # arguments as a JSON string
    calls = parse_tool_calls(turn, "hermes")
    assert [(c.name, c.arguments, c.ok) for c in calls] == [
        ("calculator", {"a": 6, "b": 7, "op": "*"}, True), ("calculator", {"a": 1, "b": 2}, True)]
    # Qwen3's template may open <think> in the prompt: the turn then holds only </think>.
    opened_in_prompt = 'maybe <tool_call>{"name": "nope"}</tool_call>?</think>' + hermes('{"name": "f"}')
    assert [(c.name, c.arguments) for c in parse_tool_calls(opened_in_prompt, "hermes")] == [("f", {})]
    still_thinking = hermes('{"name": "f"}') + '<think>then <tool_call>{"name": "g"}</tool_call>'
    assert [c.name for c in parse_tool_calls(still_thinking, "hermes")] == ["f"]


def test_malformed_hermes_calls_are_returned_with_their_error():
    bad_json, no_name, unclosed = parse_tool_calls(
        hermes('{"name": "calculator", "arguments": {"a": 1,}}', '{"arguments": {}}')
        + '<tool_call>\n{"name": "calculator", "argu', "hermes")
    assert bad_json.name == "calculator" and "not valid JSON" in bad_json.error
    assert no_name.name == "" and 'no "name"' in no_name.error
    assert unclosed.name == "calculator" and "not closed" in unclosed.error  # the name is read all the same
    assert parse_tool_calls("The answer is 42.", "hermes") == []


def test_llama3_calls_are_the_whole_turn():
    one = parse_tool_calls('{"name": "calculator", "parameters": {"a": 1, "b": 2}}', "llama3")
    assert one == [ToolCall("calculator", {"a": 1, "b": 2}, '{"name": "calculator", "parameters": {"a": 1, "b": 2}}')]
    two = parse_tool_calls('<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"x": 1}}',
                           "llama3")
    assert [(c.name, c.arguments) for c in two] == [("f", {}), ("g", {"x": 1})]
    assert parse_tool_calls("The answer is {42}.", "llama3") == []  # a plain answer: not a call
    (broken,) = parse_tool_calls('<|python_tag|>{"name": "f", "parameters": {', "llama3")
    assert broken.name == "f" and "not valid JSON" in broken.error


def test_the_family_comes_from_the_chat_template_text():
    qwen = "{%- if tools %}...<tools></tools>...<tool_call>\\n{\"name\": <function-name>, ...}</tool_call>"
    llama = "{%- if message.role == 'ipython' %}...<|python_tag|>..."
    assert tool_family_for(qwen) == "hermes"
    assert tool_family_for(llama) == "llama3"
    assert tool_family_for(qwen, override="llama3") == "llama3"
    assert tool_family_for(None) == "hermes"  # a text prompt: no template to read
    with pytest.raises(ValueError, match="no tool-call format.*hermes or llama3"):
        tool_family_for("{{ messages[0].content }}")
    with pytest.raises(ValueError, match="'mistral'"):
        tool_family_for(qwen, override="mistral")


# --- ToolEnvironment -------------------------------------------------------------------------------

def test_two_calls_get_two_tool_messages_and_a_text_rendering():
    env = ToolEnvironment(tools=[calculator])
    assert isinstance(env, Environment) and env.tools_schema == [json_schema(calculator)]
    reply = env.step(hermes('{"name": "calculator", "arguments": {"a": 6, "b": 7, "op": "*"}}',
                            '{"name": "calculator", "arguments": {"a": 0.5, "b": 0.25}}'))
    assert reply == Reply(messages=[{"role": "tool", "name": "calculator", "content": "42"},
                                    {"role": "tool", "name": "calculator", "content": "0.75"}],
                          text="<tool_response>\n42\n</tool_response>\n<tool_response>\n0.75\n</tool_response>\n")
    assert (env.tool_calls, env.tool_errors) == (2, 0)


def test_a_tool_raising_is_an_error_message_not_an_exception():
    env = ToolEnvironment(tools=[calculator])
    reply = env.step(hermes('{"name": "calculator", "arguments": {"a": 1, "b": 0, "op": "/"}}'))
    assert reply.messages[0]["content"] == "Error: ZeroDivisionError: division by zero" and not reply.done
    assert (env.tool_calls, env.tool_errors) == (1, 1)


@pytest.mark.parametrize("call, error", [
    ('{"name": "calculator", "arguments": {"a": 1, "b": }}', "Error: the tool call is not valid JSON"),
    ('{"name": "divide", "arguments": {}}', "Error: unknown tool 'divide'; the tools are calculator"),
    ('{"name": "calculator", "arguments": {"a": 1, "c": 2}}', "Error: calculator: unknown argument 'c' (the arguments "
                                                               "are a, b, op)"),
    ('{"name": "calculator", "arguments": {"a": 1}}', "Error: calculator: missing required argument 'b'"),
    ('{"name": "calculator", "arguments": {"a": "1", "b": 2}}', "Error: calculator: argument 'a' must be number, got "
                                                                 "str '1'"),
    ('{"name": "calculator", "arguments": {"a": true, "b": 2}}', "Error: calculator: argument 'a' must be number"),
    ('{"name": "calculator", "arguments": {"a": 1, "b": 2, "op": "^"}}', "Error: calculator: argument 'op' must be "
                                                                          "string, got str '^'"),
])
def test_calls_that_cannot_run_answer_with_the_reason(call, error):
    env = ToolEnvironment(tools=[calculator])
    (message,) = env.step(hermes(call)).messages
    assert message["content"].startswith(error), message["content"]
    assert (env.tool_calls, env.tool_errors) == (1, 1)


def test_nested_argument_types_are_checked_too():
    params = json_schema(search)["function"]["parameters"]
    assert argument_problem({"query": "q", "tags": ["a", "b"], "weights": {"x": 1, "y": 0.5}}, params) is None
    assert argument_problem({"query": "q", "tags": ["a", 2]}, params) == \
        "argument 'tags' must be array, got list ['a', 2]"
    assert argument_problem({"query": "q", "tags": [], "limit": None, "pair": [1, "x"]}, params) is None
    assert "argument 'pair'" in argument_problem({"query": "q", "tags": [], "pair": [1, 2]}, params)


def test_a_turn_without_a_call_ends_the_episode():
    env = ToolEnvironment(tools=[calculator])
    assert env.step("6 times 7 is 42.") == Reply(done=True)
    assert (env.tool_calls, env.tool_errors) == (0, 0)


def test_llama3_family_reads_its_own_format():
    env = ToolEnvironment(tools=[calculator], family="llama3")
    reply = env.step('<|python_tag|>{"name": "calculator", "parameters": {"a": 2, "b": 3}}')
    assert reply.messages == [{"role": "tool", "name": "calculator", "content": "5"}]


class Counter:
    """A TRL-style environment: reset(**row) and tool methods; reward functions read `.total`."""

    def __init__(self):
        self.total = 0

    def reset(self, start: int = 0, **row) -> str:
        self.total = start
        return f"The counter starts at {start}."

    def increment(self, by: int) -> int:
        """Adds to the counter.

        Args:
            by: How much to add.
        """
        self.total += by
        return self.total

    def peek(self) -> int:
        """Reads the counter."""
        return self.total

    def _private(self):  # not a tool
        pass


def test_a_trl_style_environment_class_exposes_its_public_methods():
    env = ToolEnvironment(env=Counter())
    assert [s["function"]["name"] for s in env.tools_schema] == ["increment", "peek"]  # no reset, no _private
    assert env.reset(prompt="count", start=3) == "The counter starts at 3."
    reply = env.step(hermes('{"name": "increment", "arguments": {"by": 4}}', '{"name": "peek", "arguments": {}}'))
    assert [m["content"] for m in reply.messages] == ["7", "7"]
    assert env.env.total == 7  # what a reward function reads
    env.step(hermes('{"name": "increment", "arguments": {"by": "x"}}'))
    assert (env.tool_calls, env.tool_errors) == (3, 1)
    env.reset()
    assert (env.tool_calls, env.tool_errors, env.env.total) == (0, 0, 0)  # counters are per episode


def test_tool_names_must_be_unique_and_some_tools_are_needed():
    with pytest.raises(ValueError, match="two tools are named 'calculator'"):
        ToolEnvironment(tools=[calculator, calculator])
    with pytest.raises(ValueError, match="no tools"):
        ToolEnvironment()


# --- make_environment_factory ----------------------------------------------------------------------

ENVS_MODULE = '''
from grpo_jax.episodes.environment import Reply

def add(a: int, b: int) -> int:
    """Adds.

    Args:
        a: One.
        b: Two.
    """
    return a + b

class Guess:
    """A plain Environment: reset and step."""
    def reset(self, **row):
        return None
    def step(self, turn):
        return Reply(done=turn == "7")

class Counter:
    def reset(self, **row):
        self.total = 0
    def increment(self, by: int) -> int:
        """Adds to the counter.

        Args:
            by: How much to add.
        """
        self.total += by
        return self.total

class Undocumented:
    def poke(self, x: int):
        return x

class Nothing:
    pass

def make_counter():
    return Counter()

def make_nothing():
    return Nothing()

class NeedsArgs:
    def __init__(self, level):
        self.level = level

NOT_CALLABLE = 3
'''


@pytest.fixture
def envs_module(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(textwrap.dedent(ENVS_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_envs"


def test_factories_from_import_paths(envs_module):
    guess = make_environment_factory("my_envs:Guess")()
    assert type(guess).__name__ == "Guess" and guess.step("7").done  # an Environment is used as it is
    counter = make_environment_factory("my_envs.Counter")()  # TRL's dotted form
    assert isinstance(counter, ToolEnvironment) and type(counter.env).__name__ == "Counter"
    counter.reset()
    assert counter.step(hermes('{"name": "increment", "arguments": {"by": 2}}')).messages[0]["content"] == "2"
    from_function = make_environment_factory("my_envs:make_counter")()
    assert isinstance(from_function, ToolEnvironment) and type(from_function.env).__name__ == "Counter"
    with pytest.raises(ValueError, match="environment 'my_envs:make_nothing': Nothing has neither"):
        make_environment_factory("my_envs:make_nothing")()  # a function's product is checked when it is made
    make = make_environment_factory(["my_envs:add"])
    assert make() is not make()  # one environment per episode
    assert make().step(hermes('{"name": "add", "arguments": {"a": 2, "b": 3}}')).messages[0]["content"] == "5"


@pytest.mark.parametrize("spec, message", [
    ("my_envs", "environment import path 'my_envs': expected 'package.module:Name'"),
    ("no_such_module:Env", "environment 'no_such_module:Env': cannot import module 'no_such_module'"),
    ("my_envs:Missing", "environment 'my_envs:Missing': module 'my_envs' has no 'Missing'"),
    ("my_envs:NOT_CALLABLE", "environment 'my_envs:NOT_CALLABLE' is a int, not a class or a function"),
    ("my_envs:NeedsArgs", "environment 'my_envs:NeedsArgs' needs argument(s) level; the factory is called with none"),
    ("my_envs:Nothing", "environment 'my_envs:Nothing': Nothing has neither reset() and step(turn)"),
    ("my_envs:Undocumented", "environment 'my_envs:Undocumented': tool 'poke' has no docstring"),
    (["my_envs:add", "my_envs:nope"], "tool function 'my_envs:nope': module 'my_envs' has no 'nope'"),
    (["my_envs:Guess"], "tool function 'my_envs:Guess' is a type, not a function"),
    ([], "environment tools=[]: expected at least one tool function"),
])
def test_bad_specs_are_one_clear_line(envs_module, spec, message):
    with pytest.raises(ValueError) as e:
        make_environment_factory(spec)
    assert str(e.value).startswith(message), str(e.value)
    assert "\n" not in str(e.value)
