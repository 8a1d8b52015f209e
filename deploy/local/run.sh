#!/usr/bin/env bash
# One machine, two "nodes": starts two kvd daemons, a prefill engine on node A, a decode
# engine on node B and the router on loopback; sends a few requests through the router
# (pull, then a repeated prompt that hits kvd's cache, then push); prints the generated
# text and TTFT; shuts everything down.
#
#   deploy/local/run.sh            # builds release binaries first if needed
#   KVD_BIN=target/debug deploy/local/run.sh
#   KVD_MODEL_DIR=~/models/Llama-3.2-1B deploy/local/run.sh   # a real checkpoint
#
# Without KVD_MODEL_DIR the engines run a tiny Llama-style model with random (seeded)
# weights: the generated text is noise, by design. What the demo shows is where each
# request's KV came from (computed, kvd's local cache, a pull or a push from the other
# node) and what reusing it saved in time to first token. KVD_MODEL_DIR names a Hugging
# Face checkpoint directory of a Llama or a gpt-oss (bf16/f32 weights; config.json, one
# model.safetensors, tokenizer.json);
# the engine reads it as transformers would, or refuses what it does not implement.
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
  # (the daemons keep nothing and remove their pools at exit; one that died leaves its own)
  rm -rf "$WORK" /dev/shm/kvd-local-*-$$ /dev/shm/kvd-local-*-$$.table
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

MODEL=()
if [[ -n "${KVD_MODEL_DIR:-}" ]]; then
  MODEL=(--model-config "$KVD_MODEL_DIR/config.json" --weights "$KVD_MODEL_DIR/model.safetensors")
  [[ -f "$KVD_MODEL_DIR/tokenizer.json" ]] && MODEL+=(--tokenizer "$KVD_MODEL_DIR/tokenizer.json")
  echo "model: $KVD_MODEL_DIR"
else
  echo "model: a tiny Llama-style model with random weights (the text below is noise; watch where the KV comes from and the TTFT)"
fi
PP=$(free_port); DP=$(free_port); RP=$(free_port)
RUST_LOG=warn "$BIN/kvd-engine" --role prefill --listen "127.0.0.1:$PP" --kvd "ipc://$WORK/kvd-a.sock" "${MODEL[@]}" >"$WORK/prefill.log" 2>&1 &
PIDS+=($!)
RUST_LOG=warn "$BIN/kvd-engine" --role decode --listen "127.0.0.1:$DP" --kvd "ipc://$WORK/kvd-b.sock" "${MODEL[@]}" >"$WORK/decode.log" 2>&1 &
PIDS+=($!)
wait_http "http://127.0.0.1:$PP/health" || { cat "$WORK/prefill.log"; exit 1; }
wait_http "http://127.0.0.1:$DP/health" || { cat "$WORK/decode.log"; exit 1; }
start_router() {
  RUST_LOG=warn "$BIN/kvd-router" --listen "127.0.0.1:$RP" --prefill "http://127.0.0.1:$PP" \
    --decode "http://127.0.0.1:$DP" --mode "$1" >"$WORK/router-$1.log" 2>&1 &
  RPID=$!
  PIDS+=($RPID)
  wait_http "http://127.0.0.1:$RP/health"
}

ask() { # prompt, label
  python3 - "$RP" "$1" "$2" "$WORK/results" "$PP" <<'PY'
import json, sys, time, urllib.request
port, prompt, label, results, prefill = sys.argv[1:6]
# What node A's kvd already holds of this prompt: the prefill worker reuses exactly that.
look = urllib.request.Request(f"http://127.0.0.1:{prefill}/v1/lookup", json.dumps({"prompt": prompt}).encode(),
                              {"Content-Type": "application/json"})
reused = json.load(urllib.request.urlopen(look, timeout=10))["cached_tokens"]
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
print(f"[{label}] TTFT {ttft*1e3:.1f} ms; prefill: {reused} prompt tokens reused from node A's kvd; "
      f"decode: KV by {kvd.get('source')} ({kvd.get('cached_tokens')} tokens); text: {text!r}")
with open(results, "a") as f:
    f.write(json.dumps({"label": label, "ttft_ms": ttft * 1e3, "reused": reused}) + "\n")
PY
}

PROMPT="kvd moves KV caches between prefill and decode workers; this prompt is long enough to fill several blocks of sixteen tokens each."
start_router pull
ask "$PROMPT" "pull, cold"
ask "$PROMPT" "pull, repeated (prefix hit on node A)"
kill "$RPID"; wait "$RPID" 2>/dev/null || true
start_router push
ask "$PROMPT A different ending." "push"
python3 - "$WORK/results" <<'PY'
import json, sys
r = [json.loads(l) for l in open(sys.argv[1])]
cold, hit = r[0], r[1]
print(f"reuse: the repeated prompt took {hit['reused']} prompt tokens from node A's kvd instead of "
      f"computing them; TTFT {hit['ttft_ms']:.1f} ms against {cold['ttft_ms']:.1f} ms cold")
PY
echo "logs were in $WORK (removed on exit)"
