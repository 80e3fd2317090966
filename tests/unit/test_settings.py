"""Every setting has one home and one default: the service's schema (``ServiceConfig``, with
``ClusterConfig``, ``RouterConfig`` and the configs they nest). The flags of ``tandem up``
(shared by the benchmarks that launch the service), the keys of a topology file and the
Helm chart's values each map to one field of it, and none of them holds a default of its
own unless this file names why."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from cluster import flags
from cluster.autoscaler import AutoscalingConfig
from cluster.config import ClusterConfig
from cluster.service import ROUTER_SETTINGS, ServiceConfig, configs_from_args
from tandem.cli import build_parser

CHART_VALUES = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "tandem" / "values.yaml"


def _flat(obj, prefix: str = "") -> dict[str, object]:
    """A config as dotted paths to its leaves."""
    if dataclasses.is_dataclass(obj):
        out: dict[str, object] = {}
        for f in dataclasses.fields(obj):
            out.update(_flat(getattr(obj, f.name), f"{prefix}{f.name}."))
        return out
    return {prefix.rstrip("."): obj}


def _service(*argv: str) -> ServiceConfig:
    return ServiceConfig.from_flags(build_parser().parse_args(["up", *argv]))


# flag -> (its value on the command line, the field it sets, the value there)
FLAG_FIELDS = {
    "--model": ("/models/m", "cluster.model", "/models/m"),
    "--prefill-workers": ("3", "cluster.prefill_workers", 3),
    "--decode-workers": ("2", "cluster.decode_workers", 2),
    # (Above 1 the service must be colocated: test_tensor_parallel_flags_need_a_colocated_service.)
    "--prefill-tp": ("1", "cluster.prefill_engine", {"tensor_parallel_size": 1}),
    "--decode-tp": ("1", "cluster.decode_engine", {"tensor_parallel_size": 1}),
    "--kv-transfer-backend": ("object_store", "cluster.transfer.backend", "object_store"),
    "--num-kv-blocks": ("64", "cluster.engine", {"num_kv_blocks": 64}),
    "--engine": ("max_num_seqs=8", "cluster.engine", {"max_num_seqs": 8}),
    "--host-kv-cache-memory": ("16Gi", "cluster.engine", {"host_kv_cache_memory": 16 << 30}),
    "--max-loras": ("2", "cluster.engine", {"max_loras": 2}),
    "--max-lora-rank": ("32", "cluster.engine", {"max_lora_rank": 32}),
    # (Without --max-loras, as many adapters stay resident as --lora names.)
    "--lora": ("sql=/adapters/sql", "cluster.engine", {"lora_adapters": {"sql": "/adapters/sql"}, "max_loras": 1}),
    "--stream-interval-s": ("0.05", "cluster.stream_interval_s", 0.05),
    "--token-channel": ("ray", "cluster.token_channel", "ray"),
    "--ingress": ("proxy", "ingress", "proxy"),
    "--max-outstanding-requests": ("7", "router.admission.max_requests", 7),
    "--max-outstanding-prompt-tokens": ("99", "router.admission.max_prompt_tokens", 99),
    "--placement": ("round_robin", "router.dispatch.placement", "round_robin"),
    "--local-prefill-tokens": ("64", "router.dispatch.local_prefill_tokens", 64),
    "--local-prefill-backlog-tokens": ("8", "router.dispatch.local_prefill_backlog_tokens", 8),
    "--reasoning-parser": ("deepseek_r1", "router.api.reasoning_parser", "deepseek_r1"),
    "--max-stored-responses": ("16", "router.api.max_stored_responses", 16),
    "--host": ("0.0.0.0", "host", "0.0.0.0"),
    "--http-port": ("1234", "http_port", 1234),
    "--grpc-port": ("1235", "grpc_port", 1235),
}
# Flags of `tandem up` that are not settings of the service, and what they are instead.
NOT_SERVICE_FLAGS = {
    "--help": "argparse's",
    "--config": "a topology file: the settings themselves (the keys test below)",
    "--num-cpus": "the size of the local Ray the command starts",
    "--metrics-port": "the node's scrape endpoint, which the command serves beside the service",
    "--api-key": "a secret, passed apart (from_flags(api_key=)), never stored with the flags",
}


def test_every_flag_of_tandem_up_is_a_setting_or_says_what_it_is():
    options = {s for a in build_parser()._subparsers._group_actions[0].choices["up"]._actions
               for s in a.option_strings if s.startswith("--")}
    assert options == set(FLAG_FIELDS) | set(NOT_SERVICE_FLAGS), "map a new flag to its field here"


def test_no_flag_holds_a_default_of_its_own():
    assert _service() == ServiceConfig(), "the flags' defaults must be the schema's"


@pytest.mark.parametrize("flag", sorted(FLAG_FIELDS))
def test_each_flag_sets_its_field_and_only_it(flag):
    value, path, want = FLAG_FIELDS[flag]
    before, after = _flat(_service()), _flat(_service(flag, value))
    changed = {p for p in before if before[p] != after[p]}
    assert changed == {path} and after[path] == want, f"{flag} {value} changed {changed}"


def test_the_defaults_a_flag_help_quotes_are_the_schemas():
    up = build_parser()._subparsers._group_actions[0].choices["up"]
    helps = {a.option_strings[0]: a.help for a in up._actions if a.option_strings}
    admission = ServiceConfig().router.admission
    assert f"(default {admission.max_requests})" in helps["--max-outstanding-requests"]
    assert f"(default {admission.max_prompt_tokens})" in helps["--max-outstanding-prompt-tokens"]
    assert up.get_default("http_port") == ServiceConfig().http_port
    assert up.get_default("grpc_port") == ServiceConfig().grpc_port


def test_a_topology_file_takes_exactly_the_schemas_keys():
    import cluster.config

    fields = {f.name for f in dataclasses.fields(ClusterConfig)}
    example = yaml.safe_load(cluster.config.__doc__.split("::", 1)[1])  # the module's documented example
    ClusterConfig.from_dict({k: v for k, v in example.items() if k != "model"})
    assert set(example) <= fields, f"the documented example has keys the schema lacks: {set(example) - fields}"
    with pytest.raises(ValueError, match="unknown topology settings"):
        ClusterConfig.from_dict({"prefill_worker": 2})


def _leaves(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# The chart's values that are service settings, and the field each one sets.
CHART_FIELDS = {
    "serve.maxOutstandingRequests": "router.admission.max_requests",
    "serve.maxOutstandingPromptTokens": "router.admission.max_prompt_tokens",
    "serve.placement": "router.dispatch.placement",
    "serve.localPrefillTokens": "router.dispatch.local_prefill_tokens",
    "serve.localPrefillBacklogTokens": "router.dispatch.local_prefill_backlog_tokens",
    "serve.reasoningParser": "router.api.reasoning_parser",
    "serve.maxStoredResponses": "router.api.max_stored_responses",
    "serve.ingress": "ingress",
    "serve.grpcMaxMessageBytes": "grpc_max_message_bytes",
    "service.httpPort": "http_port",
    "service.grpcPort": "grpc_port",
    "serve.topology.prefill_workers": "cluster.prefill_workers",
    "serve.topology.decode_workers": "cluster.decode_workers",
    "serve.topology.transfer.timeout_s": "cluster.transfer.timeout_s",
    "serve.topology.transfer.failure_policy": "cluster.transfer.failure_policy",
    "serve.topology.token_channel": "cluster.token_channel",
    "serve.topology.engine": "cluster.engine",
}
# Values where the chart's default differs from `tandem up`'s on purpose, and why.
CHART_DIFFERS = {
    "serve.topology.model": "a real instruction model (tandem up's default too), not the built-in test model",
    "serve.topology.token_channel_host": "0.0.0.0: routers on other pods read the workers' token channels",
    "serve.topology.transfer.backend": "nixl, which the images install (locally: nixl where installed)",
    "serve.topology.prefill_resources.num_cpus": "a whole CPU for each worker in its own pod",
    "serve.topology.prefill_resources.num_gpus": "0 on the default CPU groups (values-gpu.yaml: 1)",
    "serve.topology.decode_resources.num_cpus": "a whole CPU for each worker in its own pod",
    "serve.topology.decode_resources.num_gpus": "0 on the default CPU groups (values-gpu.yaml: 1)",
    "serve.startTimeoutSeconds": "1800 s: GPU nodes may take many minutes to join",
}
# The chart's own values (how it deploys, not what the service does), under `serve`.
CHART_ONLY = {"serve.appName", "serve.importPath", "serve.routePrefix", "serve.proxyLocation",
              "serve.haproxyThreads", "serve.workerResources.prefill.tandem_prefill",
              "serve.workerResources.decode.tandem_decode"}


def test_the_charts_values_are_the_schemas_defaults_or_say_why_not():
    values = yaml.safe_load(CHART_VALUES.read_text())
    leaves = _leaves(values)
    serve = {k for k in leaves if k.startswith("serve.")}
    unmapped = serve - set(CHART_FIELDS) - set(CHART_DIFFERS) - CHART_ONLY
    assert not unmapped, f"chart values under serve with no field here: {sorted(unmapped)}"
    default = _flat(ServiceConfig())
    wrong = {k: (leaves[k], default[path]) for k, path in CHART_FIELDS.items() if leaves[k] != default[path]}
    assert not wrong, f"chart default != the schema's (chart, schema): {wrong}"
    assert values["metrics"]["port"] == flags.METRICS_PORT
    auto = AutoscalingConfig()
    chart_auto = values["autoscaling"]
    assert (chart_auto["slo"]["ttftMs"], chart_auto["slo"]["itlMs"]) == (auto.slo.ttft_ms, auto.slo.itl_ms)
    assert chart_auto["intervalSeconds"] == auto.interval_s
    assert chart_auto["scaleDownDelaySeconds"] == auto.scale_down_delay_s
    assert chart_auto["drainTimeoutSeconds"] == auto.drain_timeout_s
    assert chart_auto["allowRoleSwitch"] == auto.allow_role_switch


# The worker groups' values that are service settings: each sets its role's engine setting.
CHART_GROUP_FIELDS = {
    f"{role}.{value}": (role, name) for role in ("prefill", "decode") for value, name in (
        ("tensorParallelSize", "tensor_parallel_size"), ("hostKvCacheMemory", "host_kv_cache_memory"),
        ("maxLoras", "max_loras"), ("maxLoraRank", "max_lora_rank"), ("loraAdapters", "lora_adapters"))
}


def test_the_worker_groups_engine_values_default_to_the_schemas():
    leaves = _leaves(yaml.safe_load(CHART_VALUES.read_text()))
    config = ClusterConfig()
    for value, (role, name) in CHART_GROUP_FIELDS.items():
        assert leaves[value] == getattr(config.engine_config(role), name), f"{value} != the {role} engine's {name}"


def test_tensor_parallel_flags_set_each_roles_size(tmp_path):
    colocated = _service("--prefill-workers", "0", "--decode-tp", "2")
    assert colocated.cluster.tensor_parallel_size("colocated") == 2
    for flag, role in (("--decode-tp", "decode"), ("--prefill-tp", "prefill")):
        with pytest.raises(ValueError, match="needs transfer.backend nixl"):
            _service(flag, "2", "--kv-transfer-backend", "collective")
        service = _service(flag, "2", "--kv-transfer-backend", "nixl")
        assert service.cluster.tensor_parallel_size(role) == 2
    topology = tmp_path / "topology.yaml"
    topology.write_text("prefill_workers: 0\ndecode_engine: {max_num_seqs: 8}\n")
    service = _service("--config", str(topology), "--decode-tp", "2")
    assert service.cluster.decode_engine == {"max_num_seqs": 8, "tensor_parallel_size": 2}, "the flag refines the file"


def test_the_charts_router_settings_are_the_flags_names():
    values = yaml.safe_load(CHART_VALUES.read_text())["serve"]
    camel = {"".join(w.title() if i else w for i, w in enumerate(name.split("_"))) for name in ROUTER_SETTINGS}
    assert camel <= set(values), f"router settings the chart does not offer: {camel - set(values)}"
    _, router = configs_from_args({"router": {name: None for name in ROUTER_SETTINGS}})
    assert router == ServiceConfig().router, "an unset router setting keeps the schema's default"
    with pytest.raises(ValueError, match="unknown router settings"):
        configs_from_args({"router": {"max_outstanding_request": 3}})


def test_configs_derived_from_others_default_to_what_they_are_derived_from():
    """SchedulerConfig is built from EngineConfig, and the cluster sets DispatchConfig's
    engine-facing fields: where they have defaults of their own (for tests and the
    simulator), those must be what the derivation gives."""
    from engine.config import EngineConfig
    from engine.core.scheduler import SchedulerConfig
    from router.dispatch import DispatchConfig

    assert EngineConfig().scheduler_config(SchedulerConfig().max_model_len) == SchedulerConfig()
    dispatch, derived = DispatchConfig(), ClusterConfig().dispatch_settings()
    derived.pop("prefix_hash_seed")  # random per process unless set: nothing to agree on
    assert {k: getattr(dispatch, k) for k in derived} == derived


def test_a_topology_files_router_section_sets_the_router_and_flags_override_it(tmp_path):
    topology = tmp_path / "topology.yaml"
    topology.write_text("decode_workers: 2\nrouter: {max_outstanding_requests: 9, placement: round_robin}\n")
    service = _service("--config", str(topology))
    assert service.cluster.decode_workers == 2
    assert (service.router.admission.max_requests, service.router.dispatch.placement) == (9, "round_robin")
    service = _service("--config", str(topology), "--max-outstanding-requests", "5")
    assert (service.router.admission.max_requests, service.router.dispatch.placement) == (5, "round_robin")
    topology.write_text("router: {max_outstanding_request: 9}\n")
    with pytest.raises(ValueError, match="router must be a mapping of"):
        _service("--config", str(topology))


def test_the_docs_topology_example_is_valid_and_takes_every_router_setting(tmp_path):
    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    example = page.split("```yaml", 1)[1].split("```", 1)[0]
    assert set(yaml.safe_load(example)["router"]) == set(ROUTER_SETTINGS)
    topology = tmp_path / "topology.yaml"
    topology.write_text(example)
    service = _service("--config", str(topology))
    assert service.cluster.decode_workers == 2 and service.ingress == "haproxy"


def test_the_charts_values_schema_offers_what_the_schema_takes():
    import json

    from cluster.ingress import INGRESSES
    from kv_transfer import BACKENDS
    from kv_transfer.config import FAILURE_POLICIES, TransferConfig

    schema = json.loads((CHART_VALUES.parent / "values.schema.json").read_text())
    serve = schema["properties"]["serve"]["properties"]
    topology = serve["topology"]["properties"]
    assert set(topology) <= {f.name for f in dataclasses.fields(ClusterConfig)}, "topology keys the app refuses"
    transfer = topology["transfer"]["properties"]
    assert set(transfer) <= {f.name for f in dataclasses.fields(TransferConfig)}
    assert (transfer["backend"]["enum"], transfer["failure_policy"]["enum"]) == (list(BACKENDS), list(FAILURE_POLICIES))
    assert (serve["placement"]["enum"], serve["ingress"]["enum"]) == (list(flags.PLACEMENTS), list(INGRESSES))
    with pytest.raises(ValueError):  # the schema's minimums are the config's
        ClusterConfig(decode_workers=topology["decode_workers"]["minimum"] - 1)
    with pytest.raises(ValueError):
        ClusterConfig(prefill_workers=topology["prefill_workers"]["minimum"] - 1)
