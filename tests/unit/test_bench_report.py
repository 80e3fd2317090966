"""The performance report's pure parts: the plan's command lines, the numbers derived
from hand-made ``bench.serve`` results, and the markdown. Nothing here starts Ray."""

from __future__ import annotations

import json

import pytest

from bench import report
from bench.serve import parse_args


def summary(tput=100.0, ttft=(100.0, 200.0, 300.0), itl=(10.0, 50.0), tpot_p99=20.0,
            goodput=None, completed=10, failed=0, cached=0, prompt=1000) -> dict:
    """A ``bench.serve`` summary; ttft is (mean, median, p99) ms, itl (median, p99) ms."""
    return {
        "duration_s": 10.0, "completed": completed, "failed": failed, "errors": {},
        "total_input_tokens": prompt, "total_output_tokens": int(tput * 10),
        "cached_prompt_tokens": cached, "request_throughput": completed / 10.0,
        "output_throughput": tput, "total_token_throughput": tput * 2,
        "goodput": goodput,
        "ttft_ms": {"mean": ttft[0], "median": ttft[1], "p90": ttft[2], "p99": ttft[2]},
        "tpot_ms": {"mean": 1.0, "median": 1.0, "p90": 1.0, "p99": tpot_p99},
        "itl_ms": {"mean": itl[0], "median": itl[0], "p90": itl[1], "p99": itl[1]},
        "e2e_ms": {"mean": 1.0, "median": 1.0, "p90": 1.0, "p99": 1.0},
    }


def single(s: dict | None, per_chunk: float | None = 1.0) -> list[dict] | None:
    """One configuration's condensed result at one rate (None: it failed)."""
    if s is None:
        return None
    return [{"request_rate": "inf", "summary": s, "slo_attainment": None,
             "tokens_per_chunk": per_chunk}]


def by_name(checks) -> dict:
    return {c.name: c for c in checks}


# -- the plan ------------------------------------------------------------------------


