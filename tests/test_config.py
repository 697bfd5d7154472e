"""Config errors name the key, the value and what is allowed; overrides parse by the field's type."""

import dataclasses
import os

import pytest

from grpo_jax import config as config_lib
from grpo_jax.config import Config, ConfigError, apply_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_override_parses_by_field_type():
    cfg = apply_overrides(Config(), ["grpo.beta=0.04", "grpo.eps_high=0.28", "eval.ks=[1, 4]",
                                     "grpo.dynamic_sampling=true", "task.options.digits=3"])
    assert cfg.grpo.beta == 0.04 and cfg.grpo.eps_high == 0.28
    assert cfg.eval.ks == (1, 4)
    assert cfg.grpo.dynamic_sampling is True
    assert cfg.task.options["digits"] == 3
    assert apply_overrides(cfg, ["grpo.eps_high=none"]).grpo.eps_high is None


@pytest.mark.parametrize("override, words", [
    ("grpo.bta=0.1", ["grpo.bta", "unknown field", "beta"]),
    ("gpro.beta=0.1", ["gpro", "unknown section", "grpo"]),
    ("grpo.kl=k9", ["grpo.kl", "'k9'", "k1", "k2", "k3"]),
    ("grpo.aggregation=mean", ["grpo.aggregation", "sequence", "token", "constant"]),
    ("grpo.beta=lots", ["grpo.beta", "'lots'", "float"]),
    ("grpo.beta=-1", ["grpo.beta", "-1", ">= 0"]),
    ("grpo.num_generations=1", ["grpo.num_generations=1", ">= 2"]),
    ("sampling.top_p=1.5", ["sampling.top_p=1.5", "(0, 1]"]),
    ("eval.ks=[1, 16]", ["eval.ks", "16", "eval.num_samples=8"]),
    ("grpo.num_minibatches=3", ["grpo.num_minibatches", "divide", "128"]),
    ("grpo.beta", ["section.field=value"]),
    # A setting that would silently do nothing: a reference resynced every N steps is never read
    # without a KL term. (bf16 master weights: tests/test_config_moved.py, model.param_dtype is gone.)
    ("grpo.ref_resync_every=10", ["grpo.ref_resync_every=10", "grpo.beta=0"]),
    ("rewards.truncated_reward=one", ["rewards.truncated_reward", "at_most_zero", "as_scored"]),
    # Hostile values: `nan < 0` is False, so NaN passed every range check and trained NaN params;
    # a negative advantage eps flipped every advantage's sign; an empty run_dir wrote into the cwd.
    ("optim.learning_rate=nan", ["optim.learning_rate=nan", "finite"]),
    ("grpo.beta=nan", ["grpo.beta=nan", "finite"]),
    ("grpo.eps_low=inf", ["grpo.eps_low=inf", "finite"]),
    ("grpo.advantage_eps=-1", ["grpo.advantage_eps=-1", ">= 0"]),
    ("train.run_dir=", ["train.run_dir is empty"]),
    ("rewards.timeout_s=-5", ["rewards.timeout_s", ">= 0"]),
    # sampling.engine="vllm"'s fields (TRL's names): the share of device memory, ports, sizes, modes.
    ("sampling.engine=sglang", ["sampling.engine", "'sglang'", "vllm"]),
    ("sampling.vllm_mode=remote", ["sampling.vllm_mode", "colocate", "server"]),
    ("sampling.vllm_gpu_memory_utilization=0", ["sampling.vllm_gpu_memory_utilization=0.0", "(0, 1]"]),
    ("sampling.vllm_gpu_memory_utilization=1.5", ["sampling.vllm_gpu_memory_utilization=1.5", "(0, 1]"]),
    ("sampling.vllm_gpu_memory_utilization=nan", ["sampling.vllm_gpu_memory_utilization=nan", "finite"]),
    ("sampling.vllm_tensor_parallel_size=0", ["sampling.vllm_tensor_parallel_size=0", "> 0"]),
    ("sampling.vllm_server_port=0", ["sampling.vllm_server_port=0", "TCP port (1-65535)"]),
    ("sampling.vllm_server_port=65536", ["sampling.vllm_server_port=65536", "TCP port (1-65535)"]),
    ("sampling.vllm_server_timeout=0", ["sampling.vllm_server_timeout=0.0", "> 0"]),
    ("sampling.vllm_max_model_length=-1", ["sampling.vllm_max_model_length=-1", ">= 0"]),
    ("sampling.vllm_dtype=float16", ["sampling.vllm_dtype", "'float16'", "auto", "float32", "bfloat16"]),
    ("sampling.vllm_enable_sleep_mode=maybe", ["sampling.vllm_enable_sleep_mode", "bool"]),
])
def test_bad_override_names_the_key(override, words):
    with pytest.raises(ConfigError) as err:
        apply_overrides(Config(), [override])
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_json_round_trip():
    cfg = apply_overrides(Config(), ["eval.ks=[1, 2]", "task.options.seed=3"])
    assert config_lib.from_dict(config_lib.to_dict(cfg)) == cfg


