"""BatchPlan: one step's rows cut into minibatches, micro-batches and devices, computed in one place
and read by the trainer's config check, `check` and the benchmark's FLOP count."""

from __future__ import annotations

import pytest

from grpo_jax.config import GRPOSection
from grpo_jax.config.batch_plan import BatchPlan


def test_the_rows_of_a_dapo_style_step():
    # 16 prompts x G = 8 = 128 completions; 2 minibatches of 64 (two optimizer updates), each
    # accumulated over 4 micro-batches of 16 rows; 2 passes over the batch (mu = 2): 4 updates.
    # On 8 row devices (data x fsdp) each device samples 128 / 8 = 16 rows.
    g = GRPOSection(prompts_per_step=16, num_generations=8, num_minibatches=2, grad_accum_steps=4, num_iterations=2)
    plan = BatchPlan.of(g, row_devices=8)
    assert (plan.rows, plan.rows_per_minibatch, plan.rows_per_micro_batch) == (128, 64, 16)
    assert (plan.rows_per_device, plan.micro_batches, plan.updates_per_step) == (16, 4, 4)
    assert plan.micro_batches_per_step == 8  # 2 minibatches x 4: the log-prob pass's chunks at most
    # The learning-rate schedule spans every update of the run: 10 steps x 4.
    assert plan.total_updates(10) == 40


def test_defaults_are_one_update_of_one_micro_batch_on_one_device():
    # GRPOSection's defaults: 16 prompts x G = 8, one minibatch, no accumulation, mu = 1.
    plan = BatchPlan.of(GRPOSection())
    assert (plan.rows, plan.rows_per_device, plan.rows_per_micro_batch) == (128, 128, 128)
    assert plan.updates_per_step == 1


@pytest.mark.parametrize("prompts,G,minibatches,accum", [(3, 5, 1, 1), (7, 4, 2, 2), (16, 16, 1, 8)])
def test_micro_batch_is_the_minibatch_cut_again(prompts, G, minibatches, accum):
    # Integer division composes: (B // n) // a == B // (n * a), so the bucketed update's chunk size
    # (per minibatch, then per micro-batch) equals the unbucketed one.
    plan = BatchPlan(prompts, G, minibatches, accum, num_iterations=1)
    assert plan.rows_per_minibatch // accum == plan.rows_per_micro_batch == prompts * G // (minibatches * accum)


def test_bench_counts_flops_of_the_trainers_micro_batch(monkeypatch):
    # bench.executed_step_flops asks step.prompt_groups about the plan's micro-batch: 16 x 8 rows in
    # 2 minibatches x 4 micro-batches = 16 rows per micro-batch.
    from grpo_jax.cli import bench
    from grpo_jax.config import Config
    from grpo_jax.model import ModelConfig

    seen = []
    real = bench.step_lib.prompt_groups
    monkeypatch.setattr(bench.step_lib, "prompt_groups", lambda g, rows, n: seen.append(rows) or real(g, rows, n))
    g = GRPOSection(prompts_per_step=16, num_generations=8, num_minibatches=2, grad_accum_steps=4)
    c = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=16)
    bench.executed_step_flops(Config(grpo=g), c, prompt_len=8, num_devices=2)
    assert seen == [16]
