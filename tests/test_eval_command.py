"""`python -m grpo_jax eval` on CPU: a random tiny model on a few GSM8K / MATH-500 rows, --checkpoint
from a 1-step run (params only, read-only), --hf from a fixture checkpoint, and config errors (exit 2).

A random model answers nothing, so its figures are 0; what is checked is that they are the ones the
samples file supports, in range, under the documented keys, from the policy that was asked for.
"""

import argparse
import json
import os
import shutil
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from grpo_jax import config as config_lib
from grpo_jax.cli import eval as eval_command
from grpo_jax.training import run_context, train
from grpo_jax.tasks import named_eval_set

FIXTURES = Path(__file__).parent / "fixtures"

TINY_CONFIG = textwrap.dedent("""
    from grpo_jax.config import (Config, EvalSection, GRPOSection, ModelSection, OptimSection, SamplingSection,
                                 TaskSection, TrainSection)


    def get_config():
        return Config(
            model=ModelSection(tokenizer="builtin", hidden_size=32, intermediate_size=64, num_layers=2,
                               num_heads=2, num_kv_heads=1, head_dim=16),
            task=TaskSection(name="arithmetic", options={"template": "plain"}),
            sampling=SamplingSection(max_new_tokens=8),
            grpo=GRPOSection(prompts_per_step=4, num_generations=4),
            # A random model earns no reward, so no gradient: weight decay is what moves the params.
            optim=OptimSection(learning_rate=1e-2, weight_decay=0.1),
            eval=EvalSection(every=0, num_questions=4, num_samples=4, ks=(1, 4)),
            train=TrainSection(steps=1, seed=3, run_dir={run_dir!r}, checkpoint_every=1, samples_every=0,
                               progress=False),
        )
""")

SUMMARY_KEYS = {"data", "data_path", "policy", "config", "num_questions", "num_samples", "ks", "temperature",
                "max_new_tokens", "answered", "truncated", "mean_length", "seconds"}


def config_file(tmp_path, run_dir="runs/unused"):
    path = tmp_path / "tiny.py"
    path.write_text(TINY_CONFIG.replace("{run_dir!r}", repr(str(run_dir))))
    return str(path)


def evaluate(*argv) -> int:
    parser = argparse.ArgumentParser()
    eval_command.add_arguments(parser)
    return eval_command.run(parser.parse_args(list(argv)))


def read_outputs(out_dir):
    summary = json.loads((Path(out_dir) / "summary.json").read_text())
    samples = [json.loads(line) for line in (Path(out_dir) / "samples.jsonl").read_text().splitlines()]
    return summary, samples


def check_figures(summary, samples, n, ks):
    """The summary's figures are in range and are those the samples file gives."""
    assert set(summary) == SUMMARY_KEYS | {f"pass@{k}" for k in ks} | {f"maj@{k}" for k in ks if k > 1} | {
        "greedy_accuracy"}
    for key in ("answered", "truncated", "greedy_accuracy", *(k for k in summary if k.startswith(("pass@", "maj@")))):
        assert 0.0 <= summary[key] <= 1.0, key
    assert summary["pass@1"] <= summary[f"pass@{max(ks)}"]
    assert np.isclose(summary["pass@1"], np.mean([q["correct"] / n for q in samples]))
    assert np.isclose(summary["greedy_accuracy"], np.mean([q["greedy"]["correct"] for q in samples]))
    sampled = [s for q in samples for s in q["samples"]]
    assert len(sampled) == n * len(samples)
    assert np.isclose(summary["truncated"], np.mean([s["truncated"] for s in sampled]))
    assert np.isclose(summary["mean_length"], np.mean([s["length"] for s in sampled]))
    assert all(1 <= s["length"] <= summary["max_new_tokens"] for s in sampled)


