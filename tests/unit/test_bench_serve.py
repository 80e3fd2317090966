"""The serving benchmark's pure parts: arrivals, workloads, metric math, the clients'
stream handling (against in-memory transports) and the command line."""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics

import grpc
import pytest

from bench.serve import GrpcClient, HttpClient, RunPlan, parse_args, run_load, service_config, warm_up
from load import workloads
from load.results import RequestResult, Slo, distribution_ms, percentile, summarize
from load.workloads import BenchRequest

VOCAB = list(range(100, 1100))


class WordTokenizer:
    """One token per whitespace-separated word (plus BOS when asked): lengths are
    countable by eye."""

    vocab_size = 1000
    all_special_ids = frozenset({0, 1})

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [2 + sum(map(ord, w)) % 998 for w in text.split()]
        return [1, *ids] if add_special_tokens else ids


# -- arrivals ----------------------------------------------------------------------


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def test_poisson_arrivals_average_the_requested_rate():
    times = workloads.arrival_times(4000, 10.0, 1.0, random.Random(0))
    assert times[0] == 0.0 and times == sorted(times)
    g = gaps(times)
    # Mean gap 0.1 s; its standard error over 4000 gaps is 0.0016 s: 5% is > 3 sigma.
    assert statistics.fmean(g) == pytest.approx(0.1, rel=0.05)
    # Exponential gaps: standard deviation equals the mean.
    assert statistics.stdev(g) / statistics.fmean(g) == pytest.approx(1.0, rel=0.1)


def test_burstiness_changes_the_spread_of_gaps_not_their_mean():
    def cv(burstiness: float) -> tuple[float, float]:
        g = gaps(workloads.arrival_times(4000, 5.0, burstiness, random.Random(1)))
        return statistics.fmean(g), statistics.stdev(g) / statistics.fmean(g)

    bursty_mean, bursty_cv = cv(0.25)  # gamma shape k: CV = 1 / sqrt(k) = 2
    regular_mean, regular_cv = cv(4.0)  # CV 0.5
    assert bursty_mean == pytest.approx(0.2, rel=0.1) and regular_mean == pytest.approx(0.2, rel=0.05)
    assert bursty_cv == pytest.approx(2.0, rel=0.15)
    assert regular_cv == pytest.approx(0.5, rel=0.1)


def test_infinite_rate_sends_everything_at_once_and_seeds_repeat():
    assert workloads.arrival_times(5, math.inf, 1.0, random.Random(0)) == [0.0] * 5
    a = workloads.arrival_times(50, 3.0, 0.5, random.Random(7))
    assert a == workloads.arrival_times(50, 3.0, 0.5, random.Random(7))
    assert a != workloads.arrival_times(50, 3.0, 0.5, random.Random(8))
    with pytest.raises(ValueError):
        workloads.arrival_times(5, 0.0, 1.0, random.Random(0))


# -- workloads ---------------------------------------------------------------------


def test_synthetic_prompts_have_exact_lengths_from_the_vocab():
    reqs = workloads.synthetic(20, 37, 9, 0.0, VOCAB, random.Random(0))
    assert all(len(r.prompt_token_ids) == 37 and r.output_len == 9 for r in reqs)
    assert all(t in set(VOCAB) for r in reqs for t in r.prompt_token_ids)
    spread = workloads.synthetic(400, 100, 20, 0.5, VOCAB, random.Random(0))
    lens = {len(r.prompt_token_ids) for r in spread}
    assert min(lens) == 50 and max(lens) == 150
    assert {r.output_len for r in spread} <= set(range(10, 31))


def test_sampleable_ids_leave_out_special_tokens():
    ids = workloads.sampleable_ids(WordTokenizer())
    assert len(ids) == 998 and 0 not in ids and 1 not in ids


