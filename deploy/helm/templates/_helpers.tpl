{{/*
The name of this release's provider objects (cloud-config ConfigMap, metrics Service, NetworkPolicy):
the release's name with `-capi-autoscaler-provider`, so that two releases in one namespace never share
one, and the metrics Service's name (the job a ServiceMonitor gives its targets) names the provider for
the alerts.
*/}}
{{- define "capi-autoscaler-provider.fullname" -}}
{{- .Release.Name | trunc 38 | trimSuffix "-" -}}-capi-autoscaler-provider
{{- end -}}

{{/*
Labels of this chart's own objects: the official chart's instance and name labels (its Service and
ServiceMonitor select by them), and this chart's.
*/}}
{{- define "capi-autoscaler-provider.labels" -}}
{{ include "cluster-autoscaler.instance-name" (index .Subcharts "cluster-autoscaler") }}
app.kubernetes.io/component: capi-autoscaler-provider
app.kubernetes.io/managed-by: {{ .Release.Service | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | quote }}
{{- end -}}

{{/* The Cluster the provider serves: NAME or NAMESPACE/NAME. */}}
{{- define "capi-autoscaler-provider.cluster" -}}
{{- with .Values.provider.cluster.namespace }}{{ . }}/{{ end }}{{ required "provider.cluster.name" .Values.provider.cluster.name }}
{{- end -}}

{{/* Where the cloud-config ConfigMap is mounted in CA's container. */}}
{{- define "capi-autoscaler-provider.cloudConfigDir" -}}/etc/capi-autoscaler-provider{{- end -}}

{{/*
The provider's container: a native sidecar (an init container with restartPolicy Always) started before
CA, which starts once its startup probe on /readyz passes (the caches of the Cluster API objects have
listed), and stopped after CA.
*/}}
{{- define "capi-autoscaler-provider.container" -}}
name: provider
image: "{{ .Values.provider.image.repository }}:{{ .Values.provider.image.tag | default .Chart.AppVersion }}"
imagePullPolicy: {{ .Values.provider.image.pullPolicy }}
restartPolicy: Always
args:
  - serve
  # gRPC (which writes replicas) on loopback only: reachable from this pod alone.
  - --address=127.0.0.1:8086
  # HTTP (/metrics, /healthz, /readyz) on the pod IP, where the kubelet probes it and Prometheus scrapes
  # it; /check answers loopback only.
  - --metrics-address=0.0.0.0:8087
  {{- with .Values.provider.extraArgs }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
# In the environment, so that `kubectl exec deploy/... -c provider -- /capi-autoscaler-provider check`
# sees what `serve` sees.
env:
  # The Events the provider records name the pod as their reporting instance.
  - name: POD_NAME
    valueFrom:
      fieldRef:
        fieldPath: metadata.name
  - name: CAPI_AUTOSCALER_PROVIDER_CLUSTER
    value: {{ include "capi-autoscaler-provider.cluster" . | quote }}
  {{- if .Values.provider.workloadKubeconfigSecret }}
  # Management cluster: in-cluster (this release's ServiceAccount), not the workload kubeconfig.
  - name: CAPI_AUTOSCALER_PROVIDER_CLOUD_CONFIG_AUTHORITATIVE
    value: "true"
  # Workload cluster: its Nodes' instance-type/region/zone labels for scale-from-zero templates.
  - name: CAPI_AUTOSCALER_PROVIDER_KUBECONFIG
    value: /etc/kubernetes/value
  {{- end }}
  {{- with .Values.provider.extraEnv }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- if .Values.provider.workloadKubeconfigSecret }}
volumeMounts:
  # The official chart's volume of clusterAPIKubeconfigSecret.
  - name: cluster-api-kubeconfig
    mountPath: /etc/kubernetes
    readOnly: true
{{- end }}
ports:
  - name: provider-http
    containerPort: 8087
startupProbe:
  httpGet:
    path: /readyz
    port: provider-http
  periodSeconds: 2
  failureThreshold: 60
readinessProbe:
  httpGet:
    path: /readyz
    port: provider-http
  periodSeconds: 5
livenessProbe:
  httpGet:
    path: /healthz
    port: provider-http
  periodSeconds: 10
resources:
  {{- toYaml .Values.provider.resources | nindent 2 }}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: ["ALL"]
{{- end -}}
