{{/* Names and labels. */}}
{{- define "k3serve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "k3serve.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one pool: (dict "root" $ "pool" "attention") */}}
{{- define "k3serve.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .pool }}
{{- end -}}

{{- define "k3serve.poolLabels" -}}
{{ include "k3serve.labels" .root }}
app.kubernetes.io/component: {{ .pool }}
{{- end -}}

{{- define "k3serve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "k3serve.routerAddress" -}}
{{ include "k3serve.fullname" . }}-router:{{ .Values.router.grpcPort }}
{{- end -}}

{{/* The model folder the binaries get as --model. */}}
{{- define "k3serve.modelDir" -}}
{{- if eq .Values.model.source "embedded" -}}
{{ .Values.model.embeddedPath }}
{{- else -}}
{{ .Values.model.mountPath }}
{{- end -}}
{{- end -}}

{{/* Flags every service takes: TLS and tokens (security.*). */}}
{{- define "k3serve.securityArgs" -}}
{{- with .Values.security }}
{{- if .tls.enabled }}
- --tls-cert=/etc/k3serve/tls/tls.crt
- --tls-key=/etc/k3serve/tls/tls.key
- --tls-ca=/etc/k3serve/tls/ca.crt
{{- end }}
{{- if .nodeToken.enabled }}
- --node-token-file=/etc/k3serve/node-token/token
{{- end }}
{{- if .adminToken.enabled }}
- --admin-token-file=/etc/k3serve/admin-token/token
{{- end }}
{{- end }}
{{- end -}}

{{/* Volumes: (dict "root" $ "model" true) — the model's only for the pools that load it. */}}
{{- define "k3serve.volumes" -}}
{{- $v := .root.Values -}}
- name: tmp
  emptyDir: {}
{{- if .model }}
- name: model-config
  configMap:
    name: {{ include "k3serve.fullname" .root }}-model
{{- if eq $v.model.source "pvc" }}
- name: weights
  persistentVolumeClaim:
    claimName: {{ $v.model.pvc.claimName }}
    readOnly: true
{{- else if eq $v.model.source "hostPath" }}
- name: weights
  hostPath:
    path: {{ $v.model.hostPath }}
    type: Directory
{{- end }}
{{- end }}
{{- if $v.security.tls.enabled }}
- name: tls
  secret:
    secretName: {{ $v.security.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- if $v.security.nodeToken.enabled }}
- name: node-token
  secret:
    secretName: {{ $v.security.nodeToken.secretName }}
    defaultMode: 0440
{{- end }}
{{- if $v.security.adminToken.enabled }}
- name: admin-token
  secret:
    secretName: {{ $v.security.adminToken.secretName }}
    defaultMode: 0440
{{- end }}
{{- if and .apiKeys $v.security.apiKeys.enabled }}
- name: api-keys
  secret:
    secretName: {{ $v.security.apiKeys.secretName }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "k3serve.volumeMounts" -}}
{{- $v := .root.Values -}}
- name: tmp
  mountPath: /tmp
{{- if .model }}
{{- if ne $v.model.source "embedded" }}
- name: weights
  mountPath: {{ $v.model.mountPath }}
  readOnly: true
{{- if $v.model.pvc.subPath }}
  subPath: {{ $v.model.pvc.subPath }}
{{- end }}
{{- end }}
- name: model-config
  mountPath: {{ include "k3serve.modelDir" .root }}/config.json
  subPath: config.json
  readOnly: true
{{- end }}
{{- if $v.security.tls.enabled }}
- name: tls
  mountPath: /etc/k3serve/tls
  readOnly: true
{{- end }}
{{- if $v.security.nodeToken.enabled }}
- name: node-token
  mountPath: /etc/k3serve/node-token
  readOnly: true
{{- end }}
{{- if $v.security.adminToken.enabled }}
- name: admin-token
  mountPath: /etc/k3serve/admin-token
  readOnly: true
{{- end }}
{{- if and .apiKeys $v.security.apiKeys.enabled }}
- name: api-keys
  mountPath: /etc/k3serve/api-keys
  readOnly: true
{{- end }}
{{- end -}}

{{/* Where a pool's pods run: (dict "root" $ "pool" "experts" "component" "expert") */}}
{{- define "k3serve.scheduling" -}}
{{- $p := index .root.Values .pool -}}
{{- with $p.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $p.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $p.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $p.topologySpreadConstraints }}
topologySpreadConstraints:
{{- range . }}
- {{ toYaml (merge (dict "labelSelector" (dict "matchLabels" (fromYaml (include "k3serve.selector" (dict "root" $.root "pool" $.component))))) .) | nindent 2 | trim }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Resources, with nvidia.com/gpu when the pool has GPUs. */}}
{{- define "k3serve.resources" -}}
{{- $r := deepCopy .resources -}}
{{- if gt (int .gpus) 0 -}}
{{- $limits := default (dict) $r.limits -}}
{{- $_ := set $limits "nvidia.com/gpu" (int .gpus) -}}
{{- $_ := set $r "limits" $limits -}}
{{- end -}}
{{ toYaml $r }}
{{- end -}}

{{- define "k3serve.podSecurity" -}}
{{- with .Values.image.pullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end -}}

{{- define "k3serve.probes" -}}
startupProbe:
  grpc: {port: {{ .port }}}
  periodSeconds: 5
  failureThreshold: 120
readinessProbe:
  grpc: {port: {{ .port }}}
  periodSeconds: 5
  failureThreshold: 2
livenessProbe:
  grpc: {port: {{ .port }}}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 30  # 5 min: NOT_SERVING while experts are re-placed is not a dead process
{{- end -}}
