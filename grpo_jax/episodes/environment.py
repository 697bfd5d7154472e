"""What an episode asks of an environment: `Environment` (reset from a data row, answer each model
turn) and `Reply` (what it says back, and whether the episode ended).

An episode starts from a data row: its "prompt" (messages or text) is the context, and
`reset(**row)` may add to it (TRL's environment_factory: the returned text is appended to the last
user message, or to a text prompt). Then, until the episode ends:

    the model takes a turn (sampled until its stop token or the per-turn token budget)
    reply = env.step(turn_text)      # the turn as text, its stop token removed
    reply.messages / reply.text      # appended to the context (tool results, feedback, a new observation)
    reply.done                       # the environment ended the episode

An episode also ends after `max_turns` model turns or when the total token budget
(`sampling.max_new_tokens`, which counts model and environment tokens, as TRL's
max_completion_length does) is spent. Environment tokens are in the context the model reads but
never in the loss (`training.episode_rollout`: `tool_mask`).

Rewards: `Reply.reward` values (per turn, optional) add up to the episode's environment reward, which
the trainer scores as the reward function "environment" beside the task's own functions; reward
functions also get the environment objects (`environments=`, TRL's keyword) to read what they kept.

One environment object serves one episode: the factory (a class, or any callable with no required
arguments) is called once per row. Tools (plain Python functions, or the public methods of a TRL
environment class) are wrapped by `episodes.tools.ToolEnvironment`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable


@dataclasses.dataclass
class Reply:
    """What the environment says after one model turn.

    messages: for chat prompts, messages appended to the conversation ({"role": "tool" | "user",
      "content": str, ...}), rendered with the checkpoint's chat template.
    text: for text prompts, text appended to the context as it is (tokenised on its own).
    done: the episode ends here (no further model turn).
    reward: this turn's reward (None: none); an episode's environment reward is the sum.
    """

    messages: Sequence[Mapping[str, Any]] = ()
    text: str = ""
    done: bool = False
    reward: float | None = None


@runtime_checkable
class Environment(Protocol):
    """One episode's environment. `reset(**row)` gets the data row's fields (prompt, answer, task
    fields) and may return text to append to the prompt (None: nothing); `step(turn)` gets the model's
    turn as text and returns a `Reply`. An exception from either is an error of the environment (the
    run stops naming it and the row); a tool's error is the tool environment's to return as text."""

    def reset(self, **row) -> str | None: ...

    def step(self, turn: str) -> Reply: ...


class EpisodeError(RuntimeError):
    """An environment raised or answered something that is not a Reply; names the environment, the
    call and the data row."""


def checked_reply(env: object, reply: object, where: str) -> Reply:
    """`reply` when it is a Reply; a bool (done), None (nothing to add) or a str (text / a user
    message) are accepted as shorthands. Anything else is an `EpisodeError` naming `where`."""
    if isinstance(reply, Reply):
        return reply
    if isinstance(reply, bool):
        return Reply(done=reply)
    if reply is None:
        return Reply()
    if isinstance(reply, str):
        return Reply(text=reply, messages=({"role": "user", "content": reply},))
    raise EpisodeError(f"{where}: {type(env).__name__}.step returned {type(reply).__name__} {reply!r:.80}; "
                            "expected a grpo_jax.episodes.Reply (or None, or a str)")
