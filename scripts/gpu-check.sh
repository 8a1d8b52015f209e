#!/usr/bin/env bash
# GPU checks, run on the GPU machine from the directory scripts/gpu-build.sh filled:
#   gpu-bin/gpu-check.sh [gpu-bin] [out-dir]
# 1. every CUDA kernel against the CPU reference (kvd-cuda tests/kernels.rs);
# 2. CUDA engines disaggregated through two kvd daemons vs a CUDA aggregated engine
#    (kvd-engine tests/gpu.rs);
# 3. kvd-bench pd-e2e on the CUDA backend (and the CPU one for comparison).
set -uo pipefail
B=$(cd "${1:-gpu-bin}" && pwd)
OUT=${2:-${OUT:-/tmp/kvd-gpu-out}}
mkdir -p "$OUT"
# Where CUDA 13's libnvrtc / libcublas may live (toolkit, or PyTorch's wheels).
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
         $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(os.path.dirname(nvidia.__file__), p, "lib") for p in os.listdir(os.path.dirname(nvidia.__file__))))' 2>/dev/null); do
  [[ -d $d ]] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
done
export LD_LIBRARY_PATH
{
  nvidia-smi -L
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  ldconfig -p | grep -E 'libcuda.so|libnvrtc.so|libcublas.so' | head
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
} 2>&1 | tee "$OUT/env.txt"
echo "== kernels" | tee "$OUT/kernels.txt"
timeout 90 "$B/kernels-test" --nocapture --test-threads 1 2>&1 | tail -40 | tee -a "$OUT/kernels.txt"
echo "== engines" | tee "$OUT/gpu-e2e.txt"
KVD_BIN_DIR=$B RUST_LOG=info timeout 150 "$B/gpu-test" --nocapture 2>&1 | tail -40 | tee -a "$OUT/gpu-e2e.txt"
echo "== bench cuda" | tee "$OUT/bench-cuda.txt"
timeout 180 "$B/kvd-bench" pd-e2e --backend cuda --bin-dir "$B" --tokens 128,512,2048,8192 --reps 2 2>&1 | tail -20 | tee -a "$OUT/bench-cuda.txt"
echo "== bench cpu" | tee "$OUT/bench-cpu.txt"
timeout 60 "$B/kvd-bench" pd-e2e --backend cpu --bin-dir "$B" --tokens 128,512 --reps 1 2>&1 | tail -20 | tee -a "$OUT/bench-cpu.txt"
