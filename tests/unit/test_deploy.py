"""The deployment files in deploy/: Helm chart, values schema, Grafana dashboard,
Prometheus config and Dockerfiles, checked offline (no cluster, Docker or helm binary).

- The chart is linted and rendered by Helm's own Go code (helm-python-sdk, Helm v4).
- Built-in Kubernetes objects are validated with kubernetes-validate (strict: unknown
  fields fail) against Kubernetes KUBE_VERSION.
- The RayService is validated against KubeRay's CRD schema (vendored in
  deploy/helm/crds-for-tests/), with unknown fields rejected as well: the API server
  would silently prune a misspelled field instead of failing.
- The ServiceMonitor and the PodMonitor are checked against small schemas of the fields
  the chart sets (the prometheus-operator CRDs are not vendored).
- The serveConfigV2 is checked with Ray Serve's own config schema, and its topology with
  cluster.config.ClusterConfig.
"""

from __future__ import annotations

import base64
import copy
import importlib.util
import json
import re
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.helpers import PROMETHEUS_SOURCE, require_tool

helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk (the test extra)")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="the test extra")

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CHART = DEPLOY / "helm" / "tandem"
GPU_VALUES = CHART / "values-gpu.yaml"
KUBE_VERSION = "1.30.0"
RELEASE, NAMESPACE = "tandem", "tandem"
# Ray's auth token for offline renders, which may not draw one (rayAuth.token).
TOKEN = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKL"

# The metric names the dashboard may use: the spec of the metrics the service exports
# (prometheus-client names: histograms add _bucket/_sum/_count, counters end in _total).
METRICS_SPEC = {
    # histograms
    "tandem:time_to_first_token_seconds",
    "tandem:inter_token_latency_seconds",
    "tandem:request_time_per_output_token_seconds",
    "tandem:e2e_request_latency_seconds",
    "tandem:request_queue_time_seconds",
    "tandem:request_prefill_time_seconds",
    "tandem:request_decode_time_seconds",
    "tandem:kv_transfer_time_seconds",
    # gauges
    "tandem:num_requests_running",
    "tandem:num_requests_waiting",
    "tandem:kv_cache_usage_perc",
    "tandem:pool_workers",
    "tandem:pool_target_workers",
    "tandem:host_cache_blocks",
    "tandem:host_cache_blocks_used",
    "tandem:lora_resident",
    # counters
    "tandem:prompt_tokens_total",
    "tandem:scaling_decisions_total",
    "tandem:role_switches_total",
    "tandem:generation_tokens_total",
    "tandem:request_success_total",
    "tandem:num_preemptions_total",
    "tandem:prefix_cache_queries_total",
    "tandem:prefix_cache_hits_total",
    "tandem:kv_transfer_bytes_total",
    "tandem:kv_transfer_failures_total",
    "tandem:requests_rejected_total",
    "tandem:host_cache_hits_total",
    "tandem:host_cache_spills_total",
    "tandem:host_cache_restores_total",
    "tandem:lora_loads_total",
    "tandem:lora_evictions_total",
}
# Digits too: tandem:e2e_request_latency_seconds.
METRIC_RE = re.compile(r"tandem:[A-Za-z0-9_:]+")
HISTOGRAM_SUFFIX = re.compile(r"_(bucket|sum|count)$")


# ---------------------------------------------------------------------------- helpers


def _ray_service_crd_path() -> Path:
    """The vendored CRD; the shared/ checkout beside the repo is only a fallback."""
    vendored = DEPLOY / "helm" / "crds-for-tests" / "ray.io_rayservices.yaml"
    if vendored.exists():
        return vendored
    return REPO / ".." / "shared" / "schemas" / "ray.io_rayservices.yaml"