@pytest.mark.parametrize("data, question_field", [("gsm8k", "question"), ("math500", "problem")])
def test_eval_of_a_random_model_on_shipped_rows(tmp_path, capsys, data, question_field):
    try:
        path = named_eval_set(data)
    except FileNotFoundError:
        pytest.skip(f"the {data} eval set is not in this checkout yet")
    out = tmp_path / "out"
    assert evaluate("--config", config_file(tmp_path), "--data", data, "--limit", "3", "--out", str(out)) == 0
    summary, samples = read_outputs(out)
    assert summary["data"] == data and summary["data_path"] == path and summary["policy"] == {"init_seed": 0}
    assert (summary["num_questions"], summary["num_samples"], summary["ks"]) == (3, 4, [1, 4])
    check_figures(summary, samples, n=4, ks=(1, 4))
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()][:3]
    assert [q["question"] for q in samples] == [r[question_field] for r in rows]
    assert [q["index"] for q in samples] == [0, 1, 2]
    assert all(q["prompt"].endswith(" Put the answer in \\boxed{}.") for q in samples)  # plain, boxed
    if data == "gsm8k":
        assert samples[0]["reference"] == "18"
    printed = capsys.readouterr()
    assert "2/2 batches" in printed.err  # the progress bar: one sampled pass, one greedy pass
    assert "pass@1 0.0000  pass@4 0.0000  maj@4 0.0000  greedy_accuracy 0.0000" in printed.out


def test_eval_of_a_checkpoint_restores_the_trained_params_only(tmp_path, capsys):
    run_dir = tmp_path / "run"
    config = config_lib.load_config_file(config_file(tmp_path, run_dir))
    result = train.run(config)
    assert result.step == 1
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
    # No --config: the run's config.json. Defaults: its eval settings; out under the run directory.
    assert evaluate("--checkpoint", str(run_dir), "--data", "gsm8k", "--limit", "2", "--num-samples", "2") == 0
    out = run_dir / "eval" / "gsm8k-step1"
    summary, samples = read_outputs(out)
    assert summary["policy"] == {"checkpoint": str(run_dir), "step": 1} and summary["ks"] == [1, 2]
    check_figures(summary, samples, n=2, ks=(1, 2))
    assert f"{run_dir} step 1" in capsys.readouterr().out
    # Read-only: nothing in the run directory changed but the eval output.
    after = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if "eval" not in p.parts)
    assert after == before
    # The params it evaluates are exactly the trained ones (not the fresh init it built shapes from).
    tokenizer = run_context.configured_tokenizer(config)
    _, _, fresh = run_context.build_model(config, tokenizer, run_context.configured_mesh(config))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), fresh)
    step, params = eval_command.restore_params(str(run_dir), abstract)
    assert step == 1
    for got, want, init in zip(jax.tree.leaves(params), jax.tree.leaves(result.params), jax.tree.leaves(fresh)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert any(not np.array_equal(np.asarray(w), np.asarray(i))
               for w, i in zip(jax.tree.leaves(result.params), jax.tree.leaves(fresh)))
    # A step that is not there, and a model that does not match the run's, are named.
    assert evaluate("--checkpoint", str(run_dir), "--step", "7", "--data", "gsm8k", "--limit", "1") == 2
    assert "config error: --step 7: not in" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match=r"no checkpoint params could be read.*\n  step 1 "):
        evaluate("--checkpoint", str(run_dir), "--set", "model.hidden_size=64", "--data", "gsm8k", "--limit", "1")


def test_eval_of_a_hugging_face_directory(tmp_path):
    hf_dir = tmp_path / "qwen2"
    shutil.copytree(FIXTURES / "hf_qwen2", hf_dir)  # vocab 96, no tokenizer files
    symbols = "".join(chr(c) for c in range(32, 127) if chr(c) != "~")  # 94 symbols + eos + pad = 96 ids
    data = tmp_path / "sums.jsonl"
    data.write_text('{"question": "What is 1+1?", "answer": "2"}\n{"question": "What is 2+3?", "answer": "5"}\n')
    out = tmp_path / "out"
    assert evaluate("--config", config_file(tmp_path), "--hf", str(hf_dir), "--set", f"model.tokenizer=char:{symbols}",
                    "--data", str(data), "--num-samples", "2", "--out", str(out)) == 0
    summary, samples = read_outputs(out)
    assert summary["policy"] == {"hf": str(hf_dir)} and summary["data"] == "sums"
    check_figures(summary, samples, n=2, ks=(1, 2))
    assert [q["reference"] for q in samples] == ["2", "5"]


