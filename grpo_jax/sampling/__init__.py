"""Sampling: token ids in, G completions per prompt out, with the log-probs of every sampled token.

The interface (`engine.py`): a `SamplingEngine` is anything with a `mesh` attribute (the mesh its
output rows are laid over, or None) and the call

    engine(params, prompts, *, num_samples, sampling, rng) -> SampleOutput

prompts: lists of token ids; sampling: a `SamplingConfig` (max_new_tokens, temperature, top_k,
top_p, greedy, ignore_eos); the `SampleOutput` holds, row r = prompt r // num_samples: the padded
prompt and its mask, the completion's token ids and mask (its length = mask.sum(1), the stop id
included), whether it ran out of tokens, and each sampled token's log-prob under
softmax(logits / temperature). The rollout (`training.rollout.dispatch_rollout`), `evaluate` and the
SFT warm-up's accuracy check call only this. An external engine (a vLLM server, say) is added by
implementing that call and returning those arrays; its log-probs are pi_old where
`off_policy.old_logprobs` resolves to "sampler", else they feed the sampler correction.

The built-in engine, one module per job:
  sampler.py     `Sampler`: the host side (checks, prompt buckets, the mesh's row layout, thread
                 split, compile cache) in front of one of the two device engines below.
  static.py      every row decodes until the longest stops (prefill, then one while_loop).
  continuous.py  continuous batching: decode slots refilled from a queue as rows stop.
  ops.py         what both engines decode with: the model step on the KV cache, the token draw
                 (top-k / top-p, Gumbel-max, log-probs), stop tests, forced lengths, row keys,
                 the caches' layout.
"""
