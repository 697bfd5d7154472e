#!/usr/bin/env bash
# Run on every Cloud TPU VM worker by launch/tpu_pod.sh, in the unpacked repo: make .venv with a
# Python the project supports (requires-python >= 3.11; TPU VM images such as tpu-ubuntu2204-base
# ship 3.10), install the project with JAX's TPU extra (pip install -e '.[tpu]': jax, jaxlib and a
# matching libtpu from PyPI), then check that libtpu came with it.
#
# Python, first that works: .venv's own if it is >= 3.11; `python3 -m venv` if python3 is >= 3.11;
# else uv (on PATH, in ~/.local/bin or ~/.cargo/bin, else `python3 -m pip install --user uv`), which fetches a
# standalone CPython $GRPO_WORKER_PYTHON (default 3.12) into its cache: no sudo, no apt.
#
#   bash launch/tpu_worker_setup.sh [--allow-cpu]    # --allow-cpu: a missing libtpu only warns
set -euo pipefail

allow_cpu=0
[[ "${1:-}" == --allow-cpu ]] && allow_cpu=1
want="${GRPO_WORKER_PYTHON:-3.12}"
host="$(hostname)"
fail() {
  echo "tpu_worker_setup.sh on $host: $*" >&2
  echo "  Fix on every worker: gcloud compute tpus tpu-vm ssh TPU --zone ZONE --worker=all --command" \
       "'curl -LsSf https://astral.sh/uv/install.sh | sh' (uv then provides Python $want), or install" \
       "python$want with python$want-venv (e.g. from the deadsnakes PPA), then rerun launch/tpu_pod.sh." >&2
  exit 1
}
supported() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }

if [[ -x .venv/bin/python ]] && supported .venv/bin/python; then
  :  # reuse: pip below brings it up to this version of the project
else
  rm -rf .venv  # absent, or made with a Python older than 3.11
  if command -v python3 >/dev/null && supported python3 && python3 -m venv .venv 2>/dev/null; then
    :
  else
    rm -rf .venv
    uv="$(command -v uv || true)"
    for candidate in "$HOME/.local/bin/uv" "$HOME/.cargo/bin/uv"; do  # pip --user's, uv installer's
      if [[ -z "$uv" && -x "$candidate" ]]; then uv="$candidate"; fi
    done
    uv="${uv:-$HOME/.local/bin/uv}"
    if [[ ! -x "$uv" ]]; then
      echo "$host: no python3 >= 3.11 with venv here ($(python3 --version 2>&1 || echo 'no python3'));" \
           "installing uv to get Python $want"
      python3 -m pip install --user --quiet uv || fail "python3 -m pip install --user uv failed"
    fi
    [[ -x "$uv" ]] || fail "uv is not at $uv after installing it"
    "$uv" venv --seed --python "$want" .venv || fail "uv venv --python $want failed"
  fi
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[tpu]'
if ! .venv/bin/python -m grpo_jax.distributed.platform_check tpu; then
  [[ $allow_cpu == 1 ]] || exit 1
  echo "$host: continuing without libtpu (--allow-cpu)" >&2
fi
echo "$host: $(.venv/bin/python --version), jax $(.venv/bin/python -c 'import jax; print(jax.__version__)')"