@pytest.mark.slow  # two eval runs (~18 s and ~11 s); CI runs it with the slow tests
@pytest.mark.parametrize("fixture", ["hf_qwen3_moe", "hf_gemma3"])
def test_eval_of_a_qwen3_moe_and_a_gemma3_directory(tmp_path, fixture):
    # The issue-28 families through the same command: Qwen3-MoE (experts in layers 0 and 2) and
    # Gemma 3 (sliding windows of 4, shorter than the chat prompt), both vocab 96, no tokenizer files.
    hf_dir = tmp_path / fixture
    shutil.copytree(FIXTURES / fixture, hf_dir)
    symbols = "".join(chr(c) for c in range(32, 127) if chr(c) != "~")  # 94 symbols + eos + pad = 96 ids
    data = tmp_path / "sums.jsonl"
    data.write_text('{"question": "What is 1+1?", "answer": "2"}\n{"question": "What is 2+3?", "answer": "5"}\n')
    out = tmp_path / "out"
    assert evaluate("--config", config_file(tmp_path), "--hf", str(hf_dir), "--set", f"model.tokenizer=char:{symbols}",
                    "--set", "sampling.max_new_tokens=4", "--data", str(data), "--num-samples", "2",
                    "--out", str(out)) == 0
    summary, samples = read_outputs(out)
    assert summary["policy"] == {"hf": str(hf_dir)} and summary["max_new_tokens"] == 4
    check_figures(summary, samples, n=2, ks=(1, 2))
    assert [q["reference"] for q in samples] == ["2", "5"]


