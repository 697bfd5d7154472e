"""The tokenizer interface (`Tokenizer`) and what every backend shares: left padding, reading a
completion's ids up to its stop token, and the mixin that builds batch_encode, encode_prompt and
apply_chat_template on a backend's `encode`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from grpo_jax.io import chat_template as chat


@runtime_checkable
class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int
    eos_ids: tuple[int, ...]
    pad_id: int

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]: ...

    def encode_prompt(self, text: str) -> list[int]: ...

    def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True, tokenize: bool = True,
                            chat_template: str | None = None, **kwargs) -> list[int] | str: ...

    def decode(self, ids) -> str: ...

    def batch_encode(self, texts: Sequence[str], *, max_len: int | None = None,
                     add_bos: bool = False, truncate: bool = False
                     ) -> tuple[np.ndarray, np.ndarray]: ...


def left_pad(rows: Sequence[Sequence[int]], pad_id: int, max_len: int | None = None,
             truncate: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Left-pads id lists into `ids_BxL` (int32) and `mask_BxL` (bool, True on real tokens).

    L is `max_len` when given, else the longest row. A row longer than `max_len` is an error
    unless `truncate`, which keeps its last `max_len` tokens (the end of a prompt is what the
    model continues from).
    """
    lengths = [len(r) for r in rows]
    length = max(lengths, default=0) if max_len is None else max_len
    if length < 0:
        raise ValueError(f"max_len must be >= 0, got {max_len}")
    ids_BxL = np.full((len(rows), length), pad_id, dtype=np.int32)
    mask_BxL = np.zeros((len(rows), length), dtype=bool)
    for b, row in enumerate(rows):
        if len(row) > length:
            if not truncate:
                raise ValueError(f"row {b} has {len(row)} tokens, more than max_len={length}; "
                                 "raise max_len or pass truncate=True to keep the last tokens")
            row = row[len(row) - length:]
        if len(row):
            ids_BxL[b, length - len(row):] = row
            mask_BxL[b, length - len(row):] = True
    return ids_BxL, mask_BxL


def completion_ids(ids: Iterable[int], eos_id: int | Iterable[int], pad_id: int,
                   drop: tuple[int, ...] = (), vocab_size: int | None = None) -> list[int]:
    """The ids `decode` turns into text: leading pads dropped, cut before the first stop id
    (`eos_id`: one id, or all of a tokenizer's `eos_ids`), other pads (and ids in `drop`) removed,
    and ids >= `vocab_size` removed: a model's embedding table
    is often padded past its tokenizer (Qwen2.5: 151,936 rows for 151,665 tokens), and a sampled
    padding row has no text, so it decodes to nothing rather than crashing the run.

    Leading pads go first so that a left-padded row still decodes when pad == eos (HF models
    without a pad token reuse eos).
    """
    arr = np.asarray(ids)
    if arr.ndim > 1:
        raise ValueError(f"decode takes one row of ids, got an array of shape {arr.shape}")
    flat = [int(i) for i in arr.reshape(-1)]
    stops = {int(eos_id)} if isinstance(eos_id, (int, np.integer)) else {int(i) for i in eos_id}
    start = 0
    while start < len(flat) and flat[start] == pad_id:
        start += 1
    out = []
    for i in flat[start:]:
        if i in stops:
            break
        if i != pad_id and i not in drop and (vocab_size is None or 0 <= i < vocab_size):
            out.append(i)
    return out


def unique_ids(ids: Iterable[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(int(i) for i in ids))


class TokenizerMixin:
    """batch_encode, encode_prompt and apply_chat_template on top of a class's `encode`.

    A class sets `pad_id`, `bos_id`, `add_bos_token` (its BOS rule for prompts), `chat_templates`
    (None: none found), `special_tokens` (name -> string, what templates see as `bos_token` ...),
    `template_home` (where templates were looked for, for the error) and may override
    `_encode_rendered` (how rendered template text, special tokens spelled out, becomes ids).
    """

    pad_id: int
    bos_id: int | None
    add_bos_token: bool = False
    chat_templates: chat.ChatTemplates | None = None
    chat_template_limits: chat.RenderLimits | None = None  # None: chat_template_bounds.DEFAULT_LIMITS
    special_tokens: Mapping[str, str]
    template_home: str

    def batch_encode(self, texts: Sequence[str], *, max_len: int | None = None,
                     add_bos: bool = False, truncate: bool = False
                     ) -> tuple[np.ndarray, np.ndarray]:
        """Encodes `texts` into left-padded `ids_BxL` (int32) and `mask_BxL` (bool)."""
        if isinstance(texts, str):
            raise TypeError("batch_encode takes a list of strings, got one str; wrap it in a list")
        rows = [self.encode(t, add_bos=add_bos) for t in texts]  # type: ignore[attr-defined]
        return left_pad(rows, self.pad_id, max_len, truncate)

    def encode_prompt(self, text: str) -> list[int]:
        """The ids a prompt is sampled from: the text's ids (special tokens written in it, such as
        "<s>", are their ids, as transformers reads them), with bos prepended when this tokenizer
        asks for one (`add_bos_token`) and the text does not already begin with it."""
        ids = self._encode_rendered(text)
        if self.add_bos_token and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def _encode_rendered(self, text: str) -> list[int]:
        return self.encode(text)  # type: ignore[attr-defined]

    def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True, tokenize: bool = True,
                            chat_template: str | None = None, tools: Sequence | None = None,
                            documents: Sequence | None = None, **kwargs) -> list[int] | str:
        """transformers' `apply_chat_template` for one conversation ([{"role", "content"}, ...]).

        Renders this tokenizer's own chat template (or `chat_template`: a template's name, or a
        Jinja template) with the generation prompt (the assistant header the model continues
        from) when `add_generation_prompt`; extra keywords are template variables. Returns the
        ids (tokenize=True: the text encoded with no special tokens added, so the bos is the
        template's own, never a second one) or the text (tokenize=False).
        """
        template, source = chat.choose_template(self.chat_templates, chat_template, tools=tools,
                                                home=self.template_home)
        text = chat.render_chat_template(template, conversation,
                                         add_generation_prompt=add_generation_prompt,
                                         special_tokens=self.special_tokens, tools=tools,
                                         documents=documents, source=source,
                                         limits=self.chat_template_limits, **kwargs)
        return self._encode_rendered(text) if tokenize else text
