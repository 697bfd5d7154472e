"""OpenEnv environments through `grpo_jax.episodes.openenv_adapter`, driven by scripted model turns.

The environment is the one OpenEnv ships: `openenv init NAME` writes its template, an echo
environment (reset says "... environment ready!", each step echoes the action's `message` with
reward 0.1 per character and never ends the episode), as a package with the in-process
environment, its models, its FastAPI app and its client. The tests run it in process and served on
localhost through its client; small subclasses add an ending, a bool reward and a NaN.

Needs the `openenv` extra (`pip install -e '.[openenv]'`); without it these tests skip, except the
one that checks the error naming the extra.
"""

import importlib
import math
import os
import socket
import sys
import threading
import time

import pytest

from grpo_jax.episodes import Environment, EpisodeError, Reply
from grpo_jax.episodes.openenv_adapter import OpenEnvAdapter, openenv_factory, text_action

ENV_NAME = "grpo_shipped_echo"  # the generated package's name: unique, so no other module shadows it

# Echo rewards are len(message) * 0.1 in float64: 0.1 is within 2**-53 relative of 1/10 and the
# product adds one rounding, so the reward is within ~2.3e-16 relative of len/10; 1e-12 is loose.
REWARD_REL = 1e-12


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    """The shipped echo environment's generated modules: `environment`, `models`, `client`, `app`."""
    pytest.importorskip("openenv", reason="needs the openenv extra: pip install -e '.[openenv]'")
    from openenv.cli.commands.init import init  # the `openenv init` command, called in process

    root = tmp_path_factory.mktemp("openenv_envs")
    with pytest.MonkeyPatch.context() as mp:
        # PATH holds only this interpreter's folder: `init` then finds no `uv` and skips its
        # `uv lock`, which would need the network.
        mp.setenv("PATH", os.path.dirname(sys.executable))
        init(ENV_NAME, output_dir=str(root))
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(root))
        modules = {part: importlib.import_module(f"{ENV_NAME}.{path}") for part, path in [
            ("environment", f"server.{ENV_NAME}_environment"), ("models", "models"),
            ("client", "client"), ("app", "server.app")]}
        yield modules


def _prefix():
    """The generated class names' prefix: grpo_shipped_echo -> GrpoShippedEcho."""
    return "".join(part.capitalize() for part in ENV_NAME.split("_"))


def _classes(echo):
    """(the in-process environment class, its action class)."""
    return (getattr(echo["environment"], f"{_prefix()}Environment"),
            getattr(echo["models"], f"{_prefix()}Action"))


def _echo_message(observation):
    return observation.echoed_message


def test_missing_package_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m == "openenv" or m.startswith("openenv.")] + ["openenv"]:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: the import fails
    with pytest.raises(ImportError, match=r"pip install 'grpo_jax\[openenv\]'"):
        OpenEnvAdapter(object(), str)


@pytest.mark.openenv
def test_shipped_echo_env_two_turns_in_process(echo):
    EchoEnvironment, EchoAction = _classes(echo)
    factory = openenv_factory(EchoEnvironment, action=EchoAction, observation_text=_echo_message)
    env = factory()
    assert isinstance(env, Environment)

    # reset: the environment's first observation goes after the prompt; the row's prompt and answer
    # are not the environment's business (its reset takes no arguments).
    assert env.reset(prompt=[{"role": "user", "content": "Say hello."}], answer="hello") == (
        "Grpo Shipped Echo environment ready!")

    reply = env.step("hello")  # 5 characters: reward 0.5
    assert reply.messages == ({"role": "user", "content": "hello"},)
    assert reply.text == "\nhello\n"
    assert reply.done is False
    assert reply.reward == pytest.approx(0.5, rel=REWARD_REL)

    reply = env.step("four")  # 4 characters: reward 0.4; the episode goes on (echo never ends it)
    assert (reply.messages[0]["content"], reply.done) == ("four", False)
    assert reply.reward == pytest.approx(0.4, rel=REWARD_REL)

    # Kept for reward functions: the reset's observation and one per step.
    assert [o.echoed_message for o in env.observations] == [
        "Grpo Shipped Echo environment ready!", "hello", "four"]
    assert env.rewards == pytest.approx([0.5, 0.4], rel=REWARD_REL)
    assert env.env.state.step_count == 2

    # One environment per episode: the factory's next adapter starts from a fresh OpenEnv environment.
    other = factory()
    assert other.env is not env.env and other.env.state.step_count == 0


@pytest.mark.openenv
def test_default_observation_text_is_the_observation_fields(echo):
    EchoEnvironment, EchoAction = _classes(echo)
    env = OpenEnvAdapter(EchoEnvironment(), EchoAction, role="tool", text_template="Echo: {observation}")
    env.reset()
    reply = env.step("hi")
    # Two content fields (done, reward, metadata left out): one JSON object, in the model's order.
    content = '{"echoed_message": "hi", "message_length": 2}'
    assert reply.messages == ({"role": "tool", "content": content},)
    assert reply.text == f"Echo: {content}"


