"""Parity of grpo_jax.core.objectives with the peers' own code: TRL 1.16's `GRPOTrainer._compute_loss`
(its loss, run on a stand-in trainer whose model returns our log-probs) and verl 0.9.1's
policy-loss registry (`verl.trainer.ppo.core_algos`). Loss and gradient with respect to the
per-token log-probs, on one batch with padding, clipped tokens and sampler weights.

Marked `parity`; skipped without torch and trl (TRL families) or verl (verl families). TRL comes
with `pip install -e '.[parity]'`; verl 0.9.1 pins an older transformers than trl 1.16 needs, so
it goes in without its dependencies: `pip install --no-deps verl==0.9.1` and then `pip install
ray codetiming hydra-core 'tensordict>=0.8,<=0.10' dill pylatexenc torchdata pybind11`.

Tolerance: the same float32 formulas with the operations in another order (torch vs XLA), sums of
at most 30 terms of size <= ~10: relative error ~30 u ~ 2e-6 (tests/tolerances.py), so rtol=1e-5,
atol=1e-6 (gradient entries that are 0 in one may be ~1e-7 in the other's rounding).
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax.core.objectives import policy_loss

pytestmark = pytest.mark.parity
RTOL, ATOL = 1e-5, 1e-6  # module docstring


def batch(seed=0, n=6, t=5):
    """log pi, log pi_old, log pi_ref, advantages [N], mask, sampler weights: answers of lengths
    5, 4, 3, 2, 5, 1 (no all-padding row: verl's sequence means skip those, ours and TRL's count
    them), log r ~ N(0, 0.3^2) so that clips, gates and trust regions all act somewhere."""
    rng = np.random.default_rng(seed)
    old = rng.uniform(-2.5, -0.1, (n, t)).astype(np.float32)
    logp = (old + 0.3 * rng.standard_normal((n, t))).clip(-6.0, -0.01).astype(np.float32)
    ref = (old + 0.2 * rng.standard_normal((n, t))).astype(np.float32)
    adv = rng.standard_normal(n).astype(np.float32)
    mask = (np.arange(t)[None, :] < np.array([5, 4, 3, 2, 5, 1])[:, None]).astype(np.float32)
    is_w = np.where(mask > 0, rng.uniform(0.5, 1.5, (n, t)), 1.0).astype(np.float32)
    return logp, old, ref, adv, mask, is_w


def ours(loss_type, logp, old, ref, adv, mask, is_w=None, **kw):
    ref = None if ref is None else jnp.asarray(ref)
    is_w = None if is_w is None else jnp.asarray(is_w)

    def f(lp):
        return policy_loss(lp, jnp.asarray(old), ref, jnp.asarray(adv), jnp.asarray(mask), loss_type=loss_type,
                           is_weights=is_w, max_len=mask.shape[1], **kw)[0]
    loss, grad = jax.value_and_grad(f)(jnp.asarray(logp))
    return float(loss), np.asarray(grad)


# ---------------------------------------------------------------------------------------------- TRL


def trl_loss(loss_type, logp, old, ref, adv, mask, is_w=None, *, beta=0.0, epsilon=0.2, epsilon_high=None,
             level="token", **args):
    """TRL's `_compute_loss` on a stand-in trainer; returns (loss, d loss / d logp)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("trl")
    from trl import GRPOTrainer

    logp_t = torch.tensor(logp, requires_grad=True)
    accelerator = types.SimpleNamespace(num_processes=1, gather=lambda x: x, gather_for_metrics=lambda x: x,
                                        reduce=lambda x, reduction="sum": x)
    defaults = dict(use_bias_correction_kl=False, delta=None, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
                    vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0,
                    steps_per_generation=1)
    trainer = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp_t, torch.zeros_like(logp_t), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level, beta=beta,
        args=types.SimpleNamespace(**{**defaults, **args}), loss_type=loss_type, epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        use_vllm=is_w is not None, vllm_importance_sampling_correction=is_w is not None,
        model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=mask.shape[1], accelerator=accelerator, _entropy_bonus_enabled=False,
        aux_loss_enabled=False, _metrics={"train": __import__("collections").defaultdict(list)},
        get_gamma_weights=GRPOTrainer.get_gamma_weights)
    n, t = mask.shape
    inputs = {"prompt_ids": torch.zeros((n, 1), dtype=torch.long), "prompt_mask": torch.ones((n, 1)),
              "completion_ids": torch.zeros((n, t), dtype=torch.long), "completion_mask": torch.tensor(mask),
              "advantages": torch.tensor(adv), "old_per_token_logps": torch.tensor(old),
              "ref_per_token_logps": torch.tensor(ref), "num_items_in_batch": torch.tensor(mask.sum())}
    if is_w is not None:
        inputs["importance_sampling_ratio"] = torch.tensor(is_w)
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    loss.backward()
    return float(loss), logp_t.grad.numpy()


