"""OpenEnv environments (PyPI `openenv`, formerly `openenv-core`) as episode environments.

OpenEnv's environments are Gym-style and typed: `reset(seed=, episode_id=, ...) -> Observation` and
`step(Action) -> Observation`, where an Observation is a pydantic model carrying `done`, `reward` and
the environment's own fields, and an Action is a pydantic model of the environment's own fields. The
same environment runs in process (the server-side class) or behind a server, reached through its
client, whose `reset` / `step` return a `StepResult(observation, reward, done)`. The adapter takes
either and maps one model turn to one OpenEnv step:

    turn text --action(turn)--> Action --env.step--> Observation
      -> Reply(messages=[{"role": role, "content": observation_text(obs)}],
               text=text_template.format(observation=...), done=obs.done, reward=obs.reward)

One adapter, and one OpenEnv environment (or client session), serves one episode, so the factory the
trainer calls per row builds both: `openenv_factory(EchoEnvironment, action=EchoAction)`.

    pip install 'grpo_jax[openenv]'      # OpenEnv, imported only when an adapter is made
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from grpo_jax.episodes.environment import EpisodeError, Reply

_INSTALL_HINT = "the OpenEnv adapter needs OpenEnv: pip install 'grpo_jax[openenv]'"
# Observation fields every OpenEnv observation has; the rest are the environment's own content.
_CONTROL_FIELDS = frozenset({"done", "reward", "metadata"})


def _require_openenv() -> None:
    """Imports openenv only here, so `grpo_jax.episodes` imports without it."""
    try:
        import openenv.core.env_server.types  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{_INSTALL_HINT} (import failed: {e})") from e


def text_action(action_cls: type) -> Callable[[str], Any]:
    """A function building `action_cls` from a turn's text, put in its one required str field.

    OpenEnv actions are pydantic models with `extra="forbid"`, so the field must be named; an
    action with no such field, or several, needs a function of its own (`action=lambda turn: ...`).
    """
    fields = getattr(action_cls, "model_fields", None)
    if fields is None:
        raise TypeError(f"action={action_cls!r} is not a pydantic model (an OpenEnv Action); pass a "
                        "function from the turn's text to an action instead")
    names = [name for name, field in fields.items() if field.is_required() and field.annotation is str]
    if len(names) != 1:
        raise TypeError(f"action={action_cls.__name__}: expected exactly one required str field to hold "
                        f"the turn's text, found {names or 'none'} among {list(fields)}; pass a "
                        "function from the turn's text to an action instead")
    (name,) = names
    return lambda turn: action_cls(**{name: turn})


def observation_text(observation: Any) -> str:
    """The observation's own fields as text: a single field as it is (a str) or as JSON, several
    fields as one JSON object. `done`, `reward` and `metadata` are left out: they are not content."""
    if hasattr(observation, "model_dump"):
        content = observation.model_dump(exclude=set(_CONTROL_FIELDS))
    elif isinstance(observation, Mapping):
        content = {k: v for k, v in observation.items() if k not in _CONTROL_FIELDS}
    else:
        return str(observation)
    if len(content) == 1:
        (value,) = content.values()
        return value if isinstance(value, str) else json.dumps(value, default=str)
    return json.dumps(content, default=str) if content else ""


def _row_reset_kwargs(reset: Callable[..., Any], row: Mapping[str, Any]) -> dict[str, Any]:
    """The row's fields that `reset` names as parameters (seed, episode_id, an environment's own
    task fields). A `**kwargs` catch-all receives nothing: a row's prompt and answer are ours, and an
    environment (or a server) that did not ask for them may reject them."""
    params = inspect.signature(reset).parameters
    return {k: v for k, v in row.items()
            if k in params and params[k].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                  inspect.Parameter.KEYWORD_ONLY)}


class OpenEnvAdapter:
    """One episode of an OpenEnv environment behind grpo_jax's `Environment` interface.

    env: an OpenEnv environment (`openenv.core.env_server.interfaces.Environment`, run in process) or
      a client of one (`EnvClient`: made synchronous with `.sync()`; or a `SyncEnvClient`).
    action: the environment's Action class (the turn goes into its one required str field, see
      `text_action`) or a function from the turn's text to an Action.
    observation_text: an Observation to the text the model reads next (default: its own fields, see
      `observation_text`); "" adds nothing to the context.
    reset_kwargs: the data row to `env.reset`'s keyword arguments (default: the row's fields that
      `reset` names as parameters, such as `seed`).
    role: the role of the observation's message in a chat context ("user", or "tool").
    text_template: how the observation is appended to a text context; `{observation}` is the text.

    What the episode saw is kept for reward functions (`environments=`): `observations` (the reset's
    first), `rewards` (one per step, None where the environment gave none) and `done`. The reset's
    reward is not counted: an episode's reward comes from its steps, as in Gym.
    """

    def __init__(self, env: Any, action: type | Callable[[str], Any], *,
                 observation_text: Callable[[Any], str] = observation_text,
                 reset_kwargs: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
                 role: str = "user", text_template: str = "\n{observation}\n"):
        _require_openenv()
        if inspect.iscoroutinefunction(getattr(env, "step", None)):
            if not hasattr(env, "sync"):
                raise TypeError(f"env={type(env).__name__}: its step is async and it has no .sync(); "
                                "pass an OpenEnv Environment, an EnvClient or a SyncEnvClient")
            env = env.sync()  # an async EnvClient: its own sync wrapper runs it on a background loop
        for method in ("reset", "step"):
            if not callable(getattr(env, method, None)):
                raise TypeError(f"env={type(env).__name__} has no {method}(); expected an OpenEnv "
                                "Environment or a client of one")
        self.env = env
        self._action = text_action(action) if isinstance(action, type) else action
        self._observation_text = observation_text
        self._reset_kwargs = reset_kwargs
        self.role = role
        self.text_template = text_template
        self.observations: list[Any] = []
        self.rewards: list[float | None] = []
        self.done = False
        self._closed = False

    def reset(self, **row) -> str | None:
        """Resets the OpenEnv environment; its first observation's text goes after the prompt."""
        kwargs = (dict(self._reset_kwargs(row)) if self._reset_kwargs is not None
                  else _row_reset_kwargs(self.env.reset, row))
        observation, _, done = self._unpack(self.env.reset(**kwargs), "reset")
        if done:
            raise EpisodeError(f"{self._name}.reset returned done=True with arguments {kwargs!r:.200}: "
                               "an episode must allow at least one model turn")
        self.observations, self.rewards, self.done = [observation], [], False
        return self._observation_text(observation) or None

    def step(self, turn: str) -> Reply:
        """The turn as an action, one OpenEnv step, its observation as the reply."""
        if self.done:
            raise EpisodeError(f"{self._name}.step called after the episode ended (turn {turn!r:.80})")
        observation, reward, done = self._unpack(self.env.step(self._action(turn)), "step")
        self.observations.append(observation)
        self.rewards.append(reward)
        self.done = done
        text = self._observation_text(observation)
        if done:
            self.close()  # a client's session on the server ends with the episode
        if not text:
            return Reply(done=done, reward=reward)
        return Reply(messages=({"role": self.role, "content": text},),
                     text=self.text_template.format(observation=text), done=done, reward=reward)

    def close(self) -> None:
        """Closes the OpenEnv environment or client once (also called when the episode ends)."""
        if not self._closed and callable(getattr(self.env, "close", None)):
            self._closed = True
            self.env.close()

    @property
    def _name(self) -> str:
        return f"OpenEnv {type(self.env).__name__}"

    def _unpack(self, result: Any, where: str) -> tuple[Any, float | None, bool]:
        """(observation, reward, done) from a client's StepResult or an in-process Observation."""
        # A StepResult carries reward and done beside the observation; an Observation carries them.
        holder = result if hasattr(result, "observation") else None
        observation = result.observation if holder is not None else result
        source = holder if holder is not None else observation
        if not hasattr(source, "done"):
            raise EpisodeError(f"{self._name}.{where} returned {type(result).__name__} {result!r:.80}; "
                               "expected an OpenEnv Observation or StepResult")
        reward = getattr(source, "reward", None)
        if reward is not None:
            try:
                reward = float(reward)  # bool rewards (OpenEnv allows them) count as 0.0 / 1.0
            except (TypeError, ValueError):
                raise EpisodeError(f"{self._name}.{where} returned reward {reward!r:.80}; expected a "
                                   "number or None") from None
            if not math.isfinite(reward):
                raise EpisodeError(f"{self._name}.{where} returned reward {reward}; expected a finite "
                                   "number (a NaN would poison the group's advantages)")
        return observation, reward, bool(source.done)


def openenv_factory(make_env: Callable[[], Any], action: type | Callable[[str], Any],
                    **options) -> Callable[[], OpenEnvAdapter]:
    """The zero-argument factory the trainer calls once per episode: a fresh OpenEnv environment (or
    client) from `make_env()`, wrapped in an `OpenEnvAdapter(env, action, **options)`."""
    _require_openenv()
    return lambda: OpenEnvAdapter(make_env(), action, **options)
