"""Episodes, worked through on a tiny model: what the model reads each turn, what trains, and that an
episode of one turn is the single-answer sample itself.

The tokenizer has one id per character; '?' is how the model asks the environment something, and
the environment answers with digits. Row layout after the prompt (C = max_new_tokens columns):

    [model turn 1 ... eos][environment's reply][model turn 2 ... eos][pad ...]
    mask       1 ............................................ 1  0 ...
    tool_mask  1 ........ 1  0 ................ 0  1 ......... 1  0 ...
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax import model as M
from grpo_jax.core import losses
from grpo_jax.episodes import EpisodeError, Reply
from grpo_jax.training.episode_rollout import EpisodeLimits, run_episodes
from grpo_jax.io.tokenizer import CharTokenizer
from grpo_jax.sampling import sampler as S
from grpo_jax.sampling.engine import SamplingConfig
from grpo_jax.training.rollout import encode_prompt

TOK = CharTokenizer("0123456789+=?")
CONFIG = M.ModelConfig(vocab_size=15, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2,
                       num_kv_heads=2, head_dim=8)
EXAMPLES = [{"prompt": "12+3=", "answer": "15"}, {"prompt": "4+4=", "answer": "8"}]


@pytest.fixture(scope="module")
def model():
    graphdef, params = nnx.split(M.init_model(CONFIG, 0), nnx.Param)
    return graphdef, params


class Recording:
    """The sampler, remembering the prompts of every call (the contexts the model read). A random
    tiny model rarely samples eos, so every turn is made to stop after `turn_length` tokens (the
    engine's forced_lengths: the last one eos), sampled as usual before it."""

    def __init__(self, inner, turn_length=3):
        self.inner, self.calls, self.turn_length = inner, [], turn_length
        self.prompt_buckets = inner.prompt_buckets
        self.mesh = None

    def __call__(self, params, prompts, *, num_samples, **kw):
        self.calls.append([list(p) for p in prompts])
        forced = [self.turn_length] * (len(prompts) * num_samples)
        return self.inner(params, prompts, num_samples=num_samples, forced_lengths=forced, **kw)


@pytest.fixture(scope="module")
def sampler(model):
    return S.Sampler(model[0], CONFIG, eos_id=TOK.eos_id, pad_id=TOK.pad_id)


class Echo:
    """Answers the first turn with '=7' and ends the episode after the second; reward 1 then."""

    def __init__(self):
        self.turns = []

    def reset(self, **row):
        return None

    def step(self, turn):
        self.turns.append(turn)
        if len(self.turns) == 1:
            return Reply(text="=7")
        return Reply(done=True, reward=1.0)


def _play(sampler, params, factory, *, max_turns, max_new_tokens=8, per_turn=0, seed=0):
    return run_episodes(sampler, params, TOK, EXAMPLES, environment_factory=factory,
                        limits=EpisodeLimits(max_turns, per_turn), num_samples=2,
                        sampling=SamplingConfig(max_new_tokens=max_new_tokens), rng=jax.random.key(seed),
                        encode_prompt=encode_prompt)


def test_an_episode_of_one_turn_is_the_single_answer_sample(model, sampler):
    sample, played = _play(sampler, model[1], Echo, max_turns=1, max_new_tokens=6, per_turn=6)
    single = sampler(model[1], [TOK.encode(ex["prompt"]) for ex in EXAMPLES], num_samples=2,
                     sampling=SamplingConfig(max_new_tokens=6), rng=jax.random.key(0))
    np.testing.assert_array_equal(sample.tokens_BxC, np.asarray(single.tokens_BxC))
    np.testing.assert_array_equal(sample.mask_BxC, np.asarray(single.mask_BxC))
    np.testing.assert_array_equal(sample.truncated_B, np.asarray(single.truncated_B))
    np.testing.assert_array_equal(sample.logprobs_BxC, np.asarray(single.logprobs_BxC))  # the same numbers, copied
    np.testing.assert_array_equal(played.tool_mask, np.asarray(single.mask_BxC))


def test_the_environments_tokens_are_read_by_the_next_turn_and_masked_out_of_training(model, sampler):
    rec = Recording(sampler)
    sample, played = _play(rec, model[1], Echo, max_turns=3, max_new_tokens=24, per_turn=8)
    reply = TOK.encode("=7")
    for r, ep in enumerate(played.episodes):
        n = int(sample.mask_BxC[r].sum())
        row, model_tok = sample.tokens_BxC[r, :n].tolist(), played.tool_mask[r, :n]
        first = 3  # turn 1: two sampled tokens and eos
        assert row[first - 1] == TOK.eos_id
        # After the first turn's eos: the reply, never trained on, then the second turn.
        assert row[first:first + 2] == reply
        assert model_tok[first:first + 2].tolist() == [0, 0]
        assert model_tok[:first].all() and model_tok[first + 2:].all()
        assert (sample.logprobs_BxC[r, first:first + 2] == 0).all()
        # The second call's context for this row was prompt + turn 1 + reply.
        prompt = TOK.encode(EXAMPLES[r // 2]["prompt"])
        assert prompt + row[:first + 2] in rec.calls[1]
        assert ep.env_reward == 1.0 and len(ep.turn_texts) == 2 and not ep.truncated
        assert n == 3 + 2 + 3
    assert len(rec.calls[0]) == 2  # turn 1: one call over the two prompts (G=2 each)
    assert len(rec.calls) == 2  # every episode ended after its second turn


def test_environment_tokens_get_exactly_zero_gradient(model, sampler):
    """The loss's gradient with respect to each token's log-prob is exactly 0 on environment tokens
    (a masked term is multiplied by 0.0, and d(0 * f)/dx = 0 exactly in floating point), with the
    KL term on, so nothing an environment wrote can move the policy."""
    sample, played = _play(Recording(sampler), model[1], Echo, max_turns=3, max_new_tokens=24, per_turn=8)
    completion_mask = jnp.asarray(sample.mask_BxC * played.tool_mask)
    assert (np.asarray(sample.mask_BxC) > np.asarray(completion_mask)).any()  # some environment tokens
    logp = jnp.asarray(sample.logprobs_BxC) - 0.1
    old = jnp.asarray(sample.logprobs_BxC)
    advantages = jnp.array([1.0, -1.0, 0.5, -0.5])

    def loss(logp_NxT):
        value, _ = losses.grpo_loss(logp_NxT, old, old - 0.2, advantages, completion_mask, eps_low=0.2, eps_high=0.2,
                                    beta=0.04, kl="k3", aggregation="token", max_len=24)
        return value

    grad = np.asarray(jax.grad(loss)(logp))
    env_tokens = (np.asarray(sample.mask_BxC) == 1) & (played.tool_mask == 0)
    assert (grad[env_tokens] == 0.0).all()
    assert (grad[np.asarray(completion_mask) == 1] != 0.0).any()


def test_the_total_budget_counts_the_environments_tokens(model, sampler):
    """Turns of 3 tokens and a reply of 2: with 7 columns in all the second turn gets 2 of its 3
    tokens and the episode is truncated (it never finished its answer)."""
    sample, played = _play(Recording(sampler), model[1], Echo, max_turns=3, max_new_tokens=7, per_turn=3)
    for r, ep in enumerate(played.episodes):
        assert int(sample.mask_BxC[r].sum()) == 7
        assert played.tool_mask[r].tolist() == [1, 1, 1, 0, 0, 1, 1]
        assert ep.truncated and sample.truncated_B[r]


class Broken:
    def reset(self, **row):
        return None

    def step(self, turn):
        raise KeyError("board")


def test_an_environment_that_raises_is_named_with_its_row_and_turn(model, sampler):
    with pytest.raises(EpisodeError, match=r"Broken.step on row 0, turn 1 raised KeyError"):
        _play(Recording(sampler), model[1], Broken, max_turns=2)


class Wrong:
    def reset(self, **row):
        return None

    def step(self, turn):
        return 3


def test_an_environment_that_answers_something_else_is_named(model, sampler):
    with pytest.raises(EpisodeError, match=r"Wrong.step returned int"):
        _play(Recording(sampler), model[1], Wrong, max_turns=2)


# --- Chat prompts: the episode is the chat template's own rendering of its messages ---------------

TOOL_TEMPLATE = (  # Qwen2.5's layout for tools, written small: tool results go back in a user turn
    "{%- if tools %}{{- '<|im_start|>system\\nTools:' }}{%- for t in tools %}{{- ' ' + t.function.name }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SCHEMA = [{"type": "function", "function": {"name": "multiply", "description": "a times b",
                                            "parameters": {"type": "object", "properties": {}}}}]


class Multiplier:
    """Answers a tool call with the product of 12 and 34; ends the episode on a turn without one."""

    tools_schema = SCHEMA

    def reset(self, **row):
        return None

    def step(self, turn):
        if "<tool_call>" in turn:
            return Reply(messages=[{"role": "tool", "content": "408"}])
        return Reply(done=True, reward=float("408" in turn))


class Scripted:
    """An engine that answers turn t of every row with `turns[t]` and its stop id."""

    mesh = None
    prompt_buckets = (16, 32, 64, 128, 256)

    def __init__(self, tokenizer, turns):
        self.tok, self.turns, self.calls = tokenizer, turns, []

    def __call__(self, params, prompts, *, num_samples, sampling, rng):
        from grpo_jax.sampling.engine import SampleOutput

        self.calls.append([list(p) for p in prompts])
        ids = list(self.tok.encode(self.turns[len(self.calls) - 1])) + [self.tok.eos_id]
        rows = len(prompts) * num_samples
        tokens = np.full((rows, sampling.max_new_tokens), self.tok.pad_id, np.int32)
        mask = np.zeros_like(tokens)
        tokens[:, :len(ids)], mask[:, :len(ids)] = ids, 1
        return SampleOutput(np.zeros((rows, 1), np.int32), np.ones((rows, 1), np.int32), tokens, mask,
                            np.zeros(rows, bool), mask * -0.5)


def test_a_chat_episode_is_the_chat_templates_rendering_of_its_messages_token_for_token(tmp_path):
    import json

    from hf_fixtures import make_tiny_instruct_checkpoint

    from grpo_jax.io.tokenizer import load_tokenizer

    ckpt = make_tiny_instruct_checkpoint(tmp_path / "ckpt")
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOL_TEMPLATE}))
    tok = load_tokenizer(str(ckpt))
    call = '<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\n</tool_call>'
    engine = Scripted(tok, [call, "the answer is 408"])
    question = [{"role": "user", "content": "what is 12 times 34?"}]
    sample, played = run_episodes(engine, None, tok, [{"prompt": question, "answer": "408"}],
                                  environment_factory=Multiplier, limits=EpisodeLimits(4), num_samples=2,
                                  sampling=SamplingConfig(max_new_tokens=240), rng=jax.random.key(0),
                                  encode_prompt=encode_prompt)
    messages = question + [{"role": "assistant", "content": call}, {"role": "tool", "content": "408"},
                           {"role": "assistant", "content": "the answer is 408"}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=True, tools=SCHEMA)
    for r, ep in enumerate(played.episodes):
        episode = ep.context  # prompt + turns + the tool's reply, as the model read and wrote them
        # The template closes the last assistant turn with a newline the model never writes.
        assert rendered == episode + list(tok.encode("\n"))
        assert ep.env_reward == 1.0 and ep.retokenized == 0 and len(ep.turn_texts) == 2
        n = int(sample.mask_BxC[r].sum())
        model_ids = sample.tokens_BxC[r, :n][played.tool_mask[r, :n] == 1].tolist()
        assert tok.decode(model_ids[: model_ids.index(tok.eos_id)]) == call
    # The prompt was rendered with the environment's tools (the template lists them).
    assert engine.calls[0][0] == list(tok.apply_chat_template(question, tokenize=True, tools=SCHEMA))
    assert tok.apply_chat_template(question, tokenize=False, tools=SCHEMA).startswith("<|im_start|>system\nTools: multiply")


