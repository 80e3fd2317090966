{{/* Names, labels and the pieces the RayService template repeats for each group. */}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's base name; Service names append -http/-grpc/-metrics, so keep room. */}}
{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The head Service KubeRay keeps for a RayService, on its active cluster:
<name>-head-svc, shortened and prefixed as KubeRay's utils.CheckName does. */}}
{{- define "tandem.kuberayHeadService" -}}
{{- $n := printf "%s-head-svc" (include "tandem.fullname" .) -}}
{{- if gt (len $n) 50 }}{{ $n = substr (int (sub (len $n) 50)) (len $n) $n }}{{ end -}}
{{- if regexMatch "^[0-9[:punct:]]" $n }}{{ $n = printf "r%s" (substr 1 (len $n) $n) }}{{ end -}}
{{- $n }}
{{- end }}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* A pod's image: its group's `image` fields where set, else the top-level image's.
Takes the root context and the group's `image` (dict "root" $ "own" $g.image). */}}
{{- define "tandem.image" -}}
{{- $own := default dict .own -}}
{{- $top := .root.Values.image -}}
{{- printf "%s:%s" ($own.repository | default $top.repository) ($own.tag | default $top.tag | default .root.Chart.AppVersion) }}
{{- end }}

{{- define "tandem.imagePullPolicy" -}}
{{- (default dict .own).pullPolicy | default .root.Values.image.pullPolicy }}
{{- end }}

{{/* rayStartParams.resources wants a quoted JSON string, e.g. '"{\"tandem_prefill\":1}"'. */}}
{{- define "tandem.rayResourcesParam" -}}
{{- printf "%q" (toJson .) | squote }}
{{- end }}

{{/* Environment shared by every Ray container. Serve reads RAY_SERVE_ENABLE_HA_PROXY in
its controller and in every proxy and replica it starts, on any pod. */}}
{{- define "tandem.env" -}}
- name: RAY_SERVE_ENABLE_HA_PROXY
  value: {{ ternary "1" "0" (eq .Values.serve.ingress "haproxy") | quote }}
{{- if eq .Values.serve.ingress "haproxy" }}
- name: RAY_SERVE_HAPROXY_NBTHREAD
  value: {{ .Values.serve.haproxyThreads | quote }}
{{- end }}
- name: RAY_SERVE_GRPC_MAX_MESSAGE_SIZE   # read before the router sees a message: Serve's default is 2 GiB
  value: {{ int64 .Values.serve.grpcMaxMessageBytes | quote }}
- name: TANDEM_METRICS_PORT
  value: {{ .Values.metrics.port | quote }}
- name: PROMETHEUS_MULTIPROC_DIR   # every Tandem process on the pod writes its metrics here
  value: /tmp/tandem-metrics
{{- if .Values.apiKey.existingSecret }}
- name: {{ .Values.apiKey.envVar }}
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKey.existingSecret }}
      key: {{ .Values.apiKey.secretKey }}
{{- end }}
{{- include "tandem.rayAuthEnv" . }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Ray's token authentication (rayAuth): the Secret that holds the token (key auth_token,
KubeRay's name for it), the chart's own unless rayAuth.existingSecret names one.
*/}}
{{- define "tandem.rayAuthSecret" -}}
{{- .Values.rayAuth.existingSecret | default (printf "%s-ray-auth" (include "tandem.fullname" .)) }}
{{- end }}

{{/* RAY_AUTH_MODE and RAY_AUTH_TOKEN for a container that talks to Ray: set by the chart,
not left to the operator, so that no Ray process of the release ever starts without
authentication (KubeRay adds the same two only where a container lacks them). */}}
{{- define "tandem.rayAuthEnv" -}}
{{- if .Values.rayAuth.enabled }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "tandem.rayAuthSecret" . }}
      key: auth_token
{{- end }}
{{- end }}

