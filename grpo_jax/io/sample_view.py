"""What a logged sample shows: the prompt as the model saw it (chat template and special tokens
visible), the completion with the token that stopped it, the reference and the extracted answer.

`decode` stops at the first stop id (a completion's end), so a chat prompt, which holds a stop id
after every turn (Qwen's `<|im_end|>`), would show only its first turn; here the ids are split at
stop ids, each piece decoded, and each stop id written out by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def token_name(tokenizer, token_id: int) -> str:
    """The text of one (special) token, e.g. "<|im_end|>"; "<stop id N>" where the tokenizer has no
    name for it (the char tokenizer's EOS)."""
    # The tokenizer wrappers keep their library object private; both have a by-id lookup.
    inner = getattr(tokenizer, "_tok", None)  # HFTokenizer: a `tokenizers.Tokenizer`
    if inner is not None and hasattr(inner, "id_to_token"):
        name = inner.id_to_token(int(token_id))
        if name:
            return name
    sp = getattr(tokenizer, "_sp", None)  # SentencePieceTokenizer
    if sp is not None and 0 <= int(token_id) < sp.get_piece_size():
        return sp.id_to_piece(int(token_id))
    return f"<stop id {int(token_id)}>"


def visible_text(tokenizer, ids: Sequence[int]) -> str:
    """`ids` (real tokens, no padding) as text with every stop id written out by name."""
    stops = set(int(i) for i in getattr(tokenizer, "eos_ids", (tokenizer.eos_id,)))
    out, piece = [], []
    for i in (int(t) for t in ids):
        if i in stops:
            out.append(tokenizer.decode(piece) if piece else "")
            out.append(token_name(tokenizer, i))
            piece = []
        else:
            piece.append(i)
    if piece:
        out.append(tokenizer.decode(piece))
    return "".join(out)


def extracted_answer(task, completion: str) -> str | None:
    """The task's reading of the model's final answer (`extract_answer`, as held-out evaluation reads
    it), None where the task has none or cannot read one."""
    extract = getattr(task, "extract_answer", None)
    if extract is None:
        return None
    try:
        return extract(completion)
    except Exception:  # noqa: BLE001 -- a display aid: a checker's failure must not stop training
        return None


def sample_record(tokenizer, task, *, prompt_ids: Sequence[int], completion_ids: Sequence[int], completion: str,
                  truncated: bool, example: dict[str, Any]) -> dict[str, Any]:
    """The labelled fields of one logged sample (rewards are added by the caller)."""
    return {
        "prompt": visible_text(tokenizer, prompt_ids),
        "completion": visible_text(tokenizer, completion_ids),
        "stop": "none (truncated at sampling.max_new_tokens)" if truncated else token_name(
            tokenizer, completion_ids[-1]) if len(completion_ids) else "none",
        "reference": example.get("answer"),
        "extracted_answer": extracted_answer(task, completion),
    }
