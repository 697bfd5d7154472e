#!/usr/bin/env bash
# The one script to run when a session is lent a GPU (the `device` tool), in under 5 minutes:
#   W2 on the GPU, the GPU test subset, `check` on the GPU's own compiler against the memory the
#   update really peaks at, the attention kernels at reasoning lengths, and W1/W3 on vLLM where installed. Run from the repo root
#   with the device's own Python (jax with CUDA installed; nothing is downloaded):
#     PYTHONPATH=. bash benchmarks/gpu_check.sh
# Each part writes its JSON under ${OUT:-/tmp/gpu_check}; a failing part does not stop the others.
set -uo pipefail
out="${OUT:-/tmp/gpu_check}"
mkdir -p "$out"
py="${PYTHON:-python3}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # measured peaks are the programs', not a 75% pool

echo "== attention kernels (fwd+bwd, one 0.5B-shaped row, bf16)"
timeout 120 "$py" benchmarks/gpu_attention.py --lengths 2048 8192 32768 > "$out/attention.json" 2> "$out/attention.err"
tail -c 2000 "$out/attention.json"

echo "== GPU tests (the cuDNN path against the reference, the attention suite)"
timeout 90 "$py" -m pytest -q -x tests/test_attention.py -p no:cacheprovider > "$out/tests.txt" 2>&1
tail -n 5 "$out/tests.txt"

echo "== W2 on the GPU"
timeout 120 "$py" benchmarks/bench_w2_gpu.py --out "$out/w2.json" > "$out/w2.txt" 2>&1
tail -n 8 "$out/w2.txt"

echo "== check of W2 on the GPU's compiler, against W2's measured device peak"
timeout 60 "$py" -m grpo_jax check --config benchmarks/w2_check_config.py --devices 1 --prompt-tokens 32 \
  --json "$out/check_w2.json" > "$out/check_w2.txt" 2>&1
grep -E "update|summary" "$out/check_w2.txt"
"$py" -c "import json; print('W2 measured device peak GiB:', (json.load(open('$out/w2.json')).get('device_peak_bytes') or 0) / 2**30)"

echo "== check at 8k tokens on the GPU's compiler (0.5B, one row per micro-batch)"
timeout 90 "$py" -m grpo_jax check --config configs/qwen25_05b_gpu.py --model-shape qwen2.5-0.5b --devices 1 \
  --set sampling.max_new_tokens=8192 --set model.remat=true --set grpo.prompts_per_step=2 \
  --set grpo.num_generations=8 --set grpo.num_minibatches=1 --set grpo.grad_accum_steps=16 \
  --json "$out/check_8k.json" > "$out/check_8k.txt" 2>&1
grep -E "update|summary" "$out/check_8k.txt"
echo "== rollouts on vLLM beside the built-in engine (W1 steps, W3 rollouts; skipped without vllm)"
if "$py" -c "import vllm" 2> /dev/null; then
  # A colocated engine shares the GPU: XLA's pool is capped (and not preallocated, above) so both fit.
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.6 timeout 240 "$py" benchmarks/bench_vllm.py --steps 8 --repeats 3 \
    > "$out/vllm.json" 2> "$out/vllm.err"
  tail -c 2000 "$out/vllm.json"
else
  echo "vllm is not installed in $py's environment: skipped"
fi
echo "done: $out"