{{/* The chart's token, base64 as a Secret holds it. `live`: the release's Secret as lookup
found it (`name`); `token`: rayAuth.token; `online`: whether Helm reads the cluster. In order: the
live token (an upgrade keeps it: a new token on a running cluster would lock the operator
out of it), the given one, a new random one on a first install, else a failure: a render
that cannot read the cluster (helm template, --dry-run, GitOps tools) would draw a new
token on every render, and applying it would replace the running release's Secret. */}}
{{- define "tandem.rayAuthTokenB64" -}}
{{- $live := index ((default dict .live).data | default dict) "auth_token" -}}
{{- if and $live .token (ne $live (b64enc .token)) }}
{{- fail (printf "rayAuth.token differs from the token in the release's Secret %s: the chart never changes a live token (KubeRay's operator would read the new one while the running pods hold the old one). Set rayAuth.token to the live one (kubectl get secret %s -o jsonpath='{.data.auth_token}' | base64 -d), or leave it empty" .name .name) }}
{{- end }}
{{- if $live }}{{ $live }}
{{- else if .token }}{{ b64enc .token }}
{{- else if .online }}{{ randAlphaNum 48 | b64enc }}
{{- else }}
{{- fail "rayAuth: this render cannot read the cluster (helm template, helm install --dry-run, Argo CD and other GitOps tools), so a Ray token made here would be new on every render and replace the running release's. Set rayAuth.existingSecret to a Secret of yours with key auth_token (kubectl create secret generic tandem-ray-token --from-literal=auth_token=\"$(openssl rand -hex 24)\"), or rayAuth.token; helm install and upgrade (or --dry-run=server) make and keep one themselves" }}
{{- end }}
{{- end }}

{{/* NetworkPolicy peers for a component outside the release (values.yaml: networkPolicy):
pods labelled app.kubernetes.io/name `name` in the namespace `namespace`, both in one peer
so both must match ("": no such peer), then the peers in `more`. A YAML list, for
fromYamlArray; empty when there are none. */}}
{{- define "tandem.networkPolicyPeers" -}}
{{- $peers := list }}
{{- with .namespace }}
{{- $peers = append $peers (dict "namespaceSelector" (dict "matchLabels" (dict "kubernetes.io/metadata.name" .)) "podSelector" (dict "matchLabels" (dict "app.kubernetes.io/name" $.name))) }}
{{- end }}
{{- toYaml (concat $peers (.more | default list)) }}
{{- end }}

{{/*
A Ray container's securityContext: its group's own where set (it replaces the top-level one
whole: merging would leave a `drop: [ALL]` beside an `add` nobody asked for), else the
top-level `securityContext`. KubeRay copies it to the wait-gcs-ready init container it adds
to every worker pod; the head's also goes to the autoscaler sidecar (autoscalerOptions).
`ipcLock` (worker groups, with rdma.enabled and rdma.ipcLock) adds IPC_LOCK to it.
*/}}
{{- define "tandem.containerSecurityContext" -}}
{{- $sc := deepCopy (.own | default .root.Values.securityContext) -}}
{{- if .ipcLock }}
{{- $caps := default dict $sc.capabilities -}}
{{- $_ := set $caps "add" (append (default list $caps.add) "IPC_LOCK" | uniq) -}}
{{- $_ := set $sc "capabilities" $caps -}}
{{- end }}
{{- toYaml $sc }}
{{- end }}

{{/* Scheduling and identity fields of a pod, from its group's values (head or worker group). */}}
{{- define "tandem.podPlacement" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .serviceAccountName }}
serviceAccountName: {{ . }}
{{- end }}
{{- with .runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- end }}

{{/* The Ray container's args: KubeRay runs them before its own `ray start`
(`bash -lc -- '<args> && ulimit ...; ray start ...'`), so at every start of the container,
a restart included (which init containers never see). The pod's metrics folder outlives
the container: the files of the previous container's processes would be summed into the
new ones' counters and gauges. */}}
{{- define "tandem.metricsCleanup" -}}
find "${PROMETHEUS_MULTIPROC_DIR:?}" -mindepth 1 -delete
{{- end }}

