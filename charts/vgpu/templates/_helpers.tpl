{{/* Object names: <fullname>[-part]. */}}
{{- define "vgpu.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "vgpu.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object; the selector labels plus the chart's. */}}
{{- define "vgpu.labels" -}}
app.kubernetes.io/name: {{ include "vgpu.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: vgpu
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "component" "...") */}}
{{- define "vgpu.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vgpu.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "vgpu.componentLabels" -}}
{{ include "vgpu.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "vgpu.daemonComponent" -}}
{{- if eq .Values.mode "dra" }}dra-driver{{ else }}device-plugin{{ end -}}
{{- end -}}

{{- define "vgpu.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* "true" when the scheduler is rendered: on by default in device-plugin mode, never in DRA mode. */}}
{{- define "vgpu.schedulerEnabled" -}}
{{- $on := .Values.scheduler.enabled -}}
{{- if eq .Values.mode "dra" -}}
{{- if eq (toString $on) "true" -}}
{{- fail "scheduler.enabled: the vgpu scheduler serves device-plugin mode only; in mode: dra the cluster's own scheduler allocates claims (leave scheduler.enabled unset or false)" -}}
{{- end -}}
{{- else if or (kindIs "invalid" $on) $on -}}
true
{{- end -}}
{{- end -}}

{{- define "vgpu.webhookEnabled" -}}
{{- $on := .Values.webhook.enabled -}}
{{- if eq .Values.mode "dra" -}}
{{- if eq (toString $on) "true" -}}
{{- fail "webhook.enabled: the vgpu webhook serves device-plugin mode only; DRA pods ask through ResourceClaims (leave webhook.enabled unset or false)" -}}
{{- end -}}
{{- else if or (kindIs "invalid" $on) $on -}}
true
{{- end -}}
{{- end -}}

{{- define "vgpu.webhookName" -}}{{ include "vgpu.fullname" . }}-webhook{{- end -}}
{{- define "vgpu.webhookSecret" -}}{{ include "vgpu.fullname" . }}-webhook-tls{{- end -}}
{{- define "vgpu.mutatingName" -}}{{ include "vgpu.fullname" . }}-webhook{{- end -}}
{{- define "vgpu.validatingName" -}}{{ include "vgpu.fullname" . }}-webhook{{- end -}}

{{/* The CEL matchCondition: the pod asks for <domain>/vcuda-core or
<domain>/vcuda-memory (requests or limits) in any container or init container. */}}
{{- define "vgpu.matchExpression" -}}
{{- $core := printf "%s/vcuda-core" .Values.resourceDomain -}}
{{- $mem := printf "%s/vcuda-memory" .Values.resourceDomain -}}
{{- printf "object.spec.containers.exists(c, has(c.resources) && ((has(c.resources.requests) && ('%s' in c.resources.requests || '%s' in c.resources.requests)) || (has(c.resources.limits) && ('%s' in c.resources.limits || '%s' in c.resources.limits)))) || (has(object.spec.initContainers) && object.spec.initContainers.exists(c, has(c.resources) && ((has(c.resources.requests) && ('%s' in c.resources.requests || '%s' in c.resources.requests)) || (has(c.resources.limits) && ('%s' in c.resources.limits || '%s' in c.resources.limits)))))" $core $mem $core $mem $core $mem $core $mem -}}
{{- end -}}

{{- define "vgpu.podSecurity" -}}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "vgpu.webhookCommon" -}}
{{- $w := .Values.webhook -}}
{{- $excluded := concat (list "kube-system" .Release.Namespace) $w.excludeNamespaces | uniq -}}
admissionReviewVersions: ["v1"]
sideEffects: None
failurePolicy: {{ $w.failurePolicy }}
timeoutSeconds: {{ $w.timeoutSeconds }}
matchPolicy: Equivalent
# Never the control plane's namespace nor vgpu's own (the webhook's pods must
# start even when no webhook replica is up).
namespaceSelector:
  matchExpressions:
    - key: kubernetes.io/metadata.name
      operator: NotIn
      values:
        {{- toYaml $excluded | nindent 8 }}
# Only pods that ask for a vgpu resource are sent at all: with failurePolicy
# Fail, a webhook that is down blocks those pods, with an error naming it, and
# no other pod of the cluster.
matchConditions:
  - name: asks-for-vgpu
    expression: {{ include "vgpu.matchExpression" . | quote }}
rules:
  - apiGroups: [""]
    apiVersions: ["v1"]
    operations: ["CREATE"]
    resources: ["pods"]
    scope: Namespaced
{{- end -}}

{{/* The kubelet's directories on the host, which the daemon also names in its
config (each is mounted at the same path inside the container). The
pod-resources socket, plugins_registry/ and plugins/ (DRA) live under the
kubelet's --root-dir; the device-plugin directory does not (see values.yaml). */}}
{{- define "vgpu.kubeletRootDir" -}}
{{- .Values.kubeletRootDir | trimSuffix "/" -}}
{{- end -}}
{{- define "vgpu.devicePluginDir" -}}
{{- .Values.kubeletDevicePluginDir | trimSuffix "/" -}}
{{- end -}}
{{- define "vgpu.podResourcesDir" -}}
{{- include "vgpu.kubeletRootDir" . }}/pod-resources
{{- end -}}
{{- define "vgpu.pluginsRegistryDir" -}}
{{- include "vgpu.kubeletRootDir" . }}/plugins_registry
{{- end -}}
{{- define "vgpu.cdiSpecDir" -}}
{{- .Values.cdiSpecDir | trimSuffix "/" -}}
{{- end -}}
{{- define "vgpu.draPluginDir" -}}
{{- include "vgpu.kubeletRootDir" . }}/plugins/vgpu.{{ .Values.resourceDomain }}
{{- end -}}

{{/* hostNetwork and its DNS policy, for a pod spec whose component sets hostNetwork. */}}
{{- define "vgpu.hostNetwork" -}}
# On the node's network (value hostNetwork): reachable where the control plane
# cannot reach pod IPs. Each containerPort is then a host port, so the
# scheduler places no two such pods on one node. ClusterFirstWithHostNet keeps
# cluster DNS names resolving. Most network plugins apply no NetworkPolicy to
# such pods.
hostNetwork: true
dnsPolicy: ClusterFirstWithHostNet
{{- end -}}


{{/* KUBERNETES_SERVICE_HOST/PORT for every container, where apiServer.host is
set: in-cluster clients (vgpu, kube-scheduler) then dial that address instead
of the `kubernetes` Service's, for clusters without kube-proxy (or where a pod
cannot reach Service IPs). A container's own env wins over the kubelet's
service variables. Renders nothing by default. */}}
{{- define "vgpu.apiServerEnv" -}}
{{- with .Values.apiServer.host }}
- name: KUBERNETES_SERVICE_HOST
  value: {{ . | quote }}
- name: KUBERNETES_SERVICE_PORT
  value: {{ $.Values.apiServer.port | quote }}
{{- end }}
{{- end -}}

{{/* A webhook's clientConfig: the Service by default, or webhook.url + path
(the API server dials that URL: a webhook on the host network where no Service
routes to it). (dict "root" $ "path" "/mutate") */}}
{{- define "vgpu.webhookClientConfig" -}}
{{- $w := .root.Values.webhook -}}
{{- if $w.url }}
url: {{ printf "%s%s" ($w.url | trimSuffix "/") .path | quote }}
{{- else }}
service:
  name: {{ include "vgpu.webhookName" .root }}
  namespace: {{ .root.Release.Namespace }}
  path: {{ .path }}
  port: 443
{{- end }}
{{- end -}}
