#!/usr/bin/env bash
# kvd under real engines on one machine: starts the kvd daemon(s), checks they serve, and
# prints the engine commands with the exact flags — or, with --run, runs them (needs vLLM
# or SGLang in the active Python with the `kvd` package installed, and a GPU).
#
#   deploy/local/engines.sh prefix [--run|--check]   # one daemon, vLLM with kvd prefix caching
#   deploy/local/engines.sh pd [--run|--check]       # two daemons ("nodes"), a vLLM prefill
#                                                    # and a vLLM decode instance, KV via kvd
#   deploy/local/engines.sh sglang [--run|--check]   # one daemon, SGLang with kvd as HiCache L3
#
# Plain: the daemons keep running (Ctrl-C stops them); run the printed commands beside
# them. --check (the test command): checks the daemons serve and that the engines'
# own config code accepts the printed flags (vLLM's KVTransferConfig and connector
# factory, SGLang's storage backend loader, when installed in $KVD_PYTHON), then stops.
# MODEL (default Qwen/Qwen2.5-0.5B-Instruct) picks the model; KVD_BIN a directory with the
# kvd binary (default: builds target/release).
set -euo pipefail
cd "$(dirname "$0")/../.."
MODE=${1:-prefix}
RUN=${2:-}
case "$RUN" in ""|--run|--check) ;; *) echo "usage: $0 prefix|pd|sglang [--run|--check]" >&2; exit 2 ;; esac
PY=${KVD_PYTHON:-python3}
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
BIN=${KVD_BIN:-target/release}
if [[ -z "${KVD_BIN:-}" ]]; then
  cargo build --release -q -p kvd-daemon
fi
case "$MODE" in prefix|pd|sglang) ;; *) echo "usage: $0 prefix|pd|sglang [--run|--check]" >&2; exit 2 ;; esac
WORK=$(mktemp -d /tmp/kvd-engines.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK" /dev/shm/kvd-engines-*-$$ /dev/shm/kvd-engines-*-$$.table
}
trap cleanup EXIT

python3 -c 'import secrets; print(secrets.token_hex(32))' >"$WORK/cluster.key"
chmod 600 "$WORK/cluster.key"
nodes=(a)
[[ "$MODE" == pd ]] && nodes=(a b)
for n in "${nodes[@]}"; do
  "$BIN/kvd" --endpoint "ipc://$WORK/kvd-$n.sock" --pool-path "/dev/shm/kvd-engines-$n-$$" \
    --cluster-secret-file "$WORK/cluster.key" --pool-size "${KVD_POOL_SIZE:-4GiB}" \
    --metrics-addr 127.0.0.1:0 --log-level warn >"$WORK/kvd-$n.log" 2>&1 &
  PIDS+=($!)
done
for n in "${nodes[@]}"; do
  for _ in $(seq 200); do [[ -S "$WORK/kvd-$n.sock" ]] && break; sleep 0.05; done
  "$BIN/kvd" ctl --endpoint "ipc://$WORK/kvd-$n.sock" stats >/dev/null \
    || { cat "$WORK/kvd-$n.log"; echo "kvd on node $n did not serve" >&2; exit 1; }
  echo "kvd node $n: ipc://$WORK/kvd-$n.sock (ok)"
done

ktc() {  # the --kv-transfer-config of one vLLM instance: role, daemon endpoint
  printf '{"kv_connector":"KvdConnector","kv_connector_module_path":"kvd.vllm_connector","kv_role":"%s","kv_load_failure_policy":"recompute","kv_connector_extra_config":{"endpoint":"%s"}}' "$1" "$2"
}
sgl() {  # SGLang's --hicache-storage-backend-extra-config: daemon endpoint
  printf '{"backend_name":"kvd","module_path":"kvd.sglang_backend","class_name":"KvdHiCacheStorage","interface_v1":1,"endpoint":"%s"}' "$1"
}
CMDS=()
CONFIGS=()  # engine:json, checked with --check
case "$MODE" in
  prefix)
    CONFIGS+=("vllm:$(ktc kv_both "ipc://$WORK/kvd-a.sock")")
    CMDS+=("vllm serve $MODEL --port 8000 --kv-transfer-config '$(ktc kv_both "ipc://$WORK/kvd-a.sock")'")
    NOTE="Send the same long prompt twice to :8000; the second is scheduled with kvd's blocks as external hits."
    ;;
  pd)
    CONFIGS+=("vllm:$(ktc kv_producer "ipc://$WORK/kvd-a.sock")" "vllm:$(ktc kv_consumer "ipc://$WORK/kvd-b.sock")")
    CMDS+=("CUDA_VISIBLE_DEVICES=0 vllm serve $MODEL --port 8100 --kv-transfer-config '$(ktc kv_producer "ipc://$WORK/kvd-a.sock")'")
    CMDS+=("CUDA_VISIBLE_DEVICES=1 vllm serve $MODEL --port 8200 --kv-transfer-config '$(ktc kv_consumer "ipc://$WORK/kvd-b.sock")'")
    NOTE="A proxy sends each prompt to :8100 with \"kv_transfer_params\": {\"do_remote_decode\": true} and max_tokens 1, then to :8200 with the kv_transfer_params of that answer (vLLM's example toy_proxy_server.py does exactly this: --prefiller-port 8100 --decoder-port 8200). Add \"mode\":\"push\" to the decode side's extra config to have the prefill daemon push."
    ;;
  sglang)
    CONFIGS+=("sglang:$(sgl "ipc://$WORK/kvd-a.sock")")
    CMDS+=("python -m sglang.launch_server --model-path $MODEL --port 8000 --enable-hierarchical-cache --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '$(sgl "ipc://$WORK/kvd-a.sock")'")
    NOTE="Pages SGLang's host cache evicts are kept in kvd and prefetched back on a prefix hit."
    ;;
esac
echo
for c in "${CMDS[@]}"; do echo "  $c"; echo; done
echo "$NOTE"
case "$RUN" in
  --check)
    "$PY" - "${CONFIGS[@]}" <<'PYEOF'
import json, sys
for arg in sys.argv[1:]:
    engine, cfg = arg.split(":", 1)
    cfg = json.loads(cfg)
    try:
        __import__(engine)
    except ImportError:
        print(f"{engine} not installed here: flags checked as JSON only")
        continue
    if engine == "vllm":
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        cls = KVConnectorFactory.get_connector_class(KVTransferConfig(**cfg))
    else:
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
        cls = StorageBackendFactory._load_backend_class(cfg["module_path"], cfg["class_name"], cfg["backend_name"])
    print(f"{engine} accepts the flags: {cls.__module__}.{cls.__name__} ({cfg.get('kv_role', 'storage backend')})")
PYEOF
    ;;
  --run)
    for c in "${CMDS[@]}"; do
      bash -c "$c" &
      PIDS+=($!)
    done
    echo "running (Ctrl-C stops the engines and the daemons)"
    wait
    ;;
  *)
    echo "the daemons run until Ctrl-C"
    wait
    ;;
esac
