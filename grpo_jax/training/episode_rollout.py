"""The turn loop: G episodes per data row against an environment, over any sampling engine.

Each turn is one call of the engine (`SamplingEngine`, built-in or vLLM) on the rows still playing:
a row whose environment is thinking leaves the batch, and comes back next turn with its whole
context (prompt, its turns, the environment's tokens) as the prompt. Engines that cache prefixes
(vLLM) prefill only the new tokens; the built-in engines prefill the whole context again (keeping a
row's cache between calls is not built), the price of never holding a decode slot while the host
waits.

The first turn is the single-answer rollout's own call (the G rows of a prompt share its prefill and
the same seed), so with `max_turns=1` an episode is exactly the single-answer sample. Later turns
sample each row once from `fold_in(rng, turn)`, keyed (as engines key rows) by the row's place in
the turn's call: the rows still playing in order, padded to a power of two so the engine compiles a
handful of shapes, not one per count. That place is the same on any number of devices of one
process; with several processes each process's rows come first in its own slice, so later turns
sample differently from a one-process run (as validly; every process agrees on the step).

What an episode leaves for training, per row, over the completion columns C =
`sampling.max_new_tokens` (the total budget: model and environment tokens together, as TRL's
max_completion_length in multi-turn episodes):

    tokens     every token after the prompt: model turns and environment replies, in order
    mask       1 on all of them: the context the update attends to
    tool_mask  1 on the model's tokens only (TRL's name): the loss and the advantage see just these
    logprobs   the engine's log-prob of each model token (0 on environment tokens)

Chat prompts: after each turn the conversation (prompt messages, each turn as an assistant message of
its own text, the environment's messages) is rendered with the checkpoint's chat template, and the
environment's tokens are what the rendering adds after the context. The model's own tokens stay as
sampled, so when they are what the template would give (the usual case) the episode's tokens are the
template's rendering of its messages, token for token. When they are not (a turn decoded and
re-encoded differently), the environment's tokens are the template's closing of the assistant turn
plus its rendering of the new messages, and the episode counts it in `turns/retokenized`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from grpo_jax.distributed import sharding
from grpo_jax.episodes.environment import EpisodeError, Reply, checked_reply
from grpo_jax.episodes.tools import ToolEnvironment
from grpo_jax.sampling.engine import SampleOutput, SamplingConfig, SamplingEngine


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    """max_turns: model turns per episode; max_tokens_per_turn: one turn's budget (0: the total);
    the total budget is the sampling config's max_new_tokens. workers: see below."""

    max_turns: int
    max_tokens_per_turn: int = 0
    # Host threads the environments answer a turn's rows on: an environment that waits (a sandbox,
    # a service) waits beside the others instead of after them. 1: one after another.
    workers: int = 8
    # What a Reply's reward is: "episode" (they add up into the episode's environment reward, scored
    # with the task's reward functions) or "process" (each is its turn's step reward; the trainer's
    # advantages are then per token, `core.advantages.process_advantages`).
    turn_rewards: str = "episode"


@dataclasses.dataclass
class Episode:
    """One row's episode as it is played: `context` is every id the model reads next turn."""

    env: Any
    example: dict
    conversation: list[dict] | None  # chat prompts: the messages so far; None for text prompts
    context: list[int]
    prompt_len: int
    logprobs: list[float] = dataclasses.field(default_factory=list)
    model_token: list[bool] = dataclasses.field(default_factory=list)
    turn_texts: list[str] = dataclasses.field(default_factory=list)
    env_reward: float | None = None
    turn_ends: list[int] = dataclasses.field(default_factory=list)  # per turn: its last model token's column + 1
    turn_rewards: list[float] = dataclasses.field(default_factory=list)  # per turn: its Reply's reward (NaN: none)
    done: bool = False
    truncated: bool = False
    retokenized: int = 0
    env_tokens: int = 0
    env_seconds: float = 0.0

    @property
    def completion(self) -> list[int]:
        return self.context[self.prompt_len:]


