"""Host-side rollouts: prompts in, scored completions out, and the held-out evaluation.

Everything here runs on the host around the jitted sampler: tokenising prompts, decoding completions,
calling the reward functions and the task's checker. The device work is the sampling engine's
call (`grpo_jax.sampling.engine.SamplingEngine`; the built-in one is `Sampler`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from grpo_jax.core import evaluation
from grpo_jax.distributed import sharding
from grpo_jax.distributed.processes import Processes
from grpo_jax.rewards import compute_rewards
from grpo_jax.rewards.calling import RewardLog, TrainerState
from grpo_jax.sampling.engine import SampleOutput, SamplingConfig, SamplingEngine
from grpo_jax.training.episode_rollout import EpisodeLimits, run_episodes


def encode_prompt(tokenizer, prompt) -> list[int]:
    """The ids a prompt is sampled from: messages ([{"role", "content"}, ...], TRL's conversational
    format) through the tokenizer's chat template with the generation prompt, as transformers'
    `apply_chat_template`; text with the tokenizer's own BOS rule (`encode_prompt`). A tokenizer
    written before those methods existed gets `encode(text)`."""
    if isinstance(prompt, (list, tuple)):
        if not hasattr(tokenizer, "apply_chat_template"):
            raise ValueError(f"the prompt is a list of messages but {tokenizer!r} has no apply_chat_template; "
                             "use a tokenizer with a chat template or give prompts as text")
        return list(tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True))
    if hasattr(tokenizer, "encode_prompt"):
        return tokenizer.encode_prompt(prompt)
    return tokenizer.encode(prompt)


def prompt_text(prompt) -> str:
    """A prompt as one string for logs and reward functions: messages as "role: content" lines."""
    if isinstance(prompt, (list, tuple)):
        return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in prompt)
    return prompt


@dataclasses.dataclass
class PendingRollout:
    """A sampler call dispatched to the devices, not yet read (JAX runs it asynchronously)."""

    sample: SampleOutput  # global arrays, rows over the batch axes ("data", "fsdp", "expert")
    examples: list[dict]  # this process's prompts' examples, in row order
    num_samples: int
    dispatched_at: float  # time.perf_counter() when the sampler was called
    # Multi-turn rollouts (the task has an environment): the played episodes; `sample` is then host
    # numpy holding every turn and environment reply (`grpo_jax.training.episode_rollout`).
    episodes: Any = None


@dataclasses.dataclass
class Rollout:
    """G answers to each of this process's prompts, read back and scored. Row r answers prompt
    r // G. Every array is host numpy, this process's rows only (all rows on one process)."""

    examples: list[dict]  # [R], each prompt's example repeated G times
    prompts: list[str]  # [R]
    completions: list[str]  # [R]
    rewards: np.ndarray  # [R] float32, NaN where no reward function applied
    reward_parts: dict[str, np.ndarray]  # name -> [R] float32, NaN for None
    lengths: np.ndarray  # [R] completion tokens (EOS included)
    truncated: np.ndarray  # [R] bool
    # prompt_tokens [R, P], prompt_mask [R, P], tokens, mask, tool_mask, logprobs [R, C]. mask: every
    # token after the prompt (what the update attends to); tool_mask: the model's own tokens (what it
    # trains on), equal to mask for single answers and 0 on an environment's tokens in episodes.
    # With routing replay also experts [R, P + C, L_sparse, K] int32 (`token_major_experts`).
    arrays: dict[str, np.ndarray]
    tokens_ready_at: float  # time.perf_counter() when the samples were on the host
    reward_seconds: float = 0.0  # host time spent in the reward functions
    reward_metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # TRL's log_metric, averaged
    reward_extra: dict[str, list] = dataclasses.field(default_factory=dict)  # TRL's log_extra, one per row
    episodes: Any = None  # the played episodes (`grpo_jax.training.episode_rollout.EpisodeBatch`), for a task with an environment


# The trainer's rows hold expert indices as int16: half of int32's bytes for an array of
# B x S x L_sparse x K (Qwen3-30B-A3B: 48 x 8 per token slot), and room for 32767 experts (the
# largest released models have 256). The model casts them back to int32 where it indexes.
EXPERTS_DTYPE = np.int16


