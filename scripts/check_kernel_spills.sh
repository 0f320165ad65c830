#!/usr/bin/env bash
# Compile every kernel in kernels/*.cu for the given GPU architectures with `ptxas -v` and fail if
# any kernel spills registers to local memory (a spill means a launch configuration holds more
# values per thread than the register file allows: slower, silently). Needs nvcc, not a GPU:
#   bash scripts/check_kernel_spills.sh            # sm_90 (H100)
#   ARCHS="80 90" bash scripts/check_kernel_spills.sh
# nvcc comes from $CUDA_HOME/bin or PATH; the CUDA 13 wheels (nvidia-cuda-nvcc, nvidia-nvvm,
# nvidia-cuda-crt, nvidia-cuda-runtime, nvidia-cuda-cccl; see docs/kernels.md) provide one. Works
# with the CPU build of PyTorch too (see the stub header below).
set -euo pipefail
cd "$(dirname "$0")/.."
archs=${ARCHS:-90}
nvcc=${CUDA_HOME:+$CUDA_HOME/bin/}nvcc
if ! command -v "$nvcc" >/dev/null; then
  echo "check_kernel_spills: no nvcc (set CUDA_HOME or put nvcc on PATH)" >&2
  exit 2
fi

work=$(mktemp -d)
declare -A pids starts  # per (source, architecture) key: its compile's process and start time
# However the check ends (a failed compile stops it early), no compile outlives it or its directory.
trap 'kill "${pids[@]}" 2>/dev/null || true; wait; rm -rf "$work"' EXIT
# The same include paths and nvcc flags as the JIT build (torch.utils.cpp_extension, megalite.ops.build).
mapfile -t flags < <(python - <<'EOF'
import os, sysconfig
from torch.utils import cpp_extension
from megalite.ops import build
for path in cpp_extension.include_paths():
    print(f"-I{path}")
print(f"-I{sysconfig.get_paths()['include']}")
for flag in list(cpp_extension.COMMON_NVCC_FLAGS) + list(build.CUDA_FLAGS):
    print(flag)
EOF
)
# A CPU build of PyTorch ships c10/cuda's headers but not the one its CMake generates for CUDA
# builds; the kernels need nothing from it beyond its existence.
torch_include=$(python -c "from torch.utils import cpp_extension; print(cpp_extension.include_paths()[0])")
if [ ! -f "$torch_include/c10/cuda/impl/cuda_cmake_macros.h" ]; then
  mkdir -p "$work/stub/c10/cuda/impl"
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$work/stub/c10/cuda/impl/cuda_cmake_macros.h"
  flags+=("-I$work/stub")
fi

sources=(kernels/*.cu)
echo "check_kernel_spills: compiling ${#sources[@]} sources for sm_${archs// /, sm_}, side by side"
# Every (architecture, source) compiles at once (nvcc is one process each: on a few cores the
# check takes the longest compile, not the sum); the results are read in order.
for arch in $archs; do
  for src in "${sources[@]}"; do
    key="$(basename "$src" .cu).sm_$arch"
    "$nvcc" -cubin -arch="sm_$arch" -std=c++17 -Ikernels "${flags[@]}" -Xptxas -v -o "$work/$key.cubin" \
      "$src" >"$work/$key.log" 2>&1 &
    pids[$key]=$! starts[$key]=$SECONDS
  done
done

status=0
for arch in $archs; do
  for src in "${sources[@]}"; do
    key="$(basename "$src" .cu).sm_$arch"
    log="$work/$key.log"
    if ! wait "${pids[$key]}"; then
      cat "$log" >&2
      echo "check_kernel_spills: $src does not compile for sm_$arch" >&2
      exit 1
    fi
    # ptxas prints, per kernel: "Compiling entry function 'NAME'", then "N bytes spill stores, M bytes spill loads".
    spills=$(awk '/Compiling entry function/ { name = $0; sub(/.*function .\047?/, "", name); sub(/\047.*/, "", name) }
                  /bytes spill stores/ && ($5 + 0 > 0 || $9 + 0 > 0) { print "  " name ": " $0 }' "$log" \
             | sed -E 's/ +([0-9]+ bytes stack)/ \1/')
    kernels=$(grep -c "Compiling entry function" "$log" || true)
    if [ -n "$spills" ]; then
      echo "sm_$arch $src: spills in" >&2
      echo "$spills" | (command -v c++filt >/dev/null && c++filt || cat) >&2
      status=1
    else
      echo "sm_$arch $src: $kernels kernels, no spills (read $((SECONDS - ${starts[$key]})) s after its start)"
    fi
  done
done
exit $status
