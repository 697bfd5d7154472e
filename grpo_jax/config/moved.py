"""Keys that moved when the config was regrouped by concern (issue 23), and the one removed.

An old key on the command line (`--set model.lora_r=8`) or in a config file is an error that names
its new place; a saved run config (a run directory's config.json from before) is read through
`upgrade_saved`, which puts each old key where it lives now, so such runs still resume.
"""

from __future__ import annotations

from grpo_jax.config.checks import ConfigError

# "old_section.old_field" -> "new_section.new_field"
MOVED = {
    "model.lora_r": "lora.r",
    "model.lora_alpha": "lora.alpha",
    "model.lora_dropout": "lora.dropout",
    "model.lora_target_modules": "lora.target_modules",
    "model.lora_init": "lora.init",
    "model.lora_base_dtype": "lora.base_dtype",
    "train.max_staleness": "off_policy.max_staleness",
    "mesh.rollout_devices": "off_policy.rollout_devices",
    "grpo.vllm_importance_sampling_correction": "off_policy.vllm_importance_sampling_correction",
    "grpo.vllm_importance_sampling_mode": "off_policy.vllm_importance_sampling_mode",
    "grpo.vllm_importance_sampling_clip_max": "off_policy.vllm_importance_sampling_clip_max",
    "grpo.vllm_importance_sampling_clip_min": "off_policy.vllm_importance_sampling_clip_min",
    "grpo.old_logprobs": "off_policy.old_logprobs",
    "task.reward_funcs": "rewards.reward_funcs",
    "task.reward_weights": "rewards.reward_weights",
    "grpo.truncated_reward": "rewards.truncated_reward",
    "train.verifier_workers": "rewards.workers",
    "train.reward_timeout_s": "rewards.timeout_s",
}
# Removed knobs: "section.field" -> (the only value it could take, why it went).
REMOVED = {
    "model.param_dtype": ("float32", "master weights are always float32: bf16 masters do not train at RL "
                                     "learning rates (near a weight of 0.02 bf16 values are ~1.2e-4 apart, so an "
                                     "AdamW step of lr 1e-6 rounds away). Set model.dtype='bfloat16' to compute in "
                                     "bf16 (and grpo.ref_dtype='bfloat16' for a bf16 reference)"),
}


def old_key_message(key: str) -> str | None:
    """Where `key` ("section.field") went, or why it was removed; None for a key that never existed."""
    if key in MOVED:
        return f"moved to {MOVED[key]}"
    if key in REMOVED:
        return f"removed: {REMOVED[key][1]}"
    return None


def upgrade_saved(data: dict, where: str) -> dict:
    """A saved config dict (section -> {field: value}) in today's layout: moved keys put in their
    new section, a removed knob dropped when it holds its one legal value. `where` names the file
    for the error when it does not (a run that saved model.param_dtype='bfloat16' never trained)."""
    out = {section: dict(values) for section, values in data.items() if isinstance(values, dict)}
    for old, new in MOVED.items():
        old_section, old_field = old.split(".")
        if old_field in out.get(old_section, {}):
            new_section, new_field = new.split(".")
            out.setdefault(new_section, {}).setdefault(new_field, out[old_section].pop(old_field))
    for old, (value, why) in REMOVED.items():
        section, field = old.split(".")
        if field in out.get(section, {}):
            saved = out[section].pop(field)
            if saved != value:
                raise ConfigError(f"{where}: {old}={saved!r} is no longer allowed; {why}")
    return out