{{/* A pod's volumes. Takes the root context and the pod's /dev/shm size limit
(dict "root" $ "shm" <tandem.shmSizeLimit>). */}}
{{- define "tandem.volumes" -}}
- name: dshm   # Ray's object store lives in /dev/shm; the container default is 64 MiB
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shm | quote }}
- name: metrics   # the pod's metrics folder, served on metrics.port by the node's exporter
  emptyDir: {}
{{- with .root.Values.modelVolume.claimName }}
- name: models    # shared by every Ray pod, read-only (modelVolume)
  persistentVolumeClaim:
    claimName: {{ . }}
    readOnly: true
{{- end }}
{{- with .root.Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
A Kubernetes quantity in bytes (a float): 8Gi, 512Mi, 2G, 1.5Gi, 1000000000, as the values
schema allows them.
*/}}
{{- define "tandem.bytes" -}}
{{- if or (kindIs "float64" .) (kindIs "int" .) (kindIs "int64" .) }}
{{- float64 . }}
{{- else }}
{{- $num := regexFind "^[0-9]+(\\.[0-9]+)?" (toString .) -}}
{{- $unit := trimPrefix $num (toString .) -}}
{{- $factors := dict "" 1.0 "m" 0.001 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 -}}
{{- if or (not $num) (not (hasKey $factors $unit)) }}
{{- fail (printf "%q is not a quantity of bytes (e.g. 8Gi, 512Mi, 2G)" (toString .)) }}
{{- end }}
{{- mulf (float64 $num) (index $factors $unit) }}
{{- end }}
{{- end }}

{{/*
The size limit of a pod's /dev/shm, a memory-backed emptyDir: Ray's object store lives
there, and what it holds counts against the container's memory. The group's `shmSizeLimit`,
or else the container's memory limit (the limit KubeRay gives the /dev/shm it adds when a
pod has none). Ray's object store must fit it, else Ray puts the store in /tmp, on the
node's disk (over 10 GB it does not start at all). Ray's default store is 30% of the
memory, capped at 200 GB and at the larger of 10 GB and 95% of /dev/shm
(ray._private.utils.resolve_object_store_memory); rayStartParams.object-store-memory sets it
outright. A limit the store does not fit is refused.
Takes: where (head, prefill, decode), shm (shmSizeLimit), memory (the container's memory
limit, "" when it has none), request (its memory request), params (its rayStartParams).
*/}}
{{- define "tandem.shmSizeLimit" -}}
{{- $limit := .shm | default .memory | default .request -}}
{{- if not $limit }}
{{- fail (printf "%s: /dev/shm needs a size limit: set %s.shmSizeLimit, or a memory limit for the container" .where .where) }}
{{- end }}
{{- if .memory }}
{{- $shm := include "tandem.bytes" $limit | float64 -}}
{{- $store := 0.0 -}}
{{- $how := "rayStartParams.object-store-memory" -}}
{{- with index (default dict .params) "object-store-memory" }}
{{- $store = include "tandem.bytes" . | float64 -}}
{{- else }}
{{- $how = "Ray's default: 30% of the memory" -}}
{{- $mem := include "tandem.bytes" .memory | float64 -}}
{{- $store = minf (mulf $mem 0.3) (maxf 1e10 (mulf $shm 0.95)) 2e11 -}}
{{- end }}
{{- if gt $store $shm }}
{{- fail (printf "%s: Ray's object store (%.0f bytes, %s) does not fit /dev/shm (%.0f bytes, shmSizeLimit %v): Ray would put it in /tmp, on disk; raise %s.shmSizeLimit or set a smaller rayStartParams.object-store-memory" .where $store $how $shm $limit .where) }}
{{- end }}
{{- end }}
{{- ternary (toJson $limit) (toString $limit) (kindIs "float64" $limit) }}
{{- end }}

{{- define "tandem.volumeMounts" -}}
- name: dshm
  mountPath: /dev/shm
- name: metrics
  mountPath: /tmp/tandem-metrics
{{- if .Values.modelVolume.claimName }}
- name: models
  mountPath: {{ .Values.modelVolume.mountPath }}
  readOnly: true
{{- end }}
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* A worker group's container resources: CPU, memory, GPUs when asked, and with
rdma.enabled the RDMA device plugin's resources (dict "g" $g "rdma" .Values.rdma). */}}
{{- define "tandem.workerResources" -}}
{{- $r := dict "cpu" (toString .g.cpu) "memory" (toString .g.memory) -}}
{{- if gt (int .g.gpus) 0 }}{{ $_ := set $r "nvidia.com/gpu" (toString .g.gpus) }}{{ end -}}
{{- if .rdma.enabled }}
{{- range $name, $n := .rdma.resources }}{{ $_ := set $r $name (toString $n) }}{{ end -}}
{{- end }}
{{- toYaml (dict "requests" $r "limits" $r) }}
{{- end }}

