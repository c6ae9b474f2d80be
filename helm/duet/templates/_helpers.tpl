{{/* Names, labels and the pieces every duet pod shares. */}}

{{- define "duet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's full name, at most 45 characters so "<fullname>-prefill-<hash>" fits 63. */}}
{{- define "duet.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "duet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "duet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "duet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "duet.labels" -}}
helm.sh/chart: {{ include "duet.chart" . }}
{{ include "duet.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: duet
{{- end }}

{{/* Labels of one component: (dict "root" $ "component" "head"). */}}
{{- define "duet.componentLabels" -}}
{{ include "duet.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "duet.componentSelector" -}}
{{ include "duet.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "duet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "duet.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "duet.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "duet.headService" -}}
{{- printf "%s-head" (include "duet.fullname" .) }}
{{- end }}

{{- define "duet.routerService" -}}
{{- printf "%s-router" (include "duet.fullname" .) }}
{{- end }}

{{- define "duet.rayAuthSecret" -}}
{{- default (printf "%s-ray-auth" (include "duet.fullname" .)) .Values.ray.auth.existingSecret }}
{{- end }}

{{- define "duet.clusterSecret" -}}
{{- default (printf "%s-cluster-secret" (include "duet.fullname" .)) .Values.clusterSecret.existingSecret }}
{{- end }}

{{/* GPUs (ranks) of one prefill group: tensorParallelSize x pipelineParallelSize. */}}
{{- define "duet.prefillGroupGpus" -}}
{{- mul (int .Values.prefill.tensorParallelSize) (int (.Values.prefill.pipelineParallelSize | default 1)) }}
{{- end }}

{{/* Pods one data-parallel group of a pool spans (list $ "decode"): 1 unless its
dataParallelSize is larger than its gpusPerPod. */}}
{{- define "duet.podsPerGroup" -}}
{{- $p := index (index . 0).Values (index . 1) }}
{{- $dp := int ($p.dataParallelSize | default 1) }}
{{- max 1 (div $dp (int $p.gpusPerPod)) }}
{{- end }}

{{/* Checks the schema cannot express (it compares no two fields). */}}
{{- define "duet.validate" -}}
{{- $group := int (include "duet.prefillGroupGpus" .) }}
{{- if mod (int .Values.prefill.gpusPerPod) $group }}
{{- fail (printf "prefill.gpusPerPod (%d) must be a multiple of prefill.tensorParallelSize x prefill.pipelineParallelSize (%d): a prefill group's ranks share one pod" (int .Values.prefill.gpusPerPod) $group) }}
{{- end }}
{{- if and (not .Values.redis.enabled) (not .Values.redis.externalUrl) (not .Values.redis.externalUrlSecret.name) }}
{{- fail "redis: with redis.enabled=false set redis.externalUrl or redis.externalUrlSecret.name" }}
{{- end }}
{{- range $pool := list "prefill" "decode" }}
{{- $p := index $.Values $pool }}
{{- if gt (int $p.minReplicas) (int $p.maxReplicas) }}
{{- fail (printf "%s.minReplicas (%d) must be <= %s.maxReplicas (%d)" $pool (int $p.minReplicas) $pool (int $p.maxReplicas)) }}
{{- end }}
{{- $dp := int ($p.dataParallelSize | default 1) }}
{{- $gpus := int $p.gpusPerPod }}
{{- if and (gt $dp 1) (mod $gpus $dp) (mod $dp $gpus) }}
{{- fail (printf "%s.gpusPerPod (%d) and %s.dataParallelSize (%d): one must be a multiple of the other (a data-parallel group's workers share a pod, or span dataParallelSize / gpusPerPod pods)" $pool $gpus $pool $dp) }}
{{- end }}
{{- $span := int (include "duet.podsPerGroup" (list $ $pool)) }}
{{- range $bound := list "replicas" "minReplicas" "maxReplicas" }}
{{- if mod (int (index $p $bound)) $span }}
{{- fail (printf "%s.%s (%d) must be a multiple of %d: a data-parallel group spans %s.dataParallelSize / %s.gpusPerPod pods" $pool $bound (int (index $p $bound)) $span $pool $pool) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and (gt (int (.Values.prefill.dataParallelSize | default 1)) 1) (ne (int (include "duet.prefillGroupGpus" .)) 1) }}
{{- fail (printf "prefill.dataParallelSize (%d) needs prefill.tensorParallelSize and prefill.pipelineParallelSize 1 (each data-parallel worker runs its attention whole)" (int .Values.prefill.dataParallelSize)) }}
{{- end }}
{{- if and (gt (int (.Values.prefill.dataParallelSize | default 1)) 1) .Values.prefill.expertParallel }}
{{- fail "prefill.expertParallel: leave it false with prefill.dataParallelSize above 1 (its workers already hold 1/dataParallelSize of the experts each)" }}
{{- end }}
{{- if .Values.planner.enabled }}
{{- $need := add (mul .Values.prefill.minReplicas .Values.prefill.gpusPerPod) (mul .Values.decode.minReplicas .Values.decode.gpusPerPod) }}
{{- if lt (int .Values.planner.gpuBudget) (int $need) }}
{{- fail (printf "planner.gpuBudget (%d) is below the %d GPUs the pools' minReplicas need (prefill.minReplicas x prefill.gpusPerPod + decode.minReplicas x decode.gpusPerPod)" (int .Values.planner.gpuBudget) (int $need)) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The session store URL `duet serve` gets (a $(VAR) reference when it comes from a Secret). */}}
{{- define "duet.sessionStoreUrl" -}}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s-redis:6379/0" (include "duet.fullname" .) }}
{{- else if .Values.redis.externalUrlSecret.name }}
{{- print "$(DUET_SESSION_STORE_URL)" }}
{{- else }}
{{- .Values.redis.externalUrl }}
{{- end }}
{{- end }}

{{/* Environment of every duet container. */}}
{{- define "duet.env" -}}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /cache
- name: HF_HOME
  value: /cache/huggingface
- name: TRITON_CACHE_DIR
  value: /cache/triton
- name: TORCH_EXTENSIONS_DIR
  value: /cache/torch_extensions
- name: PYTHONUNBUFFERED
  value: "1"
# The internal plane's secret (docs/security.md), as a file: never in the pod spec or `env`.
- name: DUET_CLUSTER_SECRET_FILE
  value: /etc/duet/cluster-secret/{{ .Values.clusterSecret.key }}
{{- if .Values.internalTLS.secretName }}
- name: DUET_INTERNAL_TLS_CERT
  value: /etc/duet/internal-tls/tls.crt
- name: DUET_INTERNAL_TLS_KEY
  value: /etc/duet/internal-tls/tls.key
- name: DUET_INTERNAL_TLS_CA
  value: /etc/duet/internal-tls/ca.crt
{{- end }}
{{- if .Values.ray.auth.enabled }}
- name: RAY_AUTH_MODE
  value: token
# NOTE: a file, not RAY_AUTH_TOKEN, so the token is never in the pod spec or `env` output.
- name: RAY_AUTH_TOKEN_PATH
  value: /etc/duet/ray-auth/{{ .Values.ray.auth.key }}
{{- else }}
- name: RAY_AUTH_MODE
  value: disabled
{{- end }}
{{- if .Values.model.hfTokenSecret.name }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.model.hfTokenSecret.name }}
      key: {{ .Values.model.hfTokenSecret.key }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Volumes of every Ray pod, and their mounts. */}}
{{- define "duet.volumes" -}}
- name: tmp
  emptyDir: {}
- name: cache
  emptyDir:
    sizeLimit: {{ .Values.model.cacheSizeLimit }}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.ray.shmSizeLimit }}
- name: cluster-secret
  secret:
    secretName: {{ include "duet.clusterSecret" . }}
    defaultMode: 0440
{{- if .Values.internalTLS.secretName }}
- name: internal-tls
  secret:
    secretName: {{ .Values.internalTLS.secretName }}
    defaultMode: 0440
{{- end }}
{{- if .Values.ray.auth.enabled }}
- name: ray-auth
  secret:
    secretName: {{ include "duet.rayAuthSecret" . }}
    defaultMode: 0440
{{- end }}
{{- if .Values.model.pvc.existingClaim }}
- name: models
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.existingClaim }}
    readOnly: true
{{- end }}
{{- end }}

