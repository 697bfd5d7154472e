"""Host-side rollouts: prompts in, scored completions out, and the held-out evaluation.

Everything here runs on the host around the jitted sampler: tokenising prompts, decoding completions,
calling the reward functions and the task's checker. The device work is `Sampler.__call__`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import numpy as np

from grpo_jax import evaluation
from grpo_jax import sharding
from grpo_jax.rewards import compute_rewards
from grpo_jax.sampler import SampleOutput, Sampler, SamplingConfig


@dataclasses.dataclass
class Rollout:
    """One batch of G answers to each of B prompts, scored. Row r answers prompt r // G.

    Arrays are host numpy, except `sample` (device arrays, for the update step).
    """

    sample: SampleOutput
    examples: list[dict]  # [B*G], each prompt's example repeated G times
    prompts: list[str]  # [B*G]
    completions: list[str]  # [B*G]
    rewards: np.ndarray  # [B*G] float32, NaN where no reward function applied
    reward_parts: dict[str, np.ndarray]  # name -> [B*G] float32, NaN for None
    lengths: np.ndarray  # [B*G] completion tokens (EOS included)
    truncated: np.ndarray  # [B*G] bool
    reward_seconds: float = 0.0  # host time spent in the reward functions


def generate_and_score(
    sampler: Sampler,
    params,
    tokenizer,
    task,
    examples: Sequence[dict],
    *,
    num_samples: int,
    sampling: SamplingConfig,
    rng: jax.Array,
    step: int,
    pool=None,
) -> Rollout:
    """Samples `num_samples` answers per example and scores them with the task's reward functions."""
    prompt_ids = [tokenizer.encode(ex["prompt"]) for ex in examples]
    sample = sampler(params, prompt_ids, num_samples=num_samples, sampling=sampling, rng=rng)
    # This process's rows (all of them on one process; its host slice on several).
    tokens = sharding.process_rows(sample.tokens_BxC)
    mask = sharding.process_rows(sample.mask_BxC)
    truncated = sharding.process_rows(sample.truncated_B).astype(bool)
    lengths = mask.sum(axis=1).astype(np.int32)
    completions = [tokenizer.decode(row[:n]) for row, n in zip(tokens, lengths)]
    rep_examples = [ex for ex in examples for _ in range(num_samples)]
    prompts = [ex["prompt"] for ex in rep_examples]
    field_names = sorted({k for ex in examples for k in ex if k != "prompt"})
    fields: dict[str, Any] = {k: [ex.get(k) for ex in rep_examples] for k in field_names}
    fields.update(truncated=truncated.tolist(), completion_lengths=lengths.tolist(), step=step)
    t0 = time.perf_counter()
    rewards, parts = compute_rewards(task.reward_fns(), prompts, completions, fields, pool=pool)
    reward_seconds = time.perf_counter() - t0
    return Rollout(
        sample=sample,
        examples=rep_examples,
        prompts=prompts,
        completions=completions,
        rewards=np.asarray(rewards, np.float32),
        reward_parts=parts,
        lengths=lengths,
        truncated=truncated,
        reward_seconds=reward_seconds,
    )


def evaluate(
    sampler: Sampler,
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
) -> dict[str, float]:
    """Held-out pass@1, pass@k, maj@k (n=`num_samples` per question) and greedy accuracy.

    Correctness is the task's own checker (`task.eval_correct`), which may be stricter than the
    training reward (seed Part 2, defence 4). Batches are padded to a fixed number of prompts so the
    sampler compiles once per eval shape.
    """
    results: dict[str, float] = {}
    # Multi-host: each process samples its host slice of every chunk of questions; the per-question
    # results are gathered before the averages, so they equal the single-host ones.
    mesh = getattr(sampler, "mesh", None)
    multi = mesh is not None and jax.process_count() > 1
    local = sharding.host_slice(batch_prompts, mesh) if multi else slice(0, batch_prompts)
    modes = [("sampled", num_samples, SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature))]
    if greedy:
        modes.append(("greedy", 1, SamplingConfig(max_new_tokens=max_new_tokens, greedy=True)))
    for mode_i, (mode, n, sampling) in enumerate(modes):
        correct = np.zeros((len(examples), n), bool)
        owned = np.zeros(len(examples), bool)  # questions this process answered (all on one host)
        answers: list[list[str | None]] = [[] for _ in examples]
        for start in range(0, len(examples), batch_prompts):
            chunk = list(examples[start : start + batch_prompts])
            real = len(chunk)
            chunk += [chunk[-1]] * (batch_prompts - real)  # fixed shape: pad with repeats, ignored below
            prompt_ids = [tokenizer.encode(ex["prompt"]) for ex in chunk[local]]
            key = jax.random.fold_in(jax.random.fold_in(rng, mode_i), start)
            sample = sampler(params, prompt_ids, num_samples=n, sampling=sampling, rng=key)
            tokens = sharding.process_rows(sample.tokens_BxC)
            lengths = sharding.process_rows(sample.mask_BxC).sum(axis=1)
            truncated = sharding.process_rows(sample.truncated_B).astype(bool)
            for row in range(max(0, min(real, local.stop) - local.start) * n):
                q, j = divmod(row, n)
                q += local.start
                owned[start + q] = True
                row = (q - local.start) * n + j
                text = tokenizer.decode(tokens[row, : lengths[row]])
                ex = chunk[q]
                # A truncated answer never finished, so it has no final answer (seed Part 2, defence 3).
                ok = (not truncated[row]) and bool(task.eval_correct(text, ex))
                correct[start + q, j] = ok
                answers[start + q].append(None if truncated[row] else task.extract_answer(text))
        majs = {}
        for k in ks:
            if k > 1 and mode != "greedy":
                # A voted answer is as correct as the first sample that gave it (same final answer).
                majs[k] = [
                    (
                        evaluation.maj_at_k(answers[q], lambda a, q=q: correct[q, answers[q].index(a)], k)
                        if owned[q]
                        else 0.0
                    )
                    for q in range(len(examples))
                ]
        if multi:
            # Each question was answered on exactly one process: the others hold False / 0 there.
            from jax.experimental import multihost_utils

            correct = np.asarray(multihost_utils.process_allgather(correct)).any(axis=0)
            majs = {
                k: np.asarray(multihost_utils.process_allgather(np.asarray(v, np.float64))).sum(axis=0)
                for k, v in majs.items()
            }
        if mode == "greedy":
            results["eval/greedy_accuracy"] = float(correct[:, 0].mean())
            continue
        counts = correct.sum(axis=1)
        results["eval/pass@1"] = float(np.mean(counts / n))
        for k in ks:
            if k > 1:
                results[f"eval/pass@{k}"] = float(
                    np.mean([evaluation.pass_at_k(n, int(c), k) for c in counts])
                )
                results[f"eval/maj@{k}"] = float(np.mean(majs[k]))
    return results