def test_shipped_configs_load_and_validate():
    for name in sorted(os.listdir(os.path.join(ROOT, "configs"))):
        if name.endswith(".py"):
            cfg = config_lib.load_config_file(os.path.join(ROOT, "configs", name))
            assert isinstance(cfg, Config), name
            with open(os.path.join(ROOT, "configs", name)) as f:
                doc = f.read().split('"""')[1]
            # big_vision habit: each config's docstring opens with the command that runs it.
            assert doc.startswith("python -m grpo_jax train --config configs/" + name), name


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.py"):
        config_lib.load_config_file(tmp_path / "nope.py")


def test_sections_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().grpo.beta = 1.0


def test_bf16_master_weights_really_do_not_move_at_rl_learning_rates():
    # The reason model.param_dtype was removed (masters are always float32), measured: one AdamW
    # step is ~lr in size; at lr 1e-6 a bf16 weight of 0.02 (spacing 2^-13 ~ 1.2e-4 there) does not change, a float32 one does.
    import jax.numpy as jnp

    w32 = jnp.float32(0.02)
    assert float(w32 - jnp.float32(1e-6)) != float(w32)
    w16 = jnp.bfloat16(0.02)
    assert float(w16 - jnp.bfloat16(1e-6)) == float(w16)


def test_overrides_apply_in_any_order_then_validate_once():
    # eval.ks=[1,2] is only valid once eval.num_samples=2 is applied; the order of the flags
    # must not matter (it did: validation ran after each flag).
    a = apply_overrides(Config(), ["eval.num_samples=2", "eval.ks=[1,2]"])
    b = apply_overrides(Config(), ["eval.ks=[1,2]", "eval.num_samples=2"])
    assert a == b and a.eval.ks == (1, 2)
    with pytest.raises(ConfigError, match="eval.ks contains 8"):
        apply_overrides(Config(), ["eval.num_samples=2"])  # the default ks (1, 8) no longer fits


def test_train_help_lists_every_field_with_its_default():
    # Before: fields were found by typing a bad key.
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "grpo_jax", "train", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120).stdout
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.default_factory().__class__):
            assert f"{section.name}.{f.name} = " in out, f.name
    assert ("grpo.aggregation = None  (one of 'sequence', 'token', 'constant', 'sequence_sum', None)" in out)


@pytest.mark.parametrize("override, words", [
    ("task.options.bogus=1", ["config error:", "task 'arithmetic'", "bogus"]),
    ("model.tokenizer=/no/such/tokenizer.json", ["config error:", "model.tokenizer=", "not found"]),
    ("mesh.data=3", ["config error:", "mesh", "1 cpu devices"]),
])
def test_task_tokenizer_and_mesh_errors_are_config_errors_with_status_2(tmp_path, override, words):
    # Before: tracebacks with exit status 1.
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "grpo_jax", "train", "--config", "configs/arith_cpu.py",
                           "--set", f"train.run_dir={tmp_path}", "--set", override], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    for w in words:
        assert w in proc.stderr, (w, proc.stderr[-1000:])


@pytest.mark.parametrize("override, words", [
    # Issue 30: accepted before. eps_low=5 clips the ratio from below at 1 - 5 = -4 (never binds), and
    # Adam with b1=2 multiplies its momentum by 2 every step (diverges); b2=1 never forgets.
    ("grpo.eps_low=5", ["grpo.eps_low=5", "[0, 1)", "1 - eps_low"]),
    ("optim.b1=2", ["optim.b1=2", "[0, 1)", "b1 0.9"]),
    ("optim.b2=1", ["optim.b2=1", "[0, 1)"]),
    ("optim.b1=-0.1", ["optim.b1=-0.1", "[0, 1)"]),
    ("model.chat_template_max_seconds=0", ["model.chat_template_max_seconds=0", "> 0"]),
])
def test_clip_epsilon_and_adam_betas_are_range_checked(override, words):
    with pytest.raises(ConfigError) as err:
        apply_overrides(Config(), [override])
    for w in words:
        assert w in str(err.value), (w, str(err.value))