{{/*
The Serve config (serveConfigV2). Rendered as JSON, which is YAML too: toYaml would print
numbers of a million and more in exponent form (8.589934592e+09), toJson keeps them whole.
`args` go to cluster.service:app: the topology (cluster/config.py keys), the custom
resources that pin each role's workers, the router's settings, the metrics port, the
ingress the pods run, how long the pools may take to start, the name of the env var
holding the API key (never the key), and the custom resource that pins the controller
and the router to the head.
*/}}
{{- define "tandem.serveConfig" -}}
{{- $s := .Values.serve -}}
{{- if ne $s.proxyLocation "HeadOnly" }}
{{- fail (printf "serve.proxyLocation: only HeadOnly works (got %q): Serve starts a proxy only on the head and on nodes that run a replica of an app, and Tandem's one replica, the router, runs on the head; the worker pods run the pools' actors, not replicas, so EveryNode starts no proxy on them, and Disabled starts none at all (no HTTP or gRPC)" (toString $s.proxyLocation)) }}
{{- end }}
{{- $topology := include "tandem.topology" . | fromJson -}}
{{- $router := dict "max_outstanding_requests" $s.maxOutstandingRequests "max_outstanding_prompt_tokens" $s.maxOutstandingPromptTokens "placement" $s.placement "local_prefill_tokens" (int (default 0 $s.localPrefillTokens)) "local_prefill_backlog_tokens" (int (default 0 $s.localPrefillBacklogTokens)) "reasoning_parser" $s.reasoningParser "max_stored_responses" $s.maxStoredResponses -}}
{{- if .Values.apiKey.existingSecret }}
{{- $_ := set $router "api_key_env" .Values.apiKey.envVar -}}
{{- end }}
{{- $args := dict "topology" $topology "worker_resources" $s.workerResources "router" $router "metrics_port" .Values.metrics.port "ingress" $s.ingress "start_timeout_s" $s.startTimeoutSeconds -}}
{{- with .Values.head.pinResource }}
{{- $_ := set $args "head_resource" . -}}
{{- end }}
{{- $app := dict "name" $s.appName "import_path" $s.importPath "route_prefix" $s.routePrefix "args" $args -}}
{{- $grpc := dict "port" .Values.service.grpcPort "grpc_servicer_functions" (list "router.grpc_api.add_generation_servicer" "router.grpc_api.add_health_servicer") -}}
{{- $cfg := dict "proxy_location" $s.proxyLocation "http_options" (dict "host" "0.0.0.0" "port" .Values.service.httpPort) "grpc_options" $grpc "applications" (list $app) -}}
{{- toPrettyJson $cfg }}
{{- end }}

{{/*
A hash of the app's args that the worker pools run with (the app names their controller
after its own hash of the same settings). Every pod template carries it, so a change to
them changes rayClusterConfig, and KubeRay starts a new cluster (upgradeStrategy
NewCluster) instead of applying it to pools that hold the GPUs the new ones need.
The router's settings and startTimeoutSeconds are left out: they apply in place.
*/}}
{{- define "tandem.poolSettingsHash" -}}
{{- $s := .Values.serve -}}
{{- dict "topology" (include "tandem.topology" . | fromJson) "worker_resources" $s.workerResources "metrics_port" .Values.metrics.port | toJson | sha256sum | trunc 16 }}
{{- end }}

