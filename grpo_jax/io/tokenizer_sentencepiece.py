"""The sentencepiece tokenizer backend: a `.model` file (the built-in tasks' model, Llama-2, Gemma,
Mistral), with a HF checkpoint's side files beside it when there are some.
"""

from __future__ import annotations

import pathlib
import re
from functools import cached_property

from grpo_jax.io import chat_template as chat
from grpo_jax.io.tokenizer_base import TokenizerMixin, completion_ids, unique_ids
from grpo_jax.io.tokenizer_files import SideFiles, stop_ids_beside


class SentencePieceTokenizer(TokenizerMixin):
    """A sentencepiece `.model` file. Ids come from the model; `eos_id`/`pad_id` override them.

    Models without a pad piece (Llama-2, Mistral) pad with unk, which a trained model almost never
    emits, so pad differs from eos and `decode` can tell a finished row from padding; with neither,
    pad falls back to eos. A tokenizer_config.json beside the file (a HF checkpoint) gives the
    prompt BOS rule (add_bos_token; without one, prompts get no bos) and the chat template;
    generation_config.json gives more stop ids.
    """

    def __init__(self, model_file: str | pathlib.Path, *, eos_id: int | None = None,
                 pad_id: int | None = None, add_bos_token: bool | None = None):
        import sentencepiece as spm

        path = pathlib.Path(model_file)
        if not path.is_file():
            raise FileNotFoundError(f"sentencepiece model file not found: {path}")
        self.model_file = path
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as e:  # "could not parse ModelProto"
            raise ValueError(f"{path}: not a readable sentencepiece model ({e})") from None
        self.vocab_size = int(self._sp.vocab_size())
        bos = self._sp.bos_id()
        self.bos_id = bos if bos >= 0 else None
        eos = self._sp.eos_id() if eos_id is None else eos_id
        if eos < 0:
            raise ValueError(f"{path} defines no eos piece; pass eos_id=")
        self.eos_id = int(eos)
        if pad_id is None:
            pad_id = next((i for i in (self._sp.pad_id(), self._sp.unk_id()) if i >= 0), self.eos_id)
        self.pad_id = int(pad_id)
        for name, value in (("eos_id", self.eos_id), ("pad_id", self.pad_id)):
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"{name}={value} is outside {path}'s vocabulary 0..{self.vocab_size - 1}")
        side = SideFiles(path.parent) if (path.parent / "tokenizer_config.json").is_file() else None
        self.eos_ids = unique_ids([self.eos_id, *stop_ids_beside(path.parent, self.vocab_size)]
                               if side is not None else [self.eos_id])
        if add_bos_token is None:
            add_bos_token = bool(side and side.add_bos_token())
        self.add_bos_token = add_bos_token and self.bos_id is not None
        pieces = {"bos_token": self.bos_id, "eos_token": self.eos_id, "unk_token": self._sp.unk_id(),
                  "pad_token": self._sp.pad_id()}
        self.special_tokens = {k: self._sp.id_to_piece(i) for k, i in pieces.items()
                               if i is not None and i >= 0}
        if side is not None:
            self.special_tokens.update({k: v for k, v in side.names.items() if v is not None})
        self.template_home = str(path.parent)
        self.chat_templates = chat.read_chat_templates(path.parent, side.config if side else None)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = list(self._sp.encode(text, out_type=int))
        if add_bos:
            if self.bos_id is None:
                raise ValueError(f"{self.model_file} defines no bos piece; call encode with add_bos=False")
            ids.insert(0, self.bos_id)
        return ids

    @cached_property
    def _control_pieces(self) -> tuple[dict[str, int], re.Pattern | None]:
        """Control and unknown pieces (<s>, </s>, <unk>, ...) by text, and a pattern finding them:
        sentencepiece never matches them in text, a template spells them out."""
        found = {self._sp.id_to_piece(i): i for i in range(self.vocab_size)
                 if self._sp.is_control(i) or self._sp.is_unknown(i)}
        found = {piece: i for piece, i in found.items() if piece}
        if not found:
            return found, None
        return found, re.compile("|".join(re.escape(p) for p in sorted(found, key=len, reverse=True)))

    def _encode_rendered(self, text: str) -> list[int]:
        """Template text with special tokens spelled out ("<s>[INST] ..."): each special token is
        its id, and each run of text between them is encoded on its own."""
        by_text, pattern = self._control_pieces
        if pattern is None:
            return self.encode(text)
        ids: list[int] = []
        start = 0
        for m in pattern.finditer(text):
            if m.start() > start:
                ids += self.encode(text[start:m.start()])
            ids.append(by_text[m.group()])
            start = m.end()
        if start < len(text):
            ids += self.encode(text[start:])
        return ids

    def decode(self, ids) -> str:
        drop = () if self.bos_id is None else (self.bos_id,)
        return self._sp.decode(completion_ids(ids, self.eos_ids, self.pad_id, drop, self.vocab_size))

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({str(self.model_file)!r})"