@pytest.mark.parametrize("body, says", [
    # Issue 30: each printed a 16-20 line traceback through importlib.
    ("def get_config(:\n    pass\n", "bad.py, line 1: syntax error: "),
    ("from grpo_jax.config import Config\n\ndef get_config():\n    return Config(train=1 / 0)\n",
     "bad.py, line 4: ZeroDivisionError: division by zero"),
    ("from grpo_jax.config import Config, GRPOSection\n\ndef get_config():\n"
     "    return Config(grpo=GRPOSection(bogus=1))\n",
     "bad.py, line 4: TypeError: GRPOSection.__init__() got an unexpected keyword argument 'bogus' "
     "(an unknown field: `python -m grpo_jax train --help` lists every section's fields)"),
])
def test_a_config_file_that_does_not_load_is_one_line_with_exit_2(tmp_path, body, says):
    import subprocess
    import sys

    (tmp_path / "bad.py").write_text(body)
    with pytest.raises(ConfigError) as err:
        config_lib.load_config_file(tmp_path / "bad.py")
    assert str(err.value).startswith(str(tmp_path / "bad.py")) and says in str(err.value), str(err.value)
    proc = subprocess.run([sys.executable, "-m", "grpo_jax", "check", "--config", str(tmp_path / "bad.py")],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and proc.stderr == f"config error: {err.value}\n", proc.stderr


def test_train_help_heads_each_section_with_what_it_is_for():
    # `train --help` groups the fields by concern: each section's line says what it holds.
    text = config_lib.describe_fields()
    for name in config_lib.SECTIONS:
        assert f"\n  {name}: " in "\n" + text, name
    assert "  off_policy: asynchronous rollouts, the sampler's own devices, the sampler correction" in text
    assert "    lora.r = 0  (int)" in text and "    rewards.workers = 0  (int)" in text


def test_each_section_validates_itself():
    # A section checks its own fields without a Config around it; the key names the section.
    for section, words in [(config_lib.LoraSection(r=4, dropout=0.1), "lora.dropout=0.1"),
                           (config_lib.OffPolicySection(rollout_devices=2), "off_policy.max_staleness >= 1"),
                           (config_lib.RewardsSection(reward_weights=(1.0,)), "rewards.reward_funcs"),
                           (config_lib.MeshSection(data=-1, fsdp=-1), "only one axis may be -1"),
                           (config_lib.GRPOSection(num_generations=1), "grpo.num_generations=1")]:
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace("+", r"\+")):
            section.validate()


def test_rollout_devices_with_a_vllm_engine_are_refused_in_either_mode():
    # vLLM places its engine itself (colocated on the trainer's devices, or a server elsewhere):
    # off_policy.rollout_devices would split devices that no sampler of ours uses.
    split = ["off_policy.rollout_devices=2", "off_policy.max_staleness=1"]
    assert apply_overrides(Config(), split).off_policy.rollout_devices == 2  # our own sampler: allowed
    for mode in ("colocate", "server"):
        with pytest.raises(ConfigError) as err:
            apply_overrides(Config(), [*split, "sampling.engine=vllm", f"sampling.vllm_mode={mode}"])
        assert str(err.value).startswith("off_policy.rollout_devices=2 with sampling.engine=vllm")
        assert "off_policy.rollout_devices=0" in str(err.value)
    # Without the split, asynchronous rollouts on vLLM are refused too (for now), naming the field.
    with pytest.raises(ConfigError, match="off_policy.max_staleness=1 with sampling.engine=vllm"):
        apply_overrides(Config(), ["sampling.engine=vllm", "off_policy.max_staleness=1"])


def test_sections_build_their_engines_configs():
    # model -> grpo_jax.model.ModelConfig (masters always float32); lora -> LoraSpec (scale alpha / r,
    # presets expanded, merged in the compute dtype).
    import jax.numpy as jnp

    model = config_lib.ModelSection(hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16,
                                    dtype="bfloat16")
    mc = model.model_config(vocab=14)
    assert (mc.vocab_size, mc.hidden_size, mc.num_kv_heads, mc.param_dtype, mc.dtype) == (14, 32, 1, "float32",
                                                                                           "bfloat16")
    assert config_lib.LoraSection().spec("float32") is None  # r = 0: full fine-tuning
    spec = config_lib.LoraSection(r=8, alpha=16.0, target_modules=("attention",)).spec("bfloat16")
    assert (spec.rank, spec.scale, spec.targets, spec.merge_dtype) == (8, 2.0, ("q_proj", "k_proj", "v_proj", "o_proj"),
                                                                       jnp.bfloat16)


