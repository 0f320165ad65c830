#!/usr/bin/env bash
# Every GPU check and figure of the repository, in parts that each fit one 10-minute call on
# the H100 (the device tool's limit); results go to $OUT (or ./gpu-results).
#   bash scripts/gpu_checks.sh kernels   # build the kernels, pytest -m gpu (MoE grouped GEMM, the zero-bubble split backward, attention sinks, --deterministic-mode too), bench_kernels.py, activation memory
#   bash scripts/gpu_checks.sh training [--presets gpt2-350m]  # benchmark_gpt.py (plain eager/compile,
#                                        # megalite eager/compile, log MFU); one preset a call if the two overrun
#   bash scripts/gpu_checks.sh planner   # validate_planner.py: predicted vs measured memory and step time
#   bash scripts/gpu_checks.sh gpupath   # kernel register spills (ptxas -v) and a gpt-175b stage's build time
#                                        # with weights drawn on the GPU (the GPU tests run under `kernels`)
#   bash scripts/gpu_checks.sh fp8       # fp8_step.py: FP8 recipes vs bf16 step time and TFLOP/s (GPT 1.3B- and
#                                        # Llama 3 8B-shaped layers), then fp8_curves.py: the loss gap after 200 steps
#   bash scripts/gpu_checks.sh optim     # pytest -m gpu of Muon (true bf16 Newton-Schulz against the CPU's
#                                        # emulation), then benchmark_optimizers.py: Muon, bf16 moments vs fused AdamW
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  kernels|training|planner|gpupath|fp8|optim) ;;
  *) echo "usage: bash scripts/gpu_checks.sh {kernels|training [benchmark_gpt.py flags]|planner|gpupath|fp8|optim}" >&2; exit 2 ;;
esac
out=${OUT:-gpu-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MEGALITE_KERNEL_CACHE=${MEGALITE_KERNEL_CACHE:-/tmp/megalite-kernels}
pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/device.txt"
status=0
case "${1:-}" in
  kernels)
    python -c "from megalite import ops; print(ops.kernels_available())" 2>&1 | tee "$out/build.txt"
    python -m pytest -m gpu -q tests/test_gpu.py tests/test_documents.py tests/test_softmax_sink.py tests/test_deterministic.py 2>&1 | tee "$out/pytest_gpu.txt" || status=1
    python scripts/bench_kernels.py --json "$out/kernels.json" 2>&1 | tee "$out/kernels.txt" || status=1
    python scripts/activation_memory.py --json "$out/act.json" 2>&1 | tee "$out/act.txt" || status=1
    ;;
  training)
    shift
    tag=$(echo "$*" | tr -c 'a-zA-Z0-9.\n-' '_')
    python scripts/benchmark_gpt.py --json "$out/gpt${tag:+_$tag}.json" "$@" 2>&1 | tee "$out/gpt${tag:+_$tag}.txt" || status=1
    ;;
  planner)
    python scripts/validate_planner.py --json "$out/planner.json" 2>&1 | tee "$out/planner.txt" || status=1
    ;;
  gpupath)
    bash scripts/check_kernel_spills.sh 2>&1 | tee "$out/spills.txt" || status=1
    python scripts/bench_model_build.py --device cuda --layers 2 --json "$out/build.json" 2>&1 \
      | tee "$out/build.txt" || status=1
    ;;
  fp8)
    python -m pytest -q -m "gpu or not gpu" tests/test_fp8.py tests/test_fp8_native.py 2>&1 | tail -3 | tee "$out/fp8_tests.txt" || status=1
    python scripts/fp8_step.py --json "$out/fp8_step.json" 2>&1 | tee "$out/fp8_step.txt" || status=1
    python scripts/fp8_curves.py --models llama-tiny --json "$out/fp8_curves.json" --svg "$out/fp8_curves.svg" 2>&1 \
      | grep -v "^iter" | tee "$out/fp8_curves.txt" || status=1
    ;;
  optim)
    python -m pytest -m gpu -q tests/test_muon.py 2>&1 | tee "$out/optim_tests.txt" || status=1
    python scripts/benchmark_optimizers.py --device cuda --hidden 2048 --layers 4 --json "$out/optimizers.json" 2>&1 \
      | tee "$out/optimizers.txt" || status=1
    ;;
esac
exit $status
