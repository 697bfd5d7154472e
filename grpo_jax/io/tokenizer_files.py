"""What a checkpoint directory says about its tokenizer besides the vocabulary: JSON files read with
errors that name the file, the stop ids of generation_config.json, and the special tokens and BOS
rule of tokenizer_config.json / special_tokens_map.json.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any


def read_json_object(path: str | pathlib.Path) -> dict[str, Any]:
    """The JSON object in file `path` (config.json, tokenizer_config.json, ...).

    Every failure names the file, and the line and column where there is one, in its message:
    a bare `JSONDecodeError: Expecting value: line 1 column 1` says neither which file of a
    checkpoint directory is broken nor that it is empty.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"JSON file not found: {path}")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ValueError(f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at line {line}, "
                         f"column {column})") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        what = "empty file, " if not text.strip() else ""
        raise ValueError(f"{path}: not valid JSON ({what}{e.msg} at line {e.lineno}, column {e.colno})"
                         ) from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def stop_ids_beside(directory: str | pathlib.Path, vocab_size: int) -> list[int]:
    """The stop ids a checkpoint's generation settings list: generation_config.json's
    "eos_token_id" (an int or a list: Qwen2.5-Instruct [151645, 151643], Llama-3.1-Instruct
    [128001, 128008, 128009]); without that file, config.json's (transformers falls back to it too).
    [] when neither says; an id outside 0..vocab_size-1 is an error naming the file."""
    directory = pathlib.Path(directory)
    for name in ("generation_config.json", "config.json"):
        file = directory / name
        if not file.is_file():
            continue
        try:
            value = read_json_object(file).get("eos_token_id")
        except ValueError:
            if name == "generation_config.json":
                raise
            return []  # the model's file: hf.load_model reports it; a tokenizer need not fail on it
        ids = value if isinstance(value, list) else [] if value is None else [value]
        for tid in ids:
            if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < vocab_size:
                raise ValueError(f"{file}: eos_token_id {value!r} must be an id or a list of ids in "
                                 f"0..{vocab_size - 1} (the tokenizer's vocabulary)")
        return ids
    return []


_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                       "mask_token")


def _token_content(value) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class SideFiles:
    """What a checkpoint directory says about its tokenizer besides the vocabulary:
    tokenizer_config.json and special_tokens_map.json (the config wins)."""

    def __init__(self, directory: pathlib.Path):
        self.config: dict[str, Any] | None = None
        self.names: dict[str, str | None] = {}      # "eos_token" -> "<|im_end|>" (None: null)
        self.sources: dict[str, pathlib.Path] = {}  # "eos_token" -> the file that said so
        for side in ("special_tokens_map.json", "tokenizer_config.json"):
            side_path = directory / side
            if side_path.is_file():
                cfg = read_json_object(side_path)
                if side == "tokenizer_config.json":
                    self.config = cfg
                for key in _SPECIAL_TOKEN_KEYS:
                    if key in cfg:
                        self.names[key] = _token_content(cfg[key])
                        self.sources[key] = side_path

    def add_bos_token(self) -> bool | None:
        """tokenizer_config.json's "add_bos_token", None when it does not say."""
        value = (self.config or {}).get("add_bos_token")
        return value if isinstance(value, bool) else None