def test_resolved_old_logprobs_reads_off_policy_and_the_update_count():
    # "auto": the trainer's pi_old inside the loss when each batch gets one update; a pass of its own
    # when it gets several (num_iterations * num_minibatches); the sampler's with the correction off.
    assert Config().resolved_old_logprobs() == "in_loss"
    assert apply_overrides(Config(), ["grpo.num_minibatches=2"]).resolved_old_logprobs() == "recompute"
    off = apply_overrides(Config(), ["off_policy.vllm_importance_sampling_correction=false"])
    assert off.resolved_old_logprobs() == "sampler"


@pytest.mark.parametrize("overrides, devices, processes, words", [
    # 128 completions (16 prompts x 8), one update per batch unless said otherwise.
    (["off_policy.max_staleness=1", "off_policy.rollout_devices=4"], 4, 1,
     "off_policy.rollout_devices=4 leaves no device to train on (4 cpu devices)"),
    (["off_policy.max_staleness=1"], 8, 2, "off_policy.max_staleness=1 runs in one process; this run has 2"),
    (["off_policy.max_staleness=1", "off_policy.rollout_devices=3"], 8, 1,
     "128 completions must split evenly over off_policy.rollout_devices=3"),
    (["mesh.data=3"], 8, 1, "mesh: data*fsdp*expert*tensor = 3*1*1*1 = 3 but there are 8 devices"),
    (["mesh.fsdp=3"], 8, 1, "mesh: 8 devices do not divide by the fixed axes (mesh.fsdp=3"),
    # 128 / (4 minibatches * 8 accumulation steps) = 4 rows per micro-batch over 8 devices.
    (["grpo.num_minibatches=4", "grpo.grad_accum_steps=8"], 8, 1, "a micro-batch of 4 completions"),
    # 12 prompts split over 3 processes but not over the 8 devices' data x fsdp.
    (["grpo.prompts_per_step=12"], 8, 3, "grpo.prompts_per_step=12 must split evenly over 3 processes"),
    (["sft.steps=1", "sft.batch_size=12"], 8, 2, "sft.batch_size=12 must split evenly over mesh.data * mesh.fsdp * mesh.expert = 8"),
])
def test_mesh_time_validation_needs_only_the_config_and_the_device_count(overrides, devices, processes, words):
    # The rules that used to be raised while building the run (training/run_context.py), now asked
    # of the config with a device and process count, before any device is touched.
    cfg = apply_overrides(Config(), overrides)
    with pytest.raises(ConfigError) as err:
        config_lib.validate_for_devices(cfg, devices, processes, "cpu")
    assert words in str(err.value), str(err.value)


def test_mesh_time_validation_returns_the_trainers_mesh_shape():
    # 8 devices, 4 of them sampling: fsdp=2 leaves data=2 on the 4 trainer devices. With 2 sampling,
    # data=-1 takes the 6 left over, which a micro-batch of 128 rows does not split over.
    cfg = apply_overrides(Config(), ["off_policy.max_staleness=1", "off_policy.rollout_devices=4", "mesh.fsdp=2"])
    assert config_lib.validate_for_devices(cfg, 8) == (2, 2, 1, 1)
    with pytest.raises(ConfigError, match="must split evenly over mesh.data \\* mesh.fsdp \\* mesh.expert = 6"):
        config_lib.validate_for_devices(apply_overrides(Config(), ["off_policy.max_staleness=1",
                                                                   "off_policy.rollout_devices=2"]), 8)


def test_eval_asks_only_for_the_device_split_and_the_mesh():
    # `eval` builds the mesh but runs no training step: a batch that would not split over 3 devices
    # (128 rows) is no reason to refuse it; a mesh that does not fit is.
    cfg = Config()
    with pytest.raises(ConfigError, match="a micro-batch of 128 completions"):
        config_lib.validate_for_devices(cfg, 3)
    assert config_lib.validate_for_devices(cfg, 3, batch=False) == (3, 1, 1, 1)
    with pytest.raises(ConfigError, match="mesh: data"):
        config_lib.validate_for_devices(apply_overrides(cfg, ["mesh.data=2"]), 3, batch=False)


def test_an_expert_axis_needs_experts_that_split_over_it():
    # mesh.expert splits a mixture-of-experts model's experts; a dense model has none to split, and
    # 8 experts do not split over 3 devices. Checked once the model's shape is known (train, check).
    mesh = apply_overrides(Config(), ["mesh.expert=2"]).mesh
    mesh.check_model(num_experts=8)  # 4 experts per device
    with pytest.raises(ConfigError, match="mesh.expert=2 splits a mixture-of-experts model's experts; this model is dense"):
        mesh.check_model(num_experts=0)
    with pytest.raises(ConfigError, match="mesh.expert=3 must divide the model's num_experts=8"):
        apply_overrides(Config(), ["mesh.expert=3"]).mesh.check_model(num_experts=8)
