"""grpo_jax.sampling.engine: the one call a rollout makes on a sampling engine.

An engine that is not the built-in `Sampler` (here a table of fixed answers, as an external
inference server would answer) runs through the trainer's rollout as written: it returns a
`SampleOutput` and the rollout decodes, measures and scores it. The expected numbers are hand counts.
"""

import dataclasses

import jax
import numpy as np
from flax import nnx

from grpo_jax import model as M
from grpo_jax.io.tokenizer import CharTokenizer
from grpo_jax.sampling.engine import SampleOutput, SamplingConfig, SamplingEngine
from grpo_jax.sampling.sampler import Sampler
from grpo_jax.tasks import RewardSpec
from grpo_jax.training import rollout

TOK = CharTokenizer("0123456789+=")


@dataclasses.dataclass
class TableEngine:
    """Answers sample j of a prompt with `answers[prompt text][j]`, log-prob -0.5 per token; an
    answer longer than max_new_tokens is cut there and truncated (no stop id)."""

    answers: dict
    mesh: object = None  # plain host arrays: one process holds every row

    def __call__(self, params, prompts, *, num_samples, sampling, rng):
        c, p = sampling.max_new_tokens, max(len(x) for x in prompts)
        rows = [(prompt, TOK.encode(self.answers[TOK.decode(prompt)][j]) + [TOK.eos_id])
                for prompt in prompts for j in range(num_samples)]
        out = {"prompt_tokens_BxP": np.full((len(rows), p), TOK.pad_id, np.int32),
               "prompt_mask_BxP": np.zeros((len(rows), p), np.int32),
               "tokens_BxC": np.full((len(rows), c), TOK.pad_id, np.int32),
               "mask_BxC": np.zeros((len(rows), c), np.int32),
               "truncated_B": np.array([len(ids) > c for _, ids in rows]),
               "logprobs_BxC": np.zeros((len(rows), c), np.float32)}
        for i, (prompt, ids) in enumerate(rows):
            out["prompt_tokens_BxP"][i, p - len(prompt):] = prompt
            out["prompt_mask_BxP"][i, p - len(prompt):] = 1
            out["tokens_BxC"][i, :min(len(ids), c)] = ids[:c]
            out["mask_BxC"][i, :min(len(ids), c)] = 1
            out["logprobs_BxC"][i, :min(len(ids), c)] = -0.5
        return SampleOutput(**out)


class ExactAnswerTask:
    def reward_fns(self):
        return [RewardSpec("exact", lambda prompts, completions, answer, **_: [
            float(c == a) for c, a in zip(completions, answer)], 1.0)]


def test_an_external_engine_feeds_the_trainers_rollout():
    engine = TableEngine({"1+1=": ["2", "3", "22"], "2+3=": ["5", "5", "55555"]})
    assert isinstance(engine, SamplingEngine)
    examples = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+3=", "answer": "5"}]
    pending = rollout.dispatch_rollout(engine, None, TOK, examples, num_samples=3,
                                       sampling=SamplingConfig(max_new_tokens=4), rng=jax.random.key(0))
    batch = rollout.score_rollout(pending, TOK, ExactAnswerTask(), step=0)
    # Row r answers prompt r // 3. "55555" has 5 characters + the stop id: cut at C = 4, truncated.
    assert batch.completions == ["2", "3", "22", "5", "5", "5555"]
    np.testing.assert_array_equal(batch.lengths, [2, 2, 3, 2, 2, 4])  # the stop id counts
    np.testing.assert_array_equal(batch.truncated, [False] * 5 + [True])
    np.testing.assert_array_equal(batch.rewards, [1, 0, 0, 1, 1, 0])
    # The engine's log-probs reach the trainer's arrays untouched (pi_old with old_logprobs="sampler").
    assert batch.arrays["logprobs"].sum() == -0.5 * batch.lengths.sum()


def test_the_builtin_sampler_is_a_sampling_engine():
    config = M.ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2,
                           num_kv_heads=1, head_dim=8)
    graphdef, params = nnx.split(M.init_model(config, 0))
    sampler = Sampler(graphdef, config, eos_id=1, pad_id=0)
    assert isinstance(sampler, SamplingEngine)
    out = sampler(params, [[3, 4], [5]], num_samples=2, sampling=SamplingConfig(max_new_tokens=3),
                  rng=jax.random.key(1))
    assert isinstance(out, SampleOutput)
    assert out.tokens_BxC.shape == out.logprobs_BxC.shape == (4, 3)