TRL_CASES = {  # id: (our loss_type, our options, TRL's loss_type, TRL's options)
    "grpo": ("grpo", {}, "grpo", {}),
    "bnpo": ("bnpo", {}, "bnpo", {}),
    "dapo-clip-higher": ("dapo", dict(eps_high=0.28), "dapo", dict(epsilon_high=0.28)),
    "dr_grpo": ("dr_grpo", {}, "dr_grpo", {}),
    # TRL's GSPO is loss_type="grpo" at importance_sampling_level="sequence".
    # eps 0.05: an answer's geometric-mean ratio moves less than a token's; this clips some.
    "gspo": ("gspo", dict(eps_low=0.05), "grpo", dict(level="sequence", epsilon=0.05)),
    "luspo": ("luspo", dict(eps_low=0.05), "luspo", dict(level="sequence", epsilon=0.05)),
    # TRL's CISPO clamps the weight at epsilon_high (ScaleRL's 5): our band [1 - 1, 1 + 4].
    "cispo": ("cispo", dict(eps_low=1.0, eps_high=4.0), "cispo", dict(epsilon_high=5.0)),
    "cispo-tight": ("cispo", dict(eps_low=1.0, eps_high=0.1), "cispo", dict(epsilon_high=1.1)),
    "sapo": ("sapo", dict(sapo_temperature_pos=1.0, sapo_temperature_neg=1.05), "sapo", {}),
    "sapo-hot": ("sapo", dict(sapo_temperature_pos=4.0, sapo_temperature_neg=6.0), "sapo",
                 dict(sapo_temperature_pos=4.0, sapo_temperature_neg=6.0)),
    "vespo": ("vespo", {}, "vespo", {}),
}


@pytest.mark.parametrize("with_kl_and_weights", [False, True], ids=["plain", "kl+is"])
@pytest.mark.parametrize("case", sorted(TRL_CASES))
def test_parity_with_trl(case, with_kl_and_weights):
    mine_type, mine_kw, trl_type, trl_kw = TRL_CASES[case]
    logp, old, ref, adv, mask, is_w = batch()
    beta = 0.04 if with_kl_and_weights else 0.0
    is_w = is_w if with_kl_and_weights else None
    want_loss, want_grad = trl_loss(trl_type, logp, old, ref, adv, mask, is_w, beta=beta, **trl_kw)
    got_loss, got_grad = ours(mine_type, logp, old, ref if beta else None, adv, mask, is_w, beta=beta, **mine_kw)
    assert got_loss == pytest.approx(want_loss, rel=RTOL, abs=ATOL)
    np.testing.assert_allclose(got_grad, want_grad, rtol=RTOL, atol=ATOL)
    assert np.abs(want_grad).sum() > 0.01  # a real gradient, so the comparison can fail


# --------------------------------------------------------------------------------------------- verl


