"""What a run is built from: float32 master weights on every path, and batch/mesh checks."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from grpo_jax.io import hf
from grpo_jax.training import run_context
from grpo_jax.distributed import sharding
from grpo_jax import model as model_lib
from grpo_jax.config import Config, ConfigError, GRPOSection, ModelSection, TaskSection
from grpo_jax.io.tokenizer import CharTokenizer


def test_a_bf16_hugging_face_checkpoint_trains_on_float32_masters(tmp_path):
    # Before: model.param_dtype was ignored when model.hf_path was set, so a bf16 checkpoint
    # trained in bf16 (updates of RL size round away) although the config asked for float32.
    small = model_lib.ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_layers=1,
                                  num_heads=2, num_kv_heads=1, head_dim=4, param_dtype="bfloat16",
                                  dtype="bfloat16")
    hf.save_model(model_lib.init_model(small, 0), tmp_path / "ckpt")
    config = Config(model=ModelSection(hf_path=str(tmp_path / "ckpt"), dtype="bfloat16"))
    model_config, _, params = run_context.build_model(config, CharTokenizer("0123456789+="),
                                                      sharding.make_mesh())
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    assert (model_config.param_dtype, model_config.dtype) == ("float32", "bfloat16")


def test_a_micro_batch_that_does_not_split_over_the_devices_names_the_fields():
    config = Config(grpo=GRPOSection(prompts_per_step=3, num_generations=3))  # 9 rows, 1 micro-batch
    run_context.check_batch_fits_mesh(config, sharding.make_mesh())  # one device: fine
    two_devices = jax.sharding.AbstractMesh((2, 1, 1), sharding.MESH_AXES)  # only its axis sizes are read
    with pytest.raises(ConfigError, match="micro-batch of 9 completions .* mesh.data \\* mesh.fsdp \\* mesh.expert = 2"):
        run_context.check_batch_fits_mesh(config, two_devices)


def test_an_over_long_data_file_prompt_is_found_at_start_up(tmp_path):
    # Before: a 40,000-word question stopped the run at the same step on every resume.
    lines = [f'{{"question": "What is {i} + 1?", "answer": "#### {i + 1}"}}' for i in range(20)]
    lines[4] = '{"question": "' + "very " * 40_000 + 'long?", "answer": "#### 5"}'
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    base = Config(model=ModelSection(tokenizer="builtin", hidden_size=16, intermediate_size=32, num_heads=2,
                                     num_kv_heads=1, head_dim=8, num_layers=1),
                  task=TaskSection(name="jsonl", options={"path": str(path), "eval_fraction": 0.0}))
    ctx, _ = run_context.build(base)
    assert ctx.task.num_train == 19
    strict = dataclasses.replace(base, task=dataclasses.replace(base.task, overlong_prompts="error"))
    # Issue 30: a 20-line traceback before; now a ConfigError (exit 2, one line) naming the file and line.
    with pytest.raises(ConfigError, match=f"^task.overlong_prompts=error: {path}:5: prompt of [0-9]+ tokens is "
                                          "longer than the limit of 16384 .*skip over-long examples "
                                          r"\(task.overlong_prompts=skip\)$"):
        run_context.build(strict)


def test_the_tokenizer_defaults_to_the_checkpoint_and_must_fit_the_model(tmp_path):
    # Before: changing only model.hf_path kept the config's old tokenizer path ("unknown tokenizer
    # spec '/models/...'", a traceback), and a tokenizer larger than the model failed only at the
    # first evaluation, inside the sampler.
    small = model_lib.ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=16, num_layers=1,
                                  num_heads=2, num_kv_heads=1, head_dim=4)
    hf.save_model(model_lib.init_model(small, 0), tmp_path / "ckpt")
    config = Config(model=ModelSection(hf_path=str(tmp_path / "ckpt")))
    assert config.model.tokenizer_spec() == str(tmp_path / "ckpt")
    with pytest.raises(ConfigError, match=r"model.hf_path \(its tokenizer\)=.*tokenizer"):
        run_context.configured_tokenizer(config)
    too_big = dataclasses.replace(config, model=dataclasses.replace(config.model, tokenizer="char:0123456789+="))
    with pytest.raises(ConfigError, match=r"ids up to 13 but the model has 8"):
        run_context.build_model(too_big, run_context.configured_tokenizer(too_big), sharding.make_mesh())
    with pytest.raises(ConfigError, match="task 'nope'"):
        run_context.configured_task(Config(task=TaskSection(name="nope")))