{{/*
Each group's tensorParallelSize as its role's engine setting (decode_engine.tensor_parallel_size;
set only above 1, so a topology at one rank renders as it always did), into `topo`. It has
this one home: serve.topology's engine sections may not name it. Above one rank with a
prefill pool, the transfer must be nixl: only nixl reads each rank's share of a block's KV
heads in place (a colocated topology, prefill_workers 0, has no prefill group to split).
*/}}
{{- define "tandem.tensorParallel" -}}
{{- $topo := .topo -}}
{{- range $section := list "engine" "prefill_engine" "decode_engine" }}
{{- if hasKey (default dict (index $topo $section)) "tensor_parallel_size" }}
{{- fail (printf "serve.topology.%s.tensor_parallel_size: set prefill.tensorParallelSize or decode.tensorParallelSize instead (the chart checks the groups' GPUs against it)" $section) }}
{{- end }}
{{- end }}
{{- $colocated := and (hasKey $topo "prefill_workers") (eq (int $topo.prefill_workers) 0) -}}
{{- range $role := list "prefill" "decode" }}
{{- $size := int (default 1 (index $.root.Values $role).tensorParallelSize) -}}
{{- if gt $size 1 }}
{{- if and (eq $role "prefill") $colocated }}
{{- fail (printf "prefill.tensorParallelSize %d: a colocated topology (serve.topology.prefill_workers: 0) has no prefill workers; its workers take decode.tensorParallelSize" $size) }}
{{- end }}
{{- $backend := (default dict $topo.transfer).backend | default "nixl" -}}
{{- if and (not $colocated) (ne $backend "nixl") }}
{{- fail (printf "%s.tensorParallelSize %d: with a prefill pool, above one rank needs serve.topology.transfer.backend nixl (got %s): only nixl reads each rank's share of a block's KV heads in place" $role $size $backend) }}
{{- end }}
{{- $key := printf "%s_engine" $role -}}
{{- $_ := set $topo $key (merge (dict "tensor_parallel_size" $size) (default dict (index $topo $key))) -}}
{{- end }}
{{- end }}
{{- end }}

{{/*
Each group's host KV tier and LoRA values as its role's engine settings, into `topo`, set
only when on (a topology without them renders as it always did): hostKvCacheMemory (a
quantity of bytes a rank) as host_kv_cache_memory, and with loraAdapters or maxLoras,
lora_adapters, max_loras (0: as many as loraAdapters names) and max_lora_rank. The groups'
values are their one home: serve.topology's engine sections may not name them. A worker's
host tier lives in its pod's memory, one a rank: hostKvCacheMemory x tensorParallelSize
must be below the group's `memory`. A colocated topology's workers take decode's values.
*/}}
{{- define "tandem.groupEngine" -}}
{{- $topo := .topo -}}
{{- $names := dict "host_kv_cache_memory" "hostKvCacheMemory" "lora_adapters" "loraAdapters" "max_loras" "maxLoras" "max_lora_rank" "maxLoraRank" -}}
{{- range $section := list "engine" "prefill_engine" "decode_engine" }}
{{- range $key, $value := $names }}
{{- if hasKey (default dict (index $topo $section)) $key }}
{{- fail (printf "serve.topology.%s.%s: set prefill.%s or decode.%s instead (each worker group's own engine value)" $section $key $value $value) }}
{{- end }}
{{- end }}
{{- end }}
{{- $colocated := and (hasKey $topo "prefill_workers") (eq (int $topo.prefill_workers) 0) -}}
{{- range $role := list "prefill" "decode" }}
{{- $g := index $.root.Values $role -}}
{{- $settings := dict -}}
{{- $given := list -}}
{{- $host := include "tandem.bytes" (default 0 $g.hostKvCacheMemory) | float64 -}}
{{- if gt $host 0.0 }}
{{- $given = append $given "hostKvCacheMemory" -}}
{{- $ranks := float64 (default 1 $g.tensorParallelSize) -}}
{{- if ge (mulf $host $ranks) (include "tandem.bytes" $g.memory | float64) }}
{{- fail (printf "%s.hostKvCacheMemory %v: a worker's host KV tier (%.0f bytes a rank x %.0f ranks) must be below its pod's memory (%s.memory %v)" $role $g.hostKvCacheMemory $host $ranks $role $g.memory) }}
{{- end }}
{{- $_ := set $settings "host_kv_cache_memory" (int64 $host) -}}
{{- end }}
{{- $adapters := default dict $g.loraAdapters -}}
{{- $maxLoras := int (default 0 $g.maxLoras) -}}
{{- if $adapters }}{{ $given = append $given "loraAdapters" }}{{ end -}}
{{- if gt $maxLoras 0 }}{{ $given = append $given "maxLoras" }}{{ end -}}
{{- if or $adapters (gt $maxLoras 0) }}
{{- $_ := set $settings "max_loras" (ternary $maxLoras (max 1 (len $adapters)) (gt $maxLoras 0)) -}}
{{- with $g.maxLoraRank }}{{ $_ := set $settings "max_lora_rank" (int .) }}{{ end -}}
{{- if $adapters }}{{ $_ := set $settings "lora_adapters" $adapters }}{{ end -}}
{{- end }}
{{- if and $settings (eq $role "prefill") $colocated }}
{{- fail (printf "prefill.%s: a colocated topology (serve.topology.prefill_workers: 0) has no prefill workers; its workers take the decode group's values" (join ", prefill." $given)) }}
{{- end }}
{{- if $settings }}
{{- $key := printf "%s_engine" $role -}}
{{- $_ := set $topo $key (merge $settings (default dict (index $topo $key))) -}}
{{- end }}
{{- end }}
{{- end }}

