#!/usr/bin/env bash
# GPU checks, run on the GPU machine from the directory scripts/gpu-build.sh filled:
#   gpu-bin/gpu-check.sh [gpu-bin] [out-dir]
# 0. every kernel file compiles under this machine's NVRTC (kvd-model tests/nvrtc.rs);
# 1. every CUDA kernel against the CPU reference (kvd-model tests/kernels.rs);
# 2. CUDA engines disaggregated through two kvd daemons vs a CUDA aggregated engine
#    (kvd-engine tests/gpu.rs);
# 3. the daemon's GPU tier on the device: IPC memory of the test process, gpu_store /
#    gpu_load through the pinned pool and gpu_pull device to device, byte for byte
#    (kvd-daemon tests/gpu_cuda.rs) on each copy path (engine, kernel, default), then
#    kvd-bench gpu against the link (one large pinned copy; one large device copy for
#    pulls) and per-piece cuMemcpyAsync, pieces 16 KiB..16 MiB and vLLM's, the copy
#    kernel on and off (chart: bench-gpu.svg);
# 4. the Python package's DMA path with torch CUDA tensors (GPU -> registered pool ->
#    GPU, byte-identical) against torch's pinned-memory copies (scripts/gpu-torch-dma.py);
# 5. kvd-bench pd-e2e on the CUDA backend, engines on the GPU tier too (same-node
#    handoffs device to device, prefix hits by gpu_load), and the CPU one for comparison.
# Every GPU test runs with KVD_REQUIRE_CUDA=1 (no device is a failure, not a skip). Each
# step's whole output goes to its own file under the out-dir; the script goes on after a
# failed step, prints a summary, and exits non-zero if any step failed.
set -uo pipefail
B=$(cd "${1:-gpu-bin}" && pwd)
OUT=${2:-${OUT:-/tmp/kvd-gpu-out}}
mkdir -p "$OUT"
export KVD_REQUIRE_CUDA=1 KVD_REQUIRE_NVRTC=1 KVD_BIN_DIR="$B"
# Where CUDA 13's libnvrtc / libcublas may live (toolkit, or PyTorch's wheels: `nvidia` is
# a namespace package, so its directory is `__path__`, not `__file__`, which is None).
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
         $(python3 -c 'import nvidia, os; d = list(nvidia.__path__)[0]; print(" ".join(os.path.join(d, p, "lib") for p in os.listdir(d)))' 2>/dev/null); do
  [[ -d $d ]] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
done
# (`set -u`: with none of these directories and none inherited it must still be set, or
# the first use below ends the script before any step, silently.)
export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}
# The machine's own ptxas (CUDA toolkit) for the sm_90 assembly check, when it has one.
KVD_PTXAS=$(command -v ptxas || ls /usr/local/cuda/bin/ptxas 2>/dev/null || true)
[[ -n $KVD_PTXAS ]] && export KVD_PTXAS
{
  nvidia-smi -L
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  ldconfig -p | grep -E 'libcuda.so|libnvrtc.so|libcublas.so' | head
  ldd --version | head -1
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
} >"$OUT/env.txt" 2>&1
failed=()
step() { # name, timeout, command...
  local name=$1 t=$2; shift 2
  echo "== $name"
  timeout "$t" "$@" >"$OUT/$name.txt" 2>&1
  local rc=$?
  tail -15 "$OUT/$name.txt"
  if [[ $rc -ne 0 ]]; then failed+=("$name (exit $rc)"); fi
}
step nvrtc 60 "$B/nvrtc-test" --nocapture
step kernels 120 "$B/kernels-test" --nocapture --test-threads 1
RUST_LOG=info step gpu-e2e 180 "$B/gpu-test" --nocapture
step gpu-tier 120 "$B/gpu-tier-test" --nocapture
step bench-gpu 300 "$B/kvd-bench" --plot "$OUT/bench-gpu.svg" gpu --device cuda --batch 512MiB --reps 3
torch_dma() {
  local d; d=$(mktemp -d)
  # The machine's python3 is itself a venv with torch: a venv made from it would not see
  # torch (--system-site-packages means the base interpreter's). Install the wheel into
  # a directory of its own and put that on PYTHONPATH instead.
  python3 -m pip install -q --no-deps --no-index --target "$d/site" "$B"/kvd-*.whl || return 1
  "$B/kvd" --endpoint "ipc://$d/kvd.sock" --pool-path "$d/kvd.pool" --pool-size 1GiB --metrics-addr 127.0.0.1:0 --gpu-device off &
  local pid=$!
  for _ in $(seq 100); do [[ -S $d/kvd.sock ]] && break; sleep 0.1; done
  PYTHONPATH="$d/site${PYTHONPATH:+:$PYTHONPATH}" python3 "$B/gpu-torch-dma.py" "ipc://$d/kvd.sock"
  local rc=$?
  kill "$pid"; wait "$pid"; rm -rf "$d"
  return $rc
}
export -f torch_dma; export B
step torch-dma 120 bash -c torch_dma
step bench-cuda 240 "$B/kvd-bench" pd-e2e --backend cuda --bin-dir "$B" --tokens 128,512,2048,8192 --reps 2 --layerwise 4 --gpu-tier cuda
step bench-cpu 60 "$B/kvd-bench" pd-e2e --backend cpu --bin-dir "$B" --tokens 128,512 --reps 1
if [[ ${#failed[@]} -gt 0 ]]; then
  printf 'gpu-check: FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "gpu-check: every step passed (logs in $OUT)"