def verl_loss(loss_mode, logp, old, adv, mask, is_w=None, *, agg="token-mean", clip_low=0.2, clip_high=0.2,
              **policy_loss_options):
    torch = pytest.importorskip("torch")
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    from verl.workers.config.actor import FSDPActorConfig, PolicyLossConfig

    config = FSDPActorConfig(rollout_n=2, ppo_micro_batch_size_per_gpu=2, clip_ratio=clip_low, clip_ratio_low=clip_low,
                             clip_ratio_high=clip_high,
                             policy_loss=PolicyLossConfig(loss_mode=loss_mode, **policy_loss_options))
    logp_t = torch.tensor(logp, requires_grad=True)
    adv_t = torch.tensor(np.broadcast_to(adv[:, None], mask.shape).copy())
    fn = core_algos.get_policy_loss_fn(loss_mode)
    loss, _ = fn(old_log_prob=torch.tensor(old), log_prob=logp_t, advantages=adv_t, response_mask=torch.tensor(mask),
                 loss_agg_mode=agg, config=config, rollout_is_weights=None if is_w is None else torch.tensor(is_w))
    loss.backward()
    return float(loss), logp_t.grad.numpy()


VERL_CASES = {  # id: (loss_mode = our loss_type, our options, verl's options)
    "gspo-seq-mean-token-mean": ("gspo", dict(aggregation="sequence", eps_high=0.28),
                                 dict(agg="seq-mean-token-mean", clip_high=0.28)),
    "gspo-token-mean": ("gspo", dict(aggregation="token"), {}),
    "geo_mean": ("geo_mean", dict(eps_low=0.4), dict(clip_low=0.4, clip_high=0.4)),
    "dppo_tv": ("dppo_tv", dict(eps_low=0.1, eps_high=0.15), dict(clip_low=0.1, clip_high=0.15)),
    "dppo_kl": ("dppo_kl", dict(eps_low=0.02, eps_high=0.03), dict(clip_low=0.02, clip_high=0.03)),
    "gpg": ("gpg", {}, {}),
    "gpg-seq-mean-token-sum-norm": ("gpg", dict(aggregation="constant"), dict(agg="seq-mean-token-sum-norm")),
    "cispo": ("cispo", dict(eps_low=0.2, eps_high=0.28), dict(clip_high=0.28)),
    "sapo": ("sapo", {}, {}),
    # verl draws Clip-Cov's tokens with torch.randperm: with ratio 1 every candidate is drawn,
    # so both sides detach the same tokens.
    "clip_cov": ("clip_cov", dict(clip_cov_ratio=1.0, clip_cov_lb=0.02, clip_cov_ub=5.0),
                 dict(clip_cov_ratio=1.0, clip_cov_lb=0.02, clip_cov_ub=5.0)),
    "kl_cov": ("kl_cov", dict(kl_cov_ratio=0.2, ppo_kl_coef=0.5), dict(kl_cov_ratio=0.2, ppo_kl_coef=0.5)),
}


@pytest.mark.parametrize("with_weights", [False, True], ids=["plain", "is"])
@pytest.mark.parametrize("case", sorted(VERL_CASES))
def test_parity_with_verl(case, with_weights):
    loss_type, mine_kw, verl_kw = VERL_CASES[case]
    logp, old, _, adv, mask, is_w = batch(seed=1)
    if loss_type == "gspo":
        # Per-answer weights (TRL's default "sequence_mask" mode gives those). With per-token ones
        # verl weighs each token's gradient by its own weight, s_i w_t grad log pi_t, where ours
        # (and TRL's, tested above) weighs the answer's gradient by their mean: GSPO's token-level
        # variant against its sequence-level ratio; equal when the weights are equal in a row.
        is_w = np.where(mask > 0, is_w[:, :1], 1.0).astype(np.float32)
    is_w = is_w if with_weights else None
    want_loss, want_grad = verl_loss(loss_type, logp, old, adv, mask, is_w, **verl_kw)
    got_loss, got_grad = ours(loss_type, logp, old, None, adv, mask, is_w, beta=0.0, **mine_kw)
    assert got_loss == pytest.approx(want_loss, rel=RTOL, abs=ATOL)
    np.testing.assert_allclose(got_grad, want_grad, rtol=RTOL, atol=ATOL)
    assert np.abs(want_grad).sum() > 0.01
