"""The programs `python -m grpo_jax check` compiles and what each phase holds: the rollout's
prefill and decode, the log-prob passes, the update and the teacher's pass, lowered on the
abstract run (`check.abstract_state`: the trainer's own step functions over ShapeDtypeStructs)
and compiled, with `compiled.memory_analysis()`'s bytes; and each phase's resident arrays."""

from __future__ import annotations

import dataclasses
import time
import types

import jax
import jax.numpy as jnp

from grpo_jax.distributed import sharding
from grpo_jax.sampling import sampler as sampler_lib
from grpo_jax.training import rollout as rollout_lib
from grpo_jax.training import run_context
from grpo_jax.training import step as step_lib
from grpo_jax.config.batch_plan import BatchPlan


@dataclasses.dataclass
class Program:
    name: str
    argument: int
    output: int
    alias: int
    temp: int
    compile_s: float

    @property
    def peak(self) -> int:
        """Bytes live while it runs: inputs, outputs not written in place of an input, scratch."""
        return self.argument + self.output - self.alias + self.temp


def _compile(name: str, lowered) -> Program:
    t0 = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - t0
    m = compiled.memory_analysis()
    if m is None:  # a backend without the analysis: the program's own arrays are still counted
        return Program(name, 0, 0, 0, 0, seconds)
    return Program(name, m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes,
                   m.temp_size_in_bytes, seconds)


def target_slots(config, rows: int, row_devices: int) -> int:
    """The continuous engine's slots per device on the backend the config is for (an accelerator
    where its mesh, dtype or checkpoint say so), not on the CPU that `check` compiles with."""
    from grpo_jax.distributed.platform_check import accelerator_expected

    backend = "accelerator" if accelerator_expected(config) else "cpu"
    return sampler_lib.slots_per_device(rows, row_devices, config.sampling.decode_slots, backend=backend)


def decode_copy(st, model_config):
    """The sampler's weights as `sharding.decode_params` makes them: in the compute dtype where
    they are a separate copy, else the params themselves."""
    from grpo_jax.model.config import DTYPES

    dtype = DTYPES[model_config.dtype] if st.separate_decode_copy else None
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(
        x.shape, dtype if dtype is not None and jnp.issubdtype(x.dtype, jnp.floating) else x.dtype, sharding=s),
        st.params, st.decode_shardings)


def _rows(shape, dtype, sh):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)


def _sampler_programs(config, model_config, mesh, st, *, prompt_len: int, stop_ids, pad_id) -> dict[str, Program]:
    """The rollout's prefill and decode for this size: the trainer's sampler
    (`run_context.build_sampler`) lowered by `Sampler.lower_abstract` on params in the decode
    layout as `Sampler._prepare` lays them out (one part: no thread split)."""
    g, s_cfg = config.grpo, config.sampling
    plan = BatchPlan.of(g, sharding.batch_size_multiple(mesh))
    rows, row_devices, c = plan.rows, plan.row_devices, s_cfg.max_new_tokens
    stop = types.SimpleNamespace(eos_ids=tuple(stop_ids), eos_id=stop_ids[0], pad_id=pad_id)
    smp = run_context.build_sampler(config, st.graphdef, model_config, stop, mesh)
    if smp.engine == "continuous" and not smp.decode_slots:  # the target accelerator's auto slots
        smp.decode_slots = target_slots(config, rows, row_devices) * row_devices
    sampling = sampler_lib.SamplingConfig(max_new_tokens=c, temperature=s_cfg.temperature, top_k=s_cfg.top_k,
                                          top_p=s_cfg.top_p, ignore_eos=s_cfg.ignore_eos,
                                          record_experts=run_context.replays_routing(config))
    prefill, decode = smp.lower_abstract(decode_copy(st, model_config), prompt_len=prompt_len,
                                         num_prompts=g.prompts_per_step, num_samples=g.num_generations,
                                         sampling=sampling)
    return {"prefill": _compile("prefill", prefill), "decode": _compile("decode", decode)}