class Slow:
    """Takes 0.3 s to answer (a sandbox, a judge service), then ends the episode."""

    def reset(self, **row):
        return None

    def step(self, turn):
        import time

        time.sleep(0.3)
        return Reply(done=True)


def test_environments_that_wait_wait_side_by_side(model, sampler):
    """Four episodes whose environment takes 0.3 s each: with 4 workers the turn's answers take
    about 0.3 s of wall time (`environment_seconds`, the sampler's calls not counted), not 1.2 s;
    the bound 0.9 s leaves 0.6 s for threads starting on a loaded machine, and one after another
    could not finish under 1.2 s."""
    limits = EpisodeLimits(2, 3, workers=4)
    kw = dict(environment_factory=Slow, limits=limits, num_samples=2, sampling=SamplingConfig(max_new_tokens=6),
              rng=jax.random.key(0), encode_prompt=encode_prompt)
    _, played = run_episodes(Recording(sampler), model[1], TOK, EXAMPLES, **kw)
    assert played.environment_seconds < 0.9
    assert sum(ep.env_seconds for ep in played.episodes) >= 4 * 0.3


def test_the_readmes_environment_and_tool_work_as_written(tmp_path):
    """README's my_envs.py, run as a user would: the feedback game's replies and reward, and the
    tool's schema and call through a tool environment."""
    import pathlib
    import re
    import sys

    from grpo_jax.episodes import make_environment_factory

    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = re.search(r"```python\n(# my_envs\.py\nfrom grpo_jax\.episodes import Reply\n.*?)```", readme, re.S).group(1)
    (tmp_path / "my_envs.py").write_text(code)
    sys.path.insert(0, str(tmp_path))
    sys.modules.pop("my_envs", None)  # another test's module of that name, if one was imported
    try:
        game = make_environment_factory("my_envs:GuessTheNumber")()
        game.reset(prompt="guess", answer="42")
        assert game.step("17").messages[0]["content"] == "higher"
        assert game.step("abc").messages[0]["content"] == "not a number"
        last = game.step("42")
        assert last.done and abs(last.reward - 0.8) < 1e-12  # third guess: 1 - 0.1 * 2
        tools = make_environment_factory(["my_envs:multiply"])()
        assert tools.tools_schema[0]["function"]["parameters"]["required"] == ["a", "b"]
        reply = tools.step('<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\n</tool_call>')
        assert reply.messages[0]["content"] == "408" and not reply.done
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("my_envs", None)