{{/*
The topology the app runs (JSON): serve.topology and, with `autoscaling.enabled`, its
`autoscaling` section from the chart's values: each pool between its worker group's
minReplicas and maxReplicas workers (one worker per pod; a pod that fits more still
counts one; a colocated topology, prefill_workers 0, has no prefill pool to bound), the
SLOs, the control loop's timings and, with allowRoleSwitch, warm role switches (refused
unless both roles ask the same resources).
*/}}
{{- define "tandem.topology" -}}
{{- $topo := deepCopy .Values.serve.topology -}}
{{- include "tandem.tensorParallel" (dict "root" . "topo" $topo) -}}
{{- include "tandem.groupEngine" (dict "root" . "topo" $topo) -}}
{{- $a := .Values.autoscaling -}}
{{- if $a.enabled }}
{{- $section := dict "slo" (dict "ttft_ms" $a.slo.ttftMs "itl_ms" $a.slo.itlMs) "interval_s" $a.intervalSeconds "scale_down_delay_s" $a.scaleDownDelaySeconds "scale_up_share" $a.scaleUpShare "drain_timeout_s" $a.drainTimeoutSeconds -}}
{{- if $a.allowRoleSwitch }}
{{- $res := default dict .Values.serve.workerResources -}}
{{- if or (ne (toJson (index $res "prefill")) (toJson (index $res "decode"))) (ne (toJson $topo.prefill_resources) (toJson $topo.decode_resources)) }}
{{- fail "autoscaling.allowRoleSwitch: a switched worker keeps its pod and its Ray resources, so both roles must ask the same ones: set serve.workerResources.prefill and .decode alike (and serve.topology's prefill_resources and decode_resources), and run them in one worker group's kind of pod" }}
{{- end }}
{{- $_ := set $section "allow_role_switch" true -}}
{{- end }}
{{- $colocated := and (hasKey $topo "prefill_workers") (eq (int $topo.prefill_workers) 0) -}}
{{- range $role := ternary (list "decode") (list "prefill" "decode") $colocated }}
{{- $g := index $.Values $role -}}
{{- $_ := set $section $role (dict "min_workers" (int $g.minReplicas) "max_workers" (int $g.maxReplicas)) -}}
{{- end }}
{{- $_ := set $topo "autoscaling" $section -}}
{{- end }}
{{- toJson $topo -}}
{{- end }}

{{/*
The worker groups' capacity, as the pools' fit is checked against it: per group its
pods (replicas, or minReplicas..maxReplicas with autoscaling), GPUs per pod and the Ray
custom resources each offers, e.g. "prefill=2x(GPU=1,tandem_prefill=1)
decode=2x(GPU=1,tandem_decode=1)". Every pod template carries it
(tandem.dev/worker-groups): KubeRay's cluster hash leaves replicas, minReplicas and
maxReplicas out, so a change to them alone would never reach the running cluster; as
an annotation it changes rayClusterConfig, and KubeRay starts a new cluster with the
new counts (upgradeStrategy NewCluster).
*/}}
{{- define "tandem.workerGroups" -}}
{{- $out := list -}}
{{- range $role := list "prefill" "decode" }}
{{- $g := index $.Values $role -}}
{{- $pods := ternary (printf "%v..%v" $g.minReplicas $g.maxReplicas) (toString $g.replicas) $.Values.autoscaling.enabled -}}
{{- $offers := list (printf "GPU=%v" $g.gpus) -}}
{{- range $name, $units := (default dict $g.rayResources) }}{{ $offers = append $offers (printf "%s=%v" $name $units) }}{{ end -}}
{{- $out = append $out (printf "%s=%sx(%s)" $role $pods (join "," $offers)) -}}
{{- end }}
{{- join " " $out }}
{{- end }}

