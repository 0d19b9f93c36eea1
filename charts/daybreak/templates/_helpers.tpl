{{/* Shared names and labels of the Daybreak chart. */}}

{{- define "daybreak.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "daybreak.operatorName" -}}
{{- printf "%s-operator" (include "daybreak.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "daybreak.policyName" -}}
{{- printf "%s-pool-policy" (include "daybreak.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The operator's ServiceAccount as the API server names it in request.userInfo.username. */}}
{{- define "daybreak.operatorUser" -}}
{{- printf "system:serviceaccount:%s:%s" .Release.Namespace (include "daybreak.operatorName" .) -}}
{{- end -}}

{{- define "daybreak.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "daybreak.selectorLabels" -}}
app.kubernetes.io/name: daybreak-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels every object of the release carries; each template adds its own component (once). */}}
{{- define "daybreak.commonLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: daybreak
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The operator's objects. */}}
{{- define "daybreak.labels" -}}
{{ include "daybreak.commonLabels" . }}
app.kubernetes.io/name: daybreak-operator
app.kubernetes.io/component: operator
{{- end -}}

{{/* Objects that belong to the agents (their ClusterRole, binding and admission policy). */}}
{{- define "daybreak.agentLabels" -}}
{{ include "daybreak.commonLabels" . }}
app.kubernetes.io/name: daybreak-agent
app.kubernetes.io/component: agent
{{- end -}}

{{/* The policy as the ConfigMap holds it (and the operator reads it): lists comma-separated. */}}
{{- define "daybreak.policyData" -}}
allowedSSDRoots: {{ join "," .Values.poolPolicy.allowedSSDRoots | quote }}
allowedAgentImages: {{ join "," .Values.poolPolicy.allowedAgentImages | quote }}
allowedTolerationKeys: {{ join "," .Values.poolPolicy.allowedTolerationKeys | quote }}
agentPriorityClassName: {{ .Values.poolPolicy.agentPriorityClassName | default "" | quote }}
agentPortRange: {{ .Values.poolPolicy.agentPortRange | default "7400-7599" | quote }}
poolGroupRange: {{ .Values.poolPolicy.poolGroupRange | default "200000-299999" | quote }}
deniedNamespaces: {{ join "," (.Values.poolPolicy.deniedNamespaces | default list) | quote }}
operatorImage: {{ include "daybreak.image" . | quote }}
{{- end -}}

{{/* CEL (daybreak-deployment-policy): the roles (prefill, decode) whose partial template spec p satisfies
the argument. */}}
{{- define "daybreak.celRoles" -}}
['prefill', 'decode'].filter(r, (r == 'prefill' ? variables.prefill : variables.decode).exists(p, {{ . }}))
{{- end -}}

{{/* CEL: every container of pod spec p (init and ephemeral ones too). */}}
{{- define "daybreak.celContainers" -}}
((has(p.containers) ? p.containers : []) + (has(p.initContainers) ? p.initContainers : []) + (has(p.ephemeralContainers) ? p.ephemeralContainers : []))
{{- end -}}
