"""On-policy distillation in the trainer: a tiny student learns from a teacher alone, resume is
exact with the teacher out of checkpoints, and bad teachers are ConfigErrors naming the field."""

import dataclasses
import os
import sys

import jax
import numpy as np
import pytest

from grpo_jax.training import train
from grpo_jax.config import ConfigError, GRPOSection

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_train import SevensTask, tiny_config  # noqa: E402
from grpo_jax.tasks import RewardSpec  # noqa: E402


class NoRewardTask(SevensTask):
    """The sevens prompts with a reward that is always 0: every group's advantages are 0, so the
    policy loss has no gradient and whatever the student learns comes from the teacher."""

    def reward_fns(self):
        return [RewardSpec("zero", lambda prompts, completions, **_: [0.0] * len(completions), 1.0)]


def _share_of_sevens(row):
    return row["rewards/sevens/mean"]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A tiny policy trained on the sevens reward (most answer tokens 7 after 40 steps, as in
    test_train), exported as a Hugging Face checkpoint."""
    run_dir = tmp_path_factory.mktemp("teacher")
    cfg = tiny_config(run_dir)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=40, checkpoint_every=0, export_hf=True))
    result = train.run(cfg, task=SevensTask())
    assert np.mean([r["reward"] for r in result.history[-5:]]) > 0.6
    return str(run_dir / "hf")


def _student(run_dir, teacher, **grpo):
    """A student of another shape (width 48, one layer) than the teacher (width 32, two layers)."""
    cfg = tiny_config(run_dir)
    model = dataclasses.replace(cfg.model, hidden_size=48, intermediate_size=96, num_layers=1)
    g = dataclasses.replace(cfg.grpo, beta=0.0, num_minibatches=1, teacher_model_name_or_path=teacher, **grpo)
    return dataclasses.replace(cfg, model=model, grpo=g)


@pytest.mark.slow
@pytest.mark.parametrize("top_k", [0, 4])
def test_the_student_learns_the_teachers_sevens_from_the_teacher_alone(tmp_path, teacher_dir, top_k):
    # The reward is always 0, so only the distillation term trains. The teacher writes mostly 7s;
    # a fresh student writes a 7 about 1 time in 14. After 30 steps of reverse KL on its own
    # samples it writes mostly 7s too (measured: > 0.7 for both estimates), and the reverse KL falls.
    cfg = _student(tmp_path, teacher_dir, loss_top_k=top_k)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=30, checkpoint_every=0))
    result = train.run(cfg, task=_CountingSevens(NoRewardTask()))
    sevens = [_share_of_sevens(r) for r in result.history if "rewards/sevens/mean" in r]
    kl = [r["distillation/reverse_kl"] for r in result.history]
    assert np.mean(sevens[:3]) < 0.3, sevens[:3]
    assert np.mean(sevens[-5:]) > 0.5, sevens[-5:]
    assert np.mean(kl[-5:]) < 0.5 * np.mean(kl[:3]), kl


class _CountingSevens(SevensTask):
    """NoRewardTask's zero reward (weight 1) plus the sevens share logged at weight 0 (a metric only)."""

    def __init__(self, inner):
        self.inner = inner

    def reward_fns(self):
        sevens = SevensTask().reward_fns()[0]
        return self.inner.reward_fns() + [RewardSpec("sevens", sevens.fn, 0.0)]