def test_eval_hf_alone_on_a_gemma3_checkpoint_uses_its_template_and_stops_at_end_of_turn(tmp_path):
    # A Gemma 3 directory as published (tokenizer, chat template, generation_config eos [1, 106])
    # whose model answers "OK<end_of_turn>": every sample ends at <end_of_turn>, 3 tokens, none truncated.
    import sys as _sys

    from flax import nnx

    _sys.path.insert(0, str(Path(__file__).parent))
    from gemma3_fixtures import gemma3_vocab, model_that_answers_ok, write_gemma3_tokenizer
    from grpo_jax.io import hf

    graphdef, params, _ = model_that_answers_ok(len(gemma3_vocab()))
    hf_dir = tmp_path / "gemma"
    hf.save_model(nnx.merge(graphdef, params), hf_dir)
    write_gemma3_tokenizer(hf_dir)
    data = tmp_path / "sums.jsonl"
    data.write_text('{"question": "What is 1+1?", "answer": "2"}\n{"question": "What is 2+3?", "answer": "5"}\n')
    out = tmp_path / "out"
    assert evaluate("--hf", str(hf_dir), "--data", str(data), "--num-samples", "2", "--out", str(out),
                    "--set", "sampling.max_new_tokens=6") == 0
    summary, samples = read_outputs(out)
    check_figures(summary, samples, n=2, ks=(1, 2))
    assert summary["truncated"] == 0.0 and summary["mean_length"] == 3.0
    assert all(s["length"] == 3 for q in samples for s in q["samples"])


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "give --config FILE (or --checkpoint RUN_DIR"),
        # Issue 30: a missing directory was reported as "no config.json there".
        (["--checkpoint", "{tmp}/nowhere"], "--checkpoint {tmp}/nowhere: no such directory; give the train.run_dir"),
        (["--config", "{config}", "--checkpoint", "{tmp}/nowhere"], "--checkpoint {tmp}/nowhere: no such directory"),
        (["--checkpoint", "{tmp}"], "--checkpoint {tmp}: no config.json there"),
        (["--config", "{config}", "--step", "3"], "--step needs --checkpoint"),
        (["--config", "{config}", "--ks", "1,x"], "--ks '1,x': expected comma-separated integers"),
        (["--config", "{config}", "--num-samples", "2", "--ks", "1,4"],
         "eval.ks contains 4; each k must be in [1, eval.num_samples=2] (from --num-samples / --ks"),
        (["--config", "{config}", "--limit", "0"], "--limit 0: must be >= 1"),
        (["--config", "{config}", "--temperature", "0"], "--temperature 0.0: must be > 0"),
        (["--config", "{config}", "--data", "{tmp}/missing.jsonl"], "data file not found"),
        (["--config", "{config}", "--data", "gsm8k", "--set", "task.name=jsonl", "--set",
          "task.options.answer_location=hash"],
         "answer_location='hash'"),
        (["--config", "{config}", "--data", "gsm8k", "--set", "task.name=jsonl", "--set",
          "task.options.eval_answer_location=last"],
         "task.options: eval_answer_location='last' is not allowed; choose one of ['boxed', 'gsm8k', 'answer_tag', 'lenient']"),
        (["--config", "{config}", "--data", "gsm8k", "--set", "task.name=jsonl", "--set",
          "task.options.approx_rtol=2"],
         "task.options: approx_rtol=2: give a relative tolerance in [0, 1)"),
        (["--config", "{config}", "--data", "gsm8k", "--answer-field", "solution"],
         "--data gsm8k: {gsm8k}, line 1: missing field 'solution'"),
        (["--config", "{config}", "--checkpoint", "{tmp}"], "--checkpoint {tmp}: no checkpoints directory"),
        # Messages need a chat template; the shipped sentencepiece model has none. Found before the
        # model is built, naming the question.
        (["--config", "{config}", "--data", "{tmp}/chat.jsonl"], "chat, question 0: cannot tokenise the prompt"),
    ],
)
def test_config_errors_exit_2_with_a_message(tmp_path, capsys, argv, message):
    (tmp_path / "chat.jsonl").write_text('{"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"}\n')
    subs = {"tmp": str(tmp_path), "config": config_file(tmp_path), "gsm8k": named_eval_set("gsm8k")}
    assert evaluate(*(a.format(**subs) for a in argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: ") and message.format(**subs) in err, err


def test_eval_command_module_runs_as_a_script(tmp_path):
    # `python -m grpo_jax.cli.eval` until `python -m grpo_jax eval` is hooked up: --help works.
    import subprocess
    import sys

    root = Path(__file__).parent.parent
    done = subprocess.run([sys.executable, "-m", "grpo_jax.cli.eval", "--help"], cwd=root, capture_output=True,
                          text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
    assert done.returncode == 0 and "--checkpoint RUN_DIR" in done.stdout and "summary.json" in done.stdout


def test_eval_hf_alone_uses_the_checkpoints_template_and_never_overwrites(tmp_path, capsys):
    # No --config: the model, tokenizer, stop ids and chat template come from the directory.
    import sys as _sys

    _sys.path.insert(0, str(Path(__file__).parent))
    from hf_fixtures import make_tiny_instruct_checkpoint

    hf_dir = make_tiny_instruct_checkpoint(tmp_path / "tiny")
    data = tmp_path / "sums.jsonl"
    data.write_text('{"question": "What is 1+1?", "answer": "2"}\n{"question": "What is 2+3?", "answer": "5"}\n')
    argv = ["--hf", str(hf_dir), "--data", str(data), "--num-samples", "2", "--set", "sampling.max_new_tokens=4"]
    assert evaluate(*argv) == 0
    out = hf_dir / "eval" / "sums"  # beside the checkpoint
    summary, samples = read_outputs(out)
    assert summary["policy"] == {"hf": str(hf_dir)} and summary["config"] is None
    check_figures(summary, samples, n=2, ks=(1, 2))
    # The text questions were asked as chat turns, as the checkpoint's template expects.
    assert samples[0]["prompt"] == [{"role": "user", "content": "What is 1+1? Put the answer in \\boxed{}."}]
    # A second run refuses to replace the first one's result, before any work; --overwrite replaces it.
    capsys.readouterr()
    assert evaluate(*argv) == 2
    err = capsys.readouterr().err
    assert "holds an earlier result" in err and "pass --overwrite" in err
    assert evaluate(*argv, "--overwrite") == 0
    # --hf alone needs a data set.
    assert evaluate("--hf", str(hf_dir)) == 2
    assert "--hf DIR without --config needs --data" in capsys.readouterr().err
