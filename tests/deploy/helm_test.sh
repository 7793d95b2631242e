#!/usr/bin/env bash
# The Helm chart (deploy/helm/k3serve): helm lint --strict and helm template with the default
# values, the GPU values and the CPU single-node values; every rendered object validated against
# the Kubernetes schemas (kubernetes-models); values.schema.json rejects a bad value; and the
# objects a values file asks for are there (GPUs, TLS mounts, PodMonitor, dashboards...).
set -euo pipefail
src="$(cd "$(dirname "$0")/../.." && pwd)"
cache="$("$src/deploy/tools/npm_tools.sh")"
helm="$cache/bin/helm"
chart="$src/deploy/helm/k3serve"
work="$(mktemp -d "$cache/helm.XXXXXX")"  # inside the cache: node_modules resolves from it
trap 'rm -rf "$work"' EXIT
cp "$src/tests/deploy/validate_manifests.mjs" "$work/"
export HELM_CACHE_HOME="$work/helm-cache" HELM_CONFIG_HOME="$work/helm-config" HELM_DATA_HOME="$work/helm-data"
fail() { echo "FAIL: $*" >&2; exit 1; }

for values in default gpu-values cpu-single-node-values; do
  args=()
  [ "$values" = default ] || args=(-f "$chart/ci/$values.yaml")
  "$helm" lint --strict "$chart" "${args[@]}" > "$work/lint.txt" 2>&1 || { cat "$work/lint.txt"; fail "helm lint --strict ($values)"; }
  "$helm" template k3serve "$chart" --namespace serving "${args[@]}" > "$work/$values.yaml" 2> "$work/template.err" ||
    { cat "$work/template.err"; fail "helm template ($values)"; }
  echo "ok: helm lint --strict and helm template ($values): $(grep -c '^kind:' "$work/$values.yaml") objects"
done
(cd "$work" && node validate_manifests.mjs default.yaml gpu-values.yaml cpu-single-node-values.yaml) > "$work/validate.txt" ||
  { cat "$work/validate.txt"; fail "a rendered object does not pass the Kubernetes schema"; }
tail -1 "$work/validate.txt"

# Not vacuous: the validator rejects a Deployment with a string for replicas.
sed '0,/replicas: 2/s//replicas: "2"/' "$work/default.yaml" > "$work/bad.yaml"
if (cd "$work" && node validate_manifests.mjs bad.yaml > "$work/bad.txt"); then fail "the validator accepted replicas: \"2\""; fi
grep -q '^FAIL .*replicas' "$work/bad.txt" || { cat "$work/bad.txt"; fail "the validator did not name replicas"; }
echo "ok: the validator rejects replicas: \"2\""

# values.schema.json rejects a bad value, naming it.
if "$helm" template k3serve "$chart" --set experts.replicas=two > /dev/null 2> "$work/bad-values.txt"; then
  fail "--set experts.replicas=two was accepted"
fi
grep -q "experts/replicas" "$work/bad-values.txt" || { cat "$work/bad-values.txt"; fail "the error does not name experts.replicas"; }
for bad in device=tpu model.source=s3 gateway.service.type=Ingress attention.gpus=-1 unknownKey=1; do
  if "$helm" template k3serve "$chart" --set "$bad" > /dev/null 2>&1; then fail "--set $bad was accepted"; fi
done
echo "ok: values.schema.json rejects experts.replicas=two and 5 other bad values"

# What each values file asks for is in what it renders.
expect() {  # expect FILE PATTERN WHAT
  grep -qE -- "$2" "$work/$1.yaml" || fail "$1: $3 (no match for /$2/)"
}
for values in default gpu-values cpu-single-node-values; do
  expect $values '^kind: StatefulSet' "an expert StatefulSet"
  expect $values 'clusterIP: None' "a headless Service"
  expect $values 'resources: \[deployments/scale\]' "the orchestrator's Role on deployments/scale"
  expect $values 'resources: \[statefulsets/scale\]' "the orchestrator's Role on statefulsets/scale"
  expect $values 'grpc: \{port: 50051\}' "native gRPC probes on the attention port"
  expect $values 'grafana_dashboard: "1"' "dashboards as ConfigMaps"
  expect $values '"model_type"' "the model config in a ConfigMap"
  ! grep -qE 'resources: \[(deployments|statefulsets)\]$|verbs: \[.*(create|delete|list|watch)' "$work/$values.yaml" ||
    fail "$values: the orchestrator's Role grants more than get/patch/update on /scale"
done
expect default 'terminationGracePeriodSeconds: 45' "attention's grace period covering the 30 s drain"
expect gpu-values 'nvidia.com/gpu: 1' "GPU resources"
expect gpu-values '--device=cuda' "the CUDA device flag"
expect gpu-values 'kind: PodMonitor' "a PodMonitor"
expect gpu-values 'kind: PrometheusRule' "a PrometheusRule"
expect gpu-values 'alert: K3serveExpertNodeDown' "the alerting rules in the PrometheusRule"
expect gpu-values 'secretName: k3serve-tls' "the TLS Secret mounted"
expect gpu-values '--tls-cert=/etc/k3serve/tls/tls.crt' "the TLS flags"
expect gpu-values '--node-token-file=' "the node token flag"
expect gpu-values 'claimName: kimi-linear-48b' "weights from the PVC"
expect gpu-values 'kind: PersistentVolumeClaim' "the PVC it creates"
expect gpu-values 'terminationGracePeriodSeconds: 135' "attention's grace period covering the 120 s drain"
expect gpu-values 'topologyKey: topology.kubernetes.io/zone' "the gateway's topology spread"
expect gpu-values 'nvidia.com/gpu.product: NVIDIA-H200' "GPU node selectors"
expect cpu-single-node-values 'hostPath:' "weights from a hostPath"
expect cpu-single-node-values 'type: NodePort' "a NodePort Service"
! grep -q 'kind: PodDisruptionBudget' "$work/cpu-single-node-values.yaml" || fail "single node: no PDBs"
! grep -q 'nvidia.com/gpu' "$work/default.yaml" || fail "default: no GPUs"
echo "ok: every values file renders what it asks for"

# The packaged chart carries the dashboards and rules the symlinks point at.
"$helm" package "$chart" -d "$work/pkg" > /dev/null 2>&1 || fail "helm package"
tar -tzf "$work"/pkg/k3serve-*.tgz > "$work/pkg.txt"
for f in k3serve/dashboards/k3serve.json k3serve/dashboards/k3serve-expert-load.json k3serve/prometheus/rules.yml \
         k3serve/values.schema.json; do
  grep -qx "$f" "$work/pkg.txt" || { cat "$work/pkg.txt"; fail "helm package lacks $f"; }
done
! grep -q 'dashboards.py\|/ci/' "$work/pkg.txt" || fail "helm package carries the generator or ci/"
echo "ok: helm package carries the dashboards and the rules"