def _reject_unknown_fields(schema):
    """A copy of a CRD's structural schema in which objects with listed properties accept
    no other keys (the API server prunes those silently; a test should fail instead)."""
    if isinstance(schema, list):
        return [_reject_unknown_fields(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _reject_unknown_fields(v) for k, v in schema.items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _split(manifests: dict[str, str]) -> list[dict]:
    docs = []
    for path, text in manifests.items():
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def _by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def _service(docs: list[dict], suffix: str) -> dict:
    (svc,) = [d for d in _by_kind(docs, "Service") if d["metadata"]["name"].endswith(suffix)]
    return svc


def _groups(rayservice: dict) -> dict[str, dict]:
    return {g["groupName"]: g for g in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def _ray_resources_param(group: dict) -> dict:
    """rayStartParams.resources is a quoted JSON string: '"{\\"tandem_prefill\\":1}"'."""
    raw = group["rayStartParams"]["resources"]
    assert raw.startswith('"') and raw.endswith('"'), f"expected a quoted JSON string, got {raw!r}"
    return json.loads(json.loads(raw))


def _with_token(values: dict | None) -> dict:
    """``values`` with Ray's auth token given, unless they name a Secret or a token."""
    values = dict(values or {})
    auth = values.get("rayAuth", {})
    if not {"existingSecret", "token"} & set(auth):
        values["rayAuth"] = {"token": TOKEN, **auth}
    return values


class OfflineChart(helm.Chart):
    """The chart rendered as helm template and GitOps tools render it, which must be given
    Ray's auth token: an offline render draws none (lookup sees no cluster)."""

    def render(self, values=None, **options):
        return super().render(_with_token(values), **options)


def _error_text(err: Exception) -> str:
    return f"{err.message} at {'/'.join(map(str, err.absolute_path))}" if hasattr(err, "message") else str(err)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def chart():
    c = OfflineChart.load(CHART)
    yield c
    c.close()


@pytest.fixture(scope="module")
def gpu_values() -> dict:
    return yaml.safe_load(GPU_VALUES.read_text())


@pytest.fixture(scope="module")
def rendered(chart, gpu_values) -> dict[str, list[dict]]:
    """The chart rendered by Helm for the default values and for the GPU example."""
    return {
        "default": _split(chart.render({}, name=RELEASE, namespace=NAMESPACE)),
        "gpu": _split(chart.render(gpu_values, name=RELEASE, namespace=NAMESPACE)),
    }


@pytest.fixture(scope="module")
def ray_service_schema() -> dict:
    crd = yaml.load(_ray_service_crd_path().read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert crd["spec"]["names"]["kind"] == "RayService"
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return _reject_unknown_fields(v1["schema"]["openAPIV3Schema"])


@pytest.fixture(scope="module")
def values_schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


# ------------------------------------------------------------------------ Helm chart


@pytest.mark.parametrize("example", [None, GPU_VALUES], ids=["default", "gpu"])
def test_chart_lints_clean(example):
    values = yaml.safe_load(example.read_text()) if example else None
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{KUBE_VERSION}")
    assert report["errors"] == [], report
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert problems == [], f"helm lint warnings/errors: {problems}"


def test_chart_renders_a_rayservice_and_two_services(rendered):
    """The HTTP Service is KubeRay's (the RayService's serveService); the chart renders
    the gRPC alias and the metrics Service, Ray's auth token and the NetworkPolicy. The GPU
    example turns the ServiceMonitor on."""
    for case, docs in rendered.items():
        kinds = sorted(d["kind"] for d in docs)
        expected = sorted(["RayService", "Service", "Service", "Secret", "NetworkPolicy"])
        if case == "gpu":
            expected = sorted([*expected, "ServiceMonitor"])
        assert kinds == expected, f"{case}: rendered {kinds}"


def test_builtin_objects_validate_against_kubernetes(rendered):
    for case, docs in rendered.items():
        for doc in docs:
            if doc["apiVersion"] in ("ray.io/v1", "monitoring.coreos.com/v1"):
                continue
            try:
                kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{case}: {doc['kind']} {doc['metadata']['name']}: {_error_text(e)}")


def test_rayservice_validates_against_the_kuberay_crd(rendered, ray_service_schema):
    validator = jsonschema.Draft4Validator(ray_service_schema)
    for case, docs in rendered.items():
        (rs,) = _by_kind(docs, "RayService")
        assert rs["apiVersion"] == "ray.io/v1"
        errors = [_error_text(e) for e in validator.iter_errors(rs)]
        assert errors == [], f"{case}: RayService does not match the CRD: {errors[:5]}"


def test_crd_check_catches_a_misspelled_field(rendered, ray_service_schema):
    (rs,) = _by_kind(rendered["default"], "RayService")
    bad = copy.deepcopy(rs)
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 3
    assert not jsonschema.Draft4Validator(ray_service_schema).is_valid(bad)


def test_worker_groups_are_pinned_by_custom_resources(rendered, chart):
    values = chart.values
    (rs,) = _by_kind(rendered["default"], "RayService")
    groups = _groups(rs)
    assert list(groups) == ["prefill", "decode"]
    for role, group in groups.items():
        assert _ray_resources_param(group) == values[role]["rayResources"]
        assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (
            values[role]["replicas"], values[role]["minReplicas"], values[role]["maxReplicas"])
        # each worker actor asks for its own role's resource, which only its group offers
        assert set(values["serve"]["workerResources"][role]) <= set(values[role]["rayResources"])


def test_gpu_example_puts_gpus_selectors_and_tolerations_on_both_groups(rendered, gpu_values):
    (rs,) = _by_kind(rendered["gpu"], "RayService")
    for role, group in _groups(rs).items():
        pod = group["template"]["spec"]
        (container,) = pod["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == str(gpu_values[role]["gpus"])
        assert pod["nodeSelector"] == gpu_values[role]["nodeSelector"]
        assert pod["tolerations"] == gpu_values[role]["tolerations"]
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head["resources"].get("limits", {})


def test_cpu_default_asks_for_no_gpus(rendered):
    (rs,) = _by_kind(rendered["default"], "RayService")
    for group in _groups(rs).values():
        assert "nvidia.com/gpu" not in group["template"]["spec"]["containers"][0]["resources"]["limits"]


def test_pods_run_as_non_root(rendered):
    for docs in rendered.values():
        (rs,) = _by_kind(docs, "RayService")
        for pod in _pods(rs):
            assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
            assert pod["spec"]["securityContext"]["runAsUser"] != 0


def test_every_ray_pod_has_a_metrics_folder_and_the_app_serves_it(rendered):
    """Each pod's processes write into one folder, which the node's exporter serves."""
    for docs in rendered.values():
        (rs,) = _by_kind(docs, "RayService")
        for pod in _pods(rs):
            (container,) = pod["spec"]["containers"]
            env = {e["name"]: e.get("value") for e in container["env"]}
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            volume = mounts[env["PROMETHEUS_MULTIPROC_DIR"]]
            assert "emptyDir" in {v["name"]: v for v in pod["spec"]["volumes"]}[volume]
            assert any(p["name"] == "tandem-metrics" for p in container["ports"])
        (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
        assert app["args"]["metrics_port"] == int(env["TANDEM_METRICS_PORT"])


def test_serve_config_is_a_valid_ray_serve_config_for_the_tandem_app(rendered):
    from ray.serve.schema import ServeDeploySchema

    from cluster.config import ClusterConfig
    from cluster.service import configs_from_args

    for case, docs in rendered.items():
        (rs,) = _by_kind(docs, "RayService")
        config = yaml.safe_load(rs["spec"]["serveConfigV2"])
        ServeDeploySchema.model_validate(config)  # raises on a malformed Serve config
        (app,) = config["applications"]
        assert app["import_path"] == "cluster.service:app"
        assert (config["http_options"]["port"], config["grpc_options"]["port"]) == (8000, 9000)
        # the topology is exactly what `tandem up --config` accepts
        ClusterConfig.from_dict(app["args"]["topology"])
        assert app["args"]["metrics_port"] == 8081, case
        # and the application builder turns the args into the deployment they describe
        cluster, _router = configs_from_args(app["args"])
        assert cluster.prefill_resources.bundle()["tandem_prefill"] == 1, case
        assert cluster.decode_resources.bundle()["tandem_decode"] == 1, case


def _pods(rs: dict) -> list[dict]:
    """The RayService's pod templates: the head's, then each worker group's."""
    cluster = rs["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]


def _containers(rs: dict) -> list[dict]:
    return [pod["spec"]["containers"][0] for pod in _pods(rs)]


def test_every_ray_container_runs_the_ingress_the_app_asks_for(chart, rendered):
    """Serve reads RAY_SERVE_ENABLE_HA_PROXY in every process it starts, on any pod; the
    app's args name the same ingress, which the app checks against its environment."""
    from cluster.ingress import check_environment

    proxy = _by_kind(_split(chart.render({"serve": {"ingress": "proxy"}}, name=RELEASE)), "RayService")
    for rs, ingress in [(_by_kind(rendered["default"], "RayService")[0], "haproxy"),
                        (_by_kind(rendered["gpu"], "RayService")[0], "haproxy"), (proxy[0], "proxy")]:
        (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
        assert app["args"]["ingress"] == ingress
        for c in _containers(rs):
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["RAY_SERVE_ENABLE_HA_PROXY"] == ("1" if ingress == "haproxy" else "0"), (ingress, c["name"])
            assert env.get("RAY_SERVE_HAPROXY_NBTHREAD") == ("1" if ingress == "haproxy" else None), c["name"]
            assert env["RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"] == "1048576", "Serve's gRPC servers would read 2 GiB"
            check_environment(app["args"]["ingress"], env)
        head_ports = {p["name"] for p in _containers(rs)[0]["ports"]}
        assert ({"haproxy-stats", "haproxy-metrics"} <= head_ports) == (ingress == "haproxy"), head_ports


def test_serve_config_grpc_servicers_match_the_router():
    from router.server import GRPC_SERVICERS

    template = (CHART / "templates" / "_helpers.tpl").read_text()
    for servicer in GRPC_SERVICERS:
        assert f'"{servicer}"' in template, f"the chart's grpc_servicer_functions lack {servicer}"


def test_api_key_comes_from_a_secret_never_from_the_config(rendered, gpu_values):
    (rs,) = _by_kind(rendered["gpu"], "RayService")
    config = yaml.safe_load(rs["spec"]["serveConfigV2"])
    env_var = config["applications"][0]["args"]["router"]["api_key_env"]
    assert env_var == "TANDEM_API_KEY"
    for c in _containers(rs):
        (entry,) = [e for e in c["env"] if e["name"] == env_var]
        assert entry["valueFrom"]["secretKeyRef"]["name"] == gpu_values["apiKey"]["existingSecret"]
    (default_rs,) = _by_kind(rendered["default"], "RayService")
    assert "api_key_env" not in yaml.safe_load(default_rs["spec"]["serveConfigV2"])["applications"][0]["args"]["router"]


def test_http_and_grpc_follow_kuberays_active_cluster(rendered, ray_service_schema):
    """During an upgrade the pending cluster's head is labelled ray.io/serve=true before
    KubeRay switches traffic: no chart Service may select on that label without the
    cluster. HTTP is KubeRay's serve Service (spec.serveService: KubeRay sets its selector
    to ray.io/cluster=<active>, ray.io/serve=true and keeps only the `serve` port); gRPC
    is an alias of KubeRay's head Service for the RayService, which KubeRay repoints to
    the active cluster together with the serve Service and which carries every port of
    the head container."""
    for case, docs in rendered.items():
        (rs,) = _by_kind(docs, "RayService")
        name = rs["metadata"]["name"]
        for svc in _by_kind(docs, "Service"):
            selector = svc["spec"].get("selector") or {}
            assert "ray.io/serve" not in selector, f"{case}: {svc['metadata']['name']} selects ray.io/serve"
        assert not [s for s in _by_kind(docs, "Service") if s["metadata"]["name"].endswith("-http")]
        serve = rs["spec"]["serveService"]
        assert serve["metadata"]["name"] == f"{name}-http"
        assert "selector" not in serve["spec"]  # KubeRay's to set (it ignores ours)
        assert serve["spec"]["type"] == "ClusterIP"
        assert [(p["name"], p["port"]) for p in serve["spec"]["ports"]] == [("serve", 8000)]
        head = _containers(rs)[0]
        head_ports = {p["name"]: p["containerPort"] for p in head["ports"]}
        assert head_ports["serve"] == 8000  # the port KubeRay puts in the serve Service
        grpc = _service(docs, "-grpc")
        assert grpc["spec"]["type"] == "ExternalName"
        assert grpc["spec"]["externalName"] == f"{name}-head-svc.{NAMESPACE}.svc.cluster.local"
        assert [p["port"] for p in grpc["spec"]["ports"]] == [head_ports["grpc"]] == [9000]
    metrics = _service(rendered["default"], "-metrics")
    assert metrics["spec"]["clusterIP"] == "None"  # one scrape target per pod
    assert [(p["name"], p["port"]) for p in metrics["spec"]["ports"]] == [("tandem-metrics", 8081)]
    for labels in [pod["metadata"]["labels"] for pod in _pods(_by_kind(rendered["default"], "RayService")[0])]:
        assert metrics["spec"]["selector"].items() <= labels.items()


def test_grpc_alias_names_the_head_service_as_kuberay_does(chart):
    """KubeRay names it CheckName(<rayservice>-head-svc): at most 50 characters (cut from
    the front), never starting with a digit."""
    def alias(**values):
        docs = _split(chart.render(values, name="9" + "x" * 52, namespace="ns"))
        (rs,) = _by_kind(docs, "RayService")
        return rs["metadata"]["name"], _service(docs, "-grpc")["spec"]["externalName"]

    name, target = alias()
    host = f"{name}-head-svc"[-50:]
    host = "r" + host[1:] if host[0].isdigit() or not host[0].isalnum() else host
    assert target == f"{host}.ns.svc.cluster.local"
    assert alias(clusterDomain="k8s.example")[1].endswith(".svc.k8s.example")


def test_no_port_is_named_metrics_so_kuberay_adds_rays_own(rendered):
    """KubeRay adds Ray's metrics port (8080, named `metrics`) to a Ray container only
    when no port has that name yet: Tandem's port must be named otherwise, and every
    reference to it (Service, ServiceMonitor, Prometheus config) must use its name."""
    for case, docs in rendered.items():
        (rs,) = _by_kind(docs, "RayService")
        for c in _containers(rs):
            names = [p["name"] for p in c["ports"]]
            assert "metrics" not in names, (case, c["name"], names)
            assert {"name": "tandem-metrics", "containerPort": 8081} in c["ports"], (case, c["name"])
        metrics = _service(docs, "-metrics")
        (port,) = metrics["spec"]["ports"]
        assert port["name"] == "tandem-metrics" and port["targetPort"] in ("tandem-metrics", 8081)
        for sm in _by_kind(docs, "ServiceMonitor"):
            assert [e["port"] for e in sm["spec"]["endpoints"]] == ["tandem-metrics"]
    prometheus = (DEPLOY / "prometheus" / "prometheus.yml").read_text()
    assert not re.search(r";metrics\b", prometheus), "the endpoints example keeps the port named `metrics`"


# KubeRay's readiness probe when a template sets none (common/pod.go,
# initLivenessAndReadinessProbe): the raylet's health on the dashboard agent (52365), the
# GCS's on the dashboard (8265) for the head, and for a RayService worker also Serve's
# proxy on the `serve` port.
_KUBERAY_PROBE_PORTS = {"head": {52365, 8265}, "worker": {52365, 8000}}


def _probe_ports(probe: dict) -> set[int]:
    """The ports a readiness probe needs a listener on."""
    if "httpGet" in probe:
        return {probe["httpGet"]["port"]}
    if "tcpSocket" in probe:
        return {probe["tcpSocket"]["port"]}
    return {int(p) for p in re.findall(r":(\d+)/", " ".join(probe["exec"]["command"]))}


def _client_endpoints(rs: dict, docs: list[dict], cluster: str = f"{RELEASE}-x7k2p") -> dict[str, set[str]]:
    """For each client Service, the kinds of pod (head, prefill, decode) that can become its
    endpoints: the pods KubeRay makes that its selector matches and that can be Ready.

    - `-http` is KubeRay's serve Service: selector ray.io/cluster=<active> and
      ray.io/serve=true. KubeRay labels every RayService worker pod ray.io/serve=true
      (common/pod.go, BuildPod) and the head once its Serve proxy answers.
    - `-grpc` is an alias of KubeRay's head Service: the active cluster's head pod.
    A pod can be Ready when every port its readiness probe checks (the template's, else
    KubeRay's) has a listener on it: the dashboard agent on every pod, the dashboard and
    Serve's HTTP and gRPC ingress on the head only (proxyLocation HeadOnly)."""
    ports = {p["name"]: p["containerPort"] for p in _containers(rs)[0]["ports"]}
    listening = {"head": {52365, 8265, ports["serve"], ports["grpc"]}, "worker": {52365}}
    selectors = {
        "-http": {"ray.io/cluster": cluster, "ray.io/serve": "true"},
        "-grpc": {"ray.io/cluster": cluster, "ray.io/node-type": "head"},
    }
    grpc = _service(docs, "-grpc")["spec"]["externalName"]
    assert grpc.startswith(f"{rs['metadata']['name']}-head-svc.")  # KubeRay's head Service
    endpoints = {}
    for suffix, selector in selectors.items():
        endpoints[suffix] = set()
        for pod in _kuberay_pods(rs, cluster):
            kind = pod["labels"]["ray.io/node-type"]
            labels = {**pod["labels"], "ray.io/serve": "true"}  # a worker's always, the head's once its proxy answers
            probe = pod["spec"]["containers"][0].get("readinessProbe")
            needs = _probe_ports(probe) if probe else _KUBERAY_PROBE_PORTS[kind]
            if selector.items() <= labels.items() and needs <= listening[kind]:
                endpoints[suffix].add("head" if kind == "head" else pod["group"])
    return endpoints


def test_only_the_head_that_serves_becomes_an_endpoint_of_the_client_services(rendered):
    """KubeRay's serve Service takes every Ready worker (it labels them all
    ray.io/serve=true), and no worker runs Serve's proxy: a worker that were Ready would get
    HTTP connections with nothing listening. Workers are Ready only while a Serve proxy
    answers on their `serve` port, so never; the head serves both Services."""
    for case, docs in rendered.items():
        (rs,) = _by_kind(docs, "RayService")
        assert _client_endpoints(rs, docs) == {"-http": {"head"}, "-grpc": {"head"}}, case
        for role, group in _groups(rs).items():
            (c,) = group["template"]["spec"]["containers"]
            assert c["readinessProbe"]["httpGet"] == {"path": "/-/healthz", "port": 8000}, (case, role)
        # not Ready, still scraped: the headless metrics Service keeps every pod in DNS
        assert _service(docs, "-metrics")["spec"]["publishNotReadyAddresses"] is True


def test_the_endpoint_check_finds_workers_that_are_ready_without_a_proxy(rendered):
    """The chart's earlier probe (the raylet's health only) let every worker in."""
    docs = rendered["gpu"]
    (rs,) = _by_kind(docs, "RayService")
    raylet_only = copy.deepcopy(rs)
    for group in _groups(raylet_only).values():
        group["template"]["spec"]["containers"][0]["readinessProbe"] = {
            "httpGet": {"path": "/api/local_raylet_healthz", "port": 52365}}
    assert _client_endpoints(raylet_only, docs)["-http"] == {"head", "prefill", "decode"}
    # KubeRay's own probe (none in the template) asks the proxy too
    for group in _groups(raylet_only).values():
        del group["template"]["spec"]["containers"][0]["readinessProbe"]
    assert _client_endpoints(raylet_only, docs)["-http"] == {"head"}


@pytest.mark.parametrize("location", ["EveryNode", "Disabled"])
def test_a_proxy_location_other_than_head_only_fails_to_render(chart, location):
    """Serve starts a proxy only on the head and on nodes with a replica of an app; the
    router, Tandem's one replica, runs on the head: EveryNode would add no proxy anywhere."""
    with pytest.raises(helm.HelmRenderError, match=f'serve.proxyLocation: only HeadOnly works \\(got "{location}"\\)'):
        chart.render({"serve": {"proxyLocation": location}}, name=RELEASE)
    (rs,) = _by_kind(_split(chart.render({}, name=RELEASE)), "RayService")
    assert yaml.safe_load(rs["spec"]["serveConfigV2"])["proxy_location"] == "HeadOnly"


def test_notes_port_forward_to_the_head_service(chart):
    """`kubectl port-forward svc/<serve Service>` picks any pod its selector matches, Ready
    or not, workers included: the notes name KubeRay's head Service, the head alone."""
    notes = chart.render({}, name=RELEASE, namespace=NAMESPACE)["tandem/templates/NOTES.txt"]
    forwards = re.findall(r"kubectl port-forward -n tandem (\S+) (.*)", notes)
    assert forwards == [(f"svc/{RELEASE}-head-svc", "8000:8000 9000:9000")], forwards


def test_every_container_start_empties_the_pods_metrics_folder(rendered, tmp_path):
    """The metrics folder is an emptyDir: it survives a container restart, and the files
    the old processes left would be merged into the new ones' metrics. KubeRay runs the
    Ray container's args before `ray start` (`bash -lc -- '<args> && ...; ray start'`),
    at every container start; init containers run only when the pod starts."""
    import subprocess

    for case, docs in rendered.items():
        (rs,) = _by_kind(docs, "RayService")
        for c in _containers(rs):
            assert "command" not in c, "KubeRay would wrap a command as well"
            (args,) = c["args"]
            assert "ray start" not in args  # else KubeRay leaves the command alone
            env = {e["name"]: e.get("value") for e in c["env"]}
            folder = tmp_path / case / c["name"]
            (folder / "sub").mkdir(parents=True)
            for name in ("counter_12.db", "gauge_all_12.db", "sub/x.db"):
                (folder / name).write_bytes(b"old")
            # the same shell KubeRay starts, with the pod's PROMETHEUS_MULTIPROC_DIR
            out = subprocess.run(["bash", "-c", f"{args} && echo started"], capture_output=True, text=True,
                                 env={"PATH": "/usr/bin:/bin", "PROMETHEUS_MULTIPROC_DIR": str(folder)})
            assert out.returncode == 0 and out.stdout.strip() == "started", out
            assert folder.is_dir() and list(folder.iterdir()) == [], (case, c["name"])
            assert env["PROMETHEUS_MULTIPROC_DIR"] == "/tmp/tandem-metrics"


def test_only_the_head_offers_the_resource_that_pins_controller_and_router(chart, rendered):
    """The controller and router ask for no CPU; a custom resource only the head
    advertises keeps them there (cluster.service.head_pinned)."""
    from cluster.service import HEAD_RESOURCE_UNITS

    for case, docs in rendered.items():
        (rs,) = _by_kind(docs, "RayService")
        head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]
        assert _ray_resources_param(head) == {"tandem_head": 1000}, case
        (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
        assert app["args"]["head_resource"] == "tandem_head"
        assert 1000 >= 100 * HEAD_RESOURCE_UNITS  # room for the controller and many routers
        for group in _groups(rs).values():
            assert "tandem_head" not in _ray_resources_param(group)
    off = _by_kind(_split(chart.render({"head": {"pinResource": ""}}, name=RELEASE)), "RayService")[0]
    assert "resources" not in off["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    assert "head_resource" not in yaml.safe_load(off["spec"]["serveConfigV2"])["applications"][0]["args"]


@pytest.mark.parametrize("access_mode", ["", "ReadWriteOnce", "ReadWriteOncePod"])
def test_a_model_volume_every_pod_mounts_must_be_readable_from_every_node(chart, access_mode):
    """The head and the worker pods run on different nodes: a ReadWriteOnce claim attaches
    to one of them, and the pods on the others stay in ContainerCreating."""
    values = {"modelVolume": {"claimName": "models", "accessMode": access_mode}}
    with pytest.raises(helm.HelmRenderError, match="ReadOnlyMany or ReadWriteMany"):
        chart.render(values, name=RELEASE)


@pytest.mark.parametrize("access_mode", ["ReadOnlyMany", "ReadWriteMany"])
def test_a_shared_model_volume_is_mounted_read_only_on_every_pod(chart, access_mode):
    docs = _split(chart.render({"modelVolume": {"claimName": "models", "accessMode": access_mode}}, name=RELEASE))
    (rs,) = _by_kind(docs, "RayService")
    for pod in _pods(rs):
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in pod["spec"]["containers"][0]["volumeMounts"]


def test_the_gpu_example_declares_a_shared_model_volume(gpu_values):
    assert gpu_values["modelVolume"]["accessMode"] in ("ReadOnlyMany", "ReadWriteMany")
    assert not [v for v in gpu_values.get("extraVolumes", []) if "persistentVolumeClaim" in v]


# A duration as prometheus-operator's CRDs accept one ("30s", "1m30s").
DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}


def _operator_object(kind: str, spec: dict) -> dict:
    """The schema of a prometheus-operator object of ``kind`` whose spec is ``spec``."""
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": {"type": "object", "required": ["name"]},
            "spec": spec,
        },
    }


# The ServiceMonitor fields the chart sets, as prometheus-operator's CRD defines them.
SERVICE_MONITOR_SCHEMA = _operator_object("ServiceMonitor", {
    "type": "object",
    "additionalProperties": False,
    "required": ["selector"],
    "properties": {
        "selector": {"type": "object", "properties": {
            "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}}},
        "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
            "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}},
        "endpoints": {"type": "array", "items": {
            "type": "object", "additionalProperties": False,
            "properties": {"port": {"type": "string"}, "path": {"type": "string"}, "interval": DURATION,
                           "scrapeTimeout": DURATION}}},
    },
})


def test_service_monitor_is_off_by_default_and_scrapes_the_metrics_service(rendered):
    assert _by_kind(rendered["default"], "ServiceMonitor") == []
    docs = rendered["gpu"]
    (sm,) = _by_kind(docs, "ServiceMonitor")
    jsonschema.validate(sm, SERVICE_MONITOR_SCHEMA)
    metrics = _service(docs, "-metrics")
    assert sm["spec"]["selector"]["matchLabels"].items() <= metrics["metadata"]["labels"].items()
    assert {e["port"] for e in sm["spec"]["endpoints"]} <= {p["name"] for p in metrics["spec"]["ports"]}
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"


# The PodMonitor fields the chart sets, as prometheus-operator's CRD defines them.
_SERVICE_MONITOR_SPEC = SERVICE_MONITOR_SCHEMA["properties"]["spec"]["properties"]
POD_MONITOR_SCHEMA = _operator_object("PodMonitor", {
    "type": "object", "additionalProperties": False, "required": ["selector", "podMetricsEndpoints"],
    "properties": {
        "selector": _SERVICE_MONITOR_SPEC["selector"],
        "namespaceSelector": _SERVICE_MONITOR_SPEC["namespaceSelector"],
        "podMetricsEndpoints": _SERVICE_MONITOR_SPEC["endpoints"],
    },
})
MONITORING_ON = {"metrics": {"podMonitor": {"enabled": True, "labels": {"release": "kps"}},
                             "grafanaDashboard": {"enabled": True}, "prometheusRule": {"enabled": True}}}


def test_monitoring_objects_are_off_by_default(rendered):
    for case, docs in rendered.items():
        assert not [d for d in docs if d["kind"] in ("PodMonitor", "PrometheusRule", "ConfigMap")], case


def test_the_pod_monitor_scrapes_rays_haproxys_and_tandems_ports_on_every_ray_pod(chart):
    """Ray's metrics (the port KubeRay adds as `metrics`, 8080), HAProxy's exporter (9101,
    the head's `haproxy-metrics`) and Tandem's, on every Ray pod of either cluster during
    an upgrade, Ready or not; Tandem's only where the ServiceMonitor does not scrape it."""
    docs = _split(chart.render(MONITORING_ON, name=RELEASE, namespace=NAMESPACE))
    (pm,) = _by_kind(docs, "PodMonitor")
    jsonschema.validate(pm, POD_MONITOR_SCHEMA)
    assert pm["metadata"]["labels"]["release"] == "kps"
    (rs,) = _by_kind(docs, "RayService")
    pods = _kuberay_pods(rs, cluster=f"{RELEASE}-old01") + _kuberay_pods(rs, cluster=f"{RELEASE}-new02")
    assert all(pm["spec"]["selector"]["matchLabels"].items() <= p["labels"].items() for p in pods)
    ports = [e["port"] for e in pm["spec"]["podMetricsEndpoints"]]
    assert ports == ["metrics", "haproxy-metrics", "tandem-metrics"]
    declared = {p["name"]: p["containerPort"] for p in _containers(rs)[0]["ports"]}
    assert (declared["haproxy-metrics"], declared["tandem-metrics"]) == (9101, 8081)
    assert "metrics" not in declared  # KubeRay adds it, 8080, to every Ray container
    both = _split(chart.render({"metrics": {"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True}},
                                "serve": {"ingress": "proxy"}}, name=RELEASE, namespace=NAMESPACE))
    (pm,) = _by_kind(both, "PodMonitor")
    assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == ["metrics"]  # no HAProxy; no double scrape


def test_the_dashboard_and_alert_rules_render_from_the_files_in_deploy(chart):
    """One source: files/ in the chart links to deploy/grafana and deploy/prometheus."""
    import os

    for name, target in [("tandem-dashboard.json", DEPLOY / "grafana" / "tandem-dashboard.json"),
                         ("alerts.yml", DEPLOY / "prometheus" / "alerts.yml")]:
        assert os.path.realpath(CHART / "files" / name) == str(target.resolve())
    docs = _split(chart.render(MONITORING_ON, name=RELEASE, namespace=NAMESPACE))
    (cm,) = _by_kind(docs, "ConfigMap")
    kubernetes_validate.validate(cm, KUBE_VERSION, strict=True)
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1" and cm["metadata"]["namespace"] == NAMESPACE
    assert json.loads(cm["data"]["tandem-dashboard.json"]) == _dashboard()
    (rule,) = _by_kind(docs, "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
    elsewhere = _split(chart.render({"metrics": {"grafanaDashboard": {"enabled": True, "namespace": "monitoring"}}},
                                    name=RELEASE, namespace=NAMESPACE))
    assert _by_kind(elsewhere, "ConfigMap")[0]["metadata"]["namespace"] == "monitoring"


def test_rdma_asks_for_the_device_plugins_resources_and_ipc_lock_on_worker_pods(chart):
    rdma = {"rdma": {"enabled": True, "resources": {"rdma/rdma_shared_device_a": 1}}}
    (rs,) = _by_kind(_split(chart.render(rdma, name=RELEASE)), "RayService")
    for role, group in _groups(rs).items():
        (c,) = group["template"]["spec"]["containers"]
        for side in ("requests", "limits"):
            assert c["resources"][side]["rdma/rdma_shared_device_a"] == "1", (role, side)
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}, role
    head = _containers(rs)[0]
    assert "add" not in head["securityContext"]["capabilities"]
    # IPC_LOCK leaves "restricted" (the worker pods need "baseline"); the head stays in it
    assert {p["group"] for p in _kuberay_pods(rs) if _restricted_violations(p["spec"])} == {"prefill", "decode"}
    (rs,) = _by_kind(_split(chart.render({"rdma": {**rdma["rdma"], "ipcLock": False}}, name=RELEASE)), "RayService")
    assert not [p for p in _kuberay_pods(rs) if _restricted_violations(p["spec"])]
    (rs,) = _by_kind(_split(chart.render({}, name=RELEASE)), "RayService")
    assert not [c for c in _containers(rs) if "rdma/rdma_shared_device_a" in c["resources"]["limits"]]


def test_replicas_outside_min_max_fail_to_render(chart):
    with pytest.raises(helm.HelmRenderError, match="minReplicas <= replicas <= maxReplicas"):
        chart.render({"decode": {"replicas": 9, "maxReplicas": 4}}, name=RELEASE)


@pytest.mark.parametrize(
    "override, message",
    [
        ({"head": {"rayStartParams": {"num-cpus": 4}}}, "head.rayStartParams.num-cpus: the chart sets"),
        ({"head": {"rayStartParams": {"resources": '"{}"'}}}, "head.rayStartParams.resources: the chart sets"),
        ({"prefill": {"rayStartParams": {"resources": '"{}"'}}}, "prefill.rayStartParams.resources: the chart sets"),
        ({"head": {"rayStartParams": {"num-gpus": 1}}}, "head.rayStartParams.num-gpus: the chart sets"),
        ({"decode": {"rayStartParams": {"num-gpus": 1}}}, "decode.rayStartParams.num-gpus: the chart sets `num-gpus` already (from decode.gpus)"),
    ],
)
def test_a_ray_start_param_the_chart_sets_fails_to_render(chart, override, message):
    """A key in both would be written twice; YAML keeps one of the two without a word."""
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        chart.render(override, name=RELEASE)


def test_ray_start_params_of_the_users_own_are_rendered(chart):
    docs = _split(chart.render({"head": {"rayStartParams": {"object-store-memory": 10**9}},
                                "decode": {"rayStartParams": {"num-cpus": 3}}}, name=RELEASE))
    (rs,) = _by_kind(docs, "RayService")
    assert rs["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["object-store-memory"] == "1000000000"
    decode = _groups(rs)["decode"]["rayStartParams"]
    assert decode["num-cpus"] == "3" and _ray_resources_param(_groups(rs)["decode"]) == {"tandem_decode": 1}


@pytest.mark.parametrize(
    "override, message",
    [
        # 3 GPU workers, 2 pods of 1 GPU
        ({"prefill": {"gpus": 1, "replicas": 2, "maxReplicas": 2},
          "serve": {"topology": {"prefill_workers": 3, "prefill_resources": {"num_cpus": 1, "num_gpus": 1}}}},
         "prefill: 3 workers asking 1 GPU each do not fit 2 pods"),
        # GPU workers on a group without GPUs
        ({"serve": {"topology": {"decode_resources": {"num_cpus": 1, "num_gpus": 1}}}},
         "decode: 1 workers asking 1 GPU each do not fit 1 pods offering 0 each"),
        # 2 decode workers, one tandem_decode unit on the single decode pod
        ({"serve": {"topology": {"decode_workers": 2}}}, "decode: 2 workers asking 1 tandem_decode each"),
        # 2 GPUs per worker, 3 GPUs per pod: one worker per pod, whatever the total says
        ({"prefill": {"gpus": 3, "replicas": 2, "maxReplicas": 2, "rayResources": {"tandem_prefill": 2}},
          "serve": {"topology": {"prefill_workers": 3, "prefill_resources": {"num_cpus": 1, "num_gpus": 2}}}},
         "prefill: 3 workers asking 2 GPU each do not fit 2 pods offering 3 each"),
    ],
)
def test_pools_that_do_not_fit_their_worker_groups_fail_to_render(chart, override, message):
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        chart.render(override, name=RELEASE)


def test_pools_that_fit_render_and_autoscaling_counts_max_replicas(chart):
    two_per_pod = {"prefill": {"gpus": 2, "replicas": 1, "rayResources": {"tandem_prefill": 2}},
                   "serve": {"topology": {"prefill_workers": 2,
                                          "prefill_resources": {"num_cpus": 1, "num_gpus": 1}}}}
    chart.render(two_per_pod, name=RELEASE)
    grows = {"autoscaling": {"enabled": True}, "decode": {"replicas": 1, "maxReplicas": 3},
             "serve": {"topology": {"decode_workers": 3}}}
    chart.render(grows, name=RELEASE)
    with pytest.raises(helm.HelmRenderError, match="do not fit"):
        chart.render({**grows, "autoscaling": {"enabled": False}}, name=RELEASE)


def test_upgrade_strategy_is_a_value_and_reaches_the_rayservice(chart, rendered, ray_service_schema, values_schema):
    for docs in rendered.values():
        (rs,) = _by_kind(docs, "RayService")
        assert rs["spec"]["upgradeStrategy"] == {"type": "NewCluster"}
    (rs,) = _by_kind(_split(chart.render({"upgradeStrategy": "None"}, name=RELEASE)), "RayService")
    assert rs["spec"]["upgradeStrategy"] == {"type": "None"}
    assert jsonschema.Draft4Validator(ray_service_schema).is_valid(rs)
    assert values_schema["properties"]["upgradeStrategy"]["enum"] == ["NewCluster", "None"]
    # the GPU cost is spelled out where the value is set
    values_text = (CHART / "values.yaml").read_text()
    assert "twice the GPUs" in values_text[: values_text.index("upgradeStrategy:")]


POOL_SETTINGS = "tandem.dev/pool-settings"
WORKER_GROUPS = "tandem.dev/worker-groups"


def _pool_settings_hashes(chart, values: dict) -> set[str]:
    """The pool-settings annotation of every pod template of the RayService ``values`` render."""
    (rs,) = _by_kind(_split(chart.render(values, name=RELEASE, namespace=NAMESPACE)), "RayService")
    return {pod["metadata"]["annotations"][POOL_SETTINGS] for pod in _pods(rs)}


@pytest.mark.parametrize(
    "change",
    [
        {"serve": {"topology": {"model": "/models/my-llama"}}},
        {"serve": {"topology": {"decode_workers": 2}}, "decode": {"replicas": 2}},
        {"serve": {"topology": {"engine": {"max_num_seqs": 8}}}},
        {"serve": {"topology": {"transfer": {"backend": "collective"}}}},
        {"serve": {"workerResources": {"decode": {"tandem_decode": 2}}}, "decode": {"rayResources": {"tandem_decode": 2}}},
        {"metrics": {"port": 8090}},
    ],
)
def test_a_pool_settings_change_changes_every_pod_template(chart, change):
    """So that KubeRay starts a new cluster for it (upgradeStrategy NewCluster), rather
    than apply it in place to pools that hold the GPUs the new ones need."""
    (before,) = _pool_settings_hashes(chart, {})  # one hash, on the head's and each group's pod
    (after,) = _pool_settings_hashes(chart, change)
    assert after != before, f"{change} left the pods' {POOL_SETTINGS} at {before}"


def test_router_settings_and_the_start_deadline_apply_in_place(chart):
    """They change only serveConfigV2, which KubeRay applies to the running cluster."""
    (default,) = _pool_settings_hashes(chart, {})
    for change in ({"serve": {"maxOutstandingRequests": 8, "placement": "round_robin"}},
                   {"serve": {"startTimeoutSeconds": 60}}, {"podAnnotations": {"team": "llm"}}):
        assert _pool_settings_hashes(chart, change) == {default}, change


def test_pod_annotations_are_kept_beside_the_pool_settings_hash(chart):
    (rs,) = _by_kind(_split(chart.render({"podAnnotations": {"team": "llm"}}, name=RELEASE)), "RayService")
    for pod in _pods(rs):
        assert pod["metadata"]["annotations"].keys() == {"team", POOL_SETTINGS, WORKER_GROUPS}
    for own in (POOL_SETTINGS, WORKER_GROUPS):
        with pytest.raises(helm.HelmRenderError, match=f"podAnnotations: {own} is the chart's own"):
            chart.render({"podAnnotations": {own: "mine"}}, name=RELEASE)


def _kuberay_cluster_hash(rs: dict) -> str:
    """What KubeRay compares to decide whether a RayService needs a new cluster
    (rayservice_controller.go, generateHashWithoutReplicasAndWorkersToDelete): the
    rayClusterConfig with each worker group's replicas, minReplicas, maxReplicas and
    workersToDelete left out."""
    config = copy.deepcopy(rs["spec"]["rayClusterConfig"])
    for group in config["workerGroupSpecs"]:
        for key in ("replicas", "minReplicas", "maxReplicas"):
            group.pop(key, None)
        group.get("scaleStrategy", {}).pop("workersToDelete", None)
    return json.dumps(config, sort_keys=True)


def _rayservice(chart, values: dict) -> dict:
    (rs,) = _by_kind(_split(chart.render(values, name=RELEASE, namespace=NAMESPACE)), "RayService")
    return rs


@pytest.mark.parametrize(
    "change",
    [
        {"prefill": {"replicas": 2}},                                   # a spare pod
        {"decode": {"replicas": 2}},
        {"prefill": {"replicas": 3}, "decode": {"replicas": 2}},
    ],
)
def test_a_change_of_replicas_alone_reaches_kuberay(chart, change):
    """KubeRay's cluster hash leaves the replica counts out: without the worker-groups
    annotation on the pod templates, a change to them alone would never reach the
    running cluster; with it, KubeRay starts a new cluster with the new counts. (With
    autoscaling, minReplicas and maxReplicas are in the pool settings' hash as well.)"""
    before, after = _rayservice(chart, {}), _rayservice(chart, change)
    assert _kuberay_cluster_hash(after) != _kuberay_cluster_hash(before), f"KubeRay would not act on {change}"
    for rs in (before, after):
        for pod in _pods(rs):
            del pod["metadata"]["annotations"][WORKER_GROUPS]
    assert _kuberay_cluster_hash(after) == _kuberay_cluster_hash(before), "the annotation is what KubeRay sees"


def test_the_worker_groups_annotation_spells_out_each_groups_capacity(chart, rendered):
    (rs,) = _by_kind(rendered["gpu"], "RayService")
    assert {p["metadata"]["annotations"][WORKER_GROUPS] for p in _pods(rs)} == {
        "prefill=2x(GPU=1,tandem_prefill=1) decode=2x(GPU=1,tandem_decode=1)"}
    autoscaled = _rayservice(chart, {"autoscaling": {"enabled": True}})
    assert _pods(autoscaled)[0]["metadata"]["annotations"][WORKER_GROUPS] == (
        "prefill=1..4x(GPU=0,tandem_prefill=1) decode=1..4x(GPU=0,tandem_decode=1)")
    # with autoscaling, replicas is only where the autoscaler starts: no new cluster for it
    started_higher = _rayservice(chart, {"autoscaling": {"enabled": True}, "decode": {"replicas": 3}})
    assert _kuberay_cluster_hash(started_higher) == _kuberay_cluster_hash(autoscaled)


def _live(groups: str | None = None, env: list | None = None) -> dict:
    """A live RayService as lookup returns it, as far as the in-place check reads it."""
    head = {"metadata": {"annotations": {} if groups is None else {WORKER_GROUPS: groups}},
            "spec": {"containers": [{"name": "ray-head", "env": env or []}]}}
    return {"spec": {"rayClusterConfig": {"headGroupSpec": {"template": head}}}}


def _render_upgrade(tmp_path, live: dict, values: dict) -> None:
    """Render a copy of the chart whose in-place check sees ``live`` as the release's live
    RayService, as lookup would return it on an upgrade (offline, lookup returns nothing)."""
    import shutil

    copy_dir = tmp_path / "tandem"
    shutil.copytree(CHART, copy_dir, dirs_exist_ok=True)
    (copy_dir / "templates" / "zz-live.yaml").write_text(
        "{{- include \"tandem.checkInPlaceUpgrade\" (dict \"root\" . \"live\" ("
        + json.dumps(json.dumps(live)) + " | fromJson)) }}\n")
    copied = OfflineChart.load(copy_dir)
    try:
        copied.render(values, name=RELEASE, namespace=NAMESPACE)
    finally:
        copied.close()


def test_upgrade_strategy_none_refuses_an_upgrade_that_changes_the_worker_groups(tmp_path):
    """None applies no rayClusterConfig change: the groups keep their pods while the new
    Serve config is applied in place, and pools sized for the new groups would not fit
    the old ones (the app retires the old pools first: a full outage)."""
    live = _live("prefill=1x(GPU=0,tandem_prefill=1) decode=1x(GPU=0,tandem_decode=1)")
    more = {"upgradeStrategy": "None", "decode": {"replicas": 2}, "serve": {"topology": {"decode_workers": 2}}}
    with pytest.raises(helm.HelmRenderError, match=r"upgradeStrategy None: this upgrade changes the worker groups "
                                                    r'from "prefill=1x.*decode=1x.*" to "prefill=1x.*decode=2x'):
        _render_upgrade(tmp_path, live, more)
    with pytest.raises(helm.HelmRenderError, match="upgradeStrategy None"):  # replicas alone
        _render_upgrade(tmp_path, live, {"upgradeStrategy": "None", "decode": {"replicas": 2}})
    # same groups: applied in place (the pools restart, and fit the pods they had)
    _render_upgrade(tmp_path, live, {"upgradeStrategy": "None", "serve": {"topology": {"engine": {"max_num_seqs": 8}}}})
    _render_upgrade(tmp_path, live, {**more, "upgradeStrategy": "NewCluster"})  # a new cluster brings the pods
    _render_upgrade(tmp_path, _live(), more)  # a release from before the annotation: not checked
    template = (CHART / "templates" / "rayservice.yaml").read_text()
    assert 'lookup "ray.io/v1" "RayService" .Release.Namespace $fullname' in template


def test_upgrade_strategy_none_refuses_an_api_key_the_running_pods_lack(tmp_path):
    """The Serve config naming the key's variable is applied in place; the pods' env is
    not: the router would read no key and serve without one."""
    key = {"apiKey": {"existingSecret": "tandem-api-key"}, "upgradeStrategy": "None"}
    with pytest.raises(helm.HelmRenderError, match='sets the API key from Secret tandem-api-key, which the running '
                                                   'pods do not have \\(their TANDEM_API_KEY comes from ""\\)'):
        _render_upgrade(tmp_path, _live(), key)
    has_it = [{"name": "TANDEM_API_KEY", "valueFrom": {"secretKeyRef": {"name": "tandem-api-key", "key": "api-key"}}}]
    _render_upgrade(tmp_path, _live(env=has_it), key)
    with pytest.raises(helm.HelmRenderError, match='comes from "tandem-api-key"'):
        _render_upgrade(tmp_path, _live(env=has_it), {**key, "apiKey": {"existingSecret": "rotated-key"}})
    _render_upgrade(tmp_path, _live(), {**key, "upgradeStrategy": "NewCluster"})


def test_the_start_deadline_is_a_value_and_reaches_the_app(chart, rendered):
    from cluster.service import configs_from_args

    for docs in rendered.values():
        (rs,) = _by_kind(docs, "RayService")
        (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
        assert configs_from_args(app["args"])[0].start_timeout_s == chart.values["serve"]["startTimeoutSeconds"]
    (rs,) = _by_kind(_split(chart.render({"serve": {"startTimeoutSeconds": 60}}, name=RELEASE)), "RayService")
    (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    assert configs_from_args(app["args"])[0].start_timeout_s == 60


@pytest.mark.parametrize("flavour", ["cpu", "gpu"])
def test_dockerfiles_pin_ray_to_the_charts_ray_version(chart, flavour):
    text = (DEPLOY / "docker" / f"Dockerfile.{flavour}").read_text()
    (version,) = re.findall(r"^ARG RAY_VERSION=(\S+)$", text, re.M)
    assert version == chart.values["rayVersion"]
    pin = text.index('RUN pip install "ray[serve]==${RAY_VERSION}"')
    assert pin < text.index("RUN pip install .") if flavour == "cpu" else pin < text.index('RUN pip install ".[gpu]"')


# ------------------------------------------------------ pod security, /dev/shm, pod fields


def _kuberay_pods(rs: dict, cluster: str = f"{RELEASE}-x7k2p") -> list[dict]:
    """The pods KubeRay makes of the RayService's templates, as far as these tests need them
    (ray-operator/controllers/ray/common/pod.go): its labels over the template's (labelPod:
    ray.io/node-type, ray.io/group, ray.io/cluster are its own, never the template's), the
    wait-gcs-ready init container it adds to worker pods (with a copy of the Ray container's
    securityContext), and with in-tree autoscaling the autoscaler sidecar on the head (with
    autoscalerOptions.securityContext, else none). ``cluster`` is the RayCluster's name,
    which KubeRay generates for a RayService (<name>-<random>)."""
    config = rs["spec"]["rayClusterConfig"]
    groups = [("head", "headgroup", config["headGroupSpec"])]
    groups += [("worker", g["groupName"], g) for g in config["workerGroupSpecs"]]
    pods = []
    for node_type, group, spec in groups:
        template = copy.deepcopy(spec["template"])
        labels = {**template["metadata"].get("labels", {}), "ray.io/node-type": node_type,
                  "ray.io/group": group, "ray.io/cluster": cluster, "ray.io/is-ray-node": "yes"}
        pod = template["spec"]
        ray = pod["containers"][0]
        if node_type == "worker":
            pod.setdefault("initContainers", []).append(
                {"name": "wait-gcs-ready", "image": ray["image"],
                 "securityContext": copy.deepcopy(ray.get("securityContext"))})
        elif config.get("enableInTreeAutoscaling"):
            sidecar = {"name": "autoscaler", "image": ray["image"]}
            if (config.get("autoscalerOptions") or {}).get("securityContext"):
                sidecar["securityContext"] = config["autoscalerOptions"]["securityContext"]
            pod["containers"].append(sidecar)
        pods.append({"group": group, "labels": labels, "spec": pod})
    return pods


# Pod Security Standards, "restricted" (Kubernetes 1.30; it includes "baseline").
_RESTRICTED_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                            "persistentVolumeClaim", "projected", "secret"}
_SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                 "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                 "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                 "net.ipv4.tcp_keepalive_probes"}
_SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
_PROFILES = ("RuntimeDefault", "Localhost")  # the seccomp and AppArmor profiles allowed


def _restricted_violations(pod: dict) -> list[str]:
    """What of a pod spec breaks the Pod Security "restricted" profile (empty: it passes)."""
    out = []
    psc = pod.get("securityContext") or {}

    def seccomp(sc):
        return (sc.get("seccompProfile") or {}).get("type")

    def common(where, sc):
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"{where}: windowsOptions.hostProcess")
        se = sc.get("seLinuxOptions") or {}
        if se.get("type") not in _SELINUX_TYPES or se.get("user") or se.get("role"):
            out.append(f"{where}: seLinuxOptions {se}")
        if (sc.get("appArmorProfile") or {}).get("type", "RuntimeDefault") not in _PROFILES:
            out.append(f"{where}: appArmorProfile {sc['appArmorProfile']}")
        if seccomp(sc) == "Unconfined":
            out.append(f"{where}: seccompProfile Unconfined")
        if sc.get("runAsUser") == 0:
            out.append(f"{where}: runAsUser 0")

    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(field):
            out.append(f"pod: {field}")
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= _RESTRICTED_VOLUME_TYPES:
            out.append(f"volume {volume['name']}: {sorted(kinds)}")
    for sysctl in psc.get("sysctls", []):
        if sysctl["name"] not in _SAFE_SYSCTLS:
            out.append(f"pod: sysctl {sysctl['name']}")
    common("pod", psc)
    containers = [*pod.get("initContainers", []), *pod.get("containers", []), *pod.get("ephemeralContainers", [])]
    for c in containers:
        sc, where = c.get("securityContext") or {}, f"container {c['name']}"
        common(where, sc)
        if sc.get("privileged"):
            out.append(f"{where}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}: allowPrivilegeEscalation is not false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{where}: capabilities do not drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{where}: adds capabilities {sorted(set(caps['add']) - {'NET_BIND_SERVICE'})}")
        if sc.get("runAsNonRoot") is False or not (sc.get("runAsNonRoot") or psc.get("runAsNonRoot")):
            out.append(f"{where}: runAsNonRoot is not true")
        if seccomp(sc) not in _PROFILES and seccomp(psc) not in _PROFILES:
            out.append(f"{where}: no RuntimeDefault or Localhost seccompProfile")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{where}: procMount {sc['procMount']}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{where}: hostPort")
    return out


_RESTRICTED_CASES = {"default": {}, "autoscaling": {"autoscaling": {"enabled": True}},
                     "proxy ingress": {"serve": {"ingress": "proxy"}}}


def test_every_pod_kuberay_makes_passes_pod_security_restricted(chart, rendered):
    """Every container of every pod, the ones KubeRay adds included: the worker pods'
    wait-gcs-ready init container (a copy of the Ray container's securityContext) and, with
    autoscaling, the head's autoscaler sidecar (autoscalerOptions.securityContext)."""
    cases = {case: _by_kind(docs, "RayService")[0] for case, docs in rendered.items()}
    for case, values in _RESTRICTED_CASES.items():
        cases[case] = _by_kind(_split(chart.render(values, name=RELEASE)), "RayService")[0]
    for case, rs in cases.items():
        pods = _kuberay_pods(rs)
        assert len(pods) == 3 and all(p["spec"]["containers"][0].get("securityContext") for p in pods), case
        for pod in pods:
            assert _restricted_violations(pod["spec"]) == [], (case, pod["group"])
    autoscaled = _kuberay_pods(cases["autoscaling"])[0]["spec"]
    assert [c["name"] for c in autoscaled["containers"]] == ["ray-head", "autoscaler"]


def test_the_restricted_check_finds_what_breaks_the_profile(chart, rendered):
    """The check above is not vacuous: the pods as the chart rendered them before (no
    container securityContext; no autoscalerOptions) and the usual breaches all fail it."""
    (rs,) = _by_kind(rendered["default"], "RayService")
    head = _kuberay_pods(rs)[0]["spec"]

    def broken(change):
        pod = copy.deepcopy(head)
        change(pod)
        return _restricted_violations(pod)

    old = broken(lambda p: p["containers"][0].pop("securityContext"))
    assert any("allowPrivilegeEscalation" in v for v in old) and any("drop ALL" in v for v in old), old
    assert broken(lambda p: p["containers"][0]["securityContext"]["capabilities"].update(add=["IPC_LOCK"]))
    assert broken(lambda p: p["securityContext"].update(runAsUser=0))
    assert broken(lambda p: p["containers"][0]["securityContext"].update(seccompProfile={"type": "Unconfined"}))
    assert broken(lambda p: p["volumes"].append({"name": "h", "hostPath": {"path": "/"}}))
    assert broken(lambda p: p.update(hostNetwork=True))
    no_options = copy.deepcopy(_by_kind(_split(chart.render({"autoscaling": {"enabled": True}}, name=RELEASE)),
                                        "RayService")[0])
    del no_options["spec"]["rayClusterConfig"]["autoscalerOptions"]
    assert _restricted_violations(_kuberay_pods(no_options)[0]["spec"]) != []


def test_pods_run_as_the_user_the_images_run_as(chart):
    """Pod-level uid and gid: the images' USER (deploy/docker), so that files the image
    made for it (the model cache under $HOME) stay its own."""
    security = chart.values["podSecurityContext"]
    for flavour in ("cpu", "gpu"):
        text = (DEPLOY / "docker" / f"Dockerfile.{flavour}").read_text()
        uid, gid = re.findall(r"^USER (\d+):(\d+)$", text, re.M)[-1]
        assert (security["runAsUser"], security["runAsGroup"]) == (int(uid), int(gid)), flavour


def test_security_contexts_are_values_and_a_group_may_replace_its_own(chart):
    rdma = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]},
            "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    (rs,) = _by_kind(_split(chart.render({"decode": {"securityContext": rdma}}, name=RELEASE)), "RayService")
    contexts = {p["group"]: p["spec"]["containers"][0]["securityContext"] for p in _kuberay_pods(rs)}
    assert contexts == {"headgroup": chart.values["securityContext"], "prefill": chart.values["securityContext"],
                        "decode": rdma}
    assert {p["group"] for p in _kuberay_pods(rs) if _restricted_violations(p["spec"])} == {"decode"}
    # top-level values merge into the defaults as Helm merges values (null removes a key)
    everywhere = {"securityContext": {"readOnlyRootFilesystem": True, "seccompProfile": None},
                  "podSecurityContext": {"runAsUser": 2000}}
    (rs,) = _by_kind(_split(chart.render(everywhere, name=RELEASE)), "RayService")
    for pod in _pods(rs):
        expected = {**chart.values["securityContext"], "readOnlyRootFilesystem": True}
        del expected["seccompProfile"]
        assert pod["spec"]["containers"][0]["securityContext"] == expected
        assert pod["spec"]["securityContext"] == {**chart.values["podSecurityContext"], "runAsUser": 2000}


_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$")
_FACTORS = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
            "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def _bytes(quantity) -> float:
    if isinstance(quantity, (int, float)):
        return float(quantity)
    number, unit = _QUANTITY.match(quantity).groups()
    return float(number) * _FACTORS[unit]


def _ray_object_store(memory: float, shm: float, object_store_memory=None) -> float:
    """The object store Ray sizes for a node with ``memory`` bytes and a /dev/shm of ``shm``
    bytes (Ray's own code, /dev/shm's size faked)."""
    from unittest import mock

    import ray._private.utils as ray_utils

    if object_store_memory is not None:
        return _bytes(object_store_memory)
    with mock.patch.object(ray_utils, "get_shared_memory_bytes", return_value=int(shm)):
        return ray_utils.resolve_object_store_memory(int(memory))


def test_dev_shm_is_bounded_and_holds_rays_object_store(chart, rendered):
    """/dev/shm is a memory-backed emptyDir with a sizeLimit (by default the container's
    memory limit, as KubeRay sizes the one it adds), and Ray's object store fits it: Ray
    keeps the store in /dev/shm only when it fits (else /tmp, on disk)."""
    for case, docs in rendered.items():
        (rs,) = _by_kind(docs, "RayService")
        for pod in _pods(rs):
            (container,) = pod["spec"]["containers"]
            (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
            shm = {v["name"]: v for v in pod["spec"]["volumes"]}[mount["name"]]["emptyDir"]
            assert shm["medium"] == "Memory", case
            assert shm["sizeLimit"] == container["resources"]["limits"]["memory"], case
            memory = _bytes(container["resources"]["limits"]["memory"])
            assert _ray_object_store(memory, _bytes(shm["sizeLimit"])) <= _bytes(shm["sizeLimit"]), case
    (rs,) = _by_kind(_split(chart.render({"head": {"shmSizeLimit": "4Gi"}, "decode": {"shmSizeLimit": "3Gi"}},
                                         name=RELEASE)), "RayService")
    limits = [{v["name"]: v for v in pod["spec"]["volumes"]}["dshm"]["emptyDir"]["sizeLimit"] for pod in _pods(rs)]
    assert limits == ["4Gi", "8Gi", "3Gi"]


@pytest.mark.parametrize(
    "memory, shm, object_store",
    [
        ("8Gi", "2Gi", None),            # 30% of 8 GiB is 2.4 GiB
        ("8Gi", "3Gi", None),
        ("64Gi", "8Gi", None),           # Ray's store: at least 10 GB, whatever /dev/shm holds
        ("64Gi", "10Gi", None),          # ...and 95% of /dev/shm past that
        ("64Gi", "", None),
        ("1000Gi", "300Gi", None),       # capped at 200 GB
        ("8Gi", "1Gi", 500_000_000),
        ("8Gi", "1Gi", "2000000000"),
        (8 * 2**30, "2.5Gi", None),
    ],
)
def test_a_dev_shm_that_rays_object_store_does_not_fit_fails_to_render(chart, memory, shm, object_store):
    """The chart refuses a /dev/shm exactly when Ray's own sizing would not fit it."""
    group = {"memory": memory, "shmSizeLimit": shm}
    if object_store is not None:
        group["rayStartParams"] = {"object-store-memory": object_store}
    store = _ray_object_store(_bytes(memory), _bytes(shm or memory), object_store)
    if store <= _bytes(shm or memory):
        chart.render({"prefill": group}, name=RELEASE)
    else:
        with pytest.raises(helm.HelmRenderError, match="prefill: Ray's object store .* does not fit /dev/shm"):
            chart.render({"prefill": group}, name=RELEASE)


def test_the_head_offers_ray_no_gpus(rendered):
    """Without num-gpus Ray counts the GPUs the container can see: a head on a GPU node
    whose runtime shows it some would offer them."""
    for case, docs in rendered.items():
        (rs,) = _by_kind(docs, "RayService")
        assert rs["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0", case


def _kuberay_start_lines():
    """scripts/kuberay_pods.py (scripts/image-check runs the chart with it): the `ray start`
    line KubeRay's operator builds for a pod."""
    spec = importlib.util.spec_from_file_location("kuberay_pods", REPO / "scripts" / "kuberay_pods.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("kuberay_pods", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return sys.modules["kuberay_pods"]


def test_each_worker_offers_ray_exactly_its_groups_gpus_when_kuberay_starts_it(rendered, gpu_values):
    """The `ray start` line KubeRay builds from a worker group: the group's `gpus` as
    num-gpus. KubeRay would add num-gpus from the nvidia.com/gpu limit itself, but only where
    rayStartParams.resources parses as JSON once trimmed of quotes, and the chart's (the
    shell-quoted form KubeRay's docs show) does not: the operator logs an error and leaves
    Ray to count the GPUs it sees. A CPU group offers none, as the head."""
    kp = _kuberay_start_lines()
    for case, docs in rendered.items():
        (rs,) = _by_kind(docs, "RayService")
        for role, group in _groups(rs).items():
            (container,) = group["template"]["spec"]["containers"]
            line = kp.ray_start_command("worker", group["rayStartParams"], container["resources"],
                                        "tandem-abcde-head-svc.tandem.svc.cluster.local", "6379")
            gpus = gpu_values[role]["gpus"] if case == "gpu" else 0
            assert re.findall(r"--num-gpus=(\S+)", line) == [str(gpus)], f"{case} {role}: {line}"


def test_standard_pod_fields_reach_each_groups_pods(chart, rendered, ray_service_schema):
    spread = [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
               "labelSelector": {"matchLabels": {"tandem.dev/role": "decode"}}, "matchLabelKeys": ["ray.io/cluster"]}]
    fields = {
        "head": {"priorityClassName": "tandem-head", "serviceAccountName": "tandem-head"},
        "prefill": {"priorityClassName": "gpu-high", "runtimeClassName": "nvidia"},
        "decode": {"topologySpreadConstraints": spread, "serviceAccountName": "tandem-decode",
                   "runtimeClassName": "nvidia"},
    }
    (rs,) = _by_kind(_split(chart.render(fields, name=RELEASE)), "RayService")
    assert jsonschema.Draft4Validator(ray_service_schema).is_valid(rs)
    names = ("priorityClassName", "topologySpreadConstraints", "serviceAccountName", "runtimeClassName")
    for role, pod in zip(["head", "prefill", "decode"], _pods(rs)):
        assert {k: v for k, v in pod["spec"].items() if k in names} == fields[role], role
    for docs in rendered.values():
        for pod in _pods(_by_kind(docs, "RayService")[0]):
            assert not set(names) & set(pod["spec"])


def test_each_group_may_run_its_own_image(chart, gpu_values):
    values = {"image": {"repository": "registry.example.com/tandem", "tag": "1.0-cpu"},
              "prefill": {"image": {"repository": "registry.example.com/tandem-gpu", "tag": "1.0-gpu"}},
              "decode": {"image": {"tag": "1.0-gpu", "pullPolicy": "Always"}}}
    (rs,) = _by_kind(_split(chart.render(values, name=RELEASE)), "RayService")
    images = [(c["image"], c["imagePullPolicy"]) for c in _containers(rs)]
    assert images == [("registry.example.com/tandem:1.0-cpu", "IfNotPresent"),
                      ("registry.example.com/tandem-gpu:1.0-gpu", "IfNotPresent"),
                      ("registry.example.com/tandem:1.0-gpu", "Always")]
    (rs,) = _by_kind(_split(chart.render(gpu_values, name=RELEASE)), "RayService")
    assert {c["image"] for c in _containers(rs)} == {"ghcr.io/tandem-serve/tandem:0.1.0-gpu"}


# RayService fields the chart may render, and the first KubeRay release that knows each
# (older operators drop an unknown field without a word).
KUBERAY_FIELD_SINCE = {
    ("spec", "upgradeStrategy"): (1, 3),
    ("spec", "rayClusterConfig", "authOptions"): (1, 5),   # 1.5.1
    ("spec", "rayClusterConfig", "authOptions", "secretName"): (1, 6),
}


def _kuberay_floor() -> tuple[int, int]:
    chart_yaml = yaml.safe_load((CHART / "Chart.yaml").read_text())
    (floor,) = re.findall(r"kuberay-operator >= (\d+)\.(\d+)", chart_yaml["annotations"]["tandem.dev/requires"])
    return tuple(map(int, floor))


def _kuberay_needed(rs: dict) -> tuple[int, int]:
    """The first KubeRay release that knows every field of KUBERAY_FIELD_SINCE ``rs`` has."""
    needed = (1, 0)
    for path, since in KUBERAY_FIELD_SINCE.items():
        node = rs
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None:
            needed = max(needed, since)
    return needed


def test_the_stated_kuberay_floor_knows_every_field_the_chart_renders(chart, rendered):
    floor = _kuberay_floor()
    for docs in [*rendered.values(), _split(chart.render({"upgradeStrategy": "None"}, name=RELEASE))]:
        (rs,) = _by_kind(docs, "RayService")
        assert floor >= _kuberay_needed(rs), f"the chart states KubeRay {floor}"
    assert floor >= (1, 6)
    # without Ray's token auth, the operator that knows upgradeStrategy will do
    (no_auth,) = _by_kind(_split(chart.render({"rayAuth": {"enabled": False}}, name=RELEASE)), "RayService")
    assert _kuberay_needed(no_auth) == (1, 3)
    requires = yaml.safe_load((CHART / "Chart.yaml").read_text())["annotations"]["tandem.dev/requires"]
    assert "from 1.3, all that rayAuth.enabled=false needs" in requires
    page = (REPO / "docs" / "kubernetes.md").read_text()
    assert re.findall(r"KubeRay operator (\d+)\.(\d+) or newer", page) == [tuple(map(str, floor))]


# ------------------------------------------------------- Ray's token auth, NetworkPolicy


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def test_ray_token_auth_is_on_by_default_in_every_ray_container(chart, rendered):
    """`ray start` (what KubeRay runs) turns token auth on only when told: every Ray
    container (and KubeRay's autoscaler) gets RAY_AUTH_MODE=token and the token, and
    authOptions names the same Secret, from which the operator reads the token for its own
    calls to the dashboard."""
    for case, docs in rendered.items():
        (secret,) = _by_kind(docs, "Secret")
        (rs,) = _by_kind(docs, "RayService")
        name = secret["metadata"]["name"]
        assert name == f"{rs['metadata']['name']}-ray-auth"
        assert base64.b64decode(secret["data"]["auth_token"]).decode() == TOKEN
        assert rs["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token", "secretName": name}
        for c in _containers(rs):
            env = _env(c)
            assert env["RAY_AUTH_MODE"]["value"] == "token", (case, c["name"])
            assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": name, "key": "auth_token"}
    (rs,) = _by_kind(_split(chart.render({"autoscaling": {"enabled": True}}, name=RELEASE)), "RayService")
    autoscaler = _env(rs["spec"]["rayClusterConfig"]["autoscalerOptions"])
    assert autoscaler["RAY_AUTH_MODE"]["value"] == "token" and "RAY_AUTH_TOKEN" in autoscaler


def test_ray_auth_takes_an_existing_secret_or_can_be_turned_off(chart):
    docs = _split(chart.render({"rayAuth": {"existingSecret": "my-ray-token"}}, name=RELEASE))
    assert _by_kind(docs, "Secret") == []
    (rs,) = _by_kind(docs, "RayService")
    assert rs["spec"]["rayClusterConfig"]["authOptions"]["secretName"] == "my-ray-token"
    for c in _containers(rs):
        assert _env(c)["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "my-ray-token"
    docs = _split(chart.render({"rayAuth": {"enabled": False}}, name=RELEASE))
    (rs,) = _by_kind(docs, "RayService")
    assert _by_kind(docs, "Secret") == [] and "authOptions" not in rs["spec"]["rayClusterConfig"]
    assert not [c for c in _containers(rs) if {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"} & set(_env(c))]


def test_the_auth_token_is_made_once_and_kept_across_upgrades(tmp_path):
    """A new token on a running cluster would lock the operator out of its head. The Secret
    takes the token lookup finds in the live one, else rayAuth.token, else a new random one
    where Helm reads the cluster (a first install); a token other than the live one fails.
    Offline lookup finds nothing, so a chart copy feeds the helper what it would find."""
    import shutil

    copy_dir = tmp_path / "tandem"
    shutil.copytree(CHART, copy_dir)

    def token(live: str, given: str, online: str) -> str:
        live_secret = f'(dict "data" (dict "auth_token" "{live}"))' if live else "dict"
        return (f'{{{{ include "tandem.rayAuthTokenB64" (dict "name" "tandem-ray-auth" "live" {live_secret} '
                f'"token" "{given}" "online" {online}) | quote }}}}')

    kept = base64.b64encode(b"kept-token").decode()
    (copy_dir / "templates" / "zz-live.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: live}\ndata:\n"
        f"  kept: {token(kept, '', 'true')}\n  keptOffline: {token(kept, '', 'false')}\n"
        f"  keptGiven: {token(kept, 'kept-token', 'false')}\n  given: {token('', 'given-token', 'false')}\n"
        f"  drawn: {token('', '', 'true')}\n"
        f"{{{{- if eq .Release.Name \"rotate\" }}}}\n  rotated: {token(kept, 'another-token', 'true')}\n{{{{- end }}}}\n")
    copied = OfflineChart.load(copy_dir)
    try:
        (live,) = [d for d in _split(copied.render({}, name=RELEASE)) if d["kind"] == "ConfigMap"]
        with pytest.raises(helm.HelmRenderError, match="rayAuth.token differs from the token in the release's "
                                                        "Secret tandem-ray-auth: the chart never changes a live token"):
            copied.render({}, name="rotate")
    finally:
        copied.close()
    assert live["data"]["kept"] == live["data"]["keptOffline"] == live["data"]["keptGiven"] == kept
    assert base64.b64decode(live["data"]["given"]) == b"given-token"
    assert re.fullmatch(r"[A-Za-z0-9]{48}", base64.b64decode(live["data"]["drawn"]).decode())
    template = (CHART / "templates" / "secret.yaml").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace $name' in template
    assert 'lookup "v1" "Secret" .Release.Namespace ""' in template  # the cluster answers a list, offline nothing


def test_an_offline_render_draws_no_token_and_names_the_values_to_set():
    """helm template, helm lint and Argo CD render without the cluster (lookup finds
    nothing): a token drawn there would be new on every render, and applying it would
    replace the running release's Secret under its pods (the operator would then read a
    token they do not hold). So the render fails and names what to set; given a token,
    two renders make the same Secret."""
    plain = helm.Chart.load(CHART)
    try:
        with pytest.raises(helm.HelmRenderError, match=r"cannot read the cluster.*rayAuth\.existingSecret.*rayAuth\.token"):
            plain.render({}, name=RELEASE, namespace=NAMESPACE)
        given = {"rayAuth": {"token": TOKEN}}
        first, second = (_by_kind(_split(plain.render(given, name=RELEASE, namespace=NAMESPACE)), "Secret")
                         for _ in range(2))
        assert first == second and base64.b64decode(first[0]["data"]["auth_token"]).decode() == TOKEN
        with pytest.raises(helm.HelmRenderError, match="rayAuth.existingSecret or rayAuth.token, not both"):
            plain.render({"rayAuth": {"token": TOKEN, "existingSecret": "mine"}}, name=RELEASE)
    finally:
        plain.close()


def _selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, f"the check reads matchLabels only: {selector}"
    return selector.get("matchLabels", {}).items() <= labels.items()


def _admits(policy: dict, namespace: str, ns_labels: dict, labels: dict, port: int) -> bool:
    """Whether a NetworkPolicy admits a TCP connection from a pod (its namespace, that
    namespace's labels, its labels) to ``port`` of the pods it selects."""
    for rule in policy["spec"]["ingress"]:
        if "ports" in rule and port not in [p["port"] for p in rule["ports"]]:
            continue
        if "from" not in rule:
            return True
        for peer in rule["from"]:
            if "ipBlock" in peer:
                continue
            in_ns = _selects(peer["namespaceSelector"], ns_labels) if "namespaceSelector" in peer else namespace == NAMESPACE
            if in_ns and _selects(peer.get("podSelector", {}), labels):
                return True
    return False


RAY_PORTS = [6379, 8265, 10001, 52365, 30000, 40000]  # GCS, dashboard, client, agent, router replica's HTTP, gRPC


def _reachable(policy: dict, source: tuple[str, dict, dict], ports: list[int]) -> list[int]:
    return [p for p in ports if _admits(policy, *source, p)]


def test_the_network_policy_admits_clients_to_the_api_and_prometheus_to_metrics_only(chart, rendered):
    """Ray's internal ports only from the release's own pods (of any of its clusters);
    clients to HTTP and gRPC; Prometheus to Tandem's, Ray's and HAProxy's metrics ports;
    KubeRay's operator to the dashboard and the serve port."""
    api, metrics = [8000, 9000], [8081, 8080, 9101]
    every = RAY_PORTS + api + metrics
    (policy,) = _by_kind(rendered["default"], "NetworkPolicy")
    (rs,) = _by_kind(rendered["default"], "RayService")
    pods = _kuberay_pods(rs, cluster=f"{RELEASE}-old01") + _kuberay_pods(rs, cluster=f"{RELEASE}-new02")
    assert all(_selects(policy["spec"]["podSelector"], p["labels"]) for p in pods)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    client = ("apps", {"kubernetes.io/metadata.name": "apps"}, {"app": "web"})
    prometheus = ("monitoring", {"kubernetes.io/metadata.name": "monitoring"}, {"app.kubernetes.io/name": "prometheus"})
    operator = ("kuberay", {"kubernetes.io/metadata.name": "kuberay"}, {"app.kubernetes.io/name": "kuberay-operator"})
    other_release = (NAMESPACE, {}, {**pods[0]["labels"], "app.kubernetes.io/instance": "other"})
    for pod in pods:  # old cluster and new, during an upgrade
        assert _reachable(policy, (NAMESPACE, {}, pod["labels"]), every) == every
    assert _reachable(policy, client, every) == api
    assert _reachable(policy, prometheus, every) == api + metrics
    assert _reachable(policy, operator, every) == [8265, 8000, 9000]
    assert _reachable(policy, other_release, every) == api
    # narrowed: only the ingress controller reaches the API, only Prometheus the metrics
    narrowed = {"networkPolicy": {
        "clients": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}]}}
    (policy,) = _by_kind(_split(chart.render(narrowed, name=RELEASE, namespace=NAMESPACE)), "NetworkPolicy")
    ingress = ("ingress-nginx", {"kubernetes.io/metadata.name": "ingress-nginx"}, {"app": "controller"})
    assert _reachable(policy, ingress, every) == api
    assert _reachable(policy, client, every) == []
    assert _reachable(policy, prometheus, every) == metrics
    assert _reachable(policy, operator, every) == [8265, 8000]
    # the Python proxy has no exporter; off, no policy
    proxy = _split(chart.render({"serve": {"ingress": "proxy"}}, name=RELEASE, namespace=NAMESPACE))
    assert _reachable(_by_kind(proxy, "NetworkPolicy")[0], prometheus, every) == api + [8081, 8080]
    assert _by_kind(_split(chart.render({"networkPolicy": {"enabled": False}}, name=RELEASE)), "NetworkPolicy") == []


def test_the_operator_and_prometheus_are_admitted_from_their_namespace_not_by_a_pod_label(chart, rendered):
    """A pod label is no boundary: whoever may create a pod anywhere can label it
    `app.kubernetes.io/name: kuberay-operator` and, with rayAuth off, submit jobs to the
    dashboard. Each default peer names its namespace by `kubernetes.io/metadata.name` (the
    API server sets it) beside the pod label, in the same peer, so both must match."""
    every = RAY_PORTS + [8000, 9000, 8081, 8080, 9101]
    for case, docs in rendered.items():
        (policy,) = _by_kind(docs, "NetworkPolicy")
        peers = [peer for rule in policy["spec"]["ingress"] for peer in rule.get("from", [])]
        unnamed = [p for p in peers if "namespaceSelector" in p
                   and set(p["namespaceSelector"].get("matchLabels", {})) != {"kubernetes.io/metadata.name"}]
        assert unnamed == [], f"{case}: peers that admit a namespace by anything but its name: {unnamed}"

    def source(namespace: str, name: str) -> tuple[str, dict, dict]:
        return namespace, {"kubernetes.io/metadata.name": namespace}, {"app.kubernetes.io/name": name}

    (policy,) = _by_kind(rendered["default"], "NetworkPolicy")
    for impostor in (source("apps", "kuberay-operator"), source("apps", "prometheus")):
        assert _reachable(policy, impostor, every) == [8000, 9000], impostor
    assert _reachable(policy, source("kuberay", "kuberay-operator"), [8265]) == [8265]
    assert _reachable(policy, source("monitoring", "prometheus"), [8081]) == [8081]
    moved = {"networkPolicy": {"operatorNamespace": "ray-system", "prometheusNamespace": "observability"}}
    (policy,) = _by_kind(_split(chart.render(moved, name=RELEASE, namespace=NAMESPACE)), "NetworkPolicy")
    assert _reachable(policy, source("ray-system", "kuberay-operator"), every) == [8265, 8000, 9000]
    assert _reachable(policy, source("observability", "prometheus"), every) == [8000, 9000, 8081, 8080, 9101]
    assert _reachable(policy, source("kuberay", "kuberay-operator"), every) == [8000, 9000]
    # "" drops a default peer; with no peer left the ports admit no one else (never everyone)
    dropped = {"networkPolicy": {"operatorNamespace": "", "prometheusNamespace": "", "clients": [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}}]}}
    (policy,) = _by_kind(_split(chart.render(dropped, name=RELEASE, namespace=NAMESPACE)), "NetworkPolicy")
    assert _reachable(policy, source("kuberay", "kuberay-operator"), every) == []
    assert _reachable(policy, source("monitoring", "prometheus"), every) == []
    # the lists add peers, e.g. the API server's addresses for an operator run with useKubernetesProxy
    api_server = {"networkPolicy": {"operator": [{"ipBlock": {"cidr": "10.0.0.1/32"}}]}}
    (policy,) = _by_kind(_split(chart.render(api_server, name=RELEASE, namespace=NAMESPACE)), "NetworkPolicy")
    (rule,) = [r for r in policy["spec"]["ingress"] if {"port": 8265, "protocol": "TCP"} in r.get("ports", [])]
    assert {"ipBlock": {"cidr": "10.0.0.1/32"}} in rule["from"]
    assert _reachable(policy, source("kuberay", "kuberay-operator"), [8265]) == [8265]


# ---------------------------------------------------------------------- values schema


def test_default_and_gpu_values_match_the_values_schema(chart, gpu_values, values_schema):
    jsonschema.Draft7Validator.check_schema(values_schema)
    for values in (chart.values, chart.merge_values(gpu_values)):
        jsonschema.Draft7Validator(values_schema).validate(values)
        chart.validate_schema(values)  # Helm's own validator agrees


def test_the_schema_offers_exactly_the_transfer_backends_there_are(values_schema):
    from kv_transfer import BACKENDS

    topology = values_schema["properties"]["serve"]["properties"]["topology"]["properties"]
    assert topology["transfer"]["properties"]["backend"]["enum"] == list(BACKENDS)


@pytest.mark.parametrize(
    "override, where",
    [
        ({"prefill": {"replicas": -1}}, "replicas"),
        ({"decode": {"gpus": "two"}}, "gpus"),
        ({"decode": {"gpus": 0.5}}, "gpus"),
        ({"prefill": {"replics": 1}}, "replics"),
        ({"serve": {"topology": {"decode_workers": 0}}}, "decode_workers"),
        ({"serve": {"placement": "random"}}, "placement"),
        ({"serve": {"ingress": "nginx"}}, "ingress"),
        ({"serve": {"haproxyThreads": 0}}, "haproxyThreads"),
        ({"serve": {"grpcMaxMessageBytes": 0}}, "grpcMaxMessageBytes"),
        ({"metrics": {"port": 70000}}, "port"),
        ({"prefill": {"rayResources": {"tandem_prefill": -1}}}, "tandem_prefill"),
        ({"serve": {"startTimeoutSeconds": 0}}, "startTimeoutSeconds"),
        ({"head": {"shmSizeLimit": "lots"}}, "shmSizeLimit"),
        ({"prefill": {"image": {"repo": "x"}}}, "repo"),
        ({"decode": {"topologySpreadConstraints": [{"maxSkew": 1}]}}, "topologyKey"),
        ({"head": {"priorityClassName": "Not A Name"}}, "priorityClassName"),
        ({"rayAuth": {"token": "too-short"}}, "token"),
        ({"networkPolicy": {"operatorNamespace": "Ray System"}}, "operatorNamespace"),
    ],
)
def test_bad_values_are_rejected_by_the_schema(chart, values_schema, override, where):
    merged = chart.merge_values(override)
    errors = list(jsonschema.Draft7Validator(values_schema).iter_errors(merged))
    assert errors, f"the schema accepted {override}"
    assert any(where in _error_text(e) or where in str(e.path) or where in e.message for e in errors), errors
    with pytest.raises(helm.HelmValuesError):
        chart.render(override, name=RELEASE)


# ------------------------------------------------------------------- Grafana dashboard


def _dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "tandem-dashboard.json").read_text())


def _exprs(dashboard: dict) -> list[tuple[str, str]]:
    out = []
    for panel in dashboard["panels"]:
        for nested in [panel, *panel.get("panels", [])]:
            for target in nested.get("targets", []):
                out.append((nested["title"], target["expr"]))
    return out


def test_dashboard_uses_only_specified_metric_names():
    exprs = _exprs(_dashboard())
    assert exprs, "the dashboard has no queries"
    used = set()
    for _title, expr in exprs:
        for name in METRIC_RE.findall(expr):
            used.add(HISTOGRAM_SUFFIX.sub("", name) if not name.endswith("_total") else name)
    unknown = used - METRICS_SPEC
    assert not unknown, f"dashboard queries metrics outside the spec: {sorted(unknown)}"
    assert used == METRICS_SPEC, f"metrics with no panel: {sorted(METRICS_SPEC - used)}"


def test_the_metrics_spec_names_metrics_the_service_exports():
    """The spec above is not a list of its own: each name is a metric ``engine/wire/metrics.py``
    defines (a counter's with ``_total``)."""
    from prometheus_client.metrics import MetricWrapperBase

    import engine.wire.metrics as metrics

    defined = {m._name + ("_total" if m._type == "counter" else "") for m in vars(metrics).values()
               if isinstance(m, MetricWrapperBase)}
    assert METRICS_SPEC <= defined, f"named in the spec, exported by no one: {sorted(METRICS_SPEC - defined)}"


def test_dashboard_queries_are_well_formed_and_filtered():
    for title, expr in _exprs(_dashboard()):
        depth = 0
        for ch in expr:
            depth += {"(": 1, ")": -1}.get(ch, 0)
            assert depth >= 0, f"{title}: unbalanced parentheses in {expr}"
        assert depth == 0 and expr.count("{") == expr.count("}"), f"{title}: unbalanced {expr}"
        for selector in re.findall(r"tandem:[A-Za-z0-9_:]+\{([^}]*)\}", expr):
            assert 'model=~"$model"' in selector and 'role=~"$role"' in selector, f"{title}: {expr}"
        for name in METRIC_RE.findall(expr):
            if name.endswith("_bucket"):
                assert re.search(re.escape(name) + r"\{[^}]*\}\[5m\]", expr), f"{title}: {expr}"


def test_dashboard_has_the_required_panels_and_variables():
    dash = _dashboard()
    names = {v["name"]: v for v in dash["templating"]["list"]}
    assert names["DS_PROMETHEUS"]["type"] == "datasource"
    assert {"model", "role"} <= set(names)
    panels = {p["title"]: p for p in dash["panels"] if p["type"] != "row"}
    for p in panels.values():
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}"
    for title in ("Time to first token", "Inter-token latency", "End-to-end request latency", "KV transfer time"):
        quantiles = {re.match(r"histogram_quantile\(([0-9.]+),", t["expr"]).group(1) for t in panels[title]["targets"]}
        assert quantiles == {"0.5", "0.9", "0.99"}, f"{title}: {quantiles}"
    expected_by = {
        "Preemptions": "mode", "KV transfer failures": "reason", "Rejected requests": "reason",
        "KV cache usage": "worker", "Requests running / waiting": "worker",
        "Pool workers and targets": "role", "Scaling decisions": "direction",
    }
    for title, label in expected_by.items():
        assert all("{{" + label + "}}" in t["legendFormat"] for t in panels[title]["targets"]), title
    throughput = " ".join(t["expr"] for t in panels["Token throughput"]["targets"])
    assert "prompt_tokens_total" in throughput and "generation_tokens_total" in throughput


# ---------------------------------------------------------------- Prometheus, Docker


def test_prometheus_scrapes_the_charts_metrics_service(rendered):
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    (sd,) = job["dns_sd_configs"]
    metrics = _service(rendered["default"], "-metrics")
    assert sd["names"] == [f"{metrics['metadata']['name']}.{NAMESPACE}.svc.cluster.local"]
    assert sd["port"] == metrics["spec"]["ports"][0]["port"]


def test_alert_rules_use_only_specified_metrics_and_end_in_a_threshold():
    rules = [r for g in yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} == {
        "TandemHighTTFTP99", "TandemKVTransferFailures", "TandemKVCacheNearlyFull", "TandemRequestsRejected"
    }
    for rule in rules:
        for name in METRIC_RE.findall(rule["expr"]):
            base = name if name.endswith("_total") else HISTOGRAM_SUFFIX.sub("", name)
            assert base in METRICS_SPEC, f"{rule['alert']}: {name} is not exported"
        assert re.search(r"\) (>|<) [0-9.]+$", rule["expr"]), f"{rule['alert']}: {rule['expr']}"
        assert rule["annotations"]["summary"] and rule["labels"]["severity"]


def test_alert_rules_pass_promtool():
    import subprocess

    require_tool("promtool", PROMETHEUS_SOURCE)
    out = subprocess.run(["promtool", "check", "rules", str(DEPLOY / "prometheus" / "alerts.yml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 4 rules found" in out.stdout


def _pyproject_packages() -> list[str]:
    # tomllib is 3.11+; the project supports 3.10, and this one line is all we need
    (line,) = re.findall(r"^include = \[(.*)\]$", (REPO / "pyproject.toml").read_text(), re.M)
    return [p.strip().strip('"').rstrip("*") for p in line.split(",")]


@pytest.mark.parametrize("flavour", ["cpu", "gpu"])
def test_dockerfiles_copy_every_package_and_run_as_non_root(flavour):
    text = (DEPLOY / "docker" / f"Dockerfile.{flavour}").read_text()
    copied = set(re.findall(r"^COPY (\w+)/ ", text, re.M))
    assert set(_pyproject_packages()) <= copied, f"Dockerfile.{flavour} misses {set(_pyproject_packages()) - copied}"
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert re.search(r'^CMD \["tandem", "up", "--host", "0.0.0.0"\]', text, re.M)
    if flavour == "cpu":
        # The CPU wheel by default (tests/unit/test_image_check.py runs the RUN line).
        assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
        assert 'pip install torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}' in text
    else:
        assert 'pip install ".[gpu]"' in text and "nvidia/cuda:13" in text


def test_autoscaling_values_become_the_topologys_section_and_the_groups_bounds(chart):
    """One set of values drives both loops: the controller's pools between the worker
    groups' min and max replicas, and Ray's autoscaler for the pods (in-tree, on)."""
    from cluster.config import ClusterConfig

    values = {"autoscaling": {"enabled": True, "slo": {"ttftMs": 800, "itlMs": 40}, "intervalSeconds": 2,
                              "scaleDownDelaySeconds": 20, "drainTimeoutSeconds": 45},
              "prefill": {"minReplicas": 1, "replicas": 1, "maxReplicas": 3},
              "decode": {"minReplicas": 1, "replicas": 2, "maxReplicas": 5},
              "serve": {"topology": {"decode_workers": 2}}}
    (rs,) = _by_kind(_split(chart.render(values, name=RELEASE)), "RayService")
    assert rs["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is True
    groups = {g["groupName"]: g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert [(g["minReplicas"], g["maxReplicas"]) for g in groups.values()] == [(1, 3), (1, 5)]
    (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    topology = app["args"]["topology"]
    assert topology["autoscaling"] == {
        "prefill": {"min_workers": 1, "max_workers": 3}, "decode": {"min_workers": 1, "max_workers": 5},
        "slo": {"ttft_ms": 800, "itl_ms": 40}, "interval_s": 2, "scale_down_delay_s": 20, "scale_up_share": 0.5,
        "drain_timeout_s": 45,
    }
    a = ClusterConfig.from_dict(topology).autoscaling  # what the controller runs
    assert (a.decode.max_workers, a.slo.itl_ms, a.drain_timeout_s) == (5, 40, 45)
    off = yaml.safe_load(_by_kind(_split(chart.render({}, name=RELEASE)), "RayService")[0]["spec"]["serveConfigV2"])
    assert "autoscaling" not in off["applications"][0]["args"]["topology"], "off: the pools keep their sizes"


def test_role_switching_renders_only_where_both_roles_ask_the_same_resources(chart):
    """``autoscaling.allowRoleSwitch``: a switched worker keeps its pod, so the chart refuses
    it with the default per-role resources (each pool pinned to its own group), and with
    shared ones renders the topology the controller accepts."""
    from cluster.config import ClusterConfig

    switching = {"autoscaling": {"enabled": True, "allowRoleSwitch": True}}
    with pytest.raises(helm.HelmRenderError, match="allowRoleSwitch: a switched worker keeps its pod"):
        chart.render(switching, name=RELEASE)
    shared = {**switching, "serve": {"workerResources": {"prefill": {"tandem_worker": 1, "tandem_prefill": None},
                                                         "decode": {"tandem_worker": 1, "tandem_decode": None}}},
              "prefill": {"rayResources": {"tandem_worker": 1}}, "decode": {"rayResources": {"tandem_worker": 1}}}
    (rs,) = _by_kind(_split(chart.render(shared, name=RELEASE)), "RayService")
    (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    topology = app["args"]["topology"]
    assert topology["autoscaling"]["allow_role_switch"] is True
    assert ClusterConfig.from_dict(topology).role_switch_problem() is None


@pytest.mark.parametrize("pools,switch", [((2, 6), False), ((2, 6), True), ((0, 8), False)],
                         ids=["disaggregated", "role-switch", "colocated"])
def test_the_planners_elastic_helm_values_render_the_bounds_it_chose(chart, pools, switch):
    """``tandem plan --low-rate``'s Helm values: the chart renders them, each worker group
    spans its pool's bounds, and the topology the app gets carries the same autoscaling
    section (SLO and timings) the simulator ran."""
    from cluster.autoscaler import SLO, AutoscalingConfig
    from cluster.config import ClusterConfig
    from sim.bounds import elastic_topology
    from sim.cli import helm_values
    from sim.topology import SimTopology

    scaling = AutoscalingConfig(slo=SLO(ttft_ms=300, itl_ms=25), interval_s=4, allow_role_switch=switch,
                                scale_up_share=1.5)
    topo = elastic_topology(SimTopology(prefill_workers=pools[0], decode_workers=pools[1]), 0.25, scaling)
    values = json.loads(json.dumps(helm_values(topo)))  # what `yaml.safe_dump` writes, read back
    (rs,) = _by_kind(_split(chart.render(values, name=RELEASE)), "RayService")
    groups = _groups(rs)
    (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    a = ClusterConfig.from_dict(app["args"]["topology"]).autoscaling  # what the controller runs
    assert (a.slo.ttft_ms, a.slo.itl_ms, a.interval_s, a.allow_role_switch, a.scale_up_share) == (300, 25, 4, switch,
                                                                                                1.5)
    assert (a.decode.min_workers, a.decode.max_workers) == (2, 8 if pools[0] == 0 else 6)
    decode = [g for name, g in groups.items() if "decode" in name][0]
    assert (decode["replicas"], decode["minReplicas"], decode["maxReplicas"]) == (2, 2, a.decode.max_workers)
    if pools[0]:
        assert (a.prefill.min_workers, a.prefill.max_workers) == (1, 2)


def test_a_colocated_plans_helm_values_render_with_an_empty_prefill_group(chart):
    """``tandem plan``'s values for a colocated best (prefill_workers 0, fixed pools): the
    prefill group starts no pod, and the app gets the colocated topology."""
    from cluster.config import ClusterConfig
    from sim.cli import helm_values
    from sim.topology import SimTopology

    values = json.loads(json.dumps(helm_values(SimTopology(prefill_workers=0, decode_workers=8))))
    (rs,) = _by_kind(_split(chart.render(values, name=RELEASE)), "RayService")
    prefill = [g for name, g in _groups(rs).items() if "prefill" in name][0]
    assert (prefill["replicas"], prefill["minReplicas"]) == (0, 0)
    (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    cluster = ClusterConfig.from_dict(app["args"]["topology"])
    assert (cluster.prefill_workers, cluster.decode_workers, cluster.autoscaling) == (0, 8, None)


@pytest.mark.parametrize("prefill_tp, decode_tp, colocated", [(2, 4, False), (1, 2, False), (1, 4, True)])
def test_a_tensor_parallel_plans_helm_values_render_a_pod_a_worker_of_its_ranks(chart, prefill_tp, decode_tp,
                                                                                colocated):
    """``tandem plan``'s values where a role's workers span several devices: each group's pods
    offer one worker's GPUs, its ``tensorParallelSize`` reaches the app's topology (the chart
    refuses the setting inside the topology's engine sections)."""
    from cluster.config import ClusterConfig
    from sim.cli import helm_values
    from sim.topology import SimTopology

    topo = SimTopology(prefill_workers=0 if colocated else 2, decode_workers=3,
                       prefill_engine={} if colocated else {"tensor_parallel_size": prefill_tp},
                       decode_engine={"tensor_parallel_size": decode_tp, "max_num_seqs": 64})
    values = json.loads(json.dumps(helm_values(topo)))
    assert values["decode"]["gpus"] == decode_tp
    (rs,) = _by_kind(_split(chart.render(values, name=RELEASE)), "RayService")
    (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    cluster = ClusterConfig.from_dict(app["args"]["topology"])
    assert cluster.tensor_parallel_size("decode") == decode_tp
    if not colocated:
        assert cluster.tensor_parallel_size("prefill") == prefill_tp
    assert cluster.engine_config("decode").max_num_seqs == 64