def compiled_programs(config, model_config, mesh, st, *, prompt_len: int, stop_ids, pad_id) -> dict[str, Program]:
    """The rollout's prefill and decode (the built-in sampler's; none with sampling.engine="vllm"),
    the log-prob pass(es) the config runs, and the update,
    lowered on abstract arguments with the trainer's shardings and compiled. The log-prob pass and
    the update are the trainer's own (`trainable.build_training`, in `st.training`)."""
    g, c = config.grpo, config.sampling.max_new_tokens
    plan = BatchPlan.of(g, sharding.batch_size_multiple(mesh))
    seq, rows, m = prompt_len + c, plan.rows, plan.rows_per_micro_batch
    rows_sh = sharding.batch_sharding(mesh)
    i32, f32 = jnp.int32, jnp.float32
    programs = {}
    if config.sampling.engine != "vllm":  # a vLLM engine is not our program: check_engine counts its share
        programs = _sampler_programs(config, model_config, mesh, st, prompt_len=prompt_len, stop_ids=stop_ids,
                                     pad_id=pad_id)
    tr, state = st.training, st.state
    tokens, attention = _rows((rows, seq), i32, rows_sh), _rows((rows, seq), i32, rows_sh)
    # Routing replay: the sampler's experts ride with the rows, token-major [B, S, L_sparse, K].
    replay = run_context.replays_routing(config)
    sparse = sum(model_config.is_sparse(i) for i in range(model_config.num_layers))
    expert_slots = (seq, sparse, model_config.num_experts_per_tok)

    def lower_pass(params):
        if replay:
            return tr.logprob_fn.replaying.lower(params, tokens, attention, c,
                                                 _rows((rows, *expert_slots), rollout_lib.EXPERTS_DTYPE, rows_sh))
        return tr.logprob_fn.jitted.lower(params, tokens, attention, c)

    if g.beta > 0:
        programs["logprobs_ref"] = _compile("logprobs_ref", lower_pass(tr.policy.reference(state)))
    if config.resolved_old_logprobs() == "recompute":
        programs["logprobs_policy"] = _compile("logprobs_policy", lower_pass(tr.policy.abstract_full_params(state)))
    a, mb_sh = g.grad_accum_steps, sharding.batch_sharding(mesh, row_axis=1)
    per_token = _rows((a, m, c), f32, mb_sh)
    batch = step_lib.UpdateBatch(
        tokens=_rows((a, m, seq), i32, mb_sh), attention=_rows((a, m, seq), i32, mb_sh),
        completion_mask=_rows((a, m, c), i32, mb_sh), advantages=_rows((a, m), f32, mb_sh),
        old_logp=None if config.resolved_old_logprobs() == "in_loss" else per_token, sampler_logp=per_token,
        ref_logp=per_token if g.beta > 0 else None, **teacher_fields(g, (a, m, c), mb_sh),
        experts=_rows((a, m, *expert_slots), rollout_lib.EXPERTS_DTYPE, mb_sh) if replay else None)
    programs["update"] = _compile("update", tr.update_fn.lower(state.params, state.opt_state, batch,
                                                               *tr.policy.update_extra_args(state)))
    if st.teacher is not None:  # the teacher's pass over the step's rows (its own shape and layout)
        from grpo_jax.training import teacher as teacher_lib

        t_graphdef, t_params = st.teacher
        pass_fn = teacher_lib.make_pass_fn(t_graphdef, config.sampling.temperature, g.loss_top_k, mesh=mesh,
                                           params=t_params, vocab=model_config.vocab_size)
        programs["logprobs_teacher"] = _compile("logprobs_teacher", _lower_teacher(pass_fn, t_params, tokens,
                                                                                   attention, c))
    return programs


def teacher_fields(g, shape, sharding_) -> dict:
    """UpdateBatch's teacher arrays as ShapeDtypeStructs of `shape` ([A, M, C]) plus [K] for top-k."""
    if not g.teacher_model_name_or_path:
        return {}
    if g.loss_top_k == 0:
        return {"teacher_logp": jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding_)}
    topk = shape + (g.loss_top_k,)
    return {"teacher_topk_logp": jax.ShapeDtypeStruct(topk, jnp.float32, sharding=sharding_),
            "teacher_topk_ids": jax.ShapeDtypeStruct(topk, jnp.int32, sharding=sharding_)}


def _lower_teacher(pass_fn, params, tokens, attention, c):
    """The teacher pass lowered: `make_logprob_fn`'s (k = 0) exposes `.jitted`; the top-k pass is a MeshJit."""
    inner = getattr(pass_fn, "logprob_fn", None)
    if inner is not None:
        return inner.jitted.lower(params, tokens, attention, c)
    return pass_fn.lower(params, tokens, attention, c)


def phase_peaks(sizes: dict[str, int], programs: dict[str, Program], separate_decode_copy: bool
                ) -> dict[str, tuple[dict[str, int], Program]]:
    """phase -> (arrays alive meanwhile that the program does not take, the program in use)."""
    adapters = sizes["adapters"] > 0  # then "params" is the frozen base, which is also the reference
    rollout = {"opt_state": sizes["opt_state"], "reference": sizes["reference"], "adapters": sizes["adapters"]}
    if separate_decode_copy or "decode" not in programs:  # the params stay beside the sampler's weights
        rollout["params"] = sizes["params"]
    if "decode" in programs:
        phases = {"rollout": (rollout, max(programs["prefill"], programs["decode"], key=lambda p: p.peak))}
    else:  # sampling.engine="vllm": JAX runs nothing while the engine samples in its own memory
        phases = {"rollout": (rollout, Program("vLLM engine (its own share)", 0, 0, 0, 0, 0.0))}
    # With adapters the reference pass reads the base; the pi_old pass reads a merged copy beside it.
    for name, others in (("logprobs_ref", {"params": 0 if adapters else sizes["params"]}),
                         ("logprobs_policy", {"reference": sizes["reference"],
                                              "params": sizes["params"] if adapters else 0})):
        if name in programs:
            phases[name] = ({**others, "adapters": sizes["adapters"], "opt_state": sizes["opt_state"],
                             "step_rows": sizes["step_rows"]}, programs[name])
    phases["update"] = ({"reference": sizes["reference"], "step_rows": sizes["step_rows"]}, programs["update"])
    if "logprobs_teacher" in programs:  # beside it: everything but the teacher, its argument
        phases["logprobs_teacher"] = ({"params": sizes["params"], "adapters": sizes["adapters"],
                                       "opt_state": sizes["opt_state"], "reference": sizes["reference"],
                                       "step_rows": sizes["step_rows"]}, programs["logprobs_teacher"])
    for name, (resident, _) in phases.items():  # the frozen teacher stays on the devices throughout
        if name != "logprobs_teacher":
            resident["teacher"] = sizes.get("teacher", 0)
    return phases

