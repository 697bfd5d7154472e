"""grpo_jax.cli.bench: the W1 task and reward, FLOP counts from shapes, the summaries the scripts print."""

import dataclasses
import math

import numpy as np
import pytest

from grpo_jax.cli import bench
from grpo_jax.model import ModelConfig
from grpo_jax.io.tokenizer import load_tokenizer

W1 = ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=4,
                 num_kv_heads=2, head_dim=64, qkv_bias=True)


def test_last_boxed_takes_the_last_box():
    # W1's rule is "the last \boxed{}", unlike the strict verifier's "exactly one box".
    assert bench.last_boxed(r"first \boxed{3}, then \boxed{57}") == "57"
    assert bench.last_boxed(r"\boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert bench.last_boxed("no box at all") is None
    assert bench.last_boxed(r"unclosed \boxed{12") is None


def test_boxed_sum_reward_is_one_only_for_the_sum():
    completions = [r"so \boxed{57}", r"\boxed{56}", "57", r"\boxed{12} no, \boxed{57}", r"\boxed{57.0}",
                   r"\boxed{x}"]
    # 57.0 is the number 57 (exact Fraction compare); "57" without a box scores 0; "x" is not a number.
    assert bench.boxed_sum_reward([""] * 6, completions, answer=["57"] * 6) == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]


def test_addition_task_examples_are_deterministic_two_digit_sums():
    task = bench.AdditionTask()
    ex = task.train_example(7)
    assert ex == bench.AdditionTask().train_example(7)  # random access, same on every run
    a, b = (int(x) for x in ex["prompt"].removeprefix("What is ").split("?")[0].split("+"))
    assert 10 <= a <= 99 and 10 <= b <= 99 and ex["answer"] == str(a + b)
    assert ex["prompt"].endswith(r"Put the answer in \boxed{}.")
    assert task.eval_correct(rf"\boxed{{{a + b}}}", ex) and not task.eval_correct(r"\boxed{0}", ex)
    assert task.extract_answer(r"\boxed{1} \boxed{2}") == "2"


def test_w1_prompts_land_in_the_32_token_bucket():
    # The sampler buckets prompt lengths to (16, 32, ...): W1 needs 16 < tokens <= 32.
    tok = load_tokenizer("builtin")
    lengths = {len(tok.encode(bench.AdditionTask().train_example(i)["prompt"])) for i in range(50)}
    assert all(16 < n <= bench.W1_PROMPT_LEN for n in lengths), lengths


def test_wide_vocab_tokenizer_drops_ids_the_tokenizer_lacks():
    tok = bench.WideVocabTokenizer(load_tokenizer("builtin"))  # 448 pieces, model vocab 1024
    ids = tok.encode("What is 1+2?")
    assert tok.decode(ids + [900, 1000]) == tok.decode(ids) == "What is 1+2?"


def test_matmul_params_of_w1():
    # per layer: D*H*(2N + 2K) = 256*64*12 = 196,608 attention weights + 3*D*F = 540,672 MLP weights.
    assert bench.matmul_params(W1) == (4 * (196_608 + 540_672), 256 * 1024)


def test_w1_step_flops_by_hand():
    # Reference forward, B=32 rows of S=96 tokens, logits at C=64 positions:
    #   weights 2*32*96*2,949,120 = 18,119,393,280; attention 4 layers * 32 * 4*N*H * 96*96
    #   = 1,207,959,552; logits 2*32*64*262,144 = 1,073,741,824. Sum 20,401,094,656.
    f = bench.grpo_step_flops(W1, num_prompts=4, group=8, prompt_len=32, new_tokens=64)
    assert f.reference == 20_401_094_656
    assert f.policy == 3 * f.reference  # forward + backward (2x)
    # Rollout: prefill 4 prompts x 32 tokens (logits at 1 slot) + 64 decode steps of 32 rows over 96 slots:
    #   prefill 2*4*32*2,949,120 + 4*4*4*4*64*32*32 + 2*4*262,144 = 773,849,088
    #   decode  64 * (2*32*2,949,120 + 4*32*4*4*64*96 + 2*32*262,144) = 13,958,643,712
    assert f.rollout == 773_849_088 + 13_958_643_712
    assert f.total == 96_336_871_424  # ~96 GFLOP (the 101 counts the rollout as full forwards)
    no_ref = bench.grpo_step_flops(W1, num_prompts=4, group=8, prompt_len=32, new_tokens=64, with_reference=False)
    assert no_ref.reference == 0 and no_ref.total == f.total - f.reference
    # Each prompt once per group (what grpo_jax runs): the 4 prompts' 32 tokens attend over 32 keys,
    # then 32 rows x 64 completion tokens attend over 96 keys, logits at the 64:
    #   prompts 2*4*32*2,949,120 + 4 layers*4*4*4*64*32*32 = 754,974,720 + 16,777,216
    #   completions 2*32*64*2,949,120 + 4*32*4*4*64*64*96 + 2*32*64*262,144
    #             = 12,079,595,520 + 805,306,368 + 1,073,741,824
    shared = bench.grpo_step_flops(W1, num_prompts=4, group=8, prompt_len=32, new_tokens=64, shared_prompt=True)
    assert shared.reference == 14_730_395_648  # 28% less than per-row prompts
    assert shared.policy == 3 * shared.reference and shared.rollout == f.rollout