@dataclasses.dataclass
class EpisodeBatch:
    """A rollout's episodes, this process's rows in row order, and what the trainer reads of them."""

    episodes: list[Episode]
    tool_mask: np.ndarray  # [R, C] int32, 1 on model tokens
    turn_rewards: str = "episode"  # EpisodeLimits.turn_rewards
    environment_seconds: float = 0.0  # wall time the environments took (their threads overlap)

    def fields(self) -> dict[str, list]:
        """What reward functions get besides the example's fields: the environment objects
        (`environments`, TRL's keyword), each episode's environment reward (None: it gave none,
        or its rewards train per turn), its turn count and its turns' texts."""
        eps = self.episodes
        return {
            "environments": [_users(e.env) for e in eps],
            # Process rewards train per turn (`turn_steps`), not again as the episode's.
            "environment_reward": [None if self.turn_rewards == "process" else e.env_reward for e in eps],
            "turns": [len(e.turn_texts) for e in eps],
            "turn_texts": [list(e.turn_texts) for e in eps],
        }

    def close(self) -> None:
        """Closes every environment that has a `close` (a remote session, a sandbox), once its
        episode is scored; an error there is the environment's and is raised naming it."""
        for row, ep in enumerate(self.episodes):
            close = getattr(ep.env, "close", None)
            if callable(close):
                try:
                    close()
                except Exception as e:  # noqa: BLE001 - the user's environment
                    raise EpisodeError(f"environment {_env_name(ep.env)}.close on row {row} raised "
                                       f"{type(e).__name__}: {e}") from e

    def row_values(self) -> dict[str, np.ndarray]:
        """Per episode, in row order: its model turns, tool calls and tool errors (a tool
        environment counts them), environment tokens, re-rendered turns (see the module docstring)."""
        eps = self.episodes
        return {
            "turns": np.array([len(e.turn_texts) for e in eps], np.float32),
            "tool_calls": np.array([getattr(e.env, "tool_calls", 0) for e in eps], np.float32),
            "tool_errors": np.array([getattr(e.env, "tool_errors", 0) for e in eps], np.float32),
            "env_tokens": np.array([e.env_tokens for e in eps], np.float32),
            "retokenized": np.array([e.retokenized for e in eps], np.float32),
        }


def turn_steps(batch: EpisodeBatch, max_turns: int) -> dict[str, np.ndarray]:
    """Each episode's turns as process-reward steps, padded to `max_turns`: "ends" [R, K] int32
    (1-based column of the turn's last model token; 0 = no such turn) and "rewards" [R, K] float32
    (the turn's Reply reward; NaN = none, or no such turn)."""
    R = len(batch.episodes)
    ends = np.zeros((R, max_turns), np.int32)
    rewards = np.full((R, max_turns), np.nan, np.float32)
    for r, ep in enumerate(batch.episodes):
        n = len(ep.turn_ends)
        ends[r, :n] = ep.turn_ends
        rewards[r, :len(ep.turn_rewards)] = ep.turn_rewards
    return {"ends": ends, "rewards": rewards}


def episode_metrics(rows: dict[str, np.ndarray], environment_seconds: float) -> dict[str, float]:
    """A batch's episode metrics from its rows' `EpisodeBatch.row_values` (every process's):
    means per episode, the longest episode in turns, and the seconds the environments took."""
    return {
        "turns/mean": float(rows["turns"].mean()),
        "turns/max": float(rows["turns"].max()),
        "tools/calls": float(rows["tool_calls"].mean()),
        "tools/errors": float(rows["tool_errors"].mean()),
        "episode/env_tokens": float(rows["env_tokens"].mean()),
        "turns/retokenized": float(rows["retokenized"].mean()),
        "time/environment": float(environment_seconds),
    }


def _render(tokenizer, conversation: list[dict], *, generation: bool, tools) -> list[int]:
    kwargs = {"tools": tools} if tools else {}
    return list(tokenizer.apply_chat_template(conversation, add_generation_prompt=generation, tokenize=True,
                                              **kwargs))


def _users(env):
    """The user's own environment object: a tool environment's wrapped TRL-style object, if any."""
    return env.env if isinstance(env, ToolEnvironment) and env.env is not None else env


