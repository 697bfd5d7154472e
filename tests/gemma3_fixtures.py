"""A tokenizer laid out as Gemma 3's instruct checkpoints ship theirs, built offline in a test.

    from gemma3_fixtures import write_gemma3_tokenizer
    write_gemma3_tokenizer(tmp_path / "gemma")   # tokenizer.json, tokenizer_config.json, generation_config.json
    tok = load_tokenizer(str(tmp_path / "gemma"))  # eos <eos> (1), eos_ids (1, 106), bos <bos> (2)

What the directory gets (Gemma 3's files, at toy size; ids as in the real 262k vocabulary where it
matters):
  tokenizer.json          a SentencePiece-style BPE without merges: <pad> 0, <eos> 1, <bos> 2, <unk> 3,
                          <mask> 4, <unused0..99> 5..104, <start_of_turn> 105, <end_of_turn> 106, "\\n"
                          107 (as in Gemma), "▁" and printable ASCII, then the 256 byte-fallback pieces
                          <0x00>..<0xFF>; spaces normalised to "▁" with no dummy prefix, decoded back
                          (Replace, ByteFallback, Fuse), and a post-processor that prepends <bos>
  tokenizer_config.json   bos <bos>, eos <eos>, pad <pad>, add_bos_token true, and the chat template
                          GEMMA3_TEMPLATE
  generation_config.json  bos 2, eos_token_id [1, 106] (<eos> and <end_of_turn>), pad 0, as published

The tokenizer files are written without grpo_jax, so tests of its tokenizer can trust them.
`model_that_answers_ok` is a fresh Gemma 3 (grpo_jax's) rigged to answer "OK" then <end_of_turn>.
"""

from __future__ import annotations

import json
import pathlib

# Gemma 3's instruct template, written from its published behaviour: the bos first; a system
# message is not a turn of its own but the first user turn's prefix, followed by a blank line;
# user and assistant turns must alternate; the assistant's role is called "model"; contents are
# trimmed; every turn is <start_of_turn>role\n...<end_of_turn>\n; the generation prompt opens a
# model turn. List contents (the multimodal form) give their text items and an image marker.
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)

PAD, EOS, BOS, START_OF_TURN, END_OF_TURN, NEWLINE = 0, 1, 2, 105, 106, 107


def gemma3_vocab() -> list[str]:
    """The pieces in id order (module docstring)."""
    pieces = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"] + [f"<unused{i}>" for i in range(100)]
    pieces += ["<start_of_turn>", "<end_of_turn>", "\n", "\u2581"] + [chr(c) for c in range(33, 127)]
    pieces += [f"<0x{b:02X}>" for b in range(256)]
    assert pieces[START_OF_TURN] == "<start_of_turn>" and pieces[NEWLINE] == "\n"
    return pieces


def gemma3_tokenizer():
    """The `tokenizers.Tokenizer` of the module docstring."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    pieces = gemma3_vocab()
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", BOS)])
    special = pieces[:START_OF_TURN + 2]  # <pad> .. <end_of_turn>: matched whole, never split
    tok.add_special_tokens([AddedToken(p, special=True, normalized=False) for p in special])
    return tok


def write_gemma3_tokenizer(path) -> pathlib.Path:
    """Writes the module docstring's files into directory `path` (created if missing); returns it."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    gemma3_tokenizer().save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "add_bos_token": True, "add_eos_token": False, "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "unk_token": "<unk>", "chat_template": GEMMA3_TEMPLATE,
        "clean_up_tokenization_spaces": False, "model_max_length": 1000000000000000019884624838656,
        "padding_side": "left", "spaces_between_special_tokens": False, "tokenizer_class": "GemmaTokenizer",
    }
    generation_config = {"bos_token_id": BOS, "cache_implementation": "hybrid", "do_sample": True,
                         "eos_token_id": [EOS, END_OF_TURN], "pad_token_id": PAD, "top_k": 64, "top_p": 0.95,
                         "transformers_version": "4.50.0.dev0"}
    for name, value in (("tokenizer_config.json", tokenizer_config), ("generation_config.json", generation_config)):
        (path / name).write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
    return path


def model_that_answers_ok(vocab_size: int):
    """(graphdef, params, ModelConfig) of a fresh Gemma 3 whose greedy answer to any prompt ending
    in "\n" (every generation prompt) is "OK" then <end_of_turn>.

    Its next token depends only on the last one (o_proj and down_proj are zero, so the residual is
    the token's embedding), and its tied embeddings make a chain "\n" -> "O" -> "K" -> <end_of_turn>.
    With e1, e2, e3 unit vectors: E["\n"] = e1, E["O"] = 2 e1 + e2, E["K"] = 10 e2 + e3,
    E[106] = 200 e3, every other row 0; the logits after x are proportional to E[x] . E[v]: after
    "\n" O 2 > "\n" 1; after O, K 10 > O 5 > "\n" 2; after K, <end_of_turn> 200 > K 101 > O 10. No
    final soft-cap (Gemma 3's published value), so these margins are the argmax's."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from grpo_jax import model as M
    from grpo_jax.io import hf

    config = hf.config_from_hf({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": vocab_size,
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 512,
        "sliding_window_pattern": 6, "rope_theta": 1000000, "rope_local_base_freq": 10000, "rope_scaling": None,
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-06, "final_logit_softcapping": None,
        "attn_logit_softcapping": None, "max_position_embeddings": 512, "bos_token_id": BOS,
        "eos_token_id": [EOS, END_OF_TURN], "pad_token_id": PAD, "attention_bias": False})
    graphdef, params = nnx.split(M.init_model(config, 0), nnx.Param)
    pure = nnx.to_pure_dict(params)
    for layer in pure["layers"].values():
        layer["attn"]["o_proj"] = jnp.zeros_like(layer["attn"]["o_proj"])
        layer["mlp"]["down_proj"] = jnp.zeros_like(layer["mlp"]["down_proj"])
    index = {piece: i for i, piece in enumerate(gemma3_vocab())}
    embed = np.zeros(pure["embed"].shape, np.float32)
    embed[NEWLINE, 0] = 1.0
    embed[index["O"], :2] = [2.0, 1.0]
    embed[index["K"], 1:3] = [10.0, 1.0]
    embed[END_OF_TURN, 2] = 200.0
    pure["embed"] = jnp.asarray(embed)
    nnx.replace_by_pure_dict(params, pure)
    return graphdef, params, config
