#!/usr/bin/env bash
# One machine, two "nodes": starts two kvd daemons, a prefill engine on node A, a decode
# engine on node B and the router on loopback; sends a few requests through the router
# (pull, then a repeated prompt that hits kvd's cache, then push); prints the generated
# text and TTFT; shuts everything down.
#
#   deploy/local/run.sh            # builds release binaries first if needed
#   KVD_BIN=target/debug deploy/local/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=${KVD_BIN:-target/release}
if [[ -z "${KVD_BIN:-}" ]]; then
  cargo build --release -q -p kvd-daemon -p kvd-engine
fi
WORK=$(mktemp -d /tmp/kvd-local.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_http() { for _ in $(seq 1 400); do python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=1)' "$1" 2>/dev/null && return 0; sleep 0.05; done; echo "timeout waiting for $1" >&2; return 1; }
wait_file() { for _ in $(seq 1 200); do [[ -S "$1" ]] && return 0; sleep 0.05; done; echo "timeout waiting for $1" >&2; return 1; }

# The two "nodes" share a cluster secret, as every node of a real cluster must.
python3 -c 'import secrets; print(secrets.token_hex(32))' >"$WORK/cluster.key"
chmod 600 "$WORK/cluster.key"
for n in a b; do
  "$BIN/kvd" --endpoint "ipc://$WORK/kvd-$n.sock" --pool-path "/dev/shm/kvd-local-$n-$$" \
    --cluster-secret-file "$WORK/cluster.key" \
    --pool-size 256MiB --metrics-addr 127.0.0.1:0 --log-level warn >"$WORK/kvd-$n.log" 2>&1 &
  PIDS+=($!)
done
wait_file "$WORK/kvd-a.sock"; wait_file "$WORK/kvd-b.sock"

PP=$(free_port); DP=$(free_port); RP=$(free_port)
RUST_LOG=warn "$BIN/kvd-engine" --role prefill --listen "127.0.0.1:$PP" --kvd "ipc://$WORK/kvd-a.sock" >"$WORK/prefill.log" 2>&1 &
PIDS+=($!)
RUST_LOG=warn "$BIN/kvd-engine" --role decode --listen "127.0.0.1:$DP" --kvd "ipc://$WORK/kvd-b.sock" >"$WORK/decode.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$PP/health"; wait_http "http://127.0.0.1:$DP/health"
start_router() {
  RUST_LOG=warn "$BIN/kvd-router" --listen "127.0.0.1:$RP" --prefill "http://127.0.0.1:$PP" \
    --decode "http://127.0.0.1:$DP" --mode "$1" >"$WORK/router-$1.log" 2>&1 &
  RPID=$!
  PIDS+=($RPID)
  wait_http "http://127.0.0.1:$RP/health"
}

ask() { # prompt, label
  python3 - "$RP" "$1" "$2" <<'PY'
import json, sys, time, urllib.request
port, prompt, label = sys.argv[1], sys.argv[2], sys.argv[3]
body = json.dumps({"prompt": prompt, "max_tokens": 24, "stream": True}).encode()
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
t0 = time.time(); ttft = None; text = ""; last = {}
with urllib.request.urlopen(req, timeout=60) as r:
    for line in r:
        line = line.decode().strip()
        if not line.startswith("data: "): continue
        data = line[6:]
        if data == "[DONE]": break
        ev = json.loads(data)
        if "error" in ev: print(f"  error: {ev['error']['message']}"); break
        if ttft is None and ev["choices"][0].get("token_ids"): ttft = time.time() - t0
        text += ev["choices"][0]["text"]; last = ev
kvd = last.get("kvd", {})
print(f"[{label}] TTFT {ttft*1e3:.1f} ms, KV from {kvd.get('source')} ({kvd.get('cached_tokens')} tokens cached), text: {text!r}")
PY
}

PROMPT="kvd moves KV caches between prefill and decode workers; this prompt is long enough to fill several blocks of sixteen tokens each."
start_router pull
ask "$PROMPT" "pull, cold"
ask "$PROMPT" "pull, repeated (prefix hit on node A)"
kill "$RPID"; wait "$RPID" 2>/dev/null || true
start_router push
ask "$PROMPT A different ending." "push"
echo "logs were in $WORK (removed on exit)"