def _env_name(env) -> str:
    return type(_users(env)).__name__


def start_episode(env, example: dict, row: int, tokenizer, encode_prompt: Callable) -> Episode:
    """Resets `env` from the data row and renders the first context (the chat template with the
    environment's tools, if it has any)."""
    try:
        extra = env.reset(**example)
    except Exception as e:  # noqa: BLE001 - the user's environment: name it and the row
        raise EpisodeError(f"environment {_env_name(env)}.reset on row {row} (prompt {str(example.get('prompt'))[:60]!r}) "
                           f"raised {type(e).__name__}: {e}") from e
    if extra is not None and not isinstance(extra, str):
        raise EpisodeError(f"environment {_env_name(env)}.reset on row {row} returned {type(extra).__name__}; "
                           "expected str or None (text to append to the prompt)")
    prompt = example["prompt"]
    if isinstance(prompt, (list, tuple)):
        conversation = [dict(m) for m in prompt]
        if extra:
            conversation[-1]["content"] = f"{conversation[-1].get('content', '')}{extra}"
        ids = _render(tokenizer, conversation, generation=True, tools=getattr(env, "tools_schema", None))
    else:
        conversation = None
        ids = list(encode_prompt(tokenizer, prompt + (extra or "")))
    return Episode(env=env, example=example, conversation=conversation, context=ids, prompt_len=len(ids))


