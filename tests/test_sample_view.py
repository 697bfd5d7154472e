"""Logged samples show what the model saw: the chat-rendered prompt with its special tokens, the
completion with its stop token, the reference and the model's extracted answer, each labelled."""

from grpo_jax.io import sample_view
from grpo_jax.io.metrics import MetricsWriter
from grpo_jax.training.rollout import encode_prompt
from grpo_jax.tasks import make_task
from grpo_jax.io.tokenizer import load_tokenizer
from hf_fixtures import make_tiny_instruct_checkpoint


def test_a_chat_prompt_and_completion_render_with_their_special_tokens(tmp_path, capsys):
    tok = load_tokenizer(str(make_tiny_instruct_checkpoint(tmp_path / "tiny")))
    messages = [{"role": "user", "content": "What is 2+2?"}]
    prompt_ids = encode_prompt(tok, messages)
    # decode() stops at the first stop id: the template's first <|im_end|> (after the default system
    # turn) would hide the question. The sample's prompt keeps every turn.
    assert "What is 2+2?" not in tok.decode(prompt_ids)
    shown = sample_view.visible_text(tok, prompt_ids)
    assert shown.endswith("<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert shown.startswith("<|im_start|>system\n")
    # A completion that stopped on <|im_end|> (Qwen's second stop id is <|endoftext|>).
    completion_ids = tok.encode("so \\boxed{4}") + [tok.eos_id]
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "What is 2+2?", "answer": "4"}\n')
    task = make_task("jsonl", path=str(data), eval_fraction=0.0)  # reads the answer in the box
    record = sample_view.sample_record(tok, task, prompt_ids=prompt_ids, completion_ids=completion_ids,
                                       completion="so \\boxed{4}", truncated=False, example={"answer": "4"})
    assert record["completion"] == "so \\boxed{4}<|im_end|>" and record["stop"] == "<|im_end|>"
    assert record["reference"] == "4"
    assert record["extracted_answer"] == "4"
    truncated = sample_view.sample_record(tok, task, prompt_ids=prompt_ids, completion_ids=completion_ids[:-1],
                                          completion="so \\boxed{4}", truncated=True, example={"answer": "4"})
    assert truncated["stop"] == "none (truncated at sampling.max_new_tokens)"
    # Printed with labels.
    with MetricsWriter(tmp_path / "run", total_steps=1, report_to=()) as w:
        w.write_samples(1, [{**record, "reward": 1.0}])
    out = capsys.readouterr().out
    assert "| reference answer: 4 | model's answer: 4" in out
    assert "prompt (as the model saw it): <|im_start|>system" in out
    assert "completion: so \\boxed{4}<|im_end|>\nstopped by: <|im_end|>" in out
