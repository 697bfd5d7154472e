"""A tiny chat checkpoint laid out as Hugging Face ships Qwen2.5-Instruct, built offline in a test.

    from hf_fixtures import make_tiny_instruct_checkpoint
    path = make_tiny_instruct_checkpoint(tmp_path / "tiny")   # -> tmp_path / "tiny"
    model = hf.load_model(path)                               # Qwen2ForCausalLM, random weights
    tok = load_tokenizer(str(path))                           # eos <|im_end|>, eos_ids (im_end, endoftext)
    ids = tok.apply_chat_template([{"role": "user", "content": "1+1?"}])

What the directory holds (the files Qwen2.5-0.5B-Instruct has, at toy size):
  config.json             Qwen2ForCausalLM, transformers-4 spelling: D=32, 2 layers, 4 heads, 2 kv
                          heads, tied embeddings, vocab_size = the tokenizer's ids rounded up to a
                          multiple of 16 (Qwen pads its embedding too: ids past the tokenizer decode
                          to nothing), bos_token_id = <|endoftext|>, eos_token_id = <|im_end|>
  model.safetensors       random weights (normal, std 0.02; norms 1), in `dtype` (bfloat16 as shipped)
  tokenizer.json          a byte-level BPE trained here on a few hundred characters (`tokenizers`,
                          no download), then <|endoftext|>, <|im_start|>, <|im_end|> added after the
                          merges as Qwen's are; any text encodes (256 byte symbols)
  vocab.json, merges.txt  the same BPE model, as slow tokenizers read it
  tokenizer_config.json   eos <|im_end|>, pad <|endoftext|>, bos null, add_bos_token false, and a
                          Qwen-style chat template (QWEN_STYLE_TEMPLATE)
  generation_config.json  eos_token_id [<|im_end|>, <|endoftext|>]: two stop ids

Built with our own code nowhere in the path (weights are written by name with numpy and
safetensors), so tests of `grpo_jax.io.hf` and `grpo_jax.io.tokenizer` can trust it.
"""

from __future__ import annotations

import json
import pathlib

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

# Our own templates, written in the Jinja dialect Hugging Face checkpoints use.
# Qwen2.5's layout: a default system prompt when the conversation has none, every turn as
# <|im_start|>role\ncontent<|im_end|>\n, the generation prompt <|im_start|>assistant\n.
QWEN_STYLE_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role not in ['system', 'user', 'assistant'] %}\n"
    "        {{- raise_exception('Unknown role: ' + message.role) }}\n"
    "    {%- endif %}\n"
    "    {%- if not (loop.first and message.role == 'system') %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# Llama 3's layout: the template writes the bos itself, then header ids around each role.
LLAMA3_STYLE_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] not in ('system', 'user', 'assistant') %}\n"
    "        {{- raise_exception('Roles must be system, user or assistant, got ' + message['role']) }}\n"
    "    {%- endif %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}\n"
    "    {{- message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# What the BPE learns from: the words a chat about arithmetic uses.
_CORPUS = [
    "You are a helpful assistant.", "What is 12 + 30? The answer is 42.",
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "<think> 7 * 6 = 42 </think> <answer> 42 </answer>", "system user assistant",
    "Hello! How can I help you today?", "1 2 3 4 5 6 7 8 9 0 + - * / = ( )",
]


# Qwen2's pre-tokenizer split (one digit per piece, words with one leading space): the published
# pattern, which transformers' Qwen2Tokenizer also builds its pipeline from.
QWEN_SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                      r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def train_tiny_bpe(vocab_size: int = 320):
    """A byte-level BPE `tokenizers.Tokenizer` with Qwen2's pipeline (NFC, the split above, bytes
    as symbols), trained on `_CORPUS`, with Qwen's three special tokens appended after the merges
    (ids vocab_size, +1, +2)."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)  # adds nothing, as Qwen's
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tok.add_special_tokens(list(QWEN_SPECIAL_TOKENS))
    return tok


def _qwen2_tensors(config: dict, rng: np.random.Generator, dtype) -> dict[str, np.ndarray]:
    """Random Qwen2 weights under their HF names ([out, in] Linear weights, q/k/v biases)."""
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    n, k = config["num_attention_heads"], config["num_key_value_heads"]
    h = d // n

    def normal(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(dtype)

    out = {"model.embed_tokens.weight": normal(v, d), "model.norm.weight": np.ones(d, dtype)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": np.ones(d, dtype),
            p + "post_attention_layernorm.weight": np.ones(d, dtype),
            p + "self_attn.q_proj.weight": normal(n * h, d), p + "self_attn.q_proj.bias": normal(n * h),
            p + "self_attn.k_proj.weight": normal(k * h, d), p + "self_attn.k_proj.bias": normal(k * h),
            p + "self_attn.v_proj.weight": normal(k * h, d), p + "self_attn.v_proj.bias": normal(k * h),
            p + "self_attn.o_proj.weight": normal(d, n * h),
            p + "mlp.gate_proj.weight": normal(f, d), p + "mlp.up_proj.weight": normal(f, d),
            p + "mlp.down_proj.weight": normal(d, f),
        })
    return out


def make_tiny_instruct_checkpoint(path, *, seed: int = 0, dtype: str = "bfloat16") -> pathlib.Path:
    """Writes the checkpoint described in the module docstring into directory `path` (created if
    missing; files of the same names are overwritten) and returns `path` as a Path.

    `seed` picks the random weights (the tokenizer is always the same); `dtype` is the weights'
    dtype on disk, "bfloat16" (as Qwen ships) or "float32".
    """
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = train_tiny_bpe()
    tok.save(str(path / "tokenizer.json"))
    tok.model.save(str(path))  # vocab.json, merges.txt
    endoftext, _, im_end = (tok.token_to_id(t) for t in QWEN_SPECIAL_TOKENS)
    n_ids = tok.get_vocab_size(with_added_tokens=True)
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                       "rstrip": False, "single_word": False, "special": True}
             for t in QWEN_SPECIAL_TOKENS}
    tokenizer_config = {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
        "chat_template": QWEN_STYLE_TEMPLATE, "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 256,
        "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }
    config = {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": endoftext,
        "eos_token_id": im_end, "hidden_act": "silu", "hidden_size": 32, "initializer_range": 0.02,
        "intermediate_size": 64, "max_position_embeddings": 256, "max_window_layers": 2,
        "model_type": "qwen2", "num_attention_heads": 4, "num_hidden_layers": 2,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
        "sliding_window": 256, "tie_word_embeddings": True, "torch_dtype": dtype,
        "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False,
        "vocab_size": -(-n_ids // 16) * 16,
    }
    generation_config = {
        "bos_token_id": endoftext, "do_sample": True, "eos_token_id": [im_end, endoftext],
        "pad_token_id": endoftext, "repetition_penalty": 1.1, "temperature": 0.7, "top_k": 20,
        "top_p": 0.8, "transformers_version": "4.43.1",
    }
    for name, value in (("tokenizer_config.json", tokenizer_config), ("config.json", config),
                        ("generation_config.json", generation_config)):
        (path / name).write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
    np_dtype = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[dtype]
    save_file(_qwen2_tensors(config, np.random.default_rng(seed), np_dtype),
              str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