def _pad_count(n: int, multiple: int) -> int:
    """The row count a turn's call is padded to: a power of two (few compiled shapes), then a
    multiple of the mesh's row multiple."""
    p = 1
    while p < n:
        p *= 2
    return -(-p // multiple) * multiple


def _call(sampler: SamplingEngine, params, contexts: list[list[int]], *, num_samples: int, sampling: SamplingConfig,
          rng, pad_to: int) -> dict[str, np.ndarray]:
    """One engine call on `contexts` (padded to `pad_to` prompts with copies of the first); this
    process's rows of its output, host numpy."""
    padded = list(contexts) + [contexts[0]] * (pad_to - len(contexts))
    out: SampleOutput = sampler(params, padded, num_samples=num_samples, sampling=sampling, rng=rng)
    rows = len(contexts) * num_samples
    return {
        "tokens": sharding.process_rows(out.tokens_BxC)[:rows],
        "mask": sharding.process_rows(out.mask_BxC)[:rows],
        "logprobs": sharding.process_rows(out.logprobs_BxC)[:rows],
        "truncated": sharding.process_rows(out.truncated_B)[:rows].astype(bool),
    }


def _take_turn(ep: Episode, tokens: np.ndarray, logprobs: np.ndarray, length: int, stopped: bool, *,
               total: int, tokenizer) -> None:
    """Appends the model's turn (its first `length` tokens, cut to what the total budget leaves); a turn that did not reach its stop token within either budget truncates the
    episode."""
    room = total - len(ep.completion)
    keep = min(length, room)
    ids = [int(t) for t in tokens[:keep]]
    ep.context.extend(ids)
    ep.logprobs.extend(float(x) for x in logprobs[:keep])
    ep.model_token.extend([True] * keep)
    ep.turn_texts.append(tokenizer.decode(ids))
    ep.turn_ends.append(len(ep.completion))
    if not stopped or keep < length:
        ep.truncated, ep.done = True, True


def _env_ids(ep: Episode, reply: Reply, tokenizer, tools, stop_ids: Sequence[int]) -> list[int]:
    """The environment's tokens after the model's turn: the chat template's rendering of the new
    messages (see the module docstring for when the model's tokens are not the template's), or the
    reply's text encoded on its own for text prompts."""
    if ep.conversation is None:
        return list(tokenizer.encode(reply.text)) if reply.text else []
    ep.conversation.append({"role": "assistant", "content": ep.turn_texts[-1]})
    closed = _render(tokenizer, ep.conversation, generation=False, tools=tools)
    ep.conversation.extend(dict(m) for m in reply.messages)
    following = _render(tokenizer, ep.conversation, generation=True, tools=tools)
    if following[: len(ep.context)] == ep.context:
        return following[len(ep.context):]
    if following[: len(closed)] != closed:
        raise EpisodeError(f"the chat template's rendering of the conversation changes earlier turns once "
                           f"{_env_name(ep.env)}'s messages are added; cannot place the environment's tokens")
    # The template's closing of the assistant turn after the stop token the model sampled.
    stop_at = max((i for i, t in enumerate(closed) if t in stop_ids), default=None)
    closing = closed[stop_at + 1:] if stop_at is not None else []
    ep.retokenized += 1
    return closing + following[len(closed):]


def _respond(ep: Episode, row: int, *, tokenizer, limits: EpisodeLimits, total: int,
             stop_ids: Sequence[int]) -> None:
    """The environment's answer to the turn just taken: its reward, whether the episode ends, and
    (when it goes on) its tokens appended to the context."""
    t0 = time.perf_counter()
    where = f"environment {_env_name(ep.env)}.step on row {row}, turn {len(ep.turn_texts)}"
    try:
        reply = checked_reply(ep.env, ep.env.step(ep.turn_texts[-1]), where)
    except EpisodeError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's environment: name it, the row and the turn
        raise EpisodeError(f"{where} raised {type(e).__name__}: {e}") from e
    ep.env_seconds += time.perf_counter() - t0
    if reply.reward is not None:
        ep.env_reward = (ep.env_reward or 0.0) + float(reply.reward)
    ep.turn_rewards.append(float("nan") if reply.reward is None else float(reply.reward))
    if ep.done:  # truncated by the turn itself: the reply's reward counts, nothing more is read
        return
    if reply.done or len(ep.turn_texts) >= limits.max_turns:
        ep.done = True
        return
    env_ids = _env_ids(ep, reply, tokenizer, getattr(ep.env, "tools_schema", None), stop_ids)
    room = total - len(ep.completion)
    if len(env_ids) >= room:  # no room left for the model to answer: the episode is cut here
        env_ids = env_ids[:room]
        ep.truncated, ep.done = True, True
    ep.context.extend(env_ids)
    ep.logprobs.extend([0.0] * len(env_ids))
    ep.model_token.extend([False] * len(env_ids))
    ep.env_tokens += len(env_ids)


def _answer_all(pool, turns: list[tuple[Episode, int]], **kw) -> None:
    """Every environment's answer to its row's turn ((episode, row) each), on `pool`'s
    threads when given. Each environment touches only its own episode, so the order they finish in
    changes nothing; the first error in row order is the one raised."""
    if pool is None:
        for ep, row in turns:
            _respond(ep, row, **kw)
        return
    for future in [pool.submit(_respond, ep, row, **kw) for ep, row in turns]:
        future.result()


def run_episodes(sampler: SamplingEngine, params, tokenizer, examples: Sequence[dict], *,
                 environment_factory: Callable[[], Any], limits: EpisodeLimits, num_samples: int,
                 sampling: SamplingConfig, rng: jax.Array, encode_prompt: Callable, processes=None
                 ) -> tuple[SampleOutput, EpisodeBatch]:
    """Plays `num_samples` episodes per example (row r: example r // num_samples) to the end and
    returns them as the engine's `SampleOutput` (host numpy, this process's rows; prompt columns
    left-padded to the first turn's bucket) and the `EpisodeBatch` (environments, tool_mask).

    `processes` (several processes): every process takes part in every turn's call, padded to the
    same row count (a multiple of the engine's mesh rows per process), until no process has a row
    playing."""
    total = sampling.max_new_tokens
    mesh = getattr(sampler, "mesh", None)
    row_multiple = 1 if mesh is None else max(1, sharding.batch_size_multiple(mesh) // max(
        processes.count if processes is not None else 1, 1))
    per_turn = min(limits.max_tokens_per_turn or total, total)
    turn_sampling = dataclasses.replace(sampling, max_new_tokens=per_turn)
    episodes = []
    for r in range(len(examples) * num_samples):
        try:
            env = environment_factory()
        except Exception as e:  # noqa: BLE001 - the user's factory
            raise EpisodeError(f"environment factory {getattr(environment_factory, '__name__', environment_factory)!r} "
                               f"raised {type(e).__name__}: {e}") from e
        episodes.append(start_episode(env, examples[r // num_samples], r, tokenizer, encode_prompt))
    stop_ids = tuple(getattr(tokenizer, "eos_ids", (tokenizer.eos_id,)))
    count = len(episodes)

    # Turn 1: the prompts' shared call when every group's first contexts agree (the usual case).
    firsts = [episodes[i * num_samples].context for i in range(len(examples))]
    shared = all(episodes[r].context == firsts[r // num_samples] for r in range(count))
    if shared:
        out = _call(sampler, params, firsts, num_samples=num_samples, sampling=turn_sampling, rng=rng,
                    pad_to=len(firsts))
    else:
        out = _call(sampler, params, [e.context for e in episodes], num_samples=1, sampling=turn_sampling, rng=rng,
                    pad_to=len(episodes))
    turn, environment_seconds = 0, 0.0
    active = list(range(count))
    pool = concurrent.futures.ThreadPoolExecutor(limits.workers) if limits.workers > 1 else None
    try:
        while True:
            for i, r in enumerate(active):
                _take_turn(episodes[r], out["tokens"][i], out["logprobs"][i], int(out["mask"][i].sum()),
                           not out["truncated"][i], total=total, tokenizer=tokenizer)
            t0 = time.perf_counter()
            _answer_all(pool, [(episodes[r], r) for r in active], tokenizer=tokenizer, limits=limits, total=total,
                        stop_ids=stop_ids)
            environment_seconds += time.perf_counter() - t0
            active = [r for r in range(count) if not episodes[r].done]
            turn += 1
            most = len(active)
            if processes is not None and processes.count > 1:
                most = int(processes.gather(np.array([len(active)], np.int64)).max())
            if most == 0:
                break
            # A process with no row playing still takes part in the call (with a copy of a context).
            contexts = [episodes[r].context for r in active] or [episodes[0].context]
            out = _call(sampler, params, contexts, num_samples=1, sampling=turn_sampling,
                        rng=jax.random.fold_in(rng, turn), pad_to=_pad_count(most, row_multiple))
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    sample, batch = _as_sample(episodes, tokenizer, total, getattr(sampler, "prompt_buckets", None))
    batch.environment_seconds, batch.turn_rewards = environment_seconds, limits.turn_rewards
    return sample, batch


def _as_sample(episodes: list[Episode], tokenizer, total: int, buckets) -> tuple[SampleOutput, EpisodeBatch]:
    """The episodes as the engine's arrays (host numpy) and the EpisodeBatch."""
    from grpo_jax.io.tokenizer import left_pad
    from grpo_jax.sampling.sampler import bucket_length

    prompts = [ep.context[: ep.prompt_len] for ep in episodes]
    longest = max(len(p) for p in prompts)
    width = bucket_length(longest, buckets) if buckets else longest
    prompt_tokens, prompt_mask = left_pad(prompts, tokenizer.pad_id, width)
    R = len(episodes)
    tokens = np.full((R, total), tokenizer.pad_id, np.int32)
    mask = np.zeros((R, total), np.int32)
    tool_mask = np.zeros((R, total), np.int32)
    logprobs = np.zeros((R, total), np.float32)
    for r, ep in enumerate(episodes):
        n = len(ep.completion)
        tokens[r, :n] = ep.completion
        mask[r, :n] = 1
        tool_mask[r, :n] = ep.model_token
        logprobs[r, :n] = ep.logprobs
    sample = SampleOutput(prompt_tokens_BxP=prompt_tokens, prompt_mask_BxP=prompt_mask.astype(np.int32),
                          tokens_BxC=tokens, mask_BxC=mask,
                          truncated_B=np.array([ep.truncated for ep in episodes]), logprobs_BxC=logprobs)
    return sample, EpisodeBatch(episodes=episodes, tool_mask=tool_mask)