def test_shared_prefix_requests_share_their_group_prefix_token_for_token():
    reqs = workloads.shared_prefix(30, 3, 64, 8, 5, 0.0, VOCAB, random.Random(0))
    assert len(reqs) == 30
    by_group: dict[str, list[BenchRequest]] = {}
    for r in reqs:
        assert len(r.prompt_token_ids) == 72 and r.output_len == 5
        by_group.setdefault(r.group, []).append(r)
    assert sorted(by_group) == ["prefix-0", "prefix-1", "prefix-2"]
    prefixes = set()
    for members in by_group.values():
        assert len(members) == 10
        heads = {tuple(r.prompt_token_ids[:64]) for r in members}
        assert len(heads) == 1
        prefixes |= heads
    assert len(prefixes) == 3
    assert len({tuple(r.prompt_token_ids[64:]) for r in reqs}) == 30  # every suffix its own
    assert [r.group for r in reqs] != sorted(r.group for r in reqs)  # groups are interleaved


def test_shared_prefix_refuses_suffixes_too_short_to_be_unique():
    with pytest.raises(ValueError, match="too few"):
        workloads.shared_prefix(10, 1, 4, 1, 4, 0.0, [5, 6, 7], random.Random(0))


def test_long_mix_has_the_requested_share_of_long_prompts():
    reqs = workloads.long_mix(50, 20, 4, 0.0, 0.2, 300, VOCAB, random.Random(0))
    long = [r for r in reqs if r.group == "long"]
    assert len(long) == 10 and all(len(r.prompt_token_ids) == 300 for r in long)
    assert all(len(r.prompt_token_ids) == 20 for r in reqs if r.group == "short")
    assert [i for i, r in enumerate(reqs) if r.group == "long"] != list(range(10))  # spread, not bunched
    assert all(r.output_len == 4 for r in reqs)


def test_check_fits_names_the_request_over_the_context():
    reqs = [BenchRequest([1] * 10, 5), BenchRequest([1] * 30, 5)]
    workloads.check_fits(reqs[:1], 15)
    with pytest.raises(ValueError, match="request 1 needs 30 prompt"):
        workloads.check_fits(reqs, 30)


def write_sharegpt(path, conversations) -> str:
    path.write_text(json.dumps(conversations))
    return str(path)


def convo(human: str, gpt: str, first: str = "human") -> dict:
    return {"conversations": [{"from": first, "value": human}, {"from": "gpt", "value": gpt}]}


def test_sharegpt_takes_first_human_turn_and_reply_length_and_filters(tmp_path):
    words = lambda n: " ".join(f"w{i}" for i in range(n))  # noqa: E731
    data = [
        convo(words(5), words(7)),  # kept: prompt 6 tokens (BOS), output 7
        convo(words(2), words(9)),  # prompt of 3 tokens: too short
        convo(words(8), words(3)),  # reply of 3 tokens: too short
        convo(words(6), words(8), first="gpt"),  # does not open with a human turn
        {"conversations": [{"from": "human", "value": words(9)}]},  # no reply
        convo(words(1100), words(10)),  # prompt over 1024 tokens
        convo(words(40), words(90)),  # kept, output clipped to the context: 128 - 41 = 87
    ]
    path = write_sharegpt(tmp_path / "sg.json", data)
    reqs = workloads.sharegpt(path, 2, WordTokenizer(), 128, random.Random(0))
    got = sorted((len(r.prompt_token_ids), r.output_len) for r in reqs)
    assert got == [(6, 7), (41, 87)]
    assert all(r.prompt_token_ids[0] == 1 for r in reqs)
    with pytest.raises(ValueError, match="only 2 usable"):
        workloads.sharegpt(path, 3, WordTokenizer(), 128, random.Random(0))


# -- metric math -----------------------------------------------------------------------


def test_percentiles_interpolate_linearly():
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert percentile([5], 99) == 5
    assert distribution_ms([0.001, 0.002, 0.003]) == pytest.approx(
        {"mean": 2.0, "median": 2.0, "p90": 2.8, "p99": 2.98}
    )
    assert distribution_ms([])["p99"] is None