def test_turn_rewards_as_process_steps_give_each_token_its_turns_and_later_turns_rewards():
    """Two episodes of one group, C = 6 columns (task.turn_rewards="process"):

        row 0: turn 1 ends at column 2 with reward 0.5, turn 2 ends at 5; the episode scores 1.0
        row 1: one turn, ending at 3, no turn reward; the episode scores 0.0

    Steps: row 0 [0.5, 1.0] (the score joins the last turn), row 1 [0.0]. Over the group's three
    steps the mean is 0.5 and the std (ddof 1) 0.5, so they normalise to 0, 1 and -1; a token gets
    its turn's value plus the later turns': row 0 = [1, 1, 1, 1, 1, 0], row 1 = [-1, -1, -1, 0, 0, 0]."""
    from types import SimpleNamespace

    from grpo_jax.training.phases import turn_advantages

    batch = SimpleNamespace(
        turn_steps={"ends": np.array([[2, 5], [3, 0]], np.int32),
                    "rewards": np.array([[0.5, np.nan], [np.nan, np.nan]], np.float32)},
        rewards=np.array([1.0, 0.0], np.float32), arrays={"tokens": np.zeros((2, 6), np.int32)})
    got = turn_advantages(batch, group_size=2, eps=0.0)
    np.testing.assert_array_equal(got, [[1, 1, 1, 1, 1, 0], [-1, -1, -1, 0, 0, 0]])