def test_resume_is_exact_and_the_teacher_is_not_checkpointed(tmp_path, teacher_dir):
    def cfg(run_dir, **train_overrides):
        c = _student(run_dir, teacher_dir, teacher_tau=0.5)
        return dataclasses.replace(c, train=dataclasses.replace(c.train, steps=4, **train_overrides))

    straight = train.run(cfg(tmp_path / "straight"), task=SevensTask())
    first = train.run(cfg(tmp_path / "split", stop_after_steps=2), task=SevensTask())
    assert first.step == 2
    ckpt_items = {p.name for p in (tmp_path / "split" / "checkpoints").rglob("*") if p.is_dir()}
    assert not [name for name in ckpt_items if "teacher" in name], ckpt_items
    resumed = train.run(cfg(tmp_path / "split"), resume=True, task=SevensTask())
    assert resumed.step == 4

    def clean(row):
        return {k: v for k, v in row.items() if not k.startswith(("time/", "tokens_per_second", "recompiles"))}

    straight_rows = {r["step"]: clean(r) for r in straight.history}
    for row in resumed.history:
        assert "distillation/reverse_kl" in row
        assert clean(row) == straight_rows[row["step"]], row["step"]
    for x, y in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_missing_teacher_is_a_config_error_naming_the_field_and_path(tmp_path):
    missing = str(tmp_path / "no_such_teacher")
    with pytest.raises(ConfigError, match=r"grpo\.teacher_model_name_or_path=.*no_such_teacher.*no Hugging Face"):
        train.run(_student(tmp_path / "run", missing), task=SevensTask())


def test_a_teacher_with_a_smaller_vocabulary_is_a_config_error(tmp_path):
    # The student's char tokenizer has 14 ids (12 symbols + pad + EOS); a teacher of 10 cannot
    # score them.
    from grpo_jax.io import hf
    from grpo_jax import model as model_lib

    small = model_lib.ModelConfig(vocab_size=10, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                                  num_kv_heads=1, head_dim=16)
    hf.save_model(model_lib.init_model(small, 0), tmp_path / "small")
    with pytest.raises(ConfigError, match=r"grpo\.teacher_model_name_or_path=.*small.*10 ids.*student's 14"):
        train.run(_student(tmp_path / "run", str(tmp_path / "small")), task=SevensTask())


@pytest.mark.parametrize("field, value, message", [
    ("teacher_tau", -1.0, "grpo.teacher_tau=-1.0 must be >= 0"),
    ("loss_top_k", -2, "grpo.loss_top_k=-2 must be >= 0"),
    ("teacher_model_name_or_path", " ", "grpo.teacher_model_name_or_path is empty"),
])
def test_bad_distillation_settings_are_config_errors(field, value, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        dataclasses.replace(tiny_config("runs/x"), grpo=GRPOSection(**{field: value}))


def test_length_buckets_on_with_a_teacher_is_a_config_error():
    with pytest.raises(ConfigError, match="bucket_by_length='on' with grpo.teacher_model_name_or_path"):
        dataclasses.replace(tiny_config("runs/x"), grpo=GRPOSection(teacher_model_name_or_path="t",
                                                                    bucket_by_length="on"))


def test_check_counts_the_teacher_as_a_real_load_holds_it(tmp_path, teacher_dir):
    # `check` reads the teacher's shape from its config.json: its bytes per device equal what
    # teacher.load puts on the device (float32: 4 B a weight; bfloat16 half), it is resident in
    # every phase, and its pass is compiled.
    from grpo_jax.cli import check as check_command
    from grpo_jax.distributed import sharding
    from grpo_jax.training import teacher as teacher_lib
    from grpo_jax.training.run_context import configured_mesh, configured_tokenizer

    cfg = _student(tmp_path, teacher_dir)
    figures = check_command.check(cfg, prompt_tokens=8)
    loaded = teacher_lib.load(cfg, configured_tokenizer(cfg), configured_mesh(cfg), 14)
    (held,) = set(sharding.bytes_per_device(loaded.params).values())
    assert figures["per_device_bytes"]["teacher"] == held > 0
    assert "logprobs_teacher" in figures["programs"]
    bf16 = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, teacher_dtype="bfloat16", loss_top_k=3))
    figures_bf16 = check_command.check(bf16, prompt_tokens=8, compile_programs=False)
    assert figures_bf16["per_device_bytes"]["teacher"] * 2 == held
    with pytest.raises(ConfigError, match=r"grpo\.teacher_model_name_or_path=.*nowhere"):
        check_command.check(_student(tmp_path, str(tmp_path / "nowhere")), prompt_tokens=8, compile_programs=False)


