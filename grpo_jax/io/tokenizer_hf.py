"""The Hugging Face tokenizer backend: a `tokenizer.json` (Qwen, Llama-3) through the `tokenizers`
package, with its checkpoint's side files for special tokens, stop ids and the chat template.
"""

from __future__ import annotations

import pathlib

from grpo_jax.io import chat_template as chat
from grpo_jax.io.tokenizer_base import TokenizerMixin, completion_ids, unique_ids
from grpo_jax.io.tokenizer_files import SideFiles, stop_ids_beside


class HFTokenizer(TokenizerMixin):
    """A Hugging Face `tokenizer.json` (Qwen, Llama-3) through the `tokenizers` package.

    bos/eos/pad tokens come from the arguments if given, else from `tokenizer_config.json` or
    `special_tokens_map.json` beside the file. No pad token (Llama-3) means pad = eos. Stop ids:
    eos first, then generation_config.json's "eos_token_id" (an int or a list).
    `encode` never adds the post-processor's special tokens; `add_bos` is the only way a bos gets
    in. Prompts (`encode_prompt`) get one as transformers would add it: tokenizer_config.json's
    "add_bos_token" when it says, else whether tokenizer.json's post-processor prepends bos
    (Llama-3's does, Qwen's adds nothing).
    """

    def __init__(self, tokenizer_json: str | pathlib.Path, *, eos_id: int | None = None,
                 pad_id: int | None = None, bos_id: int | None = None,
                 add_bos_token: bool | None = None):
        from tokenizers import Tokenizer as _HFTok

        path = pathlib.Path(tokenizer_json)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer.json not found: {path}")
        self.tokenizer_json = path
        try:
            self._tok = _HFTok.from_file(str(path))
        except Exception as e:  # noqa: BLE001 -- tokenizers raises plain Exception ("EOF while parsing")
            raise ValueError(f"{path}: not a readable tokenizer.json ({e})") from None
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        side = SideFiles(path.parent)

        def id_of(key: str) -> int | None:
            name = side.names.get(key)
            if name is None:
                return None
            tid = self._tok.token_to_id(name)
            if tid is None:
                raise ValueError(f"{key} {name!r} from {side.sources[key]} is not in the vocabulary of {path}")
            return int(tid)

        self.bos_id = bos_id if bos_id is not None else id_of("bos_token")
        stops = stop_ids_beside(path.parent, self.vocab_size)
        eos = eos_id if eos_id is not None else id_of("eos_token")
        if eos is None and stops:
            eos = stops[0]
        if eos is None:
            raise ValueError(f"no eos token for {path}: put tokenizer_config.json (eos_token) or "
                             "generation_config.json (eos_token_id) beside it or pass eos_id=")
        self.eos_id = int(eos)
        self.eos_ids = unique_ids([self.eos_id, *stops])
        pad = pad_id if pad_id is not None else id_of("pad_token")
        self.pad_id = self.eos_id if pad is None else int(pad)
        if add_bos_token is None:
            add_bos_token = side.add_bos_token()
        if add_bos_token is None:  # transformers keeps tokenizer.json's post-processor then
            probe = self._tok.encode("", add_special_tokens=True).ids
            add_bos_token = bool(probe) and probe[0] == self.bos_id
        self.add_bos_token = add_bos_token and self.bos_id is not None
        self.special_tokens = {k: v for k, v in side.names.items() if v is not None}
        self.template_home = str(path.parent)
        self.chat_templates = chat.read_chat_templates(path.parent, side.config)

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if add_bos:
            if self.bos_id is None:
                raise ValueError(f"{self.tokenizer_json} has no bos token; call encode with "
                                 "add_bos=False or pass bos_id=")
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids) -> str:
        drop = () if self.bos_id is None else (self.bos_id,)
        return self._tok.decode(completion_ids(ids, self.eos_ids, self.pad_id, drop, self.vocab_size),
                                skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.tokenizer_json)!r})"