{{/* Every Ray pod's annotations: the pool settings' hash and the worker groups'
capacity, then podAnnotations. */}}
{{- define "tandem.podAnnotations" -}}
{{- $own := dict "tandem.dev/pool-settings" (include "tandem.poolSettingsHash" .) "tandem.dev/worker-groups" (include "tandem.workerGroups" .) -}}
{{- range $key, $_ := $own }}
{{- if hasKey (default dict $.Values.podAnnotations) $key }}
{{- fail (printf "podAnnotations: %s is the chart's own (see values.yaml: upgradeStrategy)" $key) }}
{{- end }}
{{- end }}
{{- toYaml (merge $own (default dict .Values.podAnnotations)) }}
{{- end }}

{{/*
upgradeStrategy None starts no new cluster: KubeRay applies no rayClusterConfig change,
so the worker groups keep their pods, while a new Serve config is applied in place. An
upgrade that changes the groups' capacity (pods, GPUs, custom resources) is refused then:
the replicas would not change, and pools checked against the new groups (checkPoolsFit)
would start on the old ones; the app retires the old pools first, so new pools that do
not fit are a full outage. Nor would a new API key reach the pods (below). `live` is the
RayService lookup finds (empty on a first install and offline); one rendered by a chart
without the annotation is not checked for its groups.
*/}}
{{- define "tandem.checkInPlaceUpgrade" -}}
{{- if and .live (eq .root.Values.upgradeStrategy "None") }}
{{- $live := dig "spec" "rayClusterConfig" "headGroupSpec" "template" "metadata" "annotations" "tandem.dev/worker-groups" "" .live -}}
{{- $new := include "tandem.workerGroups" .root -}}
{{- if and $live (ne $live $new) }}
{{- fail (printf "upgradeStrategy None: this upgrade changes the worker groups from %q to %q, which KubeRay applies only by starting a new Ray cluster, and None starts none: the groups would keep their pods while the new Serve config starts pools sized for the new ones (pools that do not fit the old pools' pods stop serving altogether). Upgrade with upgradeStrategy NewCluster (twice the GPUs while it runs), or uninstall and install again" $live $new) }}
{{- end }}
{{- /* The API key reaches the router through its pods' env, which None leaves as it was,
while the Serve config that names the variable is applied: a key set now would be
missing, and the router would serve without one. */}}
{{- with .root.Values.apiKey.existingSecret }}
{{- $var := $.root.Values.apiKey.envVar -}}
{{- $from := "" -}}
{{- range (first (dig "spec" "rayClusterConfig" "headGroupSpec" "template" "spec" "containers" (list dict) $.live)).env }}
{{- if eq .name $var }}{{ $from = dig "valueFrom" "secretKeyRef" "name" "" . }}{{ end }}
{{- end }}
{{- if ne $from . }}
{{- fail (printf "upgradeStrategy None: this upgrade sets the API key from Secret %s, which the running pods do not have (their %s comes from %q): None starts no new cluster and leaves the pods' environment as it was, while the new Serve config is applied, so the router would run without the key. Upgrade with upgradeStrategy NewCluster, or uninstall and install again" . $var $from) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A volume every Ray pod mounts must be readable from every node: the head and the worker
pods land on different nodes, and a ReadWriteOnce claim attaches to one node only (pods
elsewhere stay in ContainerCreating). The model claim must declare ReadOnlyMany or
ReadWriteMany; on a live install (not `helm template`) every claim the pods mount is also
looked up and its access modes checked.
*/}}
{{- define "tandem.checkSharedVolumes" -}}
{{- $shared := list "ReadOnlyMany" "ReadWriteMany" -}}
{{- $mv := .Values.modelVolume -}}
{{- $claims := list -}}
{{- if $mv.claimName }}
{{- if not (has $mv.accessMode $shared) }}
{{- fail (printf "modelVolume: every Ray pod mounts claim %s, on different nodes: set modelVolume.accessMode to the claim's access mode, ReadOnlyMany or ReadWriteMany (got %q; a ReadWriteOnce volume attaches to one node, and pods on the others never start)" $mv.claimName (toString $mv.accessMode)) }}
{{- end }}
{{- $claims = append $claims $mv.claimName -}}
{{- end }}
{{- range .Values.extraVolumes }}
{{- with .persistentVolumeClaim }}{{ $claims = append $claims .claimName }}{{ end }}
{{- end }}
{{- range $claims }}
{{- $pvc := lookup "v1" "PersistentVolumeClaim" $.Release.Namespace . }}
{{- if and $pvc (not (or (has "ReadOnlyMany" $pvc.spec.accessModes) (has "ReadWriteMany" $pvc.spec.accessModes))) }}
{{- fail (printf "claim %s is %v: every Ray pod mounts it, on different nodes; it needs ReadOnlyMany or ReadWriteMany" . $pvc.spec.accessModes) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
A group's rayStartParams: those the chart sets (`set`: rendered YAML scalars, with `from`
naming the value each comes from) and the user's (`extra`, each a string). A key in both
would render twice, and one of the two would be dropped without a word: refuse it.
*/}}
{{- define "tandem.rayStartParams" -}}
{{- range $k, $v := .extra }}
{{- if hasKey $.set $k }}
{{- fail (printf "%s.rayStartParams.%s: the chart sets `%s` already (from %s); set it there, not in rayStartParams" $.where $k $k (index $.from $k)) }}
{{- end }}
{{- end }}
{{- range $k, $v := .set }}
{{ $k }}: {{ $v }}
{{- end }}
{{- range $k, $v := .extra }}
{{- /* a number of a million or more: toJson keeps it whole, where quote writes 1e+09 */}}
{{ $k }}: {{ ternary (toJson $v) (toString $v) (kindIs "float64" $v) | quote }}
{{- end }}
{{- end }}

