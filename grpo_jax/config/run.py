"""How the run goes: the `optim`, `sft` (warm-up), `eval`, `train` (steps, run directory,
checkpoints, logging) and `mesh` sections, each validating itself. `MeshSection.shape` resolves
the mesh for a device count, so a mesh that cannot be laid out is refused before any device work."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Literal

from grpo_jax.config.checks import ConfigError, check_fields, nonnegative, positive


@dataclasses.dataclass(frozen=True)
class OptimSection:
    NAME: ClassVar[str] = "optim"
    learning_rate: float = 2e-4
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 0
    b1: float = 0.9
    b2: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0

    def validate(self) -> None:
        check_fields(self)
        positive(self, "learning_rate")
        nonnegative(self, "warmup_steps", "weight_decay", "max_grad_norm")
        for key in ("b1", "b2"):
            if not 0 <= getattr(self, key) < 1:  # Adam's moving averages: 1 or more never forgets or diverges
                raise ConfigError(f"optim.{key}={getattr(self, key)} must be in [0, 1) (Adam's decay rates; usual: "
                                  "b1 0.9, b2 0.99-0.999)")


@dataclasses.dataclass(frozen=True)
class SFTSection:
    """Supervised warm-up on (prompt, answer) pairs; `steps=0` skips it."""

    NAME: ClassVar[str] = "sft"
    steps: int = 0
    batch_size: int = 128
    learning_rate: float = 1e-3
    target_accuracy: float = 0.0  # stop once greedy validation accuracy reaches this (0: never stop early)
    eval_every: int = 10
    eval_size: int = 256

    def validate(self) -> None:
        check_fields(self)
        positive(self, "batch_size")
        nonnegative(self, "steps")
        if not 0 <= self.target_accuracy <= 1:
            raise ConfigError(f"sft.target_accuracy={self.target_accuracy} must be in [0, 1]")


@dataclasses.dataclass(frozen=True)
class EvalSection:
    NAME: ClassVar[str] = "eval"
    every: int = 100  # 0: only at the start and the end
    num_questions: int = 200  # 0: no held-out evaluation
    num_samples: int = 8  # n answers per question for pass@k / maj@k
    ks: tuple[int, ...] = (1, 8)
    temperature: float = 1.0
    greedy: bool = True  # also report greedy accuracy

    def validate(self) -> None:
        check_fields(self)
        positive(self, "num_samples")
        nonnegative(self, "every", "num_questions")
        if self.temperature <= 0:
            raise ConfigError(f"eval.temperature={self.temperature} must be > 0")
        for k in self.ks:
            if not 1 <= k <= self.num_samples:
                raise ConfigError(f"eval.ks contains {k}; each k must be in [1, eval.num_samples={self.num_samples}]")


@dataclasses.dataclass(frozen=True)
class TrainSection:
    NAME: ClassVar[str] = "train"
    steps: int = 600
    seed: int = 0
    run_dir: str = "runs/default"
    log_every: int = 1
    samples_every: int = 50
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    async_checkpoints: bool = True
    stop_after_steps: int = 0  # >0: stop cleanly (with a checkpoint) after this many steps in this process
    export_hf: bool = False  # write the final policy as HF safetensors to run_dir/hf
    # With lora.r > 0, export_hf also writes the adapters as a peft directory (run_dir/peft); false:
    # the merged weights only (what adapters on Qwen3-MoE's experts need: peft has no module for them).
    export_peft: bool = True
    # Updates whose loss or gradient norm is not finite are skipped (params unchanged) and counted;
    # this many steps in a row with a skipped update stop the run.
    max_nonfinite_steps: int = 3
    progress: bool = True
    # Scalar sinks besides metrics.jsonl (TRL's name): "tensorboard", "wandb" (WANDB_MODE=offline
    # works without a network); () for none. Each is skipped with a log line when not installed.
    report_to: tuple[str, ...] = ("tensorboard",)
    wandb_project: str = "grpo_jax"

    def validate(self) -> None:
        check_fields(self)
        positive(self, "steps", "keep_checkpoints", "log_every", "max_nonfinite_steps")
        nonnegative(self, "checkpoint_every", "samples_every", "stop_after_steps")
        for sink in self.report_to:
            if sink not in ("tensorboard", "wandb"):
                raise ConfigError(f"train.report_to contains {sink!r}; choose from ['tensorboard', 'wandb'] (or [] "
                                  "for none)")
        if not self.run_dir.strip():
            raise ConfigError("train.run_dir is empty; give the directory for checkpoints, metrics and plots")


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """The device mesh (grpo_jax.distributed.sharding): batch rows over data x fsdp x expert, weights
    over fsdp and tensor, a mixture-of-experts model's experts over expert. -1 takes the devices left
    over. The default puts every local device on `data`. The sampler's own devices, if any, are
    `off_policy.rollout_devices`."""

    NAME: ClassVar[str] = "mesh"
    AXES: ClassVar[tuple[str, ...]] = ("data", "fsdp", "expert", "tensor")  # sharding.MESH_AXES' order
    data: int = -1
    fsdp: int = 1
    # Expert parallelism: devices that split a MoE layer's experts (and the batch, like data). Must
    # divide the model's num_experts (checked against the model in `check_model`).
    expert: int = 1
    tensor: int = 1

    def validate(self) -> None:
        check_fields(self)
        for key in self.AXES:
            value = getattr(self, key)
            if value == 0 or value < -1:
                raise ConfigError(f"mesh.{key}={value} must be a positive device count or -1 (the rest)")
        free = [key for key in self.AXES if getattr(self, key) == -1]
        if len(free) > 1:
            raise ConfigError(f"mesh: only one axis may be -1, got {free} = -1")

    def shape(self, num_devices: int) -> tuple[int, int, int, int]:
        """(data, fsdp, expert, tensor) over `num_devices`, the -1 axis given the devices left over;
        a ConfigError when they do not fit."""
        sizes = {key: getattr(self, key) for key in self.AXES}
        fixed = math.prod(size for size in sizes.values() if size != -1)
        free = [name for name, size in sizes.items() if size == -1]
        if free:
            if num_devices % fixed:
                raise ConfigError(f"mesh: {num_devices} devices do not divide by the fixed axes ("
                                  + ", ".join(f"mesh.{k}={v}" for k, v in sizes.items() if v != -1)
                                  + f", product {fixed})")
            sizes[free[0]] = num_devices // fixed
        if math.prod(sizes.values()) != num_devices:
            raise ConfigError(f"mesh: {'*'.join(self.AXES)} = {'*'.join(str(sizes[k]) for k in self.AXES)} = "
                              f"{math.prod(sizes.values())} but there are {num_devices} devices; use -1 for one axis")
        return tuple(sizes[k] for k in self.AXES)

    def check_model(self, num_experts: int) -> None:
        """Refuses an expert axis the model cannot use: a dense model, or experts that do not split."""
        if self.expert in (1, -1):
            return
        if num_experts == 0:
            raise ConfigError(f"mesh.expert={self.expert} splits a mixture-of-experts model's experts; this model "
                              "is dense (num_experts 0). Put these devices on mesh.data")
        if num_experts % self.expert:
            raise ConfigError(f"mesh.expert={self.expert} must divide the model's num_experts={num_experts}")