def test_fit_exponent_recovers_a_power_law():
    x = np.array([32, 64, 128, 256])
    assert bench.fit_exponent(x, 2.0 * x ** 1.5) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="positive"):
        bench.fit_exponent([1, 2], [1.0, 0.0])


def test_summarize_steps_takes_medians_over_steps_3_to_n():
    history = [{"step": s, "time/step": t, "time/rollout": t / 2} for s, t in
               [(1, 30.0), (2, 2.0), (3, 1.0), (4, 3.0), (5, 2.0)]]
    out = bench.summarize_steps(history, first=3, last=5)
    # Steps 1-2 (compilation) are left out: median of 1, 3, 2.
    assert out == {"time/step": 2.0, "time/rollout": 1.0, "steps_measured": 3}
    with pytest.raises(ValueError, match="no history rows"):
        bench.summarize_steps(history, first=9, last=12)


def test_matmul_peak_is_a_positive_rate():
    rate = bench.matmul_peak_flops(n=64, repeats=1)
    assert math.isfinite(rate) and rate > 0


def test_w1_config_is_the_workload():
    c = bench.w1_config("/tmp/x")
    assert (c.grpo.prompts_per_step, c.grpo.num_generations, c.sampling.max_new_tokens) == (4, 8, 64)
    assert c.sampling.ignore_eos and c.sampling.temperature == 1.0
    assert (c.grpo.beta, c.grpo.eps_low, c.optim.learning_rate, c.eval.num_questions) == (0.04, 0.2, 1e-5, 0)
    assert (c.model.hidden_size, c.model.vocab_size, c.model.qkv_bias, c.model.tie_embeddings) == (256, 1024, True, False)


@pytest.mark.parametrize("d,f", [(4, 6), (6, 4)])  # both branches: transpose x, or transpose dy
def test_dense_custom_vjp_matches_the_plain_matmul_gradient(d, f):
    # model.dense (the speed change of benchmarks/NOTES.md, item 7) must give the same value and
    # gradients as x @ w; sin() makes the cotangent non-constant.
    import jax
    import jax.numpy as jnp

    from grpo_jax.model import dense

    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (2, 3, d))
    w = jax.random.normal(kw, (d, f))
    ours = jax.value_and_grad(lambda x, w: jnp.sum(jnp.sin(dense(x, w))), argnums=(0, 1))(x, w)
    plain = jax.value_and_grad(lambda x, w: jnp.sum(jnp.sin(x @ w)), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(ours[0], plain[0], rtol=1e-6)
    for g_ours, g_plain in zip(ours[1], plain[1]):
        assert g_ours.shape == g_plain.shape
        np.testing.assert_allclose(g_ours, g_plain, rtol=1e-5, atol=1e-6)


def test_executed_flops_follow_the_trainers_prompt_sharing():
    # W1 on one device: both passes run each prompt once per group. With minibatches the update's
    # rows are shuffled (per-row prompts) and only the reference pass shares; switched off, neither.
    cfg = bench.w1_config("/tmp/unused")
    shared = bench.grpo_step_flops(W1, num_prompts=4, group=8, prompt_len=32, new_tokens=64, shared_prompt=True)
    per_row = bench.grpo_step_flops(W1, num_prompts=4, group=8, prompt_len=32, new_tokens=64)
    assert bench.executed_step_flops(cfg, W1, prompt_len=32, num_devices=1) == shared
    minibatched = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, num_minibatches=2))
    got = bench.executed_step_flops(minibatched, W1, prompt_len=32, num_devices=1)
    assert (got.reference, got.policy) == (shared.reference, per_row.policy)
    off = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, share_prompt_prefix=False))
    assert bench.executed_step_flops(off, W1, prompt_len=32, num_devices=1) == per_row
