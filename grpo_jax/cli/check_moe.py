"""`check`'s figure for a mixture-of-experts model: the (token, choice) pairs one sparse layer
works on, per device, in the update and in the log-prob pass.

Each device routes its own rows' tokens (`grpo_jax.model.expert_dispatch`): it gathers the tokens
of its expert group (mesh.expert devices), sorts their N*K (token, choice) pairs by expert and runs
every pair through a grouped matmul sized for all of them (static shapes; the pairs of experts it
does not hold add zeros). Per device and sparse layer:

    pairs_bytes = M * (D + I) * compute bytes,   M = K * (tokens of a pass / row devices) * mesh.expert

the rows [M, D] and one intermediate [M, I] that coexist in the layer's forward (and again in the
backward's recompute). A lower bound on that program's scratch: the tiled grouped matmul
(`grouped_matmul`, XLA's on a GPU and on the CPU `check` compiles with) gathers up to twice each,
and a CPU compile holds them in float32 where the target holds bf16. A dense model: 0.
(Before the per-device dispatch, XLA's partitioner did not split the sort over a pass's pairs and
every device gathered the whole micro-batch's: 16 times these on Qwen3-30B-A3B over fsdp 16.)
"""

from __future__ import annotations

from grpo_jax.config.batch_plan import BatchPlan


def pass_tokens(rows: int, group: int, prompt_len: int, completion_len: int) -> int:
    """Tokens the model runs for `rows` rows: each row its own prompt (group 1), or each group of
    `group` rows one shared prompt and its group's completions (`step.prompt_groups`)."""
    if group > 1:
        return rows // group * (prompt_len + group * completion_len)
    return rows * (prompt_len + completion_len)


def pairs_bytes(model_config, tokens: int) -> int:
    """[M, D] + [M, I] in the compute dtype, M = K * tokens (module docstring); 0 without experts."""
    c = model_config
    if not c.num_experts:
        return 0
    act_bytes = 2 if c.dtype == "bfloat16" else 4
    return c.num_experts_per_tok * tokens * (c.hidden_size + c.moe_intermediate_size) * act_bytes


def moe_pairs(config, model_config, row_devices: int, expert_devices: int, *, prompt_len: int,
              runs_logprob_pass: bool) -> dict[str, int]:
    """{"moe_pairs_update": .., "moe_pairs_logprobs": ..}: `pairs_bytes` per device for one update
    micro-batch and for one chunk of the log-prob pass (0 where no such pass runs), as the trainer
    cuts them (`step.prompt_groups`, `step.logprob_row_chunks`), over `row_devices` devices of
    which groups of `expert_devices` share their tokens."""
    from grpo_jax.training import step as step_lib

    g, c = config.grpo, config.sampling.max_new_tokens
    plan = BatchPlan.of(g, row_devices)
    update_group, logprob_group = step_lib.prompt_groups(g, plan.rows_per_micro_batch, row_devices)
    update = pass_tokens(plan.rows_per_micro_batch, update_group, prompt_len, c)
    chunks = step_lib.logprob_row_chunks(g, row_devices, logprob_group)
    logprobs = pass_tokens(plan.rows // chunks, logprob_group, prompt_len, c) if runs_logprob_pass else 0
    per_device = lambda tokens: tokens // row_devices * expert_devices  # noqa: E731
    return {"moe_pairs_update": pairs_bytes(model_config, per_device(update)),
            "moe_pairs_logprobs": pairs_bytes(model_config, per_device(logprobs))}