def flag_values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def without(argv: list[str], *flags: str) -> list[str]:
    """argv minus the given flags and their values."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        else:
            out.append(a)
    return out


@pytest.mark.parametrize("quick", [False, True])
def test_every_run_is_a_valid_bench_serve_command_line(quick, tmp_path):
    for comparison in report.plan(quick):
        for run in comparison.runs:
            args = parse_args(run.argv(tmp_path / f"{run.label}.json"))
            assert args.launch and args.seed == 0, f"{run.label}: expected --launch --seed 0"
            assert args.label == run.label


def test_the_configs_of_a_comparison_send_the_same_requests(tmp_path):
    """Same workload, load and seed; only the service differs."""
    service_flags = ("--engine", "--prefill-workers", "--decode-workers", "--label",
                     "--result-json")
    for comparison in report.plan(quick=False):
        argvs = [run.argv(tmp_path / "r.json") for run in comparison.runs]
        assert len({tuple(without(a, *service_flags)) for a in argvs}) == 1, comparison.key


def test_the_batching_configs_differ_in_exactly_the_settings_under_test(tmp_path):
    comparison = report.batching_comparison(report.FULL)
    engines = {run.label: dict(e.split("=") for e in flag_values(list(run.flags), "--engine"))
               for run in comparison.runs}
    assert engines["static"]["batching"] == "static"
    assert engines["continuous"]["batching"] == "continuous"
    for label in ("static", "continuous"):
        assert engines[label]["enable_chunked_prefill"] == "false"
        assert int(engines[label]["max_num_batched_tokens"]) >= report.MODEL_MAX_LEN
    assert engines["continuous-chunked"]["enable_chunked_prefill"] == "true"
    assert int(engines["continuous-chunked"]["max_num_batched_tokens"]) == report.CHUNK_BUDGET
    for run in comparison.runs:  # one colocated worker
        assert flag_values(list(run.flags), "--prefill-workers") == ["0"]
        assert flag_values(list(run.flags), "--decode-workers") == ["1"]


def test_the_topology_configs_use_the_same_number_of_workers():
    comparison = report.topology_comparison(report.FULL)
    workers = {
        run.label: sum(int(v) for f in ("--prefill-workers", "--decode-workers")
                       for v in flag_values(list(run.flags), f))
        for run in comparison.runs
    }
    assert workers == {"colocated": 2, "disaggregated": 2}


def test_quick_sends_less_than_the_full_report():
    assert report.QUICK.batching_requests < report.FULL.batching_requests
    assert report.QUICK.topology_requests * len(report.QUICK.topology_rates) < \
        report.FULL.topology_requests * len(report.FULL.topology_rates)
    assert report.QUICK.prefix_requests < report.FULL.prefix_requests


def test_only_selects_comparisons_in_report_order():
    assert [c.key for c in report.plan(True, ["prefix", "batching"])] == ["batching", "prefix"]


def test_the_recorded_command_repeats_the_run(tmp_path):
    run = report.Run("x", ("--launch", "--engine", "batching=static"))
    assert run.command(tmp_path / "x.json") == (
        "python -m bench.serve --launch --engine batching=static --label x "
        f"--result-json {tmp_path / 'x.json'}"
    )


# -- numbers ---------------------------------------------------------------------------


def test_batching_checks_compute_ratios_against_their_targets():
    checks = by_name(report.batching_checks({
        "static": single(summary(tput=100.0, itl=(30.0, 600.0))),
        "continuous": single(summary(tput=250.0, itl=(30.0, 900.0))),
        "continuous-chunked": single(summary(tput=240.0, itl=(30.0, 150.0))),
    }))
    tput = checks["output tokens/s, continuous / static"]
    assert tput.value == pytest.approx(2.5) and tput.met is True
    assert checks["ITL p99, static / continuous+chunked"].value == pytest.approx(4.0)
    cut = checks["ITL p99, continuous / continuous+chunked"]
    assert cut.value == pytest.approx(6.0) and cut.met is True
    cost = checks["throughput cost of chunking, 1 - chunked / continuous"]
    assert cost.value == pytest.approx(0.04) and cost.met is True
    assert cost.text().endswith("**4%** (target <= 10%: met)"), cost.text()


def test_a_missed_target_is_marked_not_met():
    checks = by_name(report.batching_checks({
        "static": single(summary(tput=200.0)), "continuous": single(summary(tput=220.0)),
        "continuous-chunked": single(summary(tput=150.0)),
    }))
    assert checks["output tokens/s, continuous / static"].met is False
    assert "**not met**" in checks["output tokens/s, continuous / static"].text()
    assert checks["throughput cost of chunking, 1 - chunked / continuous"].met is False


def test_a_failed_configuration_leaves_its_ratios_unmeasured():
    checks = by_name(report.batching_checks({
        "static": None, "continuous": single(summary()), "continuous-chunked": single(summary()),
    }))
    unmeasured = checks["output tokens/s, continuous / static"]
    assert unmeasured.value is None and unmeasured.met is None
    assert "not measured" in unmeasured.text()
    assert checks["ITL p99, continuous / continuous+chunked"].value == pytest.approx(1.0)


def test_prefix_checks_divide_uncached_ttft_by_cached():
    checks = by_name(report.prefix_checks({
        "prefix-cache-on": single(summary(ttft=(100.0, 80.0, 400.0))),
        "prefix-cache-off": single(summary(ttft=(500.0, 400.0, 800.0))),
    }))
    assert checks["TTFT mean, cache off / on"].value == pytest.approx(5.0)
    assert checks["TTFT p50, cache off / on"].value == pytest.approx(5.0)
    p99 = checks["TTFT p99, cache off / on"]
    assert p99.value == pytest.approx(2.0) and p99.met is False


def test_ratio_of_missing_or_zero_is_none():
    assert report.ratio(None, 1.0) is None
    assert report.ratio(1.0, None) is None
    assert report.ratio(1.0, 0.0) is None
    assert report.ratio(3.0, 2.0) == 1.5


def request(ok=True, ttft=0.1, tpot=0.01, e2e=1.0, output_tokens=4, itl=(0.01, 0.01, 0.01)) -> dict:
    return {"ok": ok, "ttft_s": ttft, "tpot_s": tpot, "e2e_s": e2e, "output_tokens": output_tokens,
            "itl_s": list(itl)}


def test_slo_attainment_counts_failures_as_misses_and_a_missing_tpot_as_met():
    requests = [request(), request(ttft=2.0), request(ok=False), request(tpot=None)]
    assert report.slo_attainment(requests, {"ttft": 1000.0, "tpot": 50.0}) == pytest.approx(0.5)
    assert report.slo_attainment(requests, {}) is None
    assert report.slo_attainment([], {"ttft": 1.0}) is None


def test_max_rate_within_slo_stops_at_the_first_rate_that_misses():
    entries = [{"request_rate": r, "slo_attainment": a}
               for r, a in (("4", 0.5), ("1", 1.0), ("2", 0.95), ("8", 0.99))]
    assert report.max_rate_within_slo(entries) == 2.0
    assert report.max_rate_within_slo([{"request_rate": "1", "slo_attainment": 0.2}]) is None
    assert report.max_rate_within_slo(None) is None


def test_condense_keeps_summaries_and_drops_per_request_records():
    result = {"runs": [{"request_rate": "2", "summary": summary(),
                        "requests": [request(), request(ttft=5.0)]}]}
    condensed = report.condense(result, {"ttft": 1000.0})
    assert condensed == [{"request_rate": "2", "summary": summary(), "slo_attainment": 0.5,
                          "tokens_per_chunk": 1.0}]


def test_tokens_per_chunk_shows_tokens_held_back_and_merged():
    streamed = request(output_tokens=4, itl=(0.01, 0.01, 0.01))  # 4 chunks
    merged = request(output_tokens=32, itl=())  # everything in the first chunk
    assert report.tokens_per_chunk([streamed]) == 1.0
    assert report.tokens_per_chunk([streamed, merged]) == pytest.approx(36 / 5)
    assert report.tokens_per_chunk([request(ok=False)]) is None


# -- tables and markdown -------------------------------------------------------------------


def test_markdown_table_has_a_header_separator_and_one_line_per_row():
    table = report.markdown_table(["a", "b"], [["1", "2"], ["3", "4"]])
    assert table.splitlines() == ["| a | b |", "|---|---|", "| 1 | 2 |", "| 3 | 4 |"]


def test_fmt_shows_missing_values_as_a_dash():
    assert report.fmt(None) == "-"
    assert report.fmt(float("nan")) == "-"
    assert report.fmt(12.345) == "12.3"
    assert report.fmt(12.345, ".0f") == "12"


def test_batching_table_marks_a_failed_configuration():
    table = report.batching_table({"static": single(summary(tput=123.4), per_chunk=1.5),
                                   "continuous": None})
    rows = table.splitlines()[2:]
    assert rows[0] == "| static | 123.4 | 200 | 300 | 10.0 | 50.0 | 20.0 | 1.50 | 10/10 | 10.0 |", \
        rows[0]
    assert rows[1].startswith("| continuous | failed | -"), rows[1]


def test_topology_table_has_one_row_per_rate_and_config_in_rate_order():
    runs = {
        "colocated": [{"request_rate": r, "summary": summary(goodput=1.5), "slo_attainment": 0.75}
                      for r in ("10", "2")],
        "disaggregated": [{"request_rate": "2", "summary": summary(goodput=2.0),
                           "slo_attainment": 1.0}],
    }
    rows = report.topology_table(runs).splitlines()[2:]
    assert [r.split(" | ")[:2] for r in rows] == [
        ["| 2", "colocated"], ["| 2", "disaggregated"],
        ["| 10", "colocated"], ["| 10", "disaggregated"],
    ]
    assert "| 1.50 | 75% |" in rows[0]  # goodput, SLO attainment
    assert "failed" in rows[3]


def test_prefix_table_shows_the_cached_share_of_prompt_tokens():
    table = report.prefix_table({"prefix-cache-on": single(summary(cached=850, prompt=1000))})
    row = table.splitlines()[2]
    assert "| 85% |" in row


def raw_result(s: dict) -> dict:
    return {"label": "x", "runs": [{"request_rate": "inf", "summary": s, "requests": [request()]}]}


def test_build_report_and_markdown_from_raw_results(tmp_path):
    """What the program writes after its runs, from results on disk; one run failed."""
    (tmp_path / "raw").mkdir()
    on = raw_result(summary(ttft=(50.0, 40.0, 90.0), cached=800))
    (tmp_path / "raw" / "prefix-cache-on.json").write_text(json.dumps(on))
    comparisons = report.plan(quick=True, only=["prefix"])
    records = {"prefix": [
        {"label": "prefix-cache-on", "command": "python -m bench.serve ...", "load_before": 1.0,
         "load_after": 1.5, "error": None, "wall_s": 20.0},
        {"label": "prefix-cache-off", "command": "python -m bench.serve ...", "load_before": 1.5,
         "load_after": 2.0, "error": "bench.serve exited with status 1", "wall_s": 5.0},
    ]}
    header = {"command": "python -m bench.report --quick", "started": "2026-01-01T00:00:00+00:00",
              "wall_s": 25.0, "quick": True, "isolate": False,
              "machine": {"cpu": "Test CPU", "cores": 2, "cores_usable": 2, "memory_gib": 4.0,
                          "platform": "p", "python": "3.11", "torch": "2.x", "ray": "2.x",
                          "git_commit": "abc"}}
    built = report.build_report(comparisons, records, tmp_path, header)
    runs = built["comparisons"]["prefix"]["runs"]
    assert runs[0]["rates"][0]["summary"]["cached_prompt_tokens"] == 800
    assert runs[1]["rates"] is None
    assert all(c["met"] is None for c in built["comparisons"]["prefix"]["checks"])
    json.dumps(built)  # report.json is plain JSON

    md = report.render_markdown(built)
    assert "Test CPU, 2 cores" in md and "torch 2.x" in md
    assert "smoke check" in md
    assert "| prefix-cache-on | 50 | 40 | 90 | 80% | 1.00 |" in md
    assert "| prefix-cache-off | failed |" in md
    assert "Failed: prefix-cache-off: bench.serve exited with status 1" in md
    assert md.count("python -m bench.serve ...") == 2
    assert "tandem bench offline" in md
