"""What a step samples and how it is scored: the `task` (prompts), `sampling` (the engine and its
decoding settings) and `rewards` (your reward functions, the truncation rule, worker processes and
time limits) sections, each validating itself."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from grpo_jax.config.checks import ConfigError, check_fields, nonnegative, positive


@dataclasses.dataclass(frozen=True)
class TaskSection:
    """The data: a built-in generator or a JSONL file (`grpo_jax.tasks.make_task(name, **options)`)."""

    NAME: ClassVar[str] = "task"
    name: str = "arithmetic"
    options: dict = dataclasses.field(default_factory=dict)
    # A data file's example whose prompt is longer than the sampler's largest prompt bucket: "skip"
    # (checked once at start-up, counted in a warning) or "error" (naming file and line).
    overlong_prompts: Literal["skip", "error"] = "skip"
    # Episodes (grpo_jax.episodes): the environment each row is played against, by import path
    # "pkg.module:Name" (a class or zero-argument factory making one environment per episode; an
    # object with public tool methods and no `step` is wrapped as TRL's environment_factory); "" for
    # single answers. max_turns: model turns per episode; max_tokens_per_turn: one turn's token budget
    # (0: the total, sampling.max_new_tokens, which counts model and environment tokens together).
    environment: str = ""
    # Or TRL's tools=: plain functions by import path, each episode a tool environment over them
    # (grpo_jax.episodes.tools). tool_call_parser: how a turn's tool calls are written, "hermes"
    # (Qwen2.5 / Qwen3 <tool_call> JSON) or "llama3" (Llama 3.1 JSON); "auto" reads the chat template.
    tools: tuple[str, ...] = ()
    tool_call_parser: Literal["auto", "hermes", "llama3"] = "auto"
    max_turns: int = 4
    max_tokens_per_turn: int = 0
    # Host threads the environments answer a turn on (each its own episode): environments that wait
    # (a sandbox, a service) wait side by side. 1: one after another.
    environment_workers: int = 8
    # A Reply's reward: "episode" (summed into the episode's reward function "environment") or
    # "process" (its turn's step reward: per-token advantages by the seed's process supervision,
    # core.advantages.process_advantages; the task's reward functions score the last turn's step).
    turn_rewards: Literal["episode", "process"] = "episode"

    def validate(self) -> None:
        check_fields(self)
        positive(self, "max_turns", "environment_workers")
        if self.environment and self.tools:
            raise ConfigError(f"task.environment={self.environment!r} and task.tools={list(self.tools)}: give one "
                              "(an environment class with tool methods covers both)")
        nonnegative(self, "max_tokens_per_turn")


@dataclasses.dataclass(frozen=True)
class RewardsSection:
    """How completions are scored (grpo_jax.rewards): whose functions, what a truncated answer may
    keep, and where and how long the functions run."""

    NAME: ClassVar[str] = "rewards"
    # Your own reward functions, in place of the task's: import paths "package.module:function"
    # (TRL's reward_funcs), each called as TRL calls it; reward_weights: one per function (TRL's
    # name; empty: 1.0 each). See grpo_jax.tasks.user_rewards.
    reward_funcs: tuple[str, ...] = ()
    reward_weights: tuple[float, ...] = ()
    # A truncated completion never reached its final answer (seed, defence 3): "at_most_zero" caps
    # its reward at 0 (penalties still apply); "as_scored" keeps what the reward functions said.
    truncated_reward: Literal["at_most_zero", "as_scored"] = "at_most_zero"
    workers: int = 0  # 0: score in-process (fast built-in checkers); >0: a pool of worker processes
    # Per batch and reward function: a function that takes longer stops the run with an error
    # (in worker processes, killed, when workers > 0). 0: no limit.
    timeout_s: float = 600.0

    def validate(self) -> None:
        check_fields(self)
        nonnegative(self, "workers", "timeout_s")
        if self.reward_weights and not self.reward_funcs:
            raise ConfigError(f"rewards.reward_weights={list(self.reward_weights)} without rewards.reward_funcs: the "
                              "weights are for your own functions; set both")
        if self.reward_weights and len(self.reward_weights) != len(self.reward_funcs):
            raise ConfigError(f"rewards.reward_weights has {len(self.reward_weights)} entries for "
                              f"{len(self.reward_funcs)} rewards.reward_funcs; give one weight per function")


@dataclasses.dataclass(frozen=True)
class SamplingSection:
    NAME: ClassVar[str] = "sampling"
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    ignore_eos: bool = False  # benchmarks: every completion runs to max_new_tokens
    # Host threads that each decode an equal share of the prompts (same samples for any count).
    # 0: auto, 2 on a one-device CPU backend with >= 2 cores (a decode loop keeps one core busy), else 1.
    threads: int = 0
    # "static": all rows decode until the longest stops. "continuous" (grpo_jax.sampling.continuous): a
    # stopped row's decode slot takes the next waiting row. "auto": continuous when completions can run
    # long (max_new_tokens > 128, EOS not ignored), where length tails make a static batch mostly padding.
    # "vllm": an existing vLLM engine (grpo_jax.sampling.vllm_engine; the vllm_* fields below).
    engine: Literal["auto", "static", "continuous", "vllm"] = "auto"
    # Continuous engine: decode slots over all devices, per sampler thread (0: auto, see
    # grpo_jax.sampling.sampler.slots_per_device), and how often (in tokens) stopped rows' slots are refilled.
    decode_slots: int = 0
    refill_every: int = 8
    # engine="vllm", with TRL's names. "colocate": an in-process vllm.LLM on the trainer's machine;
    # "server": a separate engine process (`python -m grpo_jax vllm-serve`) reached over HTTP.
    vllm_mode: Literal["colocate", "server"] = "colocate"
    # Colocate: the share of accelerator memory (of host memory on a CPU) vLLM takes for its weights
    # and KV cache; `check` counts it out of what the update may use.
    vllm_gpu_memory_utilization: float = 0.3
    vllm_tensor_parallel_size: int = 1
    vllm_enable_sleep_mode: bool = False  # colocate: free the engine's memory during the update
    vllm_max_model_length: int = 0  # 0: the checkpoint's max_position_embeddings (vLLM's default)
    # The engine's weight dtype: "auto" takes model.dtype (the dtype the trainer computes in).
    vllm_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    vllm_server_host: str = "127.0.0.1"
    vllm_server_port: int = 8000
    vllm_server_timeout: float = 240.0  # seconds to wait for the server at start-up

    def resolved_engine(self) -> str:
        """The engine `engine` names, "auto" resolved."""
        if self.engine != "auto":
            return self.engine
        return "continuous" if self.max_new_tokens > 128 and not self.ignore_eos else "static"

    def validate(self) -> None:
        check_fields(self)
        positive(self, "max_new_tokens", "refill_every")
        nonnegative(self, "top_k", "threads", "decode_slots", "vllm_max_model_length")
        positive(self, "vllm_tensor_parallel_size", "vllm_server_timeout")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ConfigError(f"sampling.vllm_gpu_memory_utilization={self.vllm_gpu_memory_utilization} must be in (0, 1]")
        if not 0 < self.vllm_server_port < 65536:
            raise ConfigError(f"sampling.vllm_server_port={self.vllm_server_port} must be a TCP port (1-65535)")
        if self.temperature <= 0:
            raise ConfigError(f"sampling.temperature={self.temperature} must be > 0 (use eval.greedy for argmax)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"sampling.top_p={self.top_p} must be in (0, 1]")