def token_major_experts(experts_BxLxSxK: np.ndarray) -> np.ndarray:
    """The sampler's experts [B, L_sparse, S, K] as the trainer's rows hold them, [B, S, L_sparse, K]
    `EXPERTS_DTYPE`: token slots on axis 1 as in `tokens`, so every cut of a row's columns (prompt
    padding, length buckets) cuts its experts alike. `model.token_logprobs` takes them back layer-major."""
    return np.ascontiguousarray(np.moveaxis(np.asarray(experts_BxLxSxK), 1, 2).astype(EXPERTS_DTYPE))


def dispatch_rollout(
    sampler: SamplingEngine,
    params,
    tokenizer,
    examples: Sequence[dict],
    *,
    num_samples: int,
    sampling: SamplingConfig,
    rng: jax.Array,
) -> PendingRollout:
    """Tokenises this process's prompts and calls the sampler; returns before the devices finish."""
    prompt_ids = [encode_prompt(tokenizer, ex["prompt"]) for ex in examples]
    t0 = time.perf_counter()
    sample = sampler(params, prompt_ids, num_samples=num_samples, sampling=sampling, rng=rng)
    return PendingRollout(sample=sample, examples=list(examples), num_samples=num_samples, dispatched_at=t0)


def episode_limits(config):
    """The configured episode limits (`task.max_turns`, `task.max_tokens_per_turn`)."""
    task = config.task
    return EpisodeLimits(max_turns=task.max_turns, max_tokens_per_turn=task.max_tokens_per_turn,
                         workers=task.environment_workers, turn_rewards=task.turn_rewards)


def play_rollout(sampler: SamplingEngine, params, tokenizer, examples: Sequence[dict], *, environment_factory,
                 limits, num_samples: int, sampling: SamplingConfig, rng: jax.Array, processes=None) -> PendingRollout:
    """`dispatch_rollout` for a task with an environment: plays the episodes to their end (every turn
    is a sampler call, and the environment answers on the host in between)."""
    t0 = time.perf_counter()
    sample, episodes = run_episodes(sampler, params, tokenizer, examples, environment_factory=environment_factory,
                                    limits=limits, num_samples=num_samples, sampling=sampling, rng=rng,
                                    encode_prompt=encode_prompt, processes=processes)
    return PendingRollout(sample=sample, examples=list(examples), num_samples=num_samples, dispatched_at=t0,
                          episodes=episodes)


def score_rollout(pending: PendingRollout, tokenizer, task, *, step: int, pool=None, timeout_s: float | None = None,
                  should_stop=None, max_steps: int | None = None) -> Rollout:
    """Reads this process's rows of a dispatched rollout, decodes them and runs the task's reward
    functions (a process pool when `pool` is given). Besides the examples' fields they get TRL's
    `completion_ids` (each completion's token ids, the stop token included), `trainer_state`
    (`global_step=step`, `max_steps`), `log_metric` and `log_extra` (`calling.RewardLog`), and
    grpo_jax's `truncated`, `completion_lengths` and `step`. A user reward function slower than
    `timeout_s` raises `RewardTimeoutError`; `should_stop()` turning true while one runs raises
    `RewardInterrupted` (see `rewards.compute_rewards`)."""
    sample = pending.sample
    arrays = {
        "prompt_tokens": sharding.process_rows(sample.prompt_tokens_BxP),
        "prompt_mask": sharding.process_rows(sample.prompt_mask_BxP),
        "tokens": sharding.process_rows(sample.tokens_BxC),
        "mask": sharding.process_rows(sample.mask_BxC),
        "logprobs": sharding.process_rows(sample.logprobs_BxC),
    }
    if sample.experts_BxLxSxK is not None:  # routing replay (off_policy.router_replay="R3")
        arrays["experts"] = token_major_experts(sharding.process_rows(sample.experts_BxLxSxK))
    truncated = sharding.process_rows(sample.truncated_B).astype(bool)
    tokens_ready_at = time.perf_counter()
    lengths = arrays["mask"].sum(axis=1).astype(np.int32)
    episodes = pending.episodes
    if episodes is None:
        arrays["tool_mask"] = arrays["mask"]
        completions = [tokenizer.decode(row[:n]) for row, n in zip(arrays["tokens"], lengths)]
    else:
        # An episode's answer is its last turn: what the model said, never the environment's text
        # (a reward reading the whole episode could credit the model with a tool's result).
        arrays["tool_mask"] = episodes.tool_mask
        completions = [ep.turn_texts[-1] if ep.turn_texts else "" for ep in episodes.episodes]
    rep_examples = [ex for ex in pending.examples for _ in range(pending.num_samples)]
    prompts = [ex["prompt"] for ex in rep_examples]
    field_names = sorted({k for ex in pending.examples for k in ex if k != "prompt"})
    fields: dict[str, Any] = {k: [ex.get(k) for ex in rep_examples] for k in field_names}
    if episodes is not None:
        fields.update(episodes.fields())
    fields.update(truncated=truncated.tolist(), completion_lengths=lengths.tolist(), step=step,
                  completion_ids=[row[:n].tolist() for row, n in zip(arrays["tokens"], lengths)],
                  trainer_state=TrainerState(global_step=step, max_steps=max_steps))
    reward_log = RewardLog()
    fields.update(log_metric=reward_log.log_metric, log_extra=reward_log.log_extra)
    t0 = time.perf_counter()
    rewards, parts = compute_rewards(task.reward_fns(), prompts, completions, fields, pool=pool,
                                     timeout_s=timeout_s, should_stop=should_stop)
    reward_seconds = time.perf_counter() - t0
    if episodes is not None:  # scored: the environments' sessions can end
        episodes.close()
    return Rollout(
        examples=rep_examples,
        prompts=prompts,
        completions=completions,
        rewards=np.asarray(rewards, np.float32),
        reward_parts=parts,
        lengths=lengths,
        truncated=truncated,
        arrays=arrays,
        tokens_ready_at=tokens_ready_at,
        reward_seconds=reward_seconds,
        reward_metrics=reward_log.means(),
        episodes=episodes,
        reward_extra={c: v for c, v in reward_log.extra.items() if len(v) == len(completions)},
    )