{{/*
The pools must fit their worker groups: each role's workers (serve.topology) ask for
num_gpus (times the group's tensorParallelSize: a bundle a rank, all on one pod) and the
role's custom resources (serve.workerResources); the group's pods
(replicas, or maxReplicas with autoscaling) offer `gpus` and `rayResources` each. A pool
that does not fit never starts (the app waits for actors Ray cannot place).
*/}}
{{- define "tandem.checkPoolsFit" -}}
{{- $topo := .Values.serve.topology -}}
{{- range $role := list "prefill" "decode" }}
{{- $g := index $.Values $role -}}
{{- $pods := int (ternary $g.maxReplicas $g.replicas $.Values.autoscaling.enabled) -}}
{{- $workers := int (default 1 (index $topo (printf "%s_workers" $role))) -}}
{{- if hasKey $topo (printf "%s_workers" $role) }}{{ $workers = int (index $topo (printf "%s_workers" $role)) }}{{ end -}}
{{- $res := default dict (index $topo (printf "%s_resources" $role)) -}}
{{- $asks := dict -}}
{{- /* a worker at tensor_parallel_size N: N bundles of num_gpus, on one pod */}}
{{- $gpusEach := mulf (float64 (default 0 $res.num_gpus)) (float64 (default 1 $g.tensorParallelSize)) -}}
{{- if gt $gpusEach 0.0 }}{{ $_ := set $asks "GPU" (list $gpusEach (float64 $g.gpus) (printf "%s.gpus" $role)) }}{{ end -}}
{{- range $name, $units := (index (default dict $.Values.serve.workerResources) $role) }}
{{- $_ := set $asks $name (list (float64 $units) (float64 (default 0 (index (default dict $g.rayResources) $name))) (printf "%s.rayResources.%s" $role $name)) -}}
{{- end }}
{{- range $name, $a := $asks }}
{{- $perPod := floor (divf (index $a 1) (index $a 0)) -}}
{{- if lt (mulf $perPod $pods) (float64 $workers) }}
{{- fail (printf "%s: %d workers asking %v %s each do not fit %d pods offering %v each (%s): %v per pod, %v in all" $role $workers (index $a 0) $name $pods (index $a 1) (index $a 2) $perPod (mulf $perPod $pods)) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
