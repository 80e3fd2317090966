"""``tandem up`` flags and topology files become one validated ClusterConfig."""

from __future__ import annotations

import pytest

from cluster.cli import _cluster_config, build_parser


def config_of(*argv):
    return _cluster_config(build_parser().parse_args(["up", *argv]))


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


def test_up_serves_smollm2_unless_a_flag_or_the_topology_file_names_a_model(tmp_path):
    from cluster.cli import _serving_default

    path = tmp_path / "topology.yaml"
    path.write_text("decode_workers: 2\n")
    assert _serving_default(config_of("--config", str(path))).model == "smollm2-135m-instruct"
    assert _serving_default(config_of()).model == "smollm2-135m-instruct"
    path.write_text("model: tandem-tiny-llama\n")
    assert _serving_default(config_of("--config", str(path))).model == "tandem-tiny-llama"
    assert _serving_default(config_of("--config", str(path), "--model", "/m/x.gguf")).model == "/m/x.gguf"