def evaluate(
    sampler: SamplingEngine,
    params,
    tokenizer,
    task,
    examples: Sequence[dict],
    *,
    num_samples: int,
    ks: Sequence[int],
    temperature: float,
    max_new_tokens: int,
    greedy: bool,
    rng: jax.Array,
    batch_prompts: int = 64,
    processes: Processes | None = None,
    on_batch: Callable[[int, int], None] | None = None,
    samples: list[dict] | None = None,
    episode_limits=None,
) -> dict[str, float]:
    """Held-out pass@1, pass@k, maj@k (n=`num_samples` per question) and greedy accuracy.

    Correctness is the task's own checker (`task.eval_correct`), which may differ from the
    training reward: stricter (seed Part 2, defence 4), or, for a jsonl task trained on one box,
    reading the answer where lm-eval-harness does (the lenient location; the comparison and its
    hedge rules are the training reward's; `eval_answer_location="boxed"` reads as training does).
    A truncated answer never finished, so it has no final answer and is wrong (defence 3). Batches
    are padded to a fixed number of prompts so the sampler compiles once per eval shape. Several
    processes: each answers its slice of every batch and the per-question results are summed over
    processes (`processes`; None: one process). Prompts are text or messages (`encode_prompt`).

    on_batch(done, total): called after each sampler call has been read and checked (`total`
    batches: one pass over the questions per mode, sampled then greedy).
    samples: when given, one record per question this process answered is appended, in question
    order: {"index", "example", "sampled": [{"completion", "answer", "correct", "truncated",
    "length"}] * num_samples, "greedy": {...} (with `greedy`)}; "answer" is `task.extract_answer`
    (None when truncated).
    """
    processes = processes or Processes(mesh=None)
    local = processes.prompt_slice(batch_prompts)
    modes = _eval_modes(num_samples, temperature, max_new_tokens, greedy)
    total_batches = len(modes) * -(-len(examples) // batch_prompts)
    done_batches = 0
    records: dict[int, dict] | None = {} if samples is not None else None
    results: dict[str, float] = {}
    for mode_i, (mode, n, sampling) in enumerate(modes):
        # Per question: answers that passed, and the final answers for the vote (None: truncated).
        # A question another process answered stays all False / 0 here; the sum below fills it in.
        correct_QxN = np.zeros((len(examples), n), bool)
        answers: list[list[str | None]] = [[] for _ in examples]
        for start in range(0, len(examples), batch_prompts):
            key = jax.random.fold_in(jax.random.fold_in(rng, mode_i), start)
            _check_batch(sampler, params, tokenizer, task, examples, start=start, batch_prompts=batch_prompts,
                         local=local, mode=mode, num_samples=n, sampling=sampling, rng=key, correct_QxN=correct_QxN,
                         answers=answers, records=records, episode_limits=episode_limits, processes=processes)
            done_batches += 1
            if on_batch is not None:
                on_batch(done_batches, total_batches)
        results.update(_mode_metrics(mode, n, ks, correct_QxN, answers, processes))
    if samples is not None:
        samples.extend(records[q] for q in sorted(records))
    return results


def _eval_modes(num_samples: int, temperature: float, max_new_tokens: int, greedy: bool
                ) -> list[tuple[str, int, SamplingConfig]]:
    """(mode, samples per question, sampling) for each evaluation pass: sampled, then greedy."""
    modes = [("sampled", num_samples, SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature))]
    if greedy:
        modes.append(("greedy", 1, SamplingConfig(max_new_tokens=max_new_tokens, greedy=True)))
    return modes


