"""The host KV tier's and LoRA's engine settings where operators set them: the flags of
``tandem up`` (``--host-kv-cache-memory``, ``--max-loras``, ``--max-lora-rank``, repeated
``--lora NAME=PATH``) over a topology file's ``engine`` section, ``tandem generate``'s
``--lora`` and ``--adapter``, the Helm chart's worker-group values, and ``tandem status``,
which shows each worker's tier and resident adapters. No Ray: the worker calls are faked, and
the chart is rendered by Helm's own code; one test generates on the tiny model under an adapter."""

from __future__ import annotations

import re

import pytest
import yaml

import cluster.pool_actors as pool_actors
from cluster import flags
from engine.wire.messages import DecodeLoad, WorkerRef
from tandem.cli import build_parser, format_status, main


def config_of(*argv):
    return flags.cluster_config(build_parser().parse_args(["up", *argv]))


# -- tandem up's flags ---------------------------------------------------------------------


@pytest.mark.parametrize("text, size", [
    ("17179869184", 16 << 30), ("16Gi", 16 << 30), ("16GiB", 16 << 30), ("512Mi", 512 << 20),
    ("1.5Gi", 3 << 29), ("16G", 16 * 10**9), ("2GB", 2 * 10**9), ("64k", 64_000), ("0", 0),
])
def test_host_memory_takes_bytes_or_a_binary_or_decimal_unit(text, size):
    assert config_of("--host-kv-cache-memory", text).engine_config("decode").host_kv_cache_memory == size


@pytest.mark.parametrize("text", ["lots", "16Gb", "16 gigs", "-1", "0.5", "inf", "nan", "Gi"])
def test_a_malformed_host_memory_is_an_argparse_error_naming_the_form(text, capsys):
    with pytest.raises(SystemExit):
        config_of("--host-kv-cache-memory", text)
    err = capsys.readouterr().err
    assert "argument --host-kv-cache-memory" in err and ("16Gi" in err or "bytes" in err), err


def test_adapters_named_by_flags_set_both_roles_and_as_many_resident_unless_max_loras_says(tmp_path):
    config = config_of("--lora", "sql=/a/sql", "--lora", "chat=/a/chat", "--max-lora-rank", "32")
    for role in ("prefill", "decode"):
        engine = config.engine_config(role)
        assert engine.lora_adapters == {"sql": "/a/sql", "chat": "/a/chat"}
        assert (engine.max_loras, engine.max_lora_rank) == (2, 32)
    assert config_of("--lora", "sql=/a/sql", "--lora", "chat=/a/chat", "--max-loras", "1") \
        .engine_config("decode").max_loras == 1
    assert config_of("--max-loras", "3").engine_config("decode").lora_adapters == {}, "loaded at run time"


def test_a_relative_adapter_path_is_made_absolute_for_the_workers_processes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert config_of("--lora", "sql=adapters/sql").engine_config("decode").lora_adapters == {
        "sql": str(tmp_path / "adapters" / "sql")}


@pytest.mark.parametrize("value", ["sql", "=/a/sql", "sql=", "sql= "])
def test_a_malformed_lora_is_an_argparse_error_naming_name_equals_path(value, capsys):
    with pytest.raises(SystemExit):
        config_of("--lora", value)
    assert "argument --lora: expected NAME=PATH" in capsys.readouterr().err


def test_an_adapter_named_twice_is_an_argparse_error_naming_both_paths(capsys):
    with pytest.raises(SystemExit):
        config_of("--lora", "sql=/a/one", "--lora", "sql=/a/two")
    assert "--lora sql: named twice (/a/one and /a/two)" in capsys.readouterr().err


def test_lora_flags_join_a_topology_files_adapters_and_keep_its_max_loras(tmp_path):
    topology = tmp_path / "topology.yaml"
    topology.write_text("engine: {lora_adapters: {sql: /f/sql}, max_num_seqs: 8}\n")
    engine = config_of("--config", str(topology), "--lora", "chat=/a/chat").engine_config("decode")
    assert engine.lora_adapters == {"sql": "/f/sql", "chat": "/a/chat"}
    assert (engine.max_loras, engine.max_num_seqs) == (2, 8), "as many resident as both name; the rest kept"
    topology.write_text("engine: {lora_adapters: {sql: /f/sql}, max_loras: 4}\n")
    assert config_of("--config", str(topology), "--lora", "chat=/a/chat").engine_config("decode").max_loras == 4
    topology.write_text("engine: {host_kv_cache_memory: 1024}\n")
    assert config_of("--config", str(topology), "--host-kv-cache-memory", "2Ki") \
        .engine_config("prefill").host_kv_cache_memory == 2048, "the flag over the file"


