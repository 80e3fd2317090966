"""``tandem up`` flags and topology files become one validated ClusterConfig."""

from __future__ import annotations

import pytest

from cluster import flags
from tandem.cli import build_parser


def config_of(*argv):
    return flags.cluster_config(build_parser().parse_args(["up", *argv]))


def test_flags_set_the_topology():
    cfg = config_of("--prefill-workers", "2", "--decode-workers", "3", "--kv-transfer-backend", "object_store",
                    "--num-kv-blocks", "128")
    assert (cfg.prefill_workers, cfg.decode_workers) == (2, 3)
    assert cfg.transfer.backend == "object_store"
    assert cfg.engine_config("decode").num_kv_blocks == 128


def test_no_flags_give_the_default_topology():
    cfg = config_of()
    assert (cfg.model, cfg.prefill_workers, cfg.decode_workers) == (None, 1, 1)


def test_flags_refine_a_topology_file(tmp_path):
    path = tmp_path / "topology.yaml"
    path.write_text("prefill_workers: 2\ndecode_workers: 2\ntransfer: {backend: collective, timeout_s: 5}\n")
    cfg = config_of("--config", str(path), "--decode-workers", "4", "--kv-transfer-backend", "object_store")
    assert (cfg.prefill_workers, cfg.decode_workers) == (2, 4)
    assert (cfg.transfer.backend, cfg.transfer.timeout_s) == ("object_store", 5)


def test_zero_prefill_workers_runs_colocated():
    assert config_of("--prefill-workers", "0").colocated


def test_bad_topology_is_an_error_naming_the_setting():
    with pytest.raises(ValueError, match="decode_workers"):
        config_of("--decode-workers", "0")
    with pytest.raises(SystemExit):
        config_of("--kv-transfer-backend", "carrier-pigeon")


@pytest.mark.parametrize("seconds", [0, -5])
def test_a_start_deadline_that_is_not_positive_is_an_error_naming_it(tmp_path, seconds):
    path = tmp_path / "topology.yaml"
    path.write_text(f"start_timeout_s: {seconds}\n")
    with pytest.raises(ValueError, match=rf"start_timeout_s must be > 0 seconds, got {seconds}"):
        config_of("--config", str(path))
    path.write_text("start_timeout_s: 90\n")
    assert config_of("--config", str(path)).start_timeout_s == 90


def test_up_serves_smollm2_unless_a_flag_or_the_topology_file_names_a_model(tmp_path):
    from tandem.cli import _serving_default

    path = tmp_path / "topology.yaml"
    path.write_text("decode_workers: 2\n")
    assert _serving_default(config_of("--config", str(path))).model == "smollm2-135m-instruct"
    assert _serving_default(config_of()).model == "smollm2-135m-instruct"
    path.write_text("model: tandem-tiny-llama\n")
    assert _serving_default(config_of("--config", str(path))).model == "tandem-tiny-llama"
    assert _serving_default(config_of("--config", str(path), "--model", "/m/x.gguf")).model == "/m/x.gguf"


TOPOLOGY = ["--prefill-workers", "0", "--decode-workers", "2", "--kv-transfer-backend", "object_store",
            "--num-kv-blocks", "96", "--engine", "max_num_seqs=8", "--engine", "enable_prefix_caching=false",
            "--ingress", "proxy"]  # fmt: skip


def test_every_program_that_starts_the_service_reads_the_same_flags_the_same_way():
    from bench import overhead, serve, soak
    from cluster.service import ServiceConfig

    parsed = {
        "tandem up": build_parser().parse_args(["up", *TOPOLOGY]),
        "bench serve --launch": serve.parse_args(["--launch", *TOPOLOGY]),
        "bench overhead": overhead.build_parser().parse_args(TOPOLOGY),
        "bench soak": soak.parse_args(["--prefill-workers", "1", *TOPOLOGY[2:]]),
    }
    configs = {name: ServiceConfig.from_flags(args, free=True) for name, args in parsed.items()}
    for name, cfg in configs.items():
        assert cfg.ingress == "proxy", name
        assert cfg.cluster.transfer.backend == "object_store", name
        assert cfg.cluster.decode_workers == 2, name
        engine = cfg.cluster.engine_config("decode")
        assert (engine.num_kv_blocks, engine.max_num_seqs, engine.enable_prefix_caching) == (96, 8, False), name
        assert cfg.http_port != cfg.grpc_port, name
    assert configs["tandem up"].cluster == configs["bench serve --launch"].cluster == configs["bench overhead"].cluster


def test_admission_flags_reach_the_router_and_unset_ones_keep_its_defaults():
    from cluster.service import ServiceConfig
    from router.server import RouterConfig

    args = build_parser().parse_args(["up", "--max-outstanding-requests", "7", "--placement", "round_robin"])
    router = ServiceConfig.from_flags(args, api_key="k").router
    assert (router.admission.max_requests, router.dispatch.placement, router.api_key) == (7, "round_robin", "k")
    default = RouterConfig()
    assert router.admission.max_prompt_tokens == default.admission.max_prompt_tokens
    assert ServiceConfig.from_flags(build_parser().parse_args(["up"])).router == default


def test_per_request_disaggregation_settings_reach_the_dispatcher_from_flags_and_the_charts_args():
    from cluster.service import ServiceConfig, configs_from_args

    args = build_parser().parse_args(["up", "--local-prefill-tokens", "64", "--local-prefill-backlog-tokens", "8192"])
    dispatch = ServiceConfig.from_flags(args).router.dispatch
    assert (dispatch.local_prefill_tokens, dispatch.local_prefill_backlog_tokens) == (64, 8192)
    assert ServiceConfig.from_flags(build_parser().parse_args(["up"])).router.dispatch.local_prefill_tokens == 0
    _, router = configs_from_args({"router": {"local_prefill_tokens": 32, "local_prefill_backlog_tokens": 0}})
    assert (router.dispatch.local_prefill_tokens, router.dispatch.local_prefill_backlog_tokens) == (32, 0)
    with pytest.raises(ValueError, match="local_prefill_tokens must be >= 0"):
        ServiceConfig.from_flags(build_parser().parse_args(["up", "--local-prefill-tokens", "-1"]))
