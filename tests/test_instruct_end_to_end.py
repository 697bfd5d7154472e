"""An instruct model's path end to end, through the command line as users run it: a Qwen2-shaped
tiny random checkpoint with a real chat template and two stop ids trains on GSM8K rows given as
chat messages, evaluates on MATH-500 while training, exports a Hugging Face directory that keeps
the checkpoint's config, generation config and tokenizer, and `eval` scores the export on GSM8K
and the run's checkpoint on MATH-500 (the shipped copies of both sets).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from hf_fixtures import make_tiny_instruct_checkpoint

from grpo_jax.tasks import named_eval_set

ROOT = Path(__file__).resolve().parents[1]

CONFIG = textwrap.dedent("""
    from grpo_jax.config import (Config, EvalSection, GRPOSection, ModelSection, OptimSection, SamplingSection,
                                 TaskSection, TrainSection)

    def get_config():
        return Config(
            model=ModelSection(hf_path={ckpt!r}),  # the tokenizer defaults to the checkpoint's own
            task=TaskSection(name="jsonl", options={{"path": {data!r}, "answer_location": "gsm8k",
                                                      "eval_path": "math500"}}),
            sampling=SamplingSection(max_new_tokens=12),
            grpo=GRPOSection(prompts_per_step=2, num_generations=4, beta=0.04, aggregation="token",
                             grad_accum_steps=2, mask_truncated_completions=True),
            optim=OptimSection(learning_rate=1e-3),
            eval=EvalSection(every=0, num_questions=4, num_samples=2, ks=(1, 2)),
            train=TrainSection(steps=2, run_dir={run!r}, checkpoint_every=1, samples_every=1, export_hf=True,
                               report_to=()),
        )
""")


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "grpo_jax", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=600)


def test_a_tiny_instruct_checkpoint_trains_and_evaluates_through_the_cli(tmp_path):
    ckpt = make_tiny_instruct_checkpoint(tmp_path / "Qwen-tiny-Instruct")
    rows = [json.loads(line) for line in open(named_eval_set("gsm8k"))][:8]
    data = tmp_path / "gsm8k_chat.jsonl"  # TRL's conversational format
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": r["question"]}],
                                        "answer": r["answer"]}) + "\n" for r in rows))
    config = tmp_path / "instruct.py"
    run = tmp_path / "run"
    config.write_text(CONFIG.format(ckpt=str(ckpt), data=str(data), run=str(run)))

    trained = _cli("train", "--config", str(config))
    assert trained.returncode == 0, trained.stderr[-4000:]
    metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    assert {"eval/pass@1", "eval/greedy_accuracy"} <= set(metrics[0])  # MATH-500 as the held-out set
    # The prompts went through the checkpoint's chat template with its generation prompt.
    # The sample shows the prompt as rendered, special tokens and all.
    sample = json.loads(open(run / "samples.jsonl").readline())
    assert sample["prompt"].startswith("<|im_start|>system\n") and sample["prompt"].endswith("<|im_start|>assistant\n")
    assert any(f"<|im_start|>user\n{r['question']}" in sample["prompt"] for r in rows)
    assert {"reference", "extracted_answer", "stop"} <= set(sample)

    # The export keeps the source's config and generation config (both stop ids) and its tokenizer.
    export = run / "hf"
    source_config = json.loads((ckpt / "config.json").read_text())
    exported_config = json.loads((export / "config.json").read_text())
    for key in ("max_position_embeddings", "bos_token_id", "eos_token_id", "vocab_size", "architectures"):
        assert exported_config[key] == source_config[key], key
    assert json.loads((export / "generation_config.json").read_text()) == json.loads(
        (ckpt / "generation_config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (export / name).read_bytes() == (ckpt / name).read_bytes(), name
    assert oct((export / "model.safetensors").stat().st_mode & 0o777) != oct(0o600)

    gsm8k = _cli("eval", "--config", str(config), "--hf", str(export), "--data", "gsm8k", "--limit", "4",
                 "--num-samples", "2", "--ks", "1,2", "--out", str(tmp_path / "eval_gsm8k"))
    assert gsm8k.returncode == 0, gsm8k.stderr[-4000:]
    math500 = _cli("eval", "--checkpoint", str(run), "--data", "math500", "--limit", "4", "--num-samples", "2",
                   "--ks", "1,2", "--out", str(tmp_path / "eval_math500"))
    assert math500.returncode == 0, math500.stderr[-4000:]
    for name in ("eval_gsm8k", "eval_math500"):
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["num_questions"] == 4
        for key in ("pass@1", "pass@2", "maj@2", "greedy_accuracy"):
            assert 0.0 <= summary[key] <= 1.0, (name, key)
        assert len((tmp_path / name / "samples.jsonl").read_text().splitlines()) == 4
