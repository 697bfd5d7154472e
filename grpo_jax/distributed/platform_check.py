"""Is this run on the hardware its config was written for? Two questions, answered without starting JAX.

1. Does the config expect an accelerator? `accelerator_expected(config)` gives the reason, or None.
   The rule: a config expects a GPU or TPU when any of these holds:
   - its mesh asks for more than one device explicitly: the product of the axes not left at -1 is
     above 1 (`mesh.fsdp=8`, `mesh.data=2`); the default mesh (data=-1) fits any device count;
   - it computes in bfloat16 (`model.dtype='bfloat16'`): XLA's CPU backend emulates bf16 matmuls,
     slower than float32;
   - it loads a Hugging Face checkpoint (`model.hf_path`): pretrained models are 0.5B parameters and up.
   The reference dtype alone (`grpo.ref_dtype`) does not count: it halves memory on CPU as well.
2. Given that reason and the backend JAX started on, `backend_verdict` says what to do: nothing on
   a GPU or TPU backend; on CPU, refuse (exit 2, with the install command) unless `--allow-cpu` was
   passed or JAX_PLATFORMS=cpu chose CPU explicitly (the tests run that way), then warn.

`python -m grpo_jax.distributed.platform_check cuda|tpu` is the launch scripts' install check: it reads the
installed distributions (no backend is started, so it runs on a login node) and exits 1 with the
command that fixes the environment when the CUDA plugin or libtpu is missing.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from grpo_jax.config import Config

_REPO = Path(__file__).resolve().parents[2]
# JAX's own extras (pyproject.toml's optional dependencies `cuda12` and `tpu` wrap them).
INSTALL_HINT = ("pip install -e '.[cuda12]' on NVIDIA GPUs (CUDA 12 wheels from PyPI), pip install -e '.[tpu]' on "
                "a Cloud TPU VM, run from the repo root in this environment")


def accelerator_expected(config: Config) -> str | None:
    """Why `config` expects a GPU or TPU ("; "-joined reasons), or None when it runs fine on a CPU."""
    reasons = []
    mesh = config.mesh
    sizes = {axis: getattr(mesh, axis) for axis in mesh.AXES}
    explicit = [size for size in sizes.values() if size != -1]
    if math.prod(explicit) > 1:
        reasons.append(f"mesh {', '.join(f'{a}={n}' for a, n in sizes.items())} asks for at least "
                       f"{math.prod(explicit)} devices")
    if config.model.dtype == "bfloat16":
        reasons.append("model.dtype='bfloat16' computes in bf16, which XLA's CPU backend emulates")
    if config.model.hf_path:
        reasons.append(f"model.hf_path={config.model.hf_path!r} loads a pretrained checkpoint")
    return "; ".join(reasons) or None


@dataclasses.dataclass(frozen=True)
class Verdict:
    action: Literal["warn", "refuse"]
    message: str


def backend_verdict(reason: str | None, backend: str, allow_cpu: bool,
                    jax_platforms: str | None = None) -> Verdict | None:
    """What to do when a run whose config expects an accelerator for `reason` starts on `backend`.

    backend: `jax.default_backend()` ("cpu", "gpu", "tpu"). jax_platforms: the JAX_PLATFORMS
    environment variable; exactly "cpu" is an explicit choice of CPU and counts as `allow_cpu`.
    None means go ahead silently; "warn" means print the message and go on; "refuse" means print it
    and exit 2.
    """
    if backend != "cpu" or reason is None:
        return None
    chosen = [p.strip() for p in (jax_platforms or "").split(",") if p.strip()] == ["cpu"]
    if allow_cpu or chosen:
        why = "--allow-cpu" if allow_cpu else "JAX_PLATFORMS=cpu"
        return Verdict("warn", f"WARNING: running on CPU ({why}) although this config expects a GPU or TPU: "
                               f"{reason}. Expect it to be very slow.")
    return Verdict("refuse", f"this config expects a GPU or TPU ({reason}), but JAX started on its CPU backend: "
                             "this environment's jaxlib has no accelerator support or sees no device "
                             "(python -c 'import jax; print(jax.devices())' shows what it sees). Install the "
                             f"accelerator jaxlib: {INSTALL_HINT}. To run on CPU anyway, pass --allow-cpu.")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _fix_command(extra: str) -> str:
    """The install command for one of pyproject.toml's accelerator extras, in this interpreter's environment."""
    if (_REPO / "pyproject.toml").is_file():  # a checkout: the project's extra keeps jax in its tested range
        return f"cd {_REPO} && {sys.executable} -m pip install -e '.[{extra}]'"
    return f"{sys.executable} -m pip install 'jax[{extra}]>=0.6,<0.12'"


def missing_accelerator_jaxlib(platform: Literal["cuda", "tpu"], version=_version) -> str | None:
    """What is wrong with this environment's JAX install for `platform`, with the fix; None when fine.

    version: distribution name -> installed version or None (importlib.metadata; a parameter so tests
    can describe an environment). Reads metadata only, so no device is touched.
    """
    where = f"the environment of {sys.executable}"
    fix = _fix_command("cuda12" if platform == "cuda" else "tpu")
    jaxlib = version("jaxlib")
    if jaxlib is None:
        return f"{where} has no jaxlib. Fix: {fix}"
    if platform == "cuda":
        if not any(version(name) for name in ("jax-cuda12-pjrt", "jax-cuda13-pjrt")):
            return (f"{where} has a CPU-only jaxlib {jaxlib} (no jax-cuda12-pjrt, JAX's CUDA plugin), so JAX "
                    f"would run on the CPU. Fix: {fix}")
        for name in ("jax-cuda12-plugin", "jax-cuda13-plugin"):
            got = version(name)
            if got is not None and got != jaxlib:
                return (f"{where} has {name} {got} but jaxlib {jaxlib}; JAX skips a plugin of another version. "
                        f"Fix: {fix}")
        return None
    if platform == "tpu":
        if version("libtpu") is None and version("libtpu-nightly") is None:
            return f"{where} has jaxlib {jaxlib} but no libtpu, so JAX would run on the CPU. Fix: {fix}"
        return None
    raise ValueError(f"platform={platform!r}; choose 'cuda' or 'tpu'")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] not in ("cuda", "tpu"):
        print("usage: python -m grpo_jax.distributed.platform_check cuda|tpu", file=sys.stderr)
        return 2
    problem = missing_accelerator_jaxlib(argv[0])
    if problem:
        print(f"accelerator check: {problem}\n(the launch scripts' --allow-cpu skips this check)", file=sys.stderr)
        return 1
    print(f"accelerator check: jaxlib {_version('jaxlib')} with {argv[0]} support in {sys.prefix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
