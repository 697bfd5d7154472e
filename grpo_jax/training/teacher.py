"""The distillation teacher: a third frozen param tree (beside the policy and the reference), read
from a Hugging Face checkpoint, sharded like the policy, and its pass over a step's rows.

The teacher may have another shape than the student (layers, width, heads) but must speak the
same tokenizer: its vocabulary must hold every id the student's tokenizer makes, and a tokenizer
saved beside it must be the same one (`check_tokenizer`). It is never trained and never saved in
checkpoints: a resumed run reads it again from `grpo.teacher_model_name_or_path`.

Per step (`Teacher.targets`): the sampled estimate (`grpo.loss_top_k = 0`) needs the teacher's
log-prob of each completion token [B, C], the reference's pass with the teacher's weights; the
top-k estimate needs its K most likely ids and their log-probs [B, C, K] (`top_k_logprobs`).
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from grpo_jax import config as config_lib
from grpo_jax.distributed import sharding
from grpo_jax.training import step as step_lib
from grpo_jax.model.transformer import default_positions

FIELD = "grpo.teacher_model_name_or_path"
# Text the two tokenizers must split alike: digits, operators, words, spaces, punctuation.
_PROBE = "0123456789+-*/= What is 12+34? The answer is \\boxed{46}.\n"


def top_k_logprobs(graphdef, params, tokens_BxS, attention_BxS, *, num_targets: int, k: int,
                   temperature: float = 1.0, vocab: int | None = None) -> tuple[jax.Array, jax.Array]:
    """(logp_BxCxK float32, ids_BxCxK int32): the K most likely next tokens at each of the last C
    positions and their log softmax(logits / temperature), over the first `vocab` ids (the
    student's vocabulary; None: all). Forms the [B, C, V] logits at once (no chunking)."""
    s = tokens_BxS.shape[1]
    model = nnx.merge(graphdef, params)
    h_BxSxD, _ = model.hidden_states(tokens_BxS, default_positions(attention_BxS), attention_BxS, max_position=s)
    logits_BxCxV = model.logits(h_BxSxD[:, s - num_targets - 1 : s - 1]).astype(jnp.float32)
    if vocab is not None:
        logits_BxCxV = logits_BxCxV[..., :vocab]
    logp_BxCxV = jax.nn.log_softmax(logits_BxCxV / temperature, axis=-1)
    logp_BxCxK, ids_BxCxK = jax.lax.top_k(logp_BxCxV, k)
    return logp_BxCxK, ids_BxCxK.astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class Teacher:
    """The teacher's weights and its jitted pass; `targets` fills UpdateBatch's teacher fields."""

    path: str
    model_config: Any
    graphdef: Any
    params: Any  # frozen, training layout, grpo.teacher_dtype
    top_k: int  # grpo.loss_top_k
    pass_fn: Any  # (params, tokens, attention, num_targets) -> logp_BxC or (logp_BxCxK, ids_BxCxK)

    def targets(self, tokens_BxS, attention_BxS, *, num_targets: int) -> dict[str, jax.Array]:
        """UpdateBatch fields: {"teacher_logp"} or {"teacher_topk_logp", "teacher_topk_ids"}."""
        out = self.pass_fn(self.params, tokens_BxS, attention_BxS, num_targets)
        if self.top_k == 0:
            return {"teacher_logp": out}
        return {"teacher_topk_logp": out[0], "teacher_topk_ids": out[1]}


def check_tokenizer(path: pathlib.Path, teacher_vocab: int, student_vocab: int, tokenizer) -> None:
    """ConfigError (naming the field and the path) unless the teacher speaks the student's
    tokenizer: a vocabulary at least the student's (a bigger one is padding rows, as Qwen2.5-7B's
    152064 beside 0.5B's 151936; they are dropped from the top-k), and the same splits of a probe
    text when a tokenizer is saved beside the teacher."""
    where = f"{FIELD}={str(path)!r}"
    if teacher_vocab < student_vocab:
        raise config_lib.ConfigError(
            f"{where}: the teacher's vocabulary has {teacher_vocab} ids (its config.json), the student's "
            f"{student_vocab}; on-policy distillation compares the two distributions id by id, so the teacher "
            "must share the student's tokenizer and have at least its vocabulary")
    if tokenizer is None:  # `check`: the vocabulary alone
        return
    from grpo_jax.io.tokenizer import load_tokenizer

    theirs = None  # no tokenizer files beside the weights (an export of a char-tokenizer run)
    if (path / "tokenizer.json").is_file() or list(path.glob("*.model")):
        try:
            theirs = load_tokenizer(str(path))
        except (FileNotFoundError, ValueError, OSError) as e:
            raise config_lib.ConfigError(f"{where}: its tokenizer cannot be read to compare with the student's: "
                                         f"{e}") from None
    if theirs is not None and (theirs.vocab_size != tokenizer.vocab_size
                               or list(theirs.encode(_PROBE)) != list(tokenizer.encode(_PROBE))):
        raise config_lib.ConfigError(
            f"{where}: the tokenizer saved with the teacher ({theirs.vocab_size} ids) splits text differently "
            f"from the student's ({tokenizer.vocab_size} ids); on-policy distillation needs one shared tokenizer")
    ids = [tokenizer.vocab_size - 1, tokenizer.pad_id, *(getattr(tokenizer, "eos_ids", None) or (tokenizer.eos_id,))]
    if max(ids) >= teacher_vocab:
        raise config_lib.ConfigError(f"{where}: the student's tokenizer has ids up to {max(ids)} but the teacher "
                                     f"has {teacher_vocab} rows of embedding")


def load(config: config_lib.Config, tokenizer, mesh, student_vocab: int) -> Teacher | None:
    """The configured teacher (None when `grpo.teacher_model_name_or_path` is unset), sharded over
    `mesh` like the policy, in `grpo.teacher_dtype`; a missing path or another vocabulary is a
    ConfigError naming the field and the path."""
    g, m = config.grpo, config.model
    if not g.teacher_model_name_or_path:
        return None
    from grpo_jax.io import hf

    path = pathlib.Path(g.teacher_model_name_or_path)
    if not (path / "config.json").is_file():
        raise config_lib.ConfigError(f"{FIELD}={str(path)!r}: no Hugging Face checkpoint there (no config.json; "
                                     "nothing is downloaded: give a local directory)")
    try:
        model = hf.load_model(path, dtype=m.dtype, param_dtype="float32", attention_impl=m.attention_impl)
    except (FileNotFoundError, ValueError) as e:
        raise config_lib.ConfigError(f"{FIELD}={str(path)!r}: {e}") from None
    check_tokenizer(path, model.config.vocab_size, student_vocab, tokenizer)
    graphdef, params = nnx.split(model)
    if g.teacher_dtype == "bfloat16":
        params = step_lib.as_dtype(params, jnp.bfloat16)
    params = sharding.put_sharded(params, sharding.param_shardings(mesh, params))
    return Teacher(path=str(path), model_config=model.config, graphdef=graphdef, params=params,
                   top_k=g.loss_top_k,
                   pass_fn=make_pass_fn(graphdef, config.sampling.temperature, g.loss_top_k, mesh=mesh,
                                        params=params, vocab=student_vocab))


def make_pass_fn(graphdef, temperature: float, top_k: int, *, mesh, params, vocab: int):
    """The teacher's jitted pass over a step's rows (rows over the batch axes ("data", "fsdp", "expert"), weights in their
    training layout, computed in float32): `step.make_logprob_fn`'s for top_k = 0, else
    `top_k_logprobs`. Returns `f(params, tokens, attention, num_targets)`."""
    if top_k == 0:
        logprob_fn = step_lib.make_logprob_fn(graphdef, temperature, mesh=mesh, params=params)

        def sampled(p, tokens, attention, num_targets):
            return logprob_fn(p, tokens, attention, num_targets=num_targets)

        sampled.logprob_fn = logprob_fn  # for `check`, which lowers logprob_fn.jitted
        return sampled

    def topk(p, tokens, attention, num_targets):
        return top_k_logprobs(graphdef, step_lib.as_dtype(p, jnp.float32), tokens, attention,
                              num_targets=num_targets, k=top_k, temperature=temperature, vocab=vocab)

    rows = sharding.batch_sharding(mesh)
    jitted = sharding.MeshJit(jax.jit(topk, static_argnums=3, in_shardings=(sharding.param_shardings(mesh, params),
                                                                               rows, rows),
                                      out_shardings=(rows, rows)), mesh)
    return jitted


def abstract_teacher(config: config_lib.Config, mesh, student_vocab: int):
    """(graphdef, params as ShapeDtypeStructs in their layout) of the teacher, from its config.json
    alone (for `check`); None without a teacher. A missing checkpoint or a vocabulary smaller than
    the student's `student_vocab` is a ConfigError naming the field and the path."""
    g = config.grpo
    if not g.teacher_model_name_or_path:
        return None
    from grpo_jax.io import hf
    from grpo_jax import model as model_lib

    path = pathlib.Path(g.teacher_model_name_or_path)
    if not (path / "config.json").is_file():
        raise config_lib.ConfigError(f"{FIELD}={str(path)!r}: no Hugging Face checkpoint there (no config.json)")
    try:
        model_config = hf.config_from_hf(hf.read_config(path), dtype=config.model.dtype, param_dtype="float32")
    except (KeyError, TypeError, ValueError) as e:
        raise config_lib.ConfigError(f"{FIELD}={str(path)!r}: {e}") from None
    dtype = jnp.bfloat16 if g.teacher_dtype == "bfloat16" else jnp.float32
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: model_lib.init_model(model_config, 0)))
    shapes = jax.eval_shape(lambda: step_lib.as_dtype(nnx.split(model_lib.init_model(model_config, 0))[1], dtype))
    shardings = sharding.param_shardings(mesh, shapes)
    params = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, shardings)
    check_tokenizer(path, model_config.vocab_size, student_vocab, None)
    return graphdef, params
