"""Typed configuration for a grpo_jax run: one frozen dataclass per concern, each validating itself.

Sections: `model` (the policy), `lora` (adapters), `task` (prompts), `sampling` (the engine),
`rewards` (scoring), `grpo` (the objective and its batch), `off_policy` (stale or foreign samples:
asynchronous rollouts, the sampler's devices, the sampler correction, pi_old), `optim`, `sft`,
`eval`, `train` (the run's steps, directory and logs) and `mesh` (the trainer's devices).

A config file is a Python module with `get_config() -> Config` (big_vision style; `files`). The
command line changes single fields with `--set section.field=value` (`overrides`); values are
parsed by the field's declared type, and an unknown key or a bad value is a `ConfigError` naming
the key, the value and what is allowed; a key from before the regrouping names its new place
(`moved`). `validate_for_devices` is the mesh-time half of validation (device and process counts).
"""

from grpo_jax.config.checks import ConfigError
from grpo_jax.config.data import RewardsSection, SamplingSection, TaskSection
from grpo_jax.config.files import from_dict, load_config_file, to_dict
from grpo_jax.config.grpo import GRPOSection
from grpo_jax.config.model import DEFAULT_TOKENIZER, MASTER_DTYPE, LoraSection, ModelSection
from grpo_jax.config.moved import MOVED, REMOVED, old_key_message, upgrade_saved
from grpo_jax.config.off_policy import OffPolicySection
from grpo_jax.config.overrides import apply_overrides, describe_fields
from grpo_jax.config.root import SECTIONS, Config, validate, validate_for_devices
from grpo_jax.config.run import EvalSection, MeshSection, OptimSection, SFTSection, TrainSection

__all__ = [
    "DEFAULT_TOKENIZER", "MASTER_DTYPE", "MOVED", "REMOVED", "SECTIONS", "Config", "ConfigError", "EvalSection",
    "GRPOSection", "LoraSection", "MeshSection", "ModelSection", "OffPolicySection", "OptimSection",
    "RewardsSection", "SFTSection", "SamplingSection", "TaskSection", "TrainSection", "apply_overrides",
    "describe_fields", "from_dict", "load_config_file", "old_key_message", "to_dict", "upgrade_saved", "validate",
    "validate_for_devices",
]