{{- define "duet.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /cache
- name: shm
  mountPath: /dev/shm
- name: cluster-secret
  mountPath: /etc/duet/cluster-secret
  readOnly: true
{{- if .Values.internalTLS.secretName }}
- name: internal-tls
  mountPath: /etc/duet/internal-tls
  readOnly: true
{{- end }}
{{- if .Values.ray.auth.enabled }}
- name: ray-auth
  mountPath: /etc/duet/ray-auth
  readOnly: true
{{- end }}
{{- if .Values.model.pvc.existingClaim }}
- name: models
  mountPath: {{ .Values.model.pvc.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* Pod-level settings shared by every duet pod. */}}
{{- define "duet.podCommon" -}}
serviceAccountName: {{ include "duet.serviceAccountName" . }}
automountServiceAccountToken: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}

{{/* nodeSelector/tolerations/affinity: (dict "own" .Values.prefill "fallback" .Values.gpu). */}}
{{- define "duet.scheduling" -}}
{{- $nodeSelector := .own.nodeSelector | default .fallback.nodeSelector }}
{{- $tolerations := .own.tolerations | default .fallback.tolerations }}
{{- $affinity := .own.affinity | default .fallback.affinity }}
{{- with $nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Extra pod template annotations. */}}
{{- define "duet.podAnnotations" -}}
{{- with .Values.podAnnotations }}{{ toYaml . }}{{ end }}
{{- end }}

{{/*
UCX's and NCCL's environment on the prefill and decode pods (kvTransfer.ucx, kvTransfer.nccl):
only what is set, so the libraries choose the rest. Ray's worker processes inherit it from the
pod's raylet, so every worker actor on the pod sees it.
*/}}
{{- define "duet.kvTransferEnv" -}}
{{- $kv := .Values.kvTransfer }}
{{- $vars := list
  (list "UCX_TLS" $kv.ucx.tls)
  (list "UCX_NET_DEVICES" $kv.ucx.netDevices)
  (list "UCX_IB_GID_INDEX" $kv.ucx.ibGidIndex)
  (list "NCCL_IB_HCA" $kv.nccl.ibHca)
  (list "NCCL_SOCKET_IFNAME" $kv.nccl.socketIfname)
  (list "NCCL_IB_GID_INDEX" $kv.nccl.ibGidIndex) }}
{{- range $vars }}
{{- $value := index . 1 }}
{{- if not (or (eq $value nil) (eq (toString $value) "")) }}
- name: {{ index . 0 }}
  value: {{ toString $value | quote }}
{{- end }}
{{- end }}
{{- end }}
