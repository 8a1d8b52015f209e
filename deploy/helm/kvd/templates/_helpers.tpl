{{- define "kvd.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{- define "kvd.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvd.poolPath" -}}
{{- if .Values.hugepages.enabled -}}/dev/hugepages/kvd.pool{{- else -}}/dev/shm/kvd/kvd.pool{{- end -}}
{{- end -}}

{{/* The Secret holding the cluster secret. */}}
{{- define "kvd.secretName" -}}
{{- if .Values.clusterSecret.existingSecret -}}
{{- .Values.clusterSecret.existingSecret -}}
{{- else -}}
{{- printf "%s-cluster-secret" .Release.Name -}}
{{- end -}}
{{- end -}}