def test_stream_timing_gives_ttft_itl_e2e_and_tpot():
    r = RequestResult(0, "", 10, 4)
    r.record_stream(10.0, [10.2, 10.25, 10.4], 10.5)
    r.output_tokens = 4
    assert r.ttft_s == pytest.approx(0.2) and r.e2e_s == pytest.approx(0.5)
    assert r.itl_s == pytest.approx([0.05, 0.15])
    assert r.tpot_s == pytest.approx(0.1)  # (0.5 - 0.2) / (4 - 1)
    r.output_tokens = 1
    assert r.tpot_s is None


def done(ttft: float, e2e: float, tokens: int, itl: list[float], prompt: int = 10) -> RequestResult:
    return RequestResult(0, "", prompt, tokens, ok=True, ttft_s=ttft, e2e_s=e2e, itl_s=itl, output_tokens=tokens)


def test_summary_throughputs_and_goodput_by_hand():
    results = [
        done(0.1, 1.0, 10, [0.1] * 9),  # tpot 0.1
        done(0.3, 0.6, 4, [0.1] * 3, prompt=20),  # tpot 0.1
        done(0.2, 2.2, 11, [0.2] * 10),  # tpot 0.2
        RequestResult(3, "", 10, 5, error="http_429"),
        RequestResult(4, "", 10, 5, error="http_429"),
        RequestResult(5, "", 10, 5, error="timeout"),
    ]
    s = summarize(results, 2.0, Slo(ttft_ms=250, tpot_ms=150))
    assert (s["completed"], s["failed"]) == (3, 3)
    assert s["errors"] == {"http_429": 2, "timeout": 1}
    assert s["request_throughput"] == 1.5
    assert s["output_throughput"] == 12.5  # 25 tokens / 2 s
    assert s["total_token_throughput"] == 32.5  # (40 + 25) / 2 s
    assert s["goodput"] == 0.5  # only the first meets both: ttft 100 <= 250, tpot 100 <= 150
    assert s["ttft_ms"]["median"] == pytest.approx(200)
    assert s["tpot_ms"]["mean"] == pytest.approx(400 / 3)
    assert s["itl_ms"]["median"] == pytest.approx(100)  # 12 gaps of 100 ms, 10 of 200 ms
    assert s["e2e_ms"]["p90"] == pytest.approx(1000 + 0.8 * 1200)
    assert summarize(results, 2.0, Slo())["goodput"] is None
    assert summarize(results, 2.0, Slo(e2e_ms=1000))["goodput"] == 1.0


# -- clients against in-memory transports ------------------------------------------------


def sse(*events) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def chunk(text: str, reason=None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": reason}], "usage": None}


USAGE = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                                  "prompt_tokens_details": {"cached_tokens": 2}}}


REQUEST = BenchRequest([5, 6, 7], 4)


def http_send(handler, request=REQUEST) -> RequestResult:
    httpx = pytest.importorskip("httpx")

    async def go() -> RequestResult:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            result = RequestResult(0, "", 3, request.output_len)
            await HttpClient(http, "http://test/", "k", None).send(request, result)
            return result

    return asyncio.run(go())