def _check_batch(sampler: SamplingEngine, params, tokenizer, task, examples: Sequence[dict], *, start: int,
                 batch_prompts: int, local: slice, mode: str, num_samples: int, sampling: SamplingConfig,
                 rng: jax.Array, correct_QxN: np.ndarray, answers: list[list[str | None]],
                 records: dict[int, dict] | None, episode_limits=None, processes: Processes | None = None) -> None:
    """Samples questions [start, start + batch_prompts) and checks this process's answers (its
    `local` slice of the batch): fills their rows of `correct_QxN` and `answers`, and with
    `records` (not None) each question's record (`evaluate`'s `samples`)."""
    chunk = list(examples[start : start + batch_prompts])
    real = len(chunk)
    chunk += [chunk[-1]] * (batch_prompts - real)  # fixed shape: pad with repeats, ignored below
    factory = getattr(task, "environment_factory", None)
    if factory is not None:  # episodes: the answer is the last turn (see score_rollout)
        sample, played = run_episodes(sampler, params, tokenizer, chunk[local], environment_factory=factory,
                                      limits=episode_limits or EpisodeLimits(max_turns=4), num_samples=num_samples,
                                      sampling=sampling, rng=rng, encode_prompt=encode_prompt, processes=processes)
        texts = [ep.turn_texts[-1] if ep.turn_texts else "" for ep in played.episodes]
        played.close()
    else:
        prompt_ids = [encode_prompt(tokenizer, ex["prompt"]) for ex in chunk[local]]
        sample = sampler(params, prompt_ids, num_samples=num_samples, sampling=sampling, rng=rng)
        texts = None
    tokens = sharding.process_rows(sample.tokens_BxC)
    lengths = sharding.process_rows(sample.mask_BxC).sum(axis=1)
    truncated = sharding.process_rows(sample.truncated_B).astype(bool)
    for q in range(local.start, min(real, local.stop)):
        for j in range(num_samples):
            row = (q - local.start) * num_samples + j
            text = tokenizer.decode(tokens[row, : lengths[row]]) if texts is None else texts[row]
            ok = (not truncated[row]) and bool(task.eval_correct(text, chunk[q]))
            answer = None if truncated[row] else task.extract_answer(text)
            correct_QxN[start + q, j] = ok
            answers[start + q].append(answer)
            if records is not None:
                record = records.setdefault(start + q, {"index": start + q, "example": chunk[q], "sampled": []})
                one = {"completion": text, "answer": answer, "correct": ok,
                       "truncated": bool(truncated[row]), "length": int(lengths[row])}
                if mode == "greedy":
                    record["greedy"] = one
                else:
                    record["sampled"].append(one)


def _mode_metrics(mode: str, n: int, ks: Sequence[int], correct_QxN: np.ndarray, answers: list[list[str | None]],
                  processes: Processes) -> dict[str, float]:
    """One pass's metrics from this process's checks, summed over processes: greedy accuracy, or
    pass@1, pass@k and maj@k (k > 1) over the n samples of each question."""
    majs = {}
    for k in ks:
        if k > 1 and mode != "greedy":
            # A voted answer is as correct as the first sample that gave it (same final answer).
            majs[k] = processes.sum(
                [
                    (
                        evaluation.maj_at_k(answers[q], lambda a, q=q: correct_QxN[q, answers[q].index(a)], k)
                        if answers[q]
                        else 0.0
                    )
                    for q in range(len(answers))
                ]
            )
    correct_QxN = processes.sum(correct_QxN.astype(np.int32)) > 0
    if mode == "greedy":
        return {"eval/greedy_accuracy": float(correct_QxN[:, 0].mean())}
    counts = correct_QxN.sum(axis=1)
    results = {"eval/pass@1": float(np.mean(counts / n))}
    for k in ks:
        if k > 1:
            results[f"eval/pass@{k}"] = float(np.mean([evaluation.pass_at_k(n, int(c), k) for c in counts]))
            results[f"eval/maj@{k}"] = float(np.mean(majs[k]))
    return results
