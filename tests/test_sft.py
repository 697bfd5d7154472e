"""Supervised warm-up: batch layout, and a few steps teach a fixed answer."""

import numpy as np

from grpo_jax import config as config_lib
from grpo_jax import model as model_lib
from grpo_jax.training import sft
from grpo_jax.sampling.sampler import Sampler
from grpo_jax.io.tokenizer import CharTokenizer

TOK = CharTokenizer("0123456789+=")


def test_batch_is_left_padded_prompt_then_answer_and_eos():
    examples = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "10+10=", "answer": "02"}]
    tokens, attention, answer_mask = sft.sft_batch(TOK, examples, max_answer_tokens=4)
    P = tokens.shape[1] - 4
    assert P == 16  # prompt width bucketed to a multiple of 16
    assert TOK.decode(tokens[0, :P]) == "1+1=" and attention[0, :P].sum() == 4
    assert list(tokens[0, P:]) == [TOK.encode("2")[0], TOK.eos_id, TOK.pad_id, TOK.pad_id]
    assert list(answer_mask[1]) == [1, 1, 1, 0]  # "0", "2", EOS


def test_answer_longer_than_the_budget_names_the_setting():
    try:
        sft.sft_batch(TOK, [{"prompt": "1=", "answer": "12345"}], max_answer_tokens=3)
    except ValueError as e:
        assert "sampling.max_new_tokens=3" in str(e)
    else:
        raise AssertionError("no error")


class FixedAnswerTask:
    def train_example(self, index):
        return {"prompt": f"{index % 50:02d}+{index % 7}=", "answer": "77"}

    def eval_correct(self, completion, example):
        return completion == example["answer"]


def test_warm_up_teaches_a_fixed_answer_and_stops_at_the_target():
    cfg = model_lib.ModelConfig(vocab_size=TOK.vocab_size, hidden_size=32, intermediate_size=64, num_layers=1,
                                num_heads=2, num_kv_heads=1, head_dim=16)
    from flax import nnx
    graphdef, params = nnx.split(model_lib.init_model(cfg, 0))
    sampler = Sampler(graphdef, cfg, eos_id=TOK.eos_id, pad_id=TOK.pad_id)
    section = config_lib.SFTSection(steps=60, batch_size=16, learning_rate=1e-2, target_accuracy=1.0,
                                    eval_every=10, eval_size=8)
    params, stats = sft.warm_up(graphdef, params, sampler, TOK, FixedAnswerTask(), section, max_new_tokens=3,
                                seed=0, log_fn=lambda s: None)
    accs = [h["valid_greedy_accuracy"] for h in stats["history"]]
    assert accs[0] == 0.0 and accs[-1] == 1.0
    assert stats["steps"] < 60  # stopped early at the target
    assert np.isfinite(stats["history"][-1]["loss"])


class OwnWarmUpTask(FixedAnswerTask):
    """Trains (GRPO) on answers "11" but warms up on "77": the warm-up reads `warmup_example`."""

    def train_example(self, index):
        return {**super().train_example(index), "answer": "11"}

    def warmup_example(self, index):
        return super().train_example(index)


def test_warm_up_trains_and_validates_on_the_tasks_own_warm_up_examples():
    cfg = model_lib.ModelConfig(vocab_size=TOK.vocab_size, hidden_size=32, intermediate_size=64, num_layers=1,
                                num_heads=2, num_kv_heads=1, head_dim=16)
    from flax import nnx
    graphdef, params = nnx.split(model_lib.init_model(cfg, 0))
    sampler = Sampler(graphdef, cfg, eos_id=TOK.eos_id, pad_id=TOK.pad_id)
    section = config_lib.SFTSection(steps=60, batch_size=16, learning_rate=1e-2, target_accuracy=1.0,
                                    eval_every=10, eval_size=8)
    task = OwnWarmUpTask()
    params, stats = sft.warm_up(graphdef, params, sampler, TOK, task, section, max_new_tokens=3, seed=0,
                                log_fn=lambda s: None)
    assert stats["history"][-1]["valid_greedy_accuracy"] == 1.0  # "77", the warm-up's answer
    examples = [task.train_example(i) for i in range(8)]
    assert sft.greedy_accuracy(sampler, params, TOK, task, examples, max_new_tokens=3) == 0.0  # never "11"