def test_http_client_sends_token_ids_and_reads_chunks_and_usage():
    seen = {}

    def handler(req):
        seen["body"] = json.loads(req.content)
        seen["url"], seen["auth"] = str(req.url), req.headers["authorization"]
        return _response(200, sse(chunk("a"), chunk("bc"), chunk("", "length"), USAGE, "[DONE]"))

    r = http_send(handler)
    assert seen["url"] == "http://test/v1/completions" and seen["auth"] == "Bearer k"
    assert seen["body"] == {
        "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert r.ok and r.error is None
    assert (r.output_tokens, r.cached_tokens) == (4, 2)
    assert len(r.itl_s) == 2 and r.ttft_s <= r.e2e_s  # three chunks: two gaps, however many tokens each


def _response(status: int, content: bytes, **headers):
    import httpx

    return httpx.Response(status, content=content, headers={"content-type": "text/event-stream", **headers})


@pytest.mark.parametrize(
    "status, body, kind",
    [
        (429, b'{"error": {"message": "server busy"}}', "http_429"),
        (200, sse(chunk("a"), {"error": {"message": "worker died"}}, "[DONE]"), "stream_error"),
        (200, sse(chunk("a"), chunk("", "abort"), USAGE, "[DONE]"), "abort"),
        (200, sse(chunk("a")), "incomplete_stream"),
    ],
)
def test_http_failures_are_counted_by_kind(status, body, kind):
    r = http_send(lambda req: _response(status, body))
    assert not r.ok and r.error == kind


def test_http_connection_failure_is_a_result_not_a_crash():
    httpx = pytest.importorskip("httpx")

    def refuse(req):
        raise httpx.ConnectError("refused")

    r = http_send(refuse)
    assert r.error == "connection"


class FakeStub:
    """``Generate`` replays messages, then optionally raises a gRPC error."""

    def __init__(self, messages, error: grpc.StatusCode | None = None) -> None:
        self.messages, self.error, self.requests = messages, error, []

    def Generate(self, request, metadata=None, timeout=None):
        self.requests.append((request, metadata))

        async def stream():
            for m in self.messages:
                yield m
            if self.error is not None:
                raise grpc.aio.AioRpcError(self.error, grpc.aio.Metadata(), grpc.aio.Metadata(), "busy")

        return stream()


def grpc_send(stub: FakeStub) -> RequestResult:
    client = GrpcClient.__new__(GrpcClient)
    client.stub, client.metadata, client.timeout_s = stub, [("authorization", "Bearer k")], 5.0
    result = RequestResult(0, "", 3, 3)
    asyncio.run(client.send(BenchRequest([5, 6, 7], 3), result))
    return result


def test_grpc_client_sends_token_ids_and_reads_usage_from_the_last_message():
    from protos.tandem.v1 import generate_pb2 as pb

    msgs = [
        pb.GenerateResponse(token_ids=[9]),
        pb.GenerateResponse(token_ids=[9, 9]),
        pb.GenerateResponse(finished=True, finish_reason="length",
                            usage=pb.Usage(prompt_tokens=3, completion_tokens=3, cached_tokens=1)),
    ]
    stub = FakeStub(msgs)
    r = grpc_send(stub)
    (request, metadata), = stub.requests
    assert list(request.token_ids.ids) == [5, 6, 7]
    assert request.sampling.max_tokens == 3 and request.sampling.ignore_eos and request.sampling.temperature == 0
    assert metadata == [("authorization", "Bearer k")]
    assert r.ok and (r.output_tokens, r.cached_tokens) == (3, 1)
    assert len(r.itl_s) == 1  # two token-carrying messages; the closing one carries none


def test_grpc_rejection_is_counted_by_status_code():
    r = grpc_send(FakeStub([], grpc.StatusCode.RESOURCE_EXHAUSTED))
    assert not r.ok and r.error == "resource_exhausted" and r.message == "busy"


# -- the load loop ------------------------------------------------------------------------


class SleepyClient:
    def __init__(self) -> None:
        self.in_flight = self.most = 0

    async def send(self, request: BenchRequest, result: RequestResult) -> None:
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        await asyncio.sleep(0.02)
        self.in_flight -= 1
        result.ok, result.output_tokens = True, request.output_len


def test_run_load_keeps_the_concurrency_cap_and_the_schedule():
    reqs = [BenchRequest([1, 2], 3) for _ in range(12)]
    client = SleepyClient()
    results, duration = asyncio.run(run_load(client, RunPlan(math.inf, reqs, [0.0] * 12), 3, False))
    assert client.most == 3 and all(r.ok for r in results)
    assert duration >= 0.08  # 4 waves of 20 ms
    client = SleepyClient()
    times = [0.0, 0.05, 0.1]
    results, _ = asyncio.run(run_load(client, RunPlan(20.0, reqs[:3], times), None, False))
    assert [r.index for r in results] == [0, 1, 2]
    assert all(r.sent_s >= t for r, t in zip(results, times))


class FlakyClient:
    """Fails with the given kinds first, then answers."""

    def __init__(self, *kinds: str) -> None:
        self.kinds = list(kinds)

    async def send(self, request: BenchRequest, result: RequestResult) -> None:
        if self.kinds:
            result.fail(self.kinds.pop(0), "nope")
        else:
            result.ok, result.output_tokens = True, request.output_len


def test_warm_up_waits_for_a_server_coming_up_but_not_for_a_wrong_one():
    asyncio.run(warm_up(FlakyClient("connection", "unavailable"), VOCAB, 0, "t", retry_s=0.001))
    with pytest.raises(RuntimeError, match=r"to t failed \(http_401\): nope"):
        asyncio.run(warm_up(FlakyClient("http_401"), VOCAB, 0, "t", retry_s=0.001))
    with pytest.raises(RuntimeError, match="connection"):
        asyncio.run(warm_up(FlakyClient(*["connection"] * 100), VOCAB, 0, "t", ready_timeout_s=0.01, retry_s=0.005))


# -- command line --------------------------------------------------------------------------


def test_flags_parse_into_rates_slos_and_engine_overrides():
    args = parse_args(["--request-rate", "1,2.5,inf", "--goodput", "ttft:500", "tpot:50",
                       "--launch", "--engine", "enable_prefix_caching=false", "--engine", "max_num_seqs=8"])
    assert args.request_rate == [1.0, 2.5, math.inf]
    assert args.goodput == Slo(ttft_ms=500, tpot_ms=50)
    assert dict(args.engine) == {"enable_prefix_caching": False, "max_num_seqs": 8}
    assert parse_args([]).request_rate == [math.inf] and parse_args([]).base_url == "http://127.0.0.1:8000"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--request-rate", "0"], "must be > 0"),
        (["--request-rate", "fast"], "not a number"),
        (["--range-ratio", "1"], "--range-ratio must be in"),
        (["--burstiness", "0"], "--burstiness must be > 0"),
        (["--goodput", "latency:5"], "KEY:MS"),
        (["--goodput", "ttft:soon"], "expected a number of ms"),
        (["--goodput", "ttft:5", "ttft:6"], "twice"),
        (["--max-concurrency", "0"], "must be >= 1"),
        (["--workload", "sharegpt"], "needs --dataset-path"),
        (["--workload", "sharegpt", "--dataset-path", "/no/such.json"], "no such file"),
        (["--prefill-workers", "2"], "--launch is needed for"),
        (["--engine", "enable_prefix_caching=false"], "--launch is needed for"),
        (["--launch", "--engine", "no-equals-sign"], "KEY=VALUE"),
        (["--launch", "--base-url", "http://x"], "free ports"),
        (["--long-fraction", "1.5"], "--long-fraction"),
    ],
)
def test_bad_flags_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_launch_flags_build_the_same_service_config_as_tandem_up(tmp_path):
    topology = tmp_path / "topology.yaml"
    topology.write_text("prefill_workers: 2\nengine: {max_num_batched_tokens: 512}\n")
    args = parse_args(["--launch", "--config", str(topology), "--decode-workers", "2", "--num-kv-blocks", "64",
                       "--engine", "enable_prefix_caching=false", "--placement", "round_robin",
                       "--max-outstanding-requests", "8"])
    cfg = service_config(args)
    assert (cfg.cluster.prefill_workers, cfg.cluster.decode_workers) == (2, 2)
    assert cfg.cluster.engine == {"max_num_batched_tokens": 512, "num_kv_blocks": 64, "enable_prefix_caching": False}
    assert cfg.router.dispatch.placement == "round_robin" and cfg.router.admission.max_requests == 8
    assert cfg.http_port != cfg.grpc_port
    bad = parse_args(["--launch", "--engine", "no_such_setting=1"])
    with pytest.raises(ValueError, match="unknown engine setting"):
        service_config(bad)


def test_plots_are_written_as_png(tmp_path):
    pytest.importorskip("matplotlib")
    from bench import plots

    cdf = plots.latency_cdfs({"1": {"TTFT": [5, 7, 9], "ITL": [1, 2], "E2E": [20, 30]}, "inf": {}},
                             tmp_path / "cdf.png")
    sw = plots.sweep(["1", "2", "inf"], [10, 20, None], [1, 2, 3], [1.0, 1.8, 2.0], "goodput", tmp_path / "sw.png")
    for path in (cdf, sw):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
