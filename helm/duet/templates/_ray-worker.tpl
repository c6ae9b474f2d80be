{{/*
A Deployment of pods that join the Ray head and block: prefill and decode workers, extra
router pods. Called with a dict:
  root       the chart's root context
  component  prefill | decode | router
  pool       the values of that component (replicas, resources, scheduling)
  gpus       GPUs per pod (0 for router pods)
  fallback   scheduling defaults (.Values.gpu for GPU pools)
  replicas   the replica count to render
*/}}
{{- define "duet.rayWorkerDeployment" -}}
{{- $root := .root }}
{{- $ctx := dict "root" $root "component" .component }}
{{- $gpus := int .gpus }}
{{- $resources := deepCopy (.pool.resources | default dict) }}
{{- if gt $gpus 0 }}
{{- $limits := get $resources "limits" | default dict }}
{{- $requests := get $resources "requests" | default dict }}
{{- $_ := set $limits $root.Values.gpu.resourceName $gpus }}
{{- $_ := set $requests $root.Values.gpu.resourceName $gpus }}
{{- $_ := set $resources "limits" $limits }}
{{- $_ := set $resources "requests" $requests }}
{{- end }}
{{- $kvWorker := has .component (list "prefill" "decode") }}
{{- $rdma := and $kvWorker $root.Values.kvTransfer.rdma.enabled }}
{{- if $rdma }}
{{- $limits := get $resources "limits" | default dict }}
{{- $requests := get $resources "requests" | default dict }}
{{- $_ := set $limits $root.Values.kvTransfer.rdma.resourceName (int $root.Values.kvTransfer.rdma.count) }}
{{- $_ := set $requests $root.Values.kvTransfer.rdma.resourceName (int $root.Values.kvTransfer.rdma.count) }}
{{- $_ := set $resources "limits" $limits }}
{{- $_ := set $resources "requests" $requests }}
{{- end }}
{{- $securityContext := deepCopy $root.Values.securityContext }}
{{- if and $rdma $root.Values.kvTransfer.rdma.ipcLock }}
{{- $capabilities := get $securityContext "capabilities" | default dict }}
{{- $_ := set $capabilities "add" (list "IPC_LOCK") }}
{{- $_ := set $securityContext "capabilities" $capabilities }}
{{- end }}
{{- $annotations := include "duet.podAnnotations" $root | fromYaml | default dict }}
{{- if $rdma }}
{{- $annotations = merge (deepCopy ($root.Values.kvTransfer.rdma.podAnnotations | default dict)) $annotations }}
{{- end }}
{{- $rayResources := dict .component (ternary $gpus 1 (gt $gpus 0)) }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "duet.fullname" $root }}-{{ .component }}
  labels:
    {{- include "duet.componentLabels" $ctx | nindent 4 }}
spec:
  replicas: {{ .replicas }}
  selector:
    matchLabels:
      {{- include "duet.componentSelector" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "duet.componentSelector" $ctx | nindent 8 }}
        {{- if eq .component "router" }}
        duet.dev/serves-api: "true"
        {{- end }}
        {{- with $root.Values.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $annotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- include "duet.podCommon" $root | nindent 6 }}
      {{- with include "duet.scheduling" (dict "own" .pool "fallback" .fallback) }}
      {{- . | trim | nindent 6 }}
      {{- end }}
      terminationGracePeriodSeconds: 30
      containers:
        - name: {{ .component }}
          image: {{ include "duet.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          securityContext:
            {{- toYaml $securityContext | nindent 12 }}
          command:
            - ray
          args:
            - start
            - --address={{ include "duet.headService" $root }}:{{ $root.Values.ray.port }}
            - --num-gpus={{ $gpus }}
            - {{ printf "--resources=%s" (toJson $rayResources) | quote }}
            # A fixed raylet port, so the probes below can check the raylet is up.
            - --node-manager-port=8076
            - --block
          env:
            {{- include "duet.env" $root | nindent 12 }}
            {{- if $kvWorker }}
            {{- include "duet.kvTransferEnv" $root | nindent 12 }}
            {{- end }}
          ports:
            - name: raylet
              containerPort: 8076
              protocol: TCP
            {{- if eq .component "router" }}
            - name: http
              containerPort: {{ $root.Values.router.service.restPort }}
              protocol: TCP
            - name: grpc
              containerPort: {{ $root.Values.router.service.grpcPort }}
              protocol: TCP
            {{- end }}
          {{- if eq .component "router" }}
          # The router actor placed on this pod answers these; until it is, the pod gets no
          # traffic (readiness) and the startup probe gives it time to be placed.
          startupProbe:
            httpGet:
              path: /health
              port: http
            periodSeconds: {{ $root.Values.head.startupProbe.periodSeconds }}
            failureThreshold: {{ $root.Values.head.startupProbe.failureThreshold }}
          livenessProbe:
            httpGet:
              path: /health
              port: http
            periodSeconds: 10
            timeoutSeconds: 5
            failureThreshold: 3
          readinessProbe:
            httpGet:
              path: /ready
              port: http
            periodSeconds: 5
            timeoutSeconds: 3
            failureThreshold: 2
          {{- else }}
          # `ray start --block` exits when the raylet dies, which restarts the container; the
          # raylet's port tells whether it is up and registered.
          livenessProbe:
            tcpSocket:
              port: raylet
            initialDelaySeconds: 30
            periodSeconds: 10
            failureThreshold: 3
          readinessProbe:
            tcpSocket:
              port: raylet
            periodSeconds: 5
            failureThreshold: 2
          {{- end }}
          resources:
            {{- toYaml $resources | nindent 12 }}
          volumeMounts:
            {{- include "duet.volumeMounts" $root | nindent 12 }}
            {{- if and (eq .component "router") $root.Values.apiKeys.existingSecret }}
            - name: api-keys
              mountPath: /etc/duet/api-keys
              readOnly: true
            {{- end }}
      volumes:
        {{- include "duet.volumes" $root | nindent 8 }}
        {{- if and (eq .component "router") $root.Values.apiKeys.existingSecret }}
        - name: api-keys
          secret:
            secretName: {{ $root.Values.apiKeys.existingSecret }}
            defaultMode: 0440
        {{- end }}
{{- end }}

{{/* The replica count of a planner-scaled pool: the live one when the planner owns it. */}}
{{- define "duet.poolReplicas" -}}
{{- $pool := index .root.Values .component }}
{{- $replicas := int $pool.replicas }}
{{- if .root.Values.planner.enabled }}
{{- $live := lookup "apps/v1" "Deployment" .root.Release.Namespace (printf "%s-%s" (include "duet.fullname" .root) .component) }}
{{- if and $live $live.spec }}
{{- $replicas = int $live.spec.replicas }}
{{- end }}
{{- end }}
{{- $replicas }}
{{- end }}
