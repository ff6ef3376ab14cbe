#!/usr/bin/env bash
# Build the image, create a kind cluster, apply the simulated overlay, run the examples and check
# where they landed. Needs docker (or podman), kind and kubectl; see README.md here.
# It cannot run on the project's CI machines (no container runtime there); e2e/ tests the same loop on
# the real Kubernetes binaries instead.
set -euo pipefail
cd "$(dirname "$0")/../.."

CLUSTER=${CLUSTER:-gpu-slice}
IMAGE=${IMAGE:-gpu-slice:0.1.0}          # the tag the manifests name
KEEP=${KEEP:-0}                          # KEEP=1 leaves the cluster up

for tool in docker kind kubectl; do
    command -v "$tool" >/dev/null || { echo "$tool is required" >&2; exit 2; }
done

docker build -t "$IMAGE" .
kind create cluster --name "$CLUSTER" --config e2e/kind/kind-config.yaml --wait 120s
[ "$KEEP" = 1 ] || trap 'kind delete cluster --name "$CLUSTER"' EXIT
kind load docker-image --name "$CLUSTER" "$IMAGE"
CTX="kind-$CLUSTER"
k() { kubectl --context "$CTX" "$@"; }

# The overlay includes the Prometheus operator's kinds (PodMonitor, PrometheusRule): without the
# operator's CRDs, apply everything else and say so.
if ! k get crd podmonitors.monitoring.coreos.com >/dev/null 2>&1; then
    echo "note: no Prometheus operator CRDs; the monitoring objects are skipped" >&2
    kubectl kustomize manifests/overlays/simulated \
        | python3 -c 'import sys, yaml; docs = [d for d in yaml.safe_load_all(sys.stdin) if d and d["kind"] not in ("PodMonitor", "ServiceMonitor", "PrometheusRule")]; print(yaml.safe_dump_all(docs))' \
        | k apply --server-side -f -
else
    k apply --server-side -k manifests/overlays/simulated
fi
k -n gpu-slice-system rollout status daemonset/gpu-slice-device-plugin --timeout=180s
# The MPS daemons' DaemonSet is OnDelete (rollout status only follows RollingUpdate): wait for its pods.
k -n gpu-slice-system wait --for=condition=Ready pod -l app.kubernetes.io/name=gpu-slice-mps --timeout=180s
k -n gpu-slice-system rollout status deployment/gpu-slice-scheduler --timeout=180s

# Every simulated node advertises its slices.
for node in $(k get nodes -l example.com/gpu-slice.simulated=true -o name); do
    for _ in $(seq 60); do
        n=$(k get "$node" -o jsonpath='{.status.allocatable.example\.com/gpu-slice}')
        [ -n "$n" ] && [ "$n" != 0 ] && break
        sleep 2
    done
    echo "$node: ${n:-0} slices allocatable"
    [ -n "$n" ] && [ "$n" != 0 ] || { echo "$node advertises no slices" >&2; exit 1; }
done

k apply -f manifests/examples/
for d in vllm-qwen-7b tgi-mistral-7b vllm-llama-13b-isolated; do
    # The images are real model servers: they are scheduled and admitted (what is checked here); they
    # may not become Ready without a GPU, so wait for placement, not readiness.
    for _ in $(seq 90); do
        placed=$(k get pods -l app="$d" -o jsonpath='{range .items[*]}{.spec.nodeName}{"\n"}{end}' | grep -c . || true)
        want=$(k get deployment "$d" -o jsonpath='{.spec.replicas}')
        [ "$placed" = "$want" ] && break
        sleep 2
    done
    [ "$placed" = "$want" ] || { echo "$d: $placed of $want pods placed" >&2; k describe pods -l app="$d" >&2; exit 1; }
done

# Where they landed: each pod's node, the GPU (or MIG instance) of its assignment, and the ids its
# device plugin stamped; the assignment and the allocated ids must agree.
python3 - "$CTX" <<'PY'
import json, subprocess, sys
ctx = sys.argv[1]
pods = json.loads(subprocess.run(["kubectl", "--context", ctx, "get", "pods", "-o", "json"], check=True,
                                 capture_output=True, text=True).stdout)["items"]
bad = 0
for p in pods:
    ann = p["metadata"].get("annotations") or {}
    if "example.com/gpu-slice.assignment" not in ann:
        continue
    a = json.loads(ann["example.com/gpu-slice.assignment"])
    alloc = json.loads(ann.get("example.com/gpu-slice.allocated", "null") or "null")
    got = sorted(alloc["sliceIds"]) if alloc else None
    ok = got is None or got == sorted(a["sliceIds"])  # not stamped yet: the container has not started
    bad += not ok or a["node"] != p["spec"].get("nodeName")
    print(f'{p["metadata"]["name"]:40} {p["spec"].get("nodeName", "-"):24} {a.get("instance") or ",".join(a["gpus"])} '
          f'{len(a["sliceIds"])} slices {"ok" if ok else "MISMATCH allocated " + str(got)}')
sys.exit(1 if bad else 0)
PY
echo "examples placed as assigned"
