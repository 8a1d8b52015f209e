#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh runs on a GPU machine that has CUDA but no Rust
# toolchain: stripped release binaries with the `cuda` feature (cudarc loads CUDA at run
# time, so no toolkit is needed here), copied to gpu-bin/ (git-ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR=target/gpu CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=true
FEAT=kvd-engine/cuda,kvd-model/cuda,kvd-daemon/cuda
cargo build --release -p kvd-daemon -p kvd-engine -p kvd-bench --features "$FEAT,kvd-bench/cuda"
cargo test --release -p kvd-model -p kvd-engine -p kvd-daemon --features "$FEAT" --no-run \
  --test kernels --test gpu --test nvrtc --test gpu_cuda
rm -rf gpu-bin && mkdir gpu-bin
cp target/gpu/release/{kvd,kvd-engine,kvd-router,kvd-bench} gpu-bin/
newest() { ls -t target/gpu/release/deps/"$1"-* | grep -v '\.d$' | head -1; }
cp "$(newest kernels)" gpu-bin/kernels-test
cp "$(newest gpu)" gpu-bin/gpu-test
cp "$(newest nvrtc)" gpu-bin/nvrtc-test
cp "$(newest gpu_cuda)" gpu-bin/gpu-tier-test
cp scripts/gpu-check.sh scripts/gpu-torch-dma.py gpu-bin/
# The Python package as an abi3 wheel (the GPU machine has torch but no registry: it
# installs this file with --no-deps).
VIRTUAL_ENV="$PWD/.venv" PATH="$PWD/.venv/bin:$PATH" .venv/bin/maturin build --release --locked -q \
  -m python/Cargo.toml -o gpu-bin
du -sh gpu-bin
# The GPU machine runs these as they are: say which glibc they need (its own must be at
# least that), and keep the bundle within what the device tool carries (64 MiB).
need=$(for f in gpu-bin/*; do objdump -T "$f" 2>/dev/null || true; done | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1 || true)
echo "gpu-bin needs ${need:-an unknown glibc} (this machine has $(ldd --version | head -1 | grep -o '[0-9.]*$')); the wheel: $(cd gpu-bin && ls ./*.whl)"
size=$(du -sm gpu-bin | cut -f1)
[[ $size -le 64 ]] || { echo "gpu-bin is ${size} MiB: over the 64 MiB the device tool carries"; exit 1; }
