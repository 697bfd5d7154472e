"""How one GRPO step's rows are cut: rows per step, per device, per minibatch and per micro-batch,
and optimizer updates per step. Computed here once, from the config and the mesh's row devices,
and read by config validation, the trainer (`run_context`), `check` and the benchmarks, so they
cannot disagree.

    rows                 = prompts_per_step * num_generations          (B, completions per step)
    rows_per_minibatch   = rows / num_minibatches                      (one optimizer update)
    rows_per_micro_batch = rows_per_minibatch / grad_accum_steps       (one forward/backward, M)
    micro_batches_per_step = num_minibatches * grad_accum_steps
    rows_per_device      = rows / (mesh.data * mesh.fsdp * mesh.expert)              (the rollout's share)
    updates_per_step     = num_iterations * num_minibatches
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    prompts_per_step: int
    num_generations: int
    num_minibatches: int
    micro_batches: int  # grpo.grad_accum_steps: micro-batches per optimizer update
    num_iterations: int
    row_devices: int = 1  # devices the rows split over: mesh.data * mesh.fsdp * mesh.expert

    @classmethod
    def of(cls, grpo, row_devices: int = 1) -> BatchPlan:
        """The plan of a `GRPOSection` (`grpo.*`; its own validation calls this, so no import of it
        here) on `row_devices` (`sharding.batch_size_multiple(mesh)`)."""
        return cls(prompts_per_step=grpo.prompts_per_step, num_generations=grpo.num_generations,
                   num_minibatches=grpo.num_minibatches, micro_batches=grpo.grad_accum_steps,
                   num_iterations=grpo.num_iterations, row_devices=row_devices)

    @property
    def rows(self) -> int:
        return self.prompts_per_step * self.num_generations

    @property
    def rows_per_minibatch(self) -> int:
        return self.rows // self.num_minibatches

    @property
    def rows_per_micro_batch(self) -> int:
        return self.rows // self.micro_batches_per_step

    @property
    def micro_batches_per_step(self) -> int:
        """Forward/backward passes per pass over the step's rows: num_minibatches x grad_accum_steps."""
        return self.num_minibatches * self.micro_batches

    @property
    def rows_per_device(self) -> int:
        return self.rows // self.row_devices

    @property
    def updates_per_step(self) -> int:
        return self.num_iterations * self.num_minibatches

    def total_updates(self, steps: int) -> int:
        """Optimizer updates in `steps` GRPO steps (the learning-rate schedule's length)."""
        return steps * self.updates_per_step
