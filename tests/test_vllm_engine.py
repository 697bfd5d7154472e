"""`VllmEngine` (grpo_jax/sampling/vllm_engine.py) on a fake backend: no vLLM needed, so this runs
in the default suite. The backend records every call and answers from a script; the tests check
what the engine asks of it (requests, seeds, sampling parameters, weights, adapters, sleep/wake)
and how it packs the answers into `SampleOutput`'s arrays.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from grpo_jax.io import hf, peft
from grpo_jax.model import ModelConfig, Transformer
from grpo_jax.model import lora
from grpo_jax.sampling.engine import SampleOutput, SamplingConfig
from grpo_jax.sampling.vllm_engine import (AdapterWeights, Completion, EngineError, VllmEngine, row_seeds,
                                           sampling_params)

CONFIG = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                     num_kv_heads=1, head_dim=16)
PAD, EOS = 0, (1, 2)
BUCKETS = (4, 8, 16)


class FakeBackend:
    """A `vllm_engine.Backend` that logs each call and answers `generate` from `script` (one
    Completion per request, in order), or with one stop token per request when there is none."""

    def __init__(self, script: list[Completion] | None = None):
        self.script = script
        self.calls: list[tuple] = []

    def generate(self, requests, params):
        self.calls.append(("generate", list(requests), dict(params)))
        return list(self.script) if self.script is not None else [Completion([EOS[0]], [-1.0], False)
                                                                  for _ in requests]

    def load_weights(self, named_arrays):
        self.calls.append(("load_weights", list(named_arrays)))

    def load_adapter(self, adapter_dir, version):
        # The engine deletes old adapter directories: read the files now.
        files = {p.name: p.read_bytes() for p in pathlib.Path(adapter_dir).iterdir()}
        self.calls.append(("load_adapter", version, files))

    def sleep(self):
        self.calls.append(("sleep",))

    def wake_up(self):
        self.calls.append(("wake_up",))

    def close(self):
        self.calls.append(("close",))

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


def _params(seed: int = 0):
    return nnx.split(Transformer(CONFIG, rngs=nnx.Rngs(seed)), nnx.Param)[1]


def _engine(backend, **kwargs) -> VllmEngine:
    return VllmEngine(backend, CONFIG, eos_ids=EOS, pad_id=PAD, prompt_buckets=BUCKETS, **kwargs)


SAMPLING = SamplingConfig(max_new_tokens=4, temperature=1.0)


# -- packing --------------------------------------------------------------------------------------

def test_completions_are_packed_as_the_builtin_sampler_lays_them_out():
    # 2 prompts (3 and 5 tokens) x G=2, max_new_tokens C=4. The longest prompt's bucket is 8 (of
    # 4, 8, 16), so every prompt is left-padded with pad_id to 8. Completions: row 0 stops on stop
    # id 1 after 2 tokens (the stop id is a real token: mask 1), row 1 runs to C (the backend says
    # truncated), row 2 stops at once on stop id 2, row 3 stops on the last position. Log-probs are
    # powers of two, exact in float32, and 0 on padding.
    script = [Completion([5, 6, 1], [-0.5, -0.25, -0.125], False),
              Completion([7, 8, 9, 10], [-1.0, -2.0, -4.0, -8.0], True),
              Completion([2], [-0.0625], False),
              Completion([11, 12, 13, 2], [-1.0, -0.5, -0.25, -0.75], False)]
    out = _engine(FakeBackend(script))(_params(), [[3, 4, 5], [6, 7, 8, 9, 10]], num_samples=2, sampling=SAMPLING,
                                       rng=jax.random.PRNGKey(0))
    assert isinstance(out, SampleOutput)
    np.testing.assert_array_equal(out.prompt_tokens_BxP,
                                  [[0, 0, 0, 0, 0, 3, 4, 5]] * 2 + [[0, 0, 0, 6, 7, 8, 9, 10]] * 2)
    np.testing.assert_array_equal(out.prompt_mask_BxP, [[0, 0, 0, 0, 0, 1, 1, 1]] * 2 + [[0, 0, 0, 1, 1, 1, 1, 1]] * 2)
    np.testing.assert_array_equal(out.tokens_BxC, [[5, 6, 1, 0], [7, 8, 9, 10], [2, 0, 0, 0], [11, 12, 13, 2]])
    np.testing.assert_array_equal(out.mask_BxC, [[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(out.truncated_B, [False, True, False, False])
    logprobs = [[-0.5, -0.25, -0.125, 0], [-1, -2, -4, -8], [-0.0625, 0, 0, 0], [-1, -0.5, -0.25, -0.75]]
    np.testing.assert_array_equal(out.logprobs_BxC, np.array(logprobs, np.float32))
    assert [a.dtype for a in (out.prompt_tokens_BxP, out.prompt_mask_BxP, out.tokens_BxC, out.mask_BxC,
                              out.truncated_B, out.logprobs_BxC)] == [np.int32] * 4 + [np.bool_, np.float32]


def test_requests_are_single_sample_rows_in_prompt_major_order_with_per_row_seeds():
    backend = FakeBackend()
    engine, params, prompts = _engine(backend), _params(), [[3], [4, 5], [6, 7, 8]]
    engine(params, prompts, num_samples=2, sampling=SAMPLING, rng=jax.random.PRNGKey(7))
    (_, requests, _), = [c for c in backend.calls if c[0] == "generate"]
    # Row r is prompt r // G: N * G = 6 single-sample requests.
    assert [r.prompt_ids for r in requests] == [[3], [3], [4, 5], [4, 5], [6, 7, 8], [6, 7, 8]]
    seeds = [r.seed for r in requests]
    assert seeds == row_seeds(jax.random.PRNGKey(7), 6)
    # Every row its own seed (the G samples of a prompt must differ), each a valid non-negative int32.
    assert len(set(seeds)) == 6 and all(0 <= s < 2**31 - 1 for s in seeds)
    # The same rng: the same seeds (equal calls, equal samples); another rng: other seeds.
    engine(params, prompts, num_samples=2, sampling=SAMPLING, rng=jax.random.PRNGKey(7))
    engine(params, prompts, num_samples=2, sampling=SAMPLING, rng=jax.random.PRNGKey(8))
    again, other = [[r.seed for r in c[1]] for c in backend.calls if c[0] == "generate"][1:]
    assert again == seeds and not set(other) & set(seeds)


@pytest.mark.parametrize("completion, words", [
    (Completion([5, 6, 7, 8, 9], [-1.0] * 5, True), ["5 tokens", "max_tokens=4", "row 1"]),  # more than C
    (Completion([5, 6], [-1.0], False), ["2 tokens and 1 log-probs", "row 1"]),  # one log-prob short
])
def test_a_malformed_answer_raises_engine_error_naming_the_row(completion, words):
    script = [Completion([1], [-1.0], False), completion]
    with pytest.raises(EngineError) as err:
        _engine(FakeBackend(script))(_params(), [[3]], num_samples=2, sampling=SAMPLING, rng=jax.random.PRNGKey(0))
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_sampling_params_map_the_sampling_config_exactly():
    sampled = SamplingConfig(max_new_tokens=7, temperature=0.7, top_k=5, top_p=0.9)
    assert sampling_params(sampled, (1, 2, 9)) == {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "max_tokens": 7,
                                                   "stop_token_ids": [1, 2, 9], "ignore_eos": False}
    # ignore_eos: every row runs to max_tokens (the built-in sampler's meaning), so no stop id is sent;
    # vLLM's own ignore_eos would only cover the checkpoint's EOS.
    benchmark = dataclasses.replace(sampled, ignore_eos=True)
    assert sampling_params(benchmark, (1, 2, 9)) == {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "max_tokens": 7,
                                                     "stop_token_ids": [], "ignore_eos": True}
    # Greedy is vLLM's temperature 0, whatever the temperature; top_k 0 and top_p 1 are "off" in both.
    greedy = SamplingConfig(max_new_tokens=3, temperature=0.7, greedy=True)
    assert sampling_params(greedy, (2,)) == {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "max_tokens": 3,
                                             "stop_token_ids": [2], "ignore_eos": False}
    # The engine passes the tokenizer's every stop id.
    backend = FakeBackend()
    _engine(backend)(_params(), [[3]], num_samples=2, sampling=sampled, rng=jax.random.PRNGKey(0))
    assert backend.calls[-1][2] == sampling_params(sampled, EOS)


# -- weights --------------------------------------------------------------------------------------

def test_weights_sync_on_the_first_call_not_again_for_the_same_params_again_for_new_ones():
    backend = FakeBackend()
    engine, params = _engine(backend), _params()
    call = lambda p: engine(p, [[3]], num_samples=2, sampling=SAMPLING, rng=jax.random.PRNGKey(0))  # noqa: E731
    assert engine.weights_version == 0 and engine.pop_weight_sync_seconds() is None
    call(params)
    assert backend.names() == ["load_weights", "generate"] and engine.weights_version == 1
    seconds = engine.pop_weight_sync_seconds()
    assert isinstance(seconds, float) and seconds >= 0 and engine.pop_weight_sync_seconds() is None  # once
    call(params)  # the same params: nothing sent, nothing timed
    assert backend.names() == ["load_weights", "generate", "generate"] and engine.weights_version == 1
    assert engine.pop_weight_sync_seconds() is None
    # An update makes new arrays: sent again. Equal values in new arrays count as new (identity).
    call(jax.tree.map(lambda w: w + 1, params))
    call(jax.tree.map(lambda w: w, params))
    assert backend.names()[3:] == ["load_weights", "generate", "load_weights", "generate"]
    assert engine.weights_version == 3 and engine.pop_weight_sync_seconds() is not None


@pytest.mark.parametrize("dtype, np_dtype", [("float32", np.float32), ("bfloat16", ml_dtypes.bfloat16)])
def test_synced_tensors_are_the_hf_names_and_shapes_in_the_engine_dtype(dtype, np_dtype):
    backend = FakeBackend()
    params = _params()
    _engine(backend, dtype=dtype).sync_weights(params)
    (_, sent), = backend.calls
    expected = hf.weight_map(CONFIG)
    assert [name for name, _ in sent] == [e.hf_name for e in expected]
    assert [a.shape for _, a in sent] == [e.hf_shape for e in expected]
    assert all(a.dtype == np_dtype for _, a in sent)
    # The values: the float32 HF tensors rounded to the engine's dtype (round to nearest even, as
    # numpy's cast does; float32 itself: bit for bit).
    for (name, a), (ref_name, ref) in zip(sent, hf.hf_tensors(params, CONFIG)):
        assert name == ref_name
        np.testing.assert_array_equal(a.view(np.uint16 if dtype == "bfloat16" else np.uint32),
                                      ref.astype(np_dtype).view(np.uint16 if dtype == "bfloat16" else np.uint32))
    with pytest.raises(ValueError, match="dtype must be one of"):
        _engine(backend, dtype="float16")


def _adapters(params, seed: int):
    adapters = lora.init_adapters(nnx.to_pure_dict(params), ("q_proj", "down_proj"), 4, jax.random.PRNGKey(seed))
    return jax.tree.map(lambda x: x + 0.01 * seed, adapters)  # B nonzero: a trained adapter


def test_adapter_weights_send_the_base_once_then_only_the_peft_adapter_files():
    backend = FakeBackend()
    engine, base = _engine(backend), _params()
    spec = lora.LoraSpec(rank=4, scale=2.0, targets=("q_proj", "down_proj"))
    call = lambda w: engine(w, [[3]], num_samples=2, sampling=SAMPLING, rng=jax.random.PRNGKey(0))  # noqa: E731
    first = AdapterWeights(adapters=_adapters(base, 1), base=base, spec=spec, alpha=8.0)
    call(first)
    assert backend.names() == ["load_weights", "load_adapter", "generate"] and engine.weights_version == 1
    assert [n for n, _ in backend.calls[0][1]] == [e.hf_name for e in hf.weight_map(CONFIG)]  # the base
    _, version, files = backend.calls[1]
    assert version == 1 and set(files) == {"adapter_config.json", "adapter_model.safetensors"}
    config = json.loads(files["adapter_config.json"])
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8.0, ["down_proj", "q_proj"])
    _assert_adapter_file(files["adapter_model.safetensors"], first.adapters)

    call(first)  # the same adapters: nothing goes over
    assert backend.names()[3:] == ["generate"]
    second = AdapterWeights(adapters=_adapters(base, 2), base=base, spec=spec, alpha=8.0)
    call(second)  # new adapters, the same base: only the adapter files
    assert backend.names()[4:] == ["load_adapter", "generate"] and engine.weights_version == 2
    assert backend.calls[4][1] == 2
    _assert_adapter_file(backend.calls[4][2]["adapter_model.safetensors"], second.adapters)


def test_full_params_after_adapters_replace_them_and_the_base_goes_again_with_the_next_adapters():
    """Full params sent after adapters are the policy (the engine drops the adapter: vllm_backends),
    so adapters over the old base afterwards send that base again, not just their files."""
    backend = FakeBackend()
    engine, base = _engine(backend), _params()
    spec = lora.LoraSpec(rank=4, scale=2.0, targets=("q_proj", "down_proj"))
    call = lambda w: engine(w, [[3]], num_samples=2, sampling=SAMPLING, rng=jax.random.PRNGKey(0))  # noqa: E731
    call(AdapterWeights(adapters=_adapters(base, 1), base=base, spec=spec, alpha=8.0))
    call(_params(seed=5))
    assert backend.names()[3:] == ["load_weights", "generate"]
    call(AdapterWeights(adapters=_adapters(base, 2), base=base, spec=spec, alpha=8.0))
    assert backend.names()[5:] == ["load_weights", "load_adapter", "generate"]


def _assert_adapter_file(data: bytes, adapters) -> None:
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(data)
        f.flush()
        tensors = load_file(f.name)
    expected = peft.peft_state_dict(jax.tree.map(np.asarray, adapters))
    assert sorted(tensors) == sorted(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(tensors[name], value)


def test_sleep_between_calls_sleeps_after_a_call_and_wakes_before_the_next():
    backend = FakeBackend()
    engine, params = _engine(backend, sleep_between_calls=True), _params()
    call = lambda p: engine(p, [[3]], num_samples=2, sampling=SAMPLING, rng=jax.random.PRNGKey(0))  # noqa: E731
    call(params)  # the engine starts awake
    assert backend.names() == ["load_weights", "generate", "sleep"]
    call(params)
    assert backend.names()[3:] == ["wake_up", "generate", "sleep"]
    call(jax.tree.map(lambda w: w * 2, params))  # awake before the weights go in
    assert backend.names()[6:] == ["wake_up", "load_weights", "generate", "sleep"]
    engine.close()
    assert backend.names()[-1] == "close"
    # Without sleep mode neither is called.
    plain = FakeBackend()
    _engine(plain)(params, [[3]], num_samples=2, sampling=SAMPLING, rng=jax.random.PRNGKey(0))
    assert "sleep" not in plain.names() and "wake_up" not in plain.names()