def test_a_teacher_whose_saved_tokenizer_splits_differently_is_a_config_error(tmp_path):
    # A teacher directory holding a byte-level BPE tokenizer.json (323 ids) beside a student with
    # the 14-id char tokenizer: the ids mean different text, whatever the vocabulary sizes. The
    # same tokenizer.json on both sides passes.
    from grpo_jax.training import teacher as teacher_lib
    from grpo_jax.io.tokenizer import load_tokenizer
    from hf_fixtures import train_tiny_bpe

    pytest.importorskip("tokenizers")
    train_tiny_bpe().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    char = load_tokenizer("char:0123456789+=")
    with pytest.raises(ConfigError, match=r"grpo\.teacher_model_name_or_path=.*splits text differently"):
        teacher_lib.check_tokenizer(tmp_path, 400, 14, char)
    bpe = load_tokenizer(str(tmp_path / "tokenizer.json"))
    teacher_lib.check_tokenizer(tmp_path, 400, bpe.vocab_size, bpe)


def _devices_run(tmp_path, devices: int, top_k: int) -> dict:
    import json
    import subprocess
    from pathlib import Path

    tests = Path(__file__).parent
    out = tmp_path / f"d{devices}_k{top_k}.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0")
    proc = subprocess.run([sys.executable, str(tests / "distillation_devices_check.py"), str(out),
                           str(tmp_path / f"run{devices}_{top_k}"), str(top_k)], env=env, cwd=tests.parent,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow  # two trainer processes per estimate, ~80 s on 2 shared cores
@pytest.mark.parametrize("top_k", [0, 4])
def test_eight_devices_match_one_device_with_a_teacher(tmp_path, top_k):
    # Rows over 8 fake devices (mesh data=8): the teacher's pass, its [rows, C] or [rows, C, K]
    # arrays and the update split their rows; the samples are the same (per-row keys), the update's
    # figures equal one device's up to float32 summation order (tests/tolerances.py).
    from tolerances import metric_tolerance

    one, eight = _devices_run(tmp_path, 1, top_k), _devices_run(tmp_path, 8, top_k)
    assert (one["device_count"], eight["device_count"]) == (1, 8)
    for got, want in zip(eight["history"], one["history"]):
        assert got["reward"] == want["reward"]
        # The distillation term makes the loss O(1) (the KL), no longer a cancellation near 0.
        for k in ("distillation/reverse_kl", "loss", "entropy", "grad_norm"):
            assert got[k] == pytest.approx(want[k], **metric_tolerance(k)), (got["step"], k)


def test_a_bfloat16_teacher_holds_bf16_weights_and_scores_like_the_float32_one(tmp_path, teacher_dir):
    # grpo.teacher_dtype="bfloat16" stores every weight in bf16 (half the bytes) and computes in
    # float32. Rounding a weight to bf16 changes it by <= 2^-9 relative; through the tiny teacher's
    # two layers a log-prob of size <= ~5 moves by a few 1e-2 at most: 0.1 nats bounds it, while a
    # teacher that did not load (random weights) differs by whole nats.
    import jax.numpy as jnp

    from grpo_jax.training import teacher as teacher_lib
    from grpo_jax.training.run_context import configured_mesh, configured_tokenizer

    cfg = _student(tmp_path, teacher_dir)
    cfg16 = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, teacher_dtype="bfloat16"))
    mesh, tok = configured_mesh(cfg), configured_tokenizer(cfg)
    t32, t16 = teacher_lib.load(cfg, tok, mesh, 14), teacher_lib.load(cfg16, tok, mesh, 14)
    assert {str(x.dtype) for x in jax.tree.leaves(t16.params)} == {"bfloat16"}
    tokens = jax.random.randint(jax.random.PRNGKey(0), (4, 10), 0, 12)
    attention = jnp.ones_like(tokens)
    a = t32.targets(tokens, attention, num_targets=4)["teacher_logp"]
    b = t16.targets(tokens, attention, num_targets=4)["teacher_logp"]
    assert b.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=0.1)
