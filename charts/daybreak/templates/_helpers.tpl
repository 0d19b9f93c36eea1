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

{{- define "daybreak.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "daybreak.selectorLabels" -}}
app.kubernetes.io/name: daybreak-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "daybreak.labels" -}}
{{ include "daybreak.selectorLabels" . }}
app.kubernetes.io/component: operator
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}
