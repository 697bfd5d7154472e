"""Keys that moved when the config was regrouped by concern (issue 23): an old key on the command
line or in a config file names its new place; a run directory's config.json written before the
regrouping still loads and resumes. (The rename script of issue 23 skips this file: it spells the
old keys on purpose.)"""

import dataclasses
import json
import os

import pytest

from grpo_jax import config as config_lib
from grpo_jax.config import Config, ConfigError, apply_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A config.json as the code before the regrouping wrote it (commit 5f4e715's to_dict), with every
# moved field set away from its default: lora_r=8, lora_alpha=16, lora_target_modules=["attention"],
# lora_base_dtype=bfloat16, max_staleness=1, vllm_importance_sampling_mode=token_truncate,
# old_logprobs=recompute, reward_funcs/weights, truncated_reward=as_scored, verifier_workers=2,
# reward_timeout_s=30, and model.param_dtype=float32 (always, then).
OLD_SAVED = os.path.join(ROOT, "tests", "fixtures", "config_before_issue23.json")


@pytest.mark.parametrize("old, new", sorted(config_lib.MOVED.items()))
def test_an_old_set_key_names_its_new_place(old, new):
    with pytest.raises(ConfigError) as err:
        apply_overrides(Config(), [f"{old}=1"])
    assert str(err.value) == f"--set {old}: moved to {new}"


def test_every_moved_key_lands_on_a_field_that_exists():
    for new in config_lib.MOVED.values():
        section, field = new.split(".")
        assert field in {f.name for f in dataclasses.fields(config_lib.SECTIONS[section]())}, new


def test_param_dtype_is_gone_and_says_why():
    # One legal value (float32): bf16 masters round RL-sized AdamW steps away (test_config measures it).
    with pytest.raises(ConfigError) as err:
        apply_overrides(Config(), ["model.param_dtype=bfloat16"])
    for words in ("--set model.param_dtype: removed", "always float32", "round", "model.dtype='bfloat16'"):
        assert words in str(err.value), str(err.value)


def test_an_old_key_in_a_config_file_names_its_new_place_and_line(tmp_path):
    (tmp_path / "old.py").write_text("from grpo_jax.config import Config, ModelSection\n\n\ndef get_config():\n"
                                     "    return Config(model=ModelSection(lora_r=16))\n")
    with pytest.raises(ConfigError) as err:
        config_lib.load_config_file(tmp_path / "old.py")
    assert str(err.value) == (f"{tmp_path / 'old.py'}, line 5: TypeError: ModelSection.__init__() got an unexpected "
                              "keyword argument 'lora_r' (model.lora_r: moved to lora.r)")


def test_a_saved_config_from_before_loads_in_the_new_layout():
    with open(OLD_SAVED) as f:
        saved = json.load(f)
    assert saved["model"]["lora_r"] == 8 and "lora" not in saved  # really the old layout
    cfg = config_lib.from_dict(saved)
    expected = apply_overrides(Config(), [
        "lora.r=8", "lora.alpha=16", "lora.target_modules=attention", "lora.base_dtype=bfloat16",
        "off_policy.max_staleness=1", "off_policy.vllm_importance_sampling_mode=token_truncate",
        "off_policy.old_logprobs=recompute", "rewards.reward_funcs=my_pkg.rewards:brevity",
        "rewards.reward_weights=0.5", "rewards.truncated_reward=as_scored", "rewards.workers=2",
        "rewards.timeout_s=30", "train.run_dir=runs/old"])
    assert cfg == expected
    assert config_lib.from_dict(config_lib.to_dict(cfg)) == cfg  # and it saves in the new layout


def test_a_saved_bf16_master_config_is_refused_naming_the_file():
    with open(OLD_SAVED) as f:
        saved = json.load(f)
    saved["model"]["param_dtype"] = "bfloat16"
    with pytest.raises(ConfigError, match="run/config.json: model.param_dtype='bfloat16' is no longer allowed"):
        config_lib.from_dict(saved, where="run/config.json")


def _old_layout(data: dict) -> dict:
    """`data` (to_dict's) as the code before the regrouping saved it."""
    old = {section: dict(values) for section, values in data.items() if section not in ("lora", "off_policy",
                                                                                         "rewards")}
    for old_key, new_key in config_lib.MOVED.items():
        (old_section, old_field), (new_section, new_field) = old_key.split("."), new_key.split(".")
        old.setdefault(old_section, {})[old_field] = data[new_section][new_field]
    old["model"]["param_dtype"] = "float32"
    return old


@pytest.mark.slow
def test_a_run_saved_before_the_regrouping_resumes(tmp_path):
    # A run stopped after step 1 whose config.json is in the old layout (as a run started before
    # this change left it) resumes with the same config: no "config changed" refusal, and it ends
    # at step 2 as a straight run does.
    from test_train import SevensTask, tiny_config

    from grpo_jax.io import run_dir
    from grpo_jax.training import train

    cfg = dataclasses.replace(tiny_config(tmp_path), train=dataclasses.replace(tiny_config(tmp_path).train, steps=2,
                                                                              stop_after_steps=1))
    first = train.run(cfg, task=SevensTask())
    assert first.stopped_by and first.step == 1
    path = tmp_path / run_dir.CONFIG_FILE
    path.write_text(json.dumps(_old_layout(json.loads(path.read_text()))))
    assert "lora_r" in json.loads(path.read_text())["model"]
    resumed = train.run(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, stop_after_steps=0)),
                        resume=True, task=SevensTask())
    assert resumed.step == 2 and not resumed.stopped_by


def test_a_changed_moved_field_is_still_caught_on_resume(tmp_path):
    # The comparison reads the old file in the new layout: lora.r 0 -> 4 changes what the
    # checkpoints hold, named by its new key.
    from grpo_jax.io import run_dir

    (tmp_path / run_dir.CONFIG_FILE).write_text(json.dumps(_old_layout(config_lib.to_dict(Config()))))
    lora = apply_overrides(Config(), ["lora.r=4"])
    with pytest.raises(run_dir.RunDirError, match="lora.r changed 0 -> 4"):
        run_dir.check_resumed_config(lora, str(tmp_path), allow_config_change=True)
    run_dir.check_resumed_config(Config(), str(tmp_path), allow_config_change=False)  # same run: no refusal