def test_the_engine_refuses_adapters_with_max_loras_zero_naming_both():
    with pytest.raises(ValueError, match=r"lora_adapters \['sql'\] need max_loras >= 1"):
        config_of("--lora", "sql=/a/sql", "--max-loras", "0")


# -- tandem generate -------------------------------------------------------------------------


def test_generate_refuses_an_adapter_no_lora_names_before_loading_a_model(capsys):
    assert main(["generate", "hi", "--model", "/nowhere", "--lora", "sql=/a/sql", "--adapter", "chat"]) == 2
    assert "--adapter 'chat' is not an adapter --lora names (named: sql)" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", "/nowhere", "--adapter", "chat"]) == 2
    assert "(named: none)" in capsys.readouterr().err


def test_generate_under_an_adapter_prints_what_the_offline_api_gives_under_it(tiny_model, tmp_path, capsys):
    from engine import LLM, SamplingParams
    from tests.unit.test_lora import make_adapter

    make_adapter(tiny_model, tmp_path / "sql", 4, 8, ["q_proj", "v_proj"], False, seed=1)
    argv = ["generate", "SELECT", "--model", tiny_model, "--max-tokens", "6", "--lora", f"sql={tmp_path / 'sql'}"]
    assert main([*argv, "--adapter", "sql"]) == 0
    out = capsys.readouterr()
    assert re.match(r"\[adapter sql, \d+ prompt tokens, 6 generated", out.err.splitlines()[-1]), out.err
    with LLM(model=tiny_model, max_loras=1, lora_adapters={"sql": str(tmp_path / "sql")}) as llm:
        (want,) = llm.generate(["SELECT"], SamplingParams(max_tokens=6, temperature=0.0), adapter="sql")
    assert out.out == want.text + "\n"
    assert main(argv) == 0, "adapters named, none picked: the base model"
    base = capsys.readouterr()
    assert re.match(r"\[\d+ prompt tokens", base.err.splitlines()[-1]) and base.out != out.out


def test_generate_parses_its_adapters_like_up_does(capsys):
    args = build_parser().parse_args(["generate", "hi", "--lora", "a=/x", "--lora", "b=/y", "--adapter", "b"])
    assert (args.lora, args.adapter) == ({"a": "/x", "b": "/y"}, "b")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--lora", "a"])
    assert "expected NAME=PATH" in capsys.readouterr().err


# -- the Helm chart's worker groups ----------------------------------------------------------


@pytest.fixture(scope="module")
def chart():
    pytest.importorskip("helm_python", reason="pip install helm-python-sdk (the test extra)")
    from tests.unit.test_deploy import CHART, OfflineChart

    c = OfflineChart.load(CHART)
    yield c
    c.close()


