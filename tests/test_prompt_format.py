"""One prompt format per run: text questions asked as chat turns (`chat`, with an optional system
prompt) in training, held-out evaluation, the named eval sets and `eval --checkpoint/--data`."""

import argparse
import json
import textwrap

from grpo_jax import config as config_lib
from grpo_jax.cli import eval as eval_command
from grpo_jax.tasks import R1_SYSTEM, make_task
from grpo_jax.tasks.templates import BOXED_INSTRUCTION, GSM8K_INSTRUCTION

CHAT_ROWS = [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "answer": str(i + 1)}
             for i in range(20)]


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_text_questions_as_chat_turns_with_a_system_prompt(tmp_path):
    path = write_rows(tmp_path / "t.jsonl", [{"question": "What is 2 + 2?", "answer": "4"}] * 3)
    task = make_task("jsonl", path=path, chat=True, system_prompt="Be brief.", eval_fraction=0.0)
    assert task.train_example(0)["prompt"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"What is 2 + 2? {BOXED_INSTRUCTION}"}]
    # r1 puts its own system text first, in the same (first) message.
    r1 = make_task("jsonl", path=path, chat=True, system_prompt="Be brief.", template="r1", eval_fraction=0.0)
    assert r1.train_example(0)["prompt"][0] == {"role": "system", "content": f"{R1_SYSTEM}\n\nBe brief."}
    # Default for a text file: text, as before.
    assert make_task("jsonl", path=path, eval_fraction=0.0).train_example(0)["prompt"] == (
        f"What is 2 + 2? {BOXED_INSTRUCTION}")


def test_a_run_on_messages_asks_the_named_eval_set_as_messages(tmp_path):
    # Training rows are messages; GSM8K's rows are text. Today they are scored as plain text, a
    # prompt the policy never trained on; with chat unset (auto) they become user turns.
    path = write_rows(tmp_path / "chat.jsonl", CHAT_ROWS)
    task = make_task("jsonl", path=path, eval_path="gsm8k", answer_location="gsm8k")
    first = task.eval_examples()[0]
    assert isinstance(first["prompt"], list) and first["prompt"][-1]["role"] == "user"
    assert first["prompt"][-1]["content"] == f"{first['question']} {GSM8K_INSTRUCTION}"
    # chat=False keeps text, for a run that wants it.
    text = make_task("jsonl", path=path, eval_path="gsm8k", answer_location="gsm8k", chat=False)
    assert isinstance(text.eval_examples()[0]["prompt"], str)


def test_eval_data_uses_the_runs_prompt_format(tmp_path):
    # `eval --checkpoint RUN --data gsm8k` for a run trained on messages: the questions are user turns.
    path = write_rows(tmp_path / "chat.jsonl", CHAT_ROWS)
    config_path = tmp_path / "run.py"
    config_path.write_text(textwrap.dedent(f"""
        from grpo_jax.config import Config, TaskSection
        def get_config():
            return Config(task=TaskSection(name="jsonl", options={{"path": {path!r}}}))
    """))
    config = config_lib.load_config_file(config_path)
    args = argparse.Namespace(data="gsm8k", question_field=None, answer_field=None, answer_format=None, limit=2)
    name, _, checker, examples = eval_command.eval_examples(config, args)
    assert name == "gsm8k" and checker.chat is True
    assert [type(e["prompt"]) for e in examples] == [list, list]
    assert examples[0]["prompt"] == [{"role": "user", "content": f"{examples[0]['question']} {BOXED_INSTRUCTION}"}]