@pytest.mark.openenv
def test_an_ending_and_a_bool_reward(echo):
    EchoEnvironment, EchoAction = _classes(echo)

    class EndsOnBye(EchoEnvironment):
        """The shipped echo, ending the episode on "bye" with reward True (a win); records close()."""
        closed = 0

        def step(self, action):
            observation = super().step(action)
            if action.message == "bye":
                observation.done, observation.reward = True, True
            return observation

        def close(self):
            self.closed += 1

    env = OpenEnvAdapter(EndsOnBye(), EchoAction, observation_text=_echo_message)
    env.reset()
    assert env.step("hi").done is False
    last = env.step("bye")
    assert (last.done, last.reward, last.messages[0]["content"]) == (True, 1.0, "bye")
    assert type(last.reward) is float  # a bool reward counts as 1.0 in the episode's sum
    assert env.env.closed == 1  # the episode's end closes the environment (a client: its session)
    env.close()
    assert env.env.closed == 1  # once
    with pytest.raises(EpisodeError, match="after the episode ended"):
        env.step("hello again")


@pytest.mark.openenv
def test_empty_observation_text_adds_nothing(echo):
    EchoEnvironment, EchoAction = _classes(echo)
    env = OpenEnvAdapter(EchoEnvironment(), EchoAction, observation_text=lambda observation: "")
    assert env.reset() is None
    reply = env.step("quiet")
    assert reply == Reply(messages=(), text="", done=False, reward=pytest.approx(0.5, rel=REWARD_REL))


@pytest.mark.openenv
def test_reset_gets_the_row_fields_it_names(echo):
    EchoEnvironment, EchoAction = _classes(echo)

    class Seeded(EchoEnvironment):
        def reset(self, seed=None, episode_id=None, **kwargs):
            self.reset_args = dict(seed=seed, episode_id=episode_id, **kwargs)
            return super().reset()

    env = OpenEnvAdapter(Seeded(), EchoAction)
    env.reset(prompt="Echo me.", answer="x", seed=7, level=3)
    # Named parameters only: the prompt, the answer and `level` would land in **kwargs uninvited.
    assert env.env.reset_args == {"seed": 7, "episode_id": None}

    env = OpenEnvAdapter(Seeded(), EchoAction,
                         reset_kwargs=lambda row: {"seed": row["seed"], "level": row["level"]})
    env.reset(prompt="Echo me.", seed=7, level=3)
    assert env.env.reset_args == {"seed": 7, "episode_id": None, "level": 3}


@pytest.mark.openenv
def test_a_nan_reward_is_the_environments_error(echo):
    EchoEnvironment, EchoAction = _classes(echo)

    class NaNReward(EchoEnvironment):
        def step(self, action):
            observation = super().step(action)
            observation.reward = math.nan
            return observation

    env = OpenEnvAdapter(NaNReward(), EchoAction)
    env.reset()
    with pytest.raises(EpisodeError, match=r"NaNReward.step returned reward nan"):
        env.step("hi")


@pytest.mark.openenv
def test_text_action_fills_the_one_str_field(echo):
    _, EchoAction = _classes(echo)
    assert text_action(EchoAction)("hi").message == "hi"
    from openenv.core.env_server.types import Action

    class Move(Action):
        piece: str
        square: str

    with pytest.raises(TypeError, match=r"exactly one required str field.*\['piece', 'square'\]"):
        text_action(Move)


@pytest.fixture
def served_echo(echo):
    """The shipped echo's FastAPI app served on a free localhost port; yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    # log_level="critical": the server logs a client's ordinary disconnect as an ERROR traceback.
    server = uvicorn.Server(uvicorn.Config(echo["app"].app, log_level="critical"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the echo server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)
    sock.close()


@pytest.mark.openenv
def test_shipped_echo_env_served_through_its_client(echo, served_echo):
    _, EchoAction = _classes(echo)
    EchoClient = getattr(echo["client"], f"{_prefix()}Env")
    # The client is async; the adapter runs it through its own .sync() wrapper. Its step returns a
    # StepResult (observation, reward, done) rather than an Observation.
    env = OpenEnvAdapter(EchoClient(base_url=served_echo), EchoAction, observation_text=_echo_message)
    try:
        assert env.reset(prompt="Say hello.", seed=3) == "Grpo Shipped Echo environment ready!"
        first, second = env.step("hello"), env.step("four")
    finally:
        env.close()
    assert [r.messages[0]["content"] for r in (first, second)] == ["hello", "four"]
    assert [r.done for r in (first, second)] == [False, False]
    assert [first.reward, second.reward] == pytest.approx([0.5, 0.4], rel=REWARD_REL)