def _topology(chart, values: dict) -> dict:
    from tests.unit.test_deploy import RELEASE, _by_kind, _split

    (rs,) = _by_kind(_split(chart.render(values, name=RELEASE)), "RayService")
    (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    return app["args"]["topology"]


def test_each_groups_host_tier_and_adapters_reach_its_roles_engine(chart):
    from cluster.config import ClusterConfig

    values = {"decode": {"hostKvCacheMemory": "2Gi", "loraAdapters": {"sql": "/models/sql", "chat": "/models/chat"}},
              "prefill": {"hostKvCacheMemory": 1 << 30, "maxLoras": 3, "maxLoraRank": 32}}
    topology = _topology(chart, values)
    assert topology["decode_engine"] == {"host_kv_cache_memory": 2 << 30, "max_loras": 2, "max_lora_rank": 16,
                                         "lora_adapters": {"sql": "/models/sql", "chat": "/models/chat"}}
    assert topology["prefill_engine"] == {"host_kv_cache_memory": 1 << 30, "max_loras": 3, "max_lora_rank": 32}
    config = ClusterConfig.from_dict(topology)
    assert config.engine_config("decode").lora_adapters == {"sql": "/models/sql", "chat": "/models/chat"}
    assert config.engine_config("prefill").max_loras == 3
    assert not {"prefill_engine", "decode_engine"} & set(_topology(chart, {})), "off renders as it always did"


def test_a_colocated_topologys_workers_take_the_decode_groups_values(chart):
    colocated = {"serve": {"topology": {"prefill_workers": 0}}}
    topology = _topology(chart, {**colocated, "decode": {"maxLoras": 2}})
    assert topology["decode_engine"] == {"max_loras": 2, "max_lora_rank": 16}


@pytest.mark.parametrize("values, message", [
    ({"serve": {"topology": {"engine": {"max_loras": 2}}}},
     "serve.topology.engine.max_loras: set prefill.maxLoras or decode.maxLoras instead"),
    ({"serve": {"topology": {"decode_engine": {"host_kv_cache_memory": 1024}}}},
     "serve.topology.decode_engine.host_kv_cache_memory: set prefill.hostKvCacheMemory or decode.hostKvCacheMemory"),
    ({"prefill": {"loraAdapters": {"a": "/x"}}, "serve": {"topology": {"prefill_workers": 0}}},
     "prefill.loraAdapters: a colocated topology (serve.topology.prefill_workers: 0) has no prefill workers"),
    ({"decode": {"hostKvCacheMemory": "8Gi"}},
     "decode.hostKvCacheMemory 8Gi: a worker's host KV tier (8589934592 bytes a rank x 1 ranks) must be below "
     "its pod's memory (decode.memory 8Gi)"),
    ({"decode": {"hostKvCacheMemory": "5Gi", "tensorParallelSize": 2}, "serve": {"topology": {"prefill_workers": 0}}},
     "x 2 ranks) must be below its pod's memory"),
])
def test_group_values_the_app_would_refuse_or_not_hold_fail_to_render(chart, values, message):
    from helm_python import HelmRenderError

    with pytest.raises(HelmRenderError, match=re.escape(message)):
        chart.render(values, name="tandem")


@pytest.mark.parametrize("group", [
    {"hostKvCacheMemory": "lots"}, {"hostKvCacheMemory": -1}, {"maxLoras": -1}, {"maxLoraRank": 0},
    {"loraAdapters": {"sql": ""}}, {"loraAdapters": ["/a/sql"]},
])
def test_the_values_schema_refuses_bad_group_engine_values(chart, group):
    from helm_python import HelmValuesError

    with pytest.raises(HelmValuesError):
        chart.render({"decode": group}, name="tandem")


# -- tandem status ---------------------------------------------------------------------------

LOAD = DecodeLoad("decode-0", free_blocks=1000, total_blocks=1024, running=3, waiting=0, waiting_for_kv=1)
STATS = {"prefix_cache_queries": 1000, "prefix_cache_hits": 700, "host_cache_blocks": 4096,
         "host_cache_blocks_used": 120, "host_cache_hits": 300, "lora_resident_adapters": ("sql", "chat"),
         "lora_loads": 5, "lora_evictions": 3, "streams": {"r": 1}, "held": ["r"]}


class _Method:
    def __init__(self, answer) -> None:
        self.answer = answer

    def remote(self):
        return self.answer


class _Worker:
    """A worker actor's handle whose calls answer at once (``ray.get`` is faked to pass them through)."""

    def __init__(self, load, stats) -> None:
        self.load, self.stats = _Method(load), _Method(stats)


def test_status_carries_each_workers_host_tier_and_adapters_from_its_engine_stats(monkeypatch):
    monkeypatch.setattr(pool_actors.ray, "get", lambda refs, timeout: list(refs))
    status = pool_actors.worker_status([("decode", WorkerRef("decode-0", _Worker(LOAD, STATS)), {"pid": 7})],
                                       [("decode", "decode-1")])
    starting, listed = status["decode"]
    assert starting["cache"] is None
    assert listed["load"]["running"] == 3 and listed["pid"] == 7
    assert listed["cache"] == {k: v for k, v in STATS.items() if k not in ("streams", "held")}, \
        "only the tier's and LoRA's stats, not the worker's whole answer"


def test_status_prints_the_tiers_use_and_hit_rate_and_the_resident_adapters():
    decode = {"worker_id": "decode-0", "draining": False, "load": {
        "worker_id": "decode-0", "free_blocks": 1000, "total_blocks": 1024, "running": 3, "waiting": 0,
        "waiting_for_kv": 1}, "cache": {**STATS, "lora_resident_adapters": ["sql", "chat"]}}
    lines = format_status({"model": "m", "pools": {"decode": [decode]}, "autoscaling": None}).splitlines()
    # Of the 600 prompt tokens the device's cache missed (1000 - (700 - 300)), the tier served 300.
    assert lines[2:4] == [
        "  decode-0                 3 running, 0 waiting, 1 waiting for KV, KV 24/1024 blocks",
        "                           host KV tier 120/4096 blocks, hit rate 50% (300 prompt tokens); "
        "LoRA resident: sql, chat (5 loads, 3 evictions)",
    ]


def test_status_prints_no_cache_line_for_a_worker_without_a_tier_or_adapters():
    plain = {**STATS, "host_cache_blocks": 0, "lora_resident_adapters": [], "lora_loads": 0}
    decode = {"worker_id": "decode-0", "draining": False, "load": None, "cache": plain}
    assert format_status({"model": "m", "pools": {"decode": [decode]}, "autoscaling": None}).splitlines()[2:] == [
        "  decode-0                 no answer", "autoscaling: off (pools of fixed size)"]
    evicted = {**plain, "lora_loads": 2, "lora_evictions": 2}
    decode["cache"] = evicted
    assert "LoRA resident: none (2 loads, 2 evictions)" in format_status(
        {"model": "m", "pools": {"decode": [decode]}, "autoscaling": None})
