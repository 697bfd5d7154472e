"""Held-out evaluation plumbing: pass@1, pass@k, maj@k and greedy accuracy from known samples.

A stand-in sampler returns fixed completions, so the expected figures can be worked out by hand.
"""

import dataclasses

import jax
import numpy as np

from grpo_jax.training import rollout
from grpo_jax.io.tokenizer import CharTokenizer

TOK = CharTokenizer("0123456789+=")


@dataclasses.dataclass
class FixedSampler:
    """Answers a prompt's sample j with `answers[prompt][j]` (greedy: sample 0)."""
    answers: dict

    def __call__(self, params, prompts, *, num_samples, sampling, rng):
        rows = []
        for prompt in prompts:
            for j in range(num_samples):
                rows.append(TOK.encode(self.answers[TOK.decode(prompt)][j]) + [TOK.eos_id])
        width = sampling.max_new_tokens
        tokens = np.full((len(rows), width), TOK.pad_id, np.int32)
        mask = np.zeros((len(rows), width), np.int32)
        for i, r in enumerate(rows):
            tokens[i, :len(r)] = r[:width]
            mask[i, :len(r)] = 1
        return type("Out", (), {"tokens_BxC": tokens, "mask_BxC": mask,
                                "truncated_B": np.zeros(len(rows), bool)})()


class EqualsTask:
    def eval_correct(self, completion, example):
        return completion == example["answer"]

    def extract_answer(self, completion):
        return completion or None


def test_pass_and_majority_figures_match_hand_counts():
    examples = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    # Question 1: 2 of 4 right ("2" and "3" tie at two votes each). Question 2: 1 of 4 right; "5" wins.
    answers = {"1+1=": ["2", "3", "3", "2"], "2+2=": ["5", "4", "5", "5"]}
    res = rollout.evaluate(FixedSampler(answers), None, TOK, EqualsTask(), examples, num_samples=4,
                           ks=(1, 2, 4), temperature=1.0, max_new_tokens=3, greedy=True,
                           rng=jax.random.PRNGKey(0), batch_prompts=2)
    assert np.isclose(res["eval/pass@1"], (2 / 4 + 1 / 4) / 2)
    # pass@2 = 1 - C(n-c, 2)/C(n, 2): q1 1 - 1/6, q2 1 - 3/6.
    assert np.isclose(res["eval/pass@2"], ((1 - 1 / 6) + (1 - 3 / 6)) / 2)
    assert np.isclose(res["eval/pass@4"], 1.0)
    # maj@4: q1 tie "2" vs "3" -> first seen "2" (correct); q2 "5" (wrong).
    assert res["eval/maj@4"] == 0.5
    # maj@2: q1 "2","3" tie -> "2" correct; q2 "5","4" tie -> "5" wrong.
    assert res["eval/maj@2"] == 0.5
    # Greedy takes sample 0: "2" right, "5" wrong.
    assert res["eval/greedy_accuracy"] == 0.5


def test_padding_the_last_batch_does_not_count_twice():
    examples = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "0+2=", "answer": "2"},
                {"prompt": "3+3=", "answer": "6"}]
    answers = {"1+1=": ["2", "2"], "0+2=": ["2", "2"], "3+3=": ["9", "9"]}
    res = rollout.evaluate(FixedSampler(answers), None, TOK, EqualsTask(), examples,
                           num_samples=2, ks=(1,), temperature=1.0, max_new_tokens=3, greedy=False,
                           rng=jax.random.PRNGKey(0), batch_prompts=2)
    # The second batch holds question 3 plus a repeat of it as padding; only question 3 counts.
    assert np.isclose(res["eval/pass@1"], 2 / 3)


class ChatTokenizer(CharTokenizer):
    """A stand-in chat template: a conversation is its last user turn's characters."""

    def apply_chat_template(self, messages, *, add_generation_prompt, tokenize):
        assert add_generation_prompt and tokenize
        return self.encode(messages[-1]["content"])


def test_progress_per_batch_samples_per_question_and_message_prompts():
    examples = [{"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"},  # messages, as TRL's
                {"prompt": "2+2=", "answer": "4"}, {"prompt": "3+3=", "answer": "6"}]
    answers = {"1+1=": ["2", "3"], "2+2=": ["4", "4"], "3+3=": ["1", "6"]}
    calls, samples = [], []
    res = rollout.evaluate(FixedSampler(answers), None, ChatTokenizer("0123456789+="), EqualsTask(), examples,
                           num_samples=2, ks=(1, 2), temperature=1.0, max_new_tokens=3, greedy=True,
                           rng=jax.random.PRNGKey(0), batch_prompts=2,
                           on_batch=lambda done, total: calls.append((done, total)), samples=samples)
    # Two batches of questions (2 + 1 padded to 2), sampled then greedy: four calls, in order.
    assert calls == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert np.isclose(res["eval/pass@1"], (1 / 2 + 1 + 1 / 2) / 3)
    # One record per real question (the padding repeat is not one), in question order.
    assert [s["index"] for s in samples] == [0, 1, 2] and [s["example"] for s in samples] == examples
    assert [[x["completion"] for x in s["sampled"]] for s in samples] == [["2", "3"], ["4", "4"], ["1", "6"]]
    assert [[x["correct"] for x in s["sampled"]] for s in samples] == [[True, False], [True, True], [False, True]]
    assert samples[0]["sampled"][0] == {"completion": "2", "answer": "2", "correct": True, "truncated": False,
                                        "length": 2}  # "2" and EOS
    assert [s["greedy"]["completion"] for s in samples] == ["2", "4", "1"]
