"""grpo_jax.sampling.sampler on device meshes: the one-device samples, with each device decoding its own rows.

Runs tests/sampler_sharding_check.py in a child process with 8 fake CPU devices (XLA_FLAGS must be
set before jax starts). Equal tokens prove the math, not the split, so the compiled programs are
read too (tests/compiled_programs.py): each device's prefill and decode take rows / (data * fsdp)
rows, the decode weights are whole along fsdp, and the decode loop's body only talks to tensor
peers. The old layout (no Sampler mesh: prompts replicated, weights fsdp-sharded) is compiled as a
control on one mesh, and every one of those assertions fails on it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
REPO = TESTS.parent
# opt level 0: XLA's CPU backend compiles ~5x faster; the numerics are still IEEE float32, and the
# one-device reference runs under the same flags.
FAST_COMPILE = "--xla_backend_optimization_level=0"
MESHES = ["8,1,1", "2,4,1", "2,2,2", "1,8,1", "1,1,8"]
ROWS, KV_HEADS, HEADS, HIDDEN, MLP = 16, 2, 8, 128, 256  # the check's workloads and MODEL
NUM_PROMPTS = {"8x2": 8, "4x4": 4}


def _run_check(tmp_path, *args) -> dict:
    out = tmp_path / "sampler_sharding.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {FAST_COMPILE}")
    proc = subprocess.run([sys.executable, str(TESTS / "sampler_sharding_check.py"), str(out), *args],
                          env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    return json.loads(out.read_text())


def _row_devices(mesh: str) -> int:
    data, fsdp, _ = (int(v) for v in mesh.split(","))
    return data * fsdp


def _assert_layout(programs: dict, mesh: str, workload: str):
    """Each device's compiled programs take its own rows, and the decode loop needs no weights
    from other devices. `programs` is sampler_sharding_check.inspect_programs' record."""
    data, fsdp, tensor = (int(v) for v in mesh.split(","))
    d = data * fsdp
    # Prefill: M = lcm(N, data*fsdp) prompt rows (each prompt once per device holding its rows),
    # M / (data*fsdp) per device: 8 prompts over 8 -> 1, over 4 -> 2; 4 prompts over 8 -> 1.
    m = math.lcm(NUM_PROMPTS[workload], d)
    assert programs["prefill_tokens"][0] == programs["prefill_mask"][0] == m // d
    assert programs["prefill_token_specs"] == ["P(('data', 'fsdp', 'expert'),)"] * 2
    # Decode: every row-carrying piece of the state, 16 rows / (data*fsdp) per device.
    assert set(programs["decode_rows"].values()) == {ROWS // d}, programs["decode_rows"]
    # The cache [B, K, H, S]: rows split, kv heads over tensor where K=2 divides.
    cache = programs["decode_cache"]
    assert cache[:2] == [ROWS // d, KV_HEADS // tensor if KV_HEADS % tensor == 0 else KV_HEADS]
    # The weights in the decode layout: whole along fsdp (D = 128 on every device), heads and the
    # MLP width over tensor.
    weights = programs["decode_weights"]
    assert weights["params['layers'][0]['attn']['q_proj'].value"] == [HIDDEN, HEADS // tensor, 16]
    assert weights["params['layers'][0]['mlp']['gate_proj'].value"] == [HIDDEN, MLP // tensor]
    assert weights["params['layers'][0]['mlp']['down_proj'].value"] == [MLP // tensor, HIDDEN]
    loop = programs["loop_collectives"]
    # Inside the decode loop's body, devices talk only to their tensor peers (devices that hold
    # the same rows): no fsdp all-gather or all-reduce per generated token ...
    assert all(c["tensor_peers_only"] for c in loop), loop
    if tensor == 1:
        assert loop == []  # ... and without tensor parallelism, not at all.


def _assert_no_weight_sized_loop_collectives(programs: dict, smallest_weight_bytes: int):
    big = [c for c in programs["loop_collectives"] if c["bytes"] >= smallest_weight_bytes]
    assert not big, f"collectives in the decode loop as large as a weight matrix ({smallest_weight_bytes} B): {big}"


def _assert_mesh_matches_one_device(result: dict, mesh: str):
    entry = result["meshes"][mesh]
    for workload in NUM_PROMPTS:
        if workload not in entry:
            continue
        got, ref = entry[workload], result["reference"][workload]
        # Same key, same params: every row's tokens, masks, truncation flag and prompt exactly.
        assert all(got["equal"].values()), got["equal"]
        # Log-probs within the float32 bound of sampler_sharding_check.logprob_tolerance (the same
        # arithmetic in another summation order), which is itself well below any real difference.
        assert got["logprob_max_diff"] <= ref["logprob_tolerance"] < 1e-3, (got["logprob_max_diff"], ref)
        # Global arrays with rows over ("data", "fsdp"); process_rows reads them back (all rows here).
        assert all(got["rows_sharded"].values()), got["rows_sharded"]
        assert got["process_rows_ok"]
        _assert_layout(got, mesh, workload)
        if int(mesh.split(",")[1]) > 1:  # the fsdp meshes
            _assert_no_weight_sized_loop_collectives(got, got["smallest_weight_bytes"])
    d = _row_devices(mesh)
    if d > 1:  # 3 prompts x 2 samples = 6 rows split over neither 8 nor 4 row devices
        assert entry["indivisible_error"] == (
            f"Sampler: 3 prompts x 2 samples = 6 rows do not split over data*fsdp = {d} devices; pass a "
            f"number of prompts whose rows (prompts x num_samples) are a multiple of {d}")
    else:
        assert entry["indivisible_error"] is None


def _assert_control_fails(result: dict, mesh: str):
    """The old layout on `mesh` breaks every layout assertion above: they can fail."""
    entry = result["meshes"][mesh]
    control = entry["control"]
    assert control["prefill_tokens"][0] == NUM_PROMPTS["8x2"]  # every device prefills all 8 prompts
    assert set(control["decode_rows"].values()) == {ROWS}       # ... and decodes all 16 rows
    fsdp = int(mesh.split(",")[1])
    assert control["decode_weights"]["params['layers'][0]['mlp']['gate_proj'].value"][0] == HIDDEN // fsdp
    # Per token, the fsdp devices all-reduce partial sums of the fsdp-sharded matmuls (XLA chose
    # that over gathering the weights), as large as a weight matrix here: 16 rows x F = 256 floats.
    assert any(not c["tensor_peers_only"] for c in control["loop_collectives"])
    with pytest.raises(AssertionError):
        _assert_layout(control, mesh, "8x2")
    with pytest.raises(AssertionError):
        _assert_no_weight_sized_loop_collectives(control, entry["8x2"]["smallest_weight_bytes"])


def test_sampler_on_every_mesh_matches_one_device_and_splits_the_rows(tmp_path):
    result = _run_check(tmp_path, "--meshes", *MESHES, "--uneven", "8,1,1", "1,8,1", "--control", "1,8,1")
    assert result["device_count"] == 8
    # Some rows end with EOS and some run out of tokens, in both workloads.
    for ref in result["reference"].values():
        assert ref["rows"] == ROWS and 0 < ref["truncated"] < ROWS
    for mesh in MESHES:
        _assert_mesh_matches_one_device(result, mesh)
    _assert_control_fails(result, "1,8,1")


@pytest.mark.slow
def test_uneven_prompts_on_every_mesh_and_the_old_layout_on_a_tensor_mesh(tmp_path):
    # 4 prompts x G=4 everywhere (on (2,2,2) the 4 prompts divide data*fsdp; on (1,1,8) rows are
    # not split at all), and the old layout on (2,2,2), where its loop also mixes fsdp and tensor.
    result = _run_check(tmp_path, "--meshes", *MESHES, "--uneven", *MESHES, "--control", "2,2,2")
    for mesh in MESHES:
        _assert_mesh_matches_one_device(result, mesh)
    _assert_control_fails(result, "2,2,2")


def test_device_groups_read_the_formats_xla_prints():
    from compiled_programs import device_groups, shape_bytes  # tests/ is on sys.path (conftest.py)

    # Named axes of a [4, 2] device mesh: 'axis_1' groups neighbours, 'axis_0' strides by 2.
    line = "%a = f32[4] all-reduce(%x), replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}, to_apply=%add"
    assert device_groups(line, 8) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert device_groups(line.replace("{'axis_1'}", "{'axis_0'}"), 8) == ((0, 2, 4, 6), (1, 3, 5, 7))
    # With device ids: iota [4,2] transposed = 0 2 4 6 1 3 5 7, laid out as [2, 1, 4]; 'axis_0'
    # pairs device k of the first half with device k of the second: (0, 1), (2, 3), ...
    line = ("%b = f32[4,1,128] all-reduce(%y), replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4], "
            "device_ids=([4,2]T(1,0)) {'axis_0'}, use_global_device_ids=true")
    assert device_groups(line, 8) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert device_groups("%c = s32[4] all-reduce(%z), replica_groups=[2,4]<=[4,2]T(1,0), x", 8) == (
        (0, 2, 4, 6), (1, 3, 5, 7))
    assert device_groups("%d = f32[2] all-reduce(%z), replica_groups={{0,1},{2,3}}, x", 4) == ((0, 1), (2, 3))
    assert device_groups("%e = f32[2] all-reduce(%z), replica_groups={}, x", 4) == ((0, 1, 2, 3),)
    assert device_groups("%f = f32[2] collective-permute(%z), source_target_pairs={{1,0},{3,2}}", 4) == (
        (1, 0), (3, 2))
    with pytest.raises(ValueError, match="no device groups"):
        device_groups("%g = f32[2] all-reduce(%z), channel_id=1", 4)
    assert shape_bytes("(f32[4,1,128]{2,1,0}, pred[], bf16[3])") == 4 * 128 * 4 + 1 + 2 * 3


def test_a_bfloat16_models_decode_copy_is_bfloat16_and_samples_the_same(tmp_path):
    # tests/decode_copy_dtype_check.py: on fsdp=4 the sampler's copy is made anyway (whole along
    # fsdp); cast before the gather it holds 2 B per weight instead of 4, and since the model casts
    # every weight to bfloat16 before use, tokens and log-probs are bit-equal to a float32 copy's.
    out = tmp_path / "decode_copy.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               XLA_FLAGS=f"--xla_force_host_platform_device_count=4 {FAST_COMPILE}")
    proc = subprocess.run([sys.executable, str(TESTS / "decode_copy_dtype_check.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    result = json.loads(out.read_text())
    assert result["copies"]["bfloat16 copy"] == ["bfloat16"] and result["copies"]["float32 copy"] == ["float32"]
    assert 2 * result["copies"]["bfloat16 copy bytes"] == result["copies"]["float32 copy bytes"]
    assert result["tokens_equal"] and result["logprobs_equal"] and result["distinct_tokens"] > 10
