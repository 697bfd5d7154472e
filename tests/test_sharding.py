"""grpo_jax.distributed.sharding: mesh arithmetic, the spec table's fallbacks, multi-host helpers, and the proof
that a sharded GRPO step computes what the one-device step computes.

Multi-device checks run in child processes (XLA_FLAGS must be set before jax starts; this pytest
process keeps its single CPU device): tests/sharding_check.py (8 fake devices, one process) and
tests/distributed_check.py (two processes of 2 devices each, joined by jax.distributed).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from grpo_jax import model as model_lib
from grpo_jax.distributed import sharding
from tolerances import metric_tolerance

TESTS = Path(__file__).parent
REPO = TESTS.parent
# opt level 0: XLA's CPU backend compiles the tiny model ~5x faster; numerics are still IEEE float32
# (both sides of every comparison run under the same flags).
FAST_COMPILE = "--xla_backend_optimization_level=0"

TINY = model_lib.ModelConfig(vocab_size=44, hidden_size=32, intermediate_size=64, num_layers=1,
                             num_heads=8, num_kv_heads=2, head_dim=8)


def _abstract_params():
    from flax import nnx

    return jax.eval_shape(lambda: nnx.split(model_lib.init_model(TINY, 0))[1])


def _spec_of(specs, *path):
    node = specs
    for key in path:
        node = node[key]
    return node.get_value() if hasattr(node, "get_value") else node.value


# ----------------------------------------------------------------------------------------------
# Mesh arithmetic.

def test_mesh_shape_fills_the_free_axis():
    # 8 devices, fsdp=2, tensor=2: data takes the 8 / 4 = 2 left over.
    # (data, fsdp, expert, tensor), the mesh's axis order.
    assert sharding.mesh_shape(-1, 2, 2, num_devices=8) == (2, 2, 1, 2)
    # 16 devices (a v5e-16), fsdp -1: all 16 on fsdp.
    assert sharding.mesh_shape(1, -1, 1, num_devices=16) == (1, 16, 1, 1)
    assert sharding.mesh_shape(8, 1, 1, num_devices=8) == (8, 1, 1, 1)
    # 64 devices (a v5p-64), experts over 8 of them and the batch over all 64.
    assert sharding.mesh_shape(1, -1, 1, num_devices=64, expert=8) == (1, 8, 8, 1)


@pytest.mark.parametrize("args, message", [
    ((-1, 3, 1, 8), "8 devices do not divide by the fixed axes"),
    ((-1, -1, 1, 8), "only one axis may be -1"),
    ((2, 2, 1, 8), "= 4 but there are 8 devices"),
    ((0, 1, 1, 8), "mesh.data=0"),
])
def test_mesh_shape_errors_name_the_axis(args, message):
    with pytest.raises(ValueError, match=message):
        sharding.mesh_shape(*args[:3], num_devices=args[3])


def test_make_mesh_on_one_device_has_the_four_axes():
    mesh = sharding.make_mesh()
    assert mesh.axis_names == ("data", "fsdp", "expert", "tensor")
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1}


# ----------------------------------------------------------------------------------------------
# The spec table, its fallback and the decode variant (abstract meshes: no devices needed).

def test_fit_spec_replicates_a_dimension_that_does_not_divide():
    mesh = AbstractMesh((1, 2, 8), ("data", "fsdp", "tensor"))
    # k_proj [D=32, K=2, H=8]: K=2 heads cannot split 8 ways, so that dim is whole; D splits 2 ways.
    assert sharding.fit_spec(P("fsdp", "tensor", None), (32, 2, 8), mesh) == P("fsdp", None, None)
    # Batch rows over data x fsdp = 2: 6 rows divide, 5 do not.
    assert sharding.fit_spec(P(("data", "fsdp"), None), (6, 3), mesh) == P(("data", "fsdp"), None)
    assert sharding.fit_spec(P(("data", "fsdp"), None), (5, 3), mesh) == P(None, None)


def test_param_specs_follow_the_model_table_with_fallbacks():
    params = _abstract_params()
    specs = sharding.param_specs(AbstractMesh((1, 2, 8), ("data", "fsdp", "tensor")), params)
    attn = ("layers", 0, "attn")
    assert _spec_of(specs, *attn, "q_proj") == P("fsdp", "tensor", None)   # [32, 8, 8]: 8 heads / 8
    assert _spec_of(specs, *attn, "k_proj") == P("fsdp", None, None)       # [32, 2, 8]: 2 kv heads
    assert _spec_of(specs, "embed") == P(None, "fsdp")                       # [44, 32]: 44 % 8 != 0
    assert _spec_of(specs, "layers", 0, "mlp", "down_proj") == P("tensor", "fsdp")  # [64, 32]
    assert _spec_of(specs, "final_norm") == P(None)


def test_decode_specs_drop_fsdp_and_keep_tensor():
    params = _abstract_params()
    specs = sharding.param_specs(AbstractMesh((2, 2, 2), ("data", "fsdp", "tensor")), params,
                                 decode=True)
    assert _spec_of(specs, "layers", 0, "attn", "q_proj") == P(None, "tensor", None)
    assert _spec_of(specs, "layers", 0, "mlp", "down_proj") == P("tensor", None)
    assert _spec_of(specs, "lm_head") == P(None, "tensor")


def test_opt_state_shardings_mirror_params_and_replicate_scalars():
    import optax

    mesh = sharding.make_mesh()
    params = _abstract_params()
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    shardings = sharding.opt_state_shardings(mesh, jax.eval_shape(tx.init, params), params)
    adam = shardings[1][0]
    assert jax.tree.leaves(adam.mu) == jax.tree.leaves(sharding.param_shardings(mesh, params))
    assert adam.count.spec == P()


# ----------------------------------------------------------------------------------------------
# Multi-host helpers in a single process.

def test_initialize_distributed_is_a_no_op_for_one_process():
    assert sharding.initialize_distributed(environ={}) is False
    assert sharding.initialize_distributed(environ={"GRPO_NUM_PROCESSES": "1"}) is False
    assert sharding.initialize_distributed(environ={"GRPO_DISTRIBUTED": "off"}) is False


@pytest.mark.parametrize("environ, message", [
    ({"GRPO_NUM_PROCESSES": "2"}, r"\['coordinator', 'process_id'\] not given"),
    ({"GRPO_NUM_PROCESSES": "two"}, "GRPO_NUM_PROCESSES='two' must be an integer"),
    ({"GRPO_DISTRIBUTED": "yes"}, "GRPO_DISTRIBUTED='yes': allowed values are 'auto', 'off'"),
    ({"GRPO_COORDINATOR": "h:1", "GRPO_NUM_PROCESSES": "2", "GRPO_PROCESS_ID": "2"},
     r"process_id=2 must be in \[0, 2\)"),
])
def test_initialize_distributed_errors_name_the_setting(environ, message):
    with pytest.raises(ValueError, match=message):
        sharding.initialize_distributed(environ=environ)


def test_host_slice_on_one_process_is_everything():
    assert sharding.host_slice(12) == slice(0, 12)
    assert sharding.host_slice(12, sharding.make_mesh()) == slice(0, 12)


def test_global_batch_round_trips_rows_and_counts_bytes():
    mesh = sharding.make_mesh()
    rows = {"tokens": np.arange(12, dtype=np.int32).reshape(2, 3, 2), "none": None}
    batch = sharding.global_batch(mesh, rows, num_rows=3, row_axis=1)
    assert batch["none"] is None
    assert batch["tokens"].sharding.spec == P(None, ("data", "fsdp", "expert"))
    np.testing.assert_array_equal(sharding.process_rows(batch["tokens"], row_axis=1), rows["tokens"])
    # 12 int32 = 48 bytes, all on the one device.
    assert list(sharding.bytes_per_device(batch).values()) == [48]
    np.testing.assert_array_equal(sharding.allgather_rows([1.0, 2.0]), [1.0, 2.0])


# ----------------------------------------------------------------------------------------------
# 8 fake devices: a full GRPO step on meshes against one device.

def _run_sharding_check(tmp_path, *args) -> dict:
    out = tmp_path / "sharding.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {FAST_COMPILE}")
    proc = subprocess.run([sys.executable, str(TESTS / "sharding_check.py"), str(out), *args],
                          env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    return json.loads(out.read_text())


def _assert_mesh_matches_reference(result: dict, mesh: str):
    entry, ref = result["meshes"][mesh], result["reference"]
    # Same params before the step: jax.jit(init, out_shardings) draws the same random numbers.
    assert entry["init_equal"] and entry["init_sharded"]
    # Rollout: same fixed key -> the same 16 answers token for token, the same sampler log-probs.
    assert entry["tokens_equal"]
    assert entry["rollout_logp_violation"] <= 0 and entry["ref_logp_violation"] <= 0
    assert entry["rewards"] == pytest.approx(ref["rewards"], rel=1e-6)
    # Two AdamW updates moved weights by up to ~2 * lr = 0.02 ...
    assert entry["params_max_abs_change"] > 5e-3
    # ... and land where the single-device run lands (bounds from tests/tolerances.py), Adam too.
    assert entry["params_violation"] <= 0, entry["params_violation"]
    assert entry["opt_state_violation"] <= 0, entry["opt_state_violation"]
    for got, want in zip(entry["metrics"], ref["metrics"]):
        assert got.keys() == want.keys()
        for name in want:
            assert got[name] == pytest.approx(want[name], **metric_tolerance(name)), name
    # The second update saw ratios != 1 (clipping happened), so the loss is not a trivial 0.
    assert ref["metrics"][1]["clip_ratio/region_mean"] > 0
    # Outputs keep the training layout (the donated buffers are reused, not gathered).
    assert entry["params_sharded_after"] and entry["opt_state_sharded_after"]


def test_grpo_step_on_a_2x2x2_mesh_matches_one_device_and_fsdp_divides_memory(tmp_path):
    result = _run_sharding_check(tmp_path, "--meshes", "2,2,2", "--memory")
    assert result["device_count"] == 8
    _assert_mesh_matches_reference(result, "2,2,2")
    # On 2 x 2 rows: the reference pass runs each of the 4 prompts once for its group of 4 (one
    # prompt per device); the update's micro-batches hold 2 prompts, too few to split, so rows.
    assert result["meshes"]["2,2,2"]["prompt_groups"] == [1, 4]

    # Params + Adam mu + nu per device, fsdp = 1, 2, 4, 8 (data = 8 / fsdp), measured from the
    # arrays' shards: every device holds the same, and it is the table's arithmetic.
    memory = result["memory"]
    for fsdp in ("1", "2", "4", "8"):
        assert memory[fsdp]["max"] == memory[fsdp]["min"] == memory[fsdp]["expected"]
    # fsdp=1: 306,056 bytes = 25,504 float32 weights x 3 (param, mu, nu) x 4 bytes + 8.
    # Of those, 1,928 stay whole (5 RMSNorm scales [32] x 3 x 4 bytes, + 2 int32 step counts:
    # Adam's and the schedule's); the rest falls exactly as 1/fsdp.
    full, whole = memory["1"]["max"], memory["1"]["whole"]
    assert (full, whole) == (306_056, 1_928)
    for fsdp in (2, 4, 8):
        assert memory[str(fsdp)]["max"] - whole == (full - whole) / fsdp


@pytest.mark.slow
def test_grpo_step_on_every_mesh_matches_one_device(tmp_path):
    meshes = ["8,1,1", "2,4,1", "2,2,2", "1,1,8"]
    result = _run_sharding_check(tmp_path, "--meshes", *meshes, "--decode-variant", "2,2,2")
    for mesh in meshes:
        _assert_mesh_matches_reference(result, mesh)
    # Tensor parallel only: the update and the reference pass both run each prompt once.
    assert result["meshes"]["1,1,8"]["prompt_groups"] == [4, 4]
    # Rolling out with the decode layout (weights whole along fsdp) changes nothing either.
    entry = result["meshes"]["2,2,2"]
    assert entry["decode_specs_ok"] and entry["decode_tokens_equal"]
    assert entry["decode_params_violation"] <= 0


# ----------------------------------------------------------------------------------------------
# Two processes joined by jax.distributed on the CPU backend.

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_joined_by_jax_distributed_agree_with_one_device(tmp_path):
    # jax 0.10.2 runs multi-process CPU computations with gloo collectives (the default
    # jax_cpu_collectives_implementation), so this runs rather than skips.
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count=2 {FAST_COMPILE}")
    procs = [subprocess.Popen([sys.executable, str(TESTS / "distributed_check.py"), str(tmp_path / f"p{i}.json"),
                               "--process-id", str(i), "--num-processes", "2", "--port", str(port)],
                              env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=600)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-4000:] for log in logs)
    r0, r1 = (json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(2))

    # 2 processes x 2 local devices = one 4-device mesh (data=2 across processes, fsdp=2 within).
    assert (r0["process_count"], r0["device_count"], r0["local_device_count"]) == (2, 4, 2)
    assert (r0["process_index"], r1["process_index"]) == (0, 1)
    # Each process loaded only its half of the 8 rows of each micro-batch.
    assert (r0["rows"], r1["rows"]) == ([0, 4], [4, 8])
    assert r0["process_rows_ok"] and r1["process_rows_ok"]
    assert r0["gathered_rows"] == r1["gathered_rows"] == list(range(8))
    # Both processes see the same metrics and the same gathered params ...
    assert r0["metrics"] == r1["metrics"]
    assert r0["params_checksum"] == r1["params_checksum"]
    assert r0["params_changed"] > 5e-3
    # ... equal to two updates on one device of process 0 (same init, allclose after).
    assert r0["init_equal"]
    assert r0["params_violation"] <= 0, r0["params_violation"]
    for got, want in zip(r0["metrics"], r0["ref_metrics"]):
        assert got.keys() == want.keys()
        for name in want:
            assert got[name] == pytest.approx(want[name], **metric_tolerance(name)), name
    # fsdp=2: each device holds half of every matrix and of its Adam moments.
    assert len(set(r0["bytes_per_local_device"])) == 1
