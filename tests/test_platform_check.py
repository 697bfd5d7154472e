"""grpo_jax.distributed.platform_check: which configs expect an accelerator, what a CPU backend then does, and
the launch scripts' install check (installed distributions only; no backend is started)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_jax import config as config_lib
from grpo_jax.distributed import platform_check
from grpo_jax.config import MeshSection

REPO = Path(__file__).resolve().parents[1]


def _config(name: str) -> config_lib.Config:
    return config_lib.load_config_file(REPO / "configs" / name)


def _with_mesh(config, **axes):
    return dataclasses.replace(config, mesh=MeshSection(**axes))


def test_the_cpu_demo_expects_no_accelerator():
    assert platform_check.accelerator_expected(_config("arith_cpu.py")) is None


def test_the_gpu_and_pod_configs_expect_one_for_their_dtype_and_checkpoint():
    for name in ("qwen25_05b_gpu.py", "tpu_pod.py"):
        reason = platform_check.accelerator_expected(_config(name))
        assert "model.dtype='bfloat16'" in reason and "model.hf_path=" in reason, name


@pytest.mark.parametrize("axes, devices", [
    ({"data": -1, "fsdp": 8}, 8),               # the README's pod layouts
    ({"data": 2, "fsdp": -1, "tensor": 4}, 8),  # the rest stays free; the explicit axes already ask for 8
    ({"data": 2}, 2),
])
def test_a_mesh_asking_for_several_devices_expects_an_accelerator(axes, devices):
    reason = platform_check.accelerator_expected(_with_mesh(_config("arith_cpu.py"), **axes))
    assert reason.startswith("mesh ") and f"at least {devices} devices" in reason


@pytest.mark.parametrize("axes", [{}, {"data": -1, "fsdp": 1, "tensor": 1}, {"data": 1, "fsdp": -1}])
def test_a_mesh_that_fits_one_device_does_not(axes):
    assert platform_check.accelerator_expected(_with_mesh(_config("arith_cpu.py"), **axes)) is None


def test_a_bf16_reference_alone_does_not_expect_an_accelerator():
    cpu = _config("arith_cpu.py")
    config = dataclasses.replace(cpu, grpo=dataclasses.replace(cpu.grpo, ref_dtype="bfloat16"))
    assert platform_check.accelerator_expected(config) is None


REASON = "model.dtype='bfloat16' computes in bf16"


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_an_accelerator_backend_goes_ahead_silently(backend):
    assert platform_check.backend_verdict(REASON, backend, allow_cpu=False) is None


def test_a_cpu_config_on_cpu_goes_ahead_silently():
    assert platform_check.backend_verdict(None, "cpu", allow_cpu=False) is None


def test_an_accelerator_config_on_cpu_is_refused_with_the_fix():
    verdict = platform_check.backend_verdict(REASON, "cpu", allow_cpu=False)
    assert verdict.action == "refuse"
    for piece in (REASON, "pip install -e '.[cuda12]'", "pip install -e '.[tpu]'", "--allow-cpu", "jax.devices()"):
        assert piece in verdict.message, piece


@pytest.mark.parametrize("allow_cpu, jax_platforms, why", [
    (True, None, "--allow-cpu"),
    (False, "cpu", "JAX_PLATFORMS=cpu"),  # an explicit choice of CPU, as the test suite makes
    (False, " cpu ", "JAX_PLATFORMS=cpu"),
])
def test_allow_cpu_or_jax_platforms_cpu_turn_the_refusal_into_a_loud_warning(allow_cpu, jax_platforms, why):
    verdict = platform_check.backend_verdict(REASON, "cpu", allow_cpu=allow_cpu, jax_platforms=jax_platforms)
    assert verdict.action == "warn" and verdict.message.startswith("WARNING") and why in verdict.message


@pytest.mark.parametrize("jax_platforms", ["", "cuda,cpu", "tpu"])
def test_jax_platforms_that_allow_an_accelerator_do_not_excuse_a_cpu_fallback(jax_platforms):
    verdict = platform_check.backend_verdict(REASON, "cpu", allow_cpu=False, jax_platforms=jax_platforms)
    assert verdict.action == "refuse"


def _env(**installed):
    """An environment described as distribution -> version (the `version` argument)."""
    return lambda name: installed.get(name)


def test_install_check_finds_the_cuda_plugin_or_says_how_to_install_it():
    check = platform_check.missing_accelerator_jaxlib
    ok = _env(jaxlib="0.10.2", **{"jax-cuda12-plugin": "0.10.2", "jax-cuda12-pjrt": "0.10.2"})
    assert check("cuda", version=ok) is None
    cpu_only = check("cuda", version=_env(jaxlib="0.10.2"))
    assert "CPU-only jaxlib 0.10.2" in cpu_only and f"cd {REPO} && " in cpu_only and "-e '.[cuda12]'" in cpu_only
    stale = check("cuda", version=_env(jaxlib="0.10.2", **{"jax-cuda12-plugin": "0.9.0", "jax-cuda12-pjrt": "0.9.0"}))
    assert "jax-cuda12-plugin 0.9.0 but jaxlib 0.10.2" in stale


def test_install_check_finds_libtpu_or_says_how_to_install_it():
    check = platform_check.missing_accelerator_jaxlib
    assert check("tpu", version=_env(jaxlib="0.10.2", libtpu="0.0.42.1")) is None
    assert "no libtpu" in check("tpu", version=_env(jaxlib="0.10.2")) and "-e '.[tpu]'" in check(
        "tpu", version=_env(jaxlib="0.10.2"))
    assert "has no jaxlib" in check("tpu", version=_env())


def test_the_install_check_command_fails_in_this_cpu_environment():
    # The test venv holds the CPU jaxlib (requirements.txt), exactly what the launch scripts must stop.
    proc = subprocess.run([sys.executable, "-m", "grpo_jax.distributed.platform_check", "cuda"], capture_output=True, text=True,
                          timeout=60, cwd=REPO, check=False)
    if proc.returncode == 0:
        pytest.skip("this environment has a CUDA jaxlib")
    assert proc.returncode == 1 and "pip install -e '.[cuda12]'" in proc.stderr and "--allow-cpu" in proc.stderr


def test_the_module_does_not_start_jax():
    # The install check runs on login nodes and before a worker's venv is trusted: metadata only.
    proc = subprocess.run([sys.executable, "-c", "import sys, grpo_jax.distributed.platform_check; print('jax' in sys.modules)"],
                          capture_output=True, text=True, timeout=60, cwd=REPO, check=True)
    assert proc.stdout.strip() == "False"
