#!/usr/bin/env bash
# Rehearses the GPU check here, the way the GPU machine will run it, before any device
# time is spent: the bundle (scripts/gpu-build.sh → gpu-bin/) copied to another absolute
# path, run by gpu-bin/gpu-check.sh with a bare environment (`env -i`), the test venv's
# python3 (a venv, as the GPU machine's is), no network (a network namespace with only
# loopback), and the tree's sources, build outputs and the Rust toolchains hidden (tmpfs
# over them). On a machine without a GPU every step that needs none must pass, and every
# failure must be a CUDA call saying so; this script checks exactly that and exits
# non-zero otherwise.
#   scripts/gpu-rehearse.sh [out-dir]
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-/tmp/kvd-gpu-rehearsal}
[[ -x $ROOT/gpu-bin/gpu-check.sh ]] || { echo "no bundle: run scripts/gpu-build.sh first"; exit 1; }
[[ -x $ROOT/.venv/bin/python3 ]] || { echo "no test venv: run scripts/test.sh once first"; exit 1; }
WORK=$(mktemp -d /tmp/kvd-gpu-bundle.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
cp -r "$ROOT/gpu-bin" "$WORK/bundle"
rm -rf "$OUT" && mkdir -p "$OUT"
hide=("$ROOT/target" "$ROOT/daemon" "$ROOT/model" "$ROOT/engine" "$ROOT/client" "$ROOT/protocol"
      "$ROOT/cuda" "$ROOT/gpu" "$ROOT/store" "$ROOT/nvme" "$ROOT/transfer" "$ROOT/checksum" "$ROOT/testkit"
      "$ROOT/bench" "$ROOT/scripts" "$ROOT/gpu-bin" "$HOME/.cargo" "$HOME/.rustup")
inner=$(cat <<EOF
for d in ${hide[*]}; do [[ -d \$d ]] && mount -t tmpfs none "\$d"; done
ip link set lo up
if command -v cargo >/dev/null || command -v rustc >/dev/null; then echo "rehearsal: a Rust toolchain is still visible"; exit 3; fi
exec env -i HOME="$WORK" PATH="$ROOT/.venv/bin:/usr/bin:/bin" bash "$WORK/bundle/gpu-check.sh" "$WORK/bundle" "$OUT"
EOF
)
unshare -rmn bash -c "$inner" | tee "$OUT/rehearsal.txt"
# Which failures are not the absent GPU's.
bad=0
for f in "$OUT"/*.txt; do
  name=$(basename "$f" .txt)
  [[ $name == env || $name == rehearsal ]] && continue
  grep -q "^gpu-check: FAILED: $name " "$OUT/rehearsal.txt" || continue
  if ! grep -qE 'libcuda not found|no CUDA device|no usable CUDA device|CUDA device is required|KVD_REQUIRE_CUDA=1 but' "$f"; then
    echo "rehearsal: step $name failed for another reason than the absent GPU: $f"
    bad=1
  fi
done
[[ $bad -eq 0 ]] && echo "rehearsal: every step that needs no GPU passed; every failure is a CUDA call"
exit $bad
