"""The tandem command: serve (up), query a server (request, status), fetch a named model
(pull), make the built-in test model (make-model), generate offline (generate), run
benchmarks (bench), simulate a deployment (sim) and plan one (plan)."""

from __future__ import annotations

import argparse
import sys

from cluster.autoscaler import decision_text
from cluster.flags import GRPC_PORT, HTTP_PORT, LOCAL_URL, METRICS_PORT, add_lora_flag, add_service_flags
from cluster.ingress import describe
from engine.config import EngineConfig
from engine.model.model_registry import DEFAULT_SERVE_MODEL, NAMED_MODELS, ModelFetchError, model_names

MODEL_HELP = (
    f"a named model ({', '.join(model_names())}), a Hugging Face checkpoint directory or a "
    f".gguf file (default: {DEFAULT_SERVE_MODEL}, fetched on first use)"
)


def _cmd_make_model(args: argparse.Namespace) -> int:
    from engine.model.default_model import make_model

    path = make_model(args.dir, seed=args.seed)
    print(f"wrote {path}")
    return 0


def _cmd_pull(args: argparse.Namespace) -> int:
    from engine.model.model_registry import pull

    print(pull(args.name))
    return 0


def _lora_settings(args: argparse.Namespace) -> dict:
    """The engine's LoRA settings for ``tandem generate``: the ``--lora`` adapters, one
    resident (the prompt runs under one), and ``--adapter`` checked against them before
    the model loads."""
    adapters = args.lora or {}
    if args.adapter is not None and args.adapter not in adapters:
        named = ", ".join(sorted(adapters)) or "none"
        raise ValueError(f"--adapter {args.adapter!r} is not an adapter --lora names (named: {named})")
    if not adapters:
        return {}
    return {"max_loras": 1, "max_lora_rank": args.max_lora_rank, "lora_adapters": adapters}


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )
    with LLM(model=args.model, dtype=args.dtype, num_kv_blocks=args.num_kv_blocks,
             tensor_parallel_size=args.tensor_parallel_size, **_lora_settings(args)) as llm:
        prompt = args.prompt
        if args.chat:
            prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        (out,) = llm.generate([prompt], params, adapter=args.adapter)
        stats = llm.stats()
    print(out.text)
    under = f"adapter {args.adapter}, " if args.adapter is not None else ""
    print(
        f"[{under}{out.num_prompt_tokens} prompt tokens, {len(out.token_ids)} generated, "
        f"finish_reason={out.finish_reason}, blocks in use after: {stats.num_blocks_in_use}]",
        file=sys.stderr,
    )
    return 0


def _serving_default(cluster):
    """``tandem up`` serves a real chat model when neither flag nor file names one (the
    library's and the benchmarks' default stays tandem-tiny-llama)."""
    return cluster if cluster.model is not None else cluster.replace(model=DEFAULT_SERVE_MODEL)


def _banner(service, args: argparse.Namespace) -> str:
    """What ``tandem up`` started and where, for the operator."""
    import os

    info, config = service.model_info, service.config
    return (
        f"tandem is up: model {info['name']!r} on {config.cluster.prefill_workers} prefill + "
        f"{config.cluster.decode_workers} decode workers\n"
        f"  HTTP (OpenAI API): {service.http_url}/v1   health: {service.http_url}/health\n"
        f"  gRPC (tandem.v1.Generation): {service.grpc_target}\n"
        f"  ingress: {describe(config.ingress, {**os.environ, **service.serve_env})}\n"
        f"  metrics (Prometheus): http://{args.host}:{args.metrics_port}/metrics\n"
        f"  auth: {'API key required' if config.router.api_key else 'none'}; Ctrl-C stops"
    )


def _cmd_up(args: argparse.Namespace) -> int:
    import dataclasses
    import os
    import signal
    import threading

    from cluster.local import local_ray
    from cluster.metrics_server import start_metrics_server
    from cluster.service import ServiceConfig, TandemService
    from engine.model.model_registry import resolve_model

    config = ServiceConfig.from_flags(args, api_key=args.api_key or os.environ.get("TANDEM_API_KEY") or None)
    config = dataclasses.replace(config, cluster=_serving_default(config.cluster))
    # Here, before any worker starts: a first pull shows its progress on this terminal,
    # and a failing one ends the command with its message instead of failing workers.
    resolve_model(config.cluster.model)
    with local_ray(args.num_cpus):
        # After ray.init: Ray's core installs its own SIGTERM handler, which aborts the process.
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        service = TandemService(config).start()
        try:
            metrics_server = start_metrics_server(args.metrics_port, args.host)
            print(_banner(service, args), flush=True)
            stop.wait()
            print("shutting down", flush=True)
            metrics_server.shutdown()
        finally:
            service.shutdown()
    return 0


def _call(args: argparse.Namespace, path: str, body: dict | None = None) -> dict | None:
    """GET (or, with ``body``, POST) ``path`` on the server at ``args.url`` with the API
    key (``--api-key``, else ``$TANDEM_API_KEY``); its JSON answer, or None after
    printing why there is none (stdlib only)."""
    import json
    import os
    import urllib.error
    import urllib.request

    headers = {"content-type": "application/json"} if body is not None else {}
    key = args.api_key or os.environ.get("TANDEM_API_KEY")
    if key:
        headers["authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(args.url.rstrip("/") + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        print(f"error {e.code}: {e.read().decode()}", file=sys.stderr)
    except urllib.error.URLError as e:
        print(f"error: no server at {args.url}: {e.reason}", file=sys.stderr)
    except TimeoutError:
        print(f"error: {args.url} did not answer within {args.timeout} s (--timeout)", file=sys.stderr)
    return None


def _cmd_request(args: argparse.Namespace) -> int:
    """Send one completion to a running server and print the answer."""
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.chat:
        out = _call(args, "/v1/chat/completions", {"messages": [{"role": "user", "content": args.prompt}], **params})
    else:
        out = _call(args, "/v1/completions", {"prompt": args.prompt, **params})
    if out is None:
        return 1
    choice = out["choices"][0]
    print(choice["message"]["content"] if args.chat else choice["text"])
    u = out["usage"]
    print(
        f"[{u['prompt_tokens']} prompt tokens, {u['completion_tokens']} generated, "
        f"finish_reason={choice['finish_reason']}]",
        file=sys.stderr,
    )
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    """Print a running server's pools, autoscaling targets and latest decisions (``GET /status``)."""
    import json

    status = _call(args, "/status")
    if status is None:
        return 1
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def format_status(status: dict) -> str:
    """``GET /status``'s answer as lines for a terminal."""
    lines = [f"model {status.get('model')}"]
    scaling = status.get("autoscaling") or {}
    targets = scaling.get("targets", {})
    for role, workers in sorted(status["pools"].items(), key=lambda kv: kv[0] != "prefill"):
        live = sum(not w["draining"] and not w.get("starting") for w in workers)
        t = targets.get(role)
        bounds = f"  (target {t['target']}, min {t['min']}, max {t['max']})" if t else ""
        lines.append(f"{role}: {live} worker{'s' * (live != 1)}{bounds}")
        for w in workers:
            name = w["worker_id"] + (" (draining)" if w["draining"] else "")
            load = "starting (waiting for room, or loading)" if w.get("starting") else _load_line(w["load"])
            where = f"  [pid {w['pid']} on {w['node']}]" if w.get("pid") else ""
            lines.append(f"  {name:24} {load}{where}")
            cache = _cache_line(w.get("cache"))
            if cache:
                lines.append(f"  {'':24} {cache}")
    if "slo" in scaling:
        seen, slo = scaling.get("router_latency"), scaling["slo"]
        clients = "no requests lately" if seen is None else (
            f"TTFT p90 {_ms(seen['ttft_ms'])}, ITL p90 {_ms(seen['itl_ms'])} "
            f"over {seen['requests']} requests, {seen['tokens']} tokens")
        lines.append(f"clients saw: {clients}  (SLO: TTFT {slo['ttft_ms']:g} ms, ITL {slo['itl_ms']:g} ms)")
    if "decisions" in scaling:
        lines.append("autoscaling decisions (latest last):" if scaling["decisions"] else "no autoscaling decisions yet")
        for d in scaling["decisions"][-10:]:
            lines.append(f"  {d['ago_s']:>7.1f} s ago  {decision_text(d)}")
    elif not scaling:
        lines.append("autoscaling: off (pools of fixed size)")
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def _cache_line(cache: dict | None) -> str:
    """A worker's host KV tier (its use, and the share of the prompt tokens its device cache
    missed that the tier served) and its resident LoRA adapters; "" when it has neither."""
    if not cache:
        return ""
    parts = []
    if cache.get("host_cache_blocks"):
        hits = cache["host_cache_hits"]
        missed = cache["prefix_cache_queries"] - (cache["prefix_cache_hits"] - hits)
        rate = f"{hits / missed:.0%}" if missed else "-"
        parts.append(f"host KV tier {cache['host_cache_blocks_used']}/{cache['host_cache_blocks']} blocks, "
                     f"hit rate {rate} ({hits} prompt tokens)")
    resident = cache.get("lora_resident_adapters") or []
    if resident or cache.get("lora_loads"):
        loads, evictions = cache["lora_loads"], cache["lora_evictions"]
        parts.append(f"LoRA resident: {', '.join(resident) or 'none'} ({loads} load{'s' * (loads != 1)}, "
                     f"{evictions} eviction{'s' * (evictions != 1)})")
    return "; ".join(parts)


def _load_line(load: dict | None) -> str:
    if load is None:
        return "no answer"
    if "queued_prefill_tokens" in load:
        return (f"{load['queued_prefill_tokens']} prompt tokens queued, {load['running_chunks']} prefilling, "
                f"{load['sending']} sending")
    used = load["total_blocks"] - load["free_blocks"]
    return (f"{load['running']} running, {load['waiting']} waiting, {load['waiting_for_kv']} waiting for KV, "
            f"KV {used}/{load['total_blocks']} blocks")


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.bench == "offline":
        from bench.offline import main as offline_main

        return offline_main(args.rest)
    if args.bench == "serve":
        from bench.serve import main as serve_main

        return serve_main(args.rest)
    if args.bench == "report":
        from bench.report import main as report_main

        return report_main(args.rest)
    if args.bench == "overhead":
        from bench.overhead import main as overhead_main

        return overhead_main(args.rest)
    if args.bench == "tp":
        from bench.tp import main as tp_main

        return tp_main(args.rest)
    raise SystemExit(f"unknown benchmark {args.bench!r}")


def _add_make_model(sub) -> None:
    mm = sub.add_parser("make-model", help="write the built-in test model (tandem-tiny-llama) to DIR")
    mm.add_argument("dir")
    mm.add_argument("--seed", type=int, default=0)
    mm.set_defaults(func=_cmd_make_model)


def _add_pull(sub) -> None:
    pull = sub.add_parser("pull", help="fetch a named model into $TANDEM_HOME and print its path")
    pull.add_argument("name", choices=sorted(NAMED_MODELS))
    pull.set_defaults(func=_cmd_pull)


def _add_generate(sub) -> None:
    gen = sub.add_parser("generate", help="generate a completion offline")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=DEFAULT_SERVE_MODEL, help=MODEL_HELP)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 elsewhere")
    gen.add_argument("--num-kv-blocks", type=int, default=None)
    gen.add_argument("--tensor-parallel-size", type=int, default=1,
                     help="split the model over this many ranks (processes on this host)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    add_lora_flag(gen, "load a LoRA adapter (its name and PEFT directory), repeatable; --adapter picks one")
    gen.add_argument("--adapter", default=None, metavar="NAME",
                     help="generate under this --lora adapter (default: the base model)")
    gen.add_argument("--max-lora-rank", type=int, default=EngineConfig.max_lora_rank, metavar="N",
                     help="the largest rank a --lora adapter may have (default %(default)s)")
    gen.set_defaults(func=_cmd_generate)


def _add_up(sub) -> None:
    up = sub.add_parser("up", help="start Ray, the worker pools and the HTTP/gRPC router; Ctrl-C stops")
    add_service_flags(up, model_help=MODEL_HELP)
    up.add_argument("--host", default="127.0.0.1", help="HTTP bind address (gRPC: see docs/serving.md)")
    up.add_argument("--http-port", type=int, default=HTTP_PORT)
    up.add_argument("--grpc-port", type=int, default=GRPC_PORT)
    up.add_argument("--metrics-port", type=int, default=METRICS_PORT, help="Prometheus scrape endpoint of this node")
    up.add_argument("--api-key", default=None, help="require this key (default: $TANDEM_API_KEY, else none)")
    up.set_defaults(func=_cmd_up)


def _add_request(sub) -> None:
    req = sub.add_parser("request", help="send one completion to a running server and print it")
    req.add_argument("prompt")
    req.add_argument("--url", default=LOCAL_URL)
    req.add_argument("--max-tokens", type=int, default=32)
    req.add_argument("--temperature", type=float, default=0.0)
    req.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    req.add_argument("--api-key", default=None, help="default: $TANDEM_API_KEY")
    req.add_argument("--timeout", type=float, default=120.0)
    req.set_defaults(func=_cmd_request)


def _add_status(sub) -> None:
    st = sub.add_parser("status", help="print a running server's pools (each worker's load, host KV tier and "
                                       "resident LoRA adapters), autoscaling targets and decisions")
    st.add_argument("--url", default=LOCAL_URL)
    st.add_argument("--api-key", default=None, help="default: $TANDEM_API_KEY")
    st.add_argument("--json", action="store_true", help="print the server's answer as it is")
    st.add_argument("--timeout", type=float, default=30.0)
    st.set_defaults(func=_cmd_status)


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="run a benchmark program (offline, serve, report, overhead, tp)")
    bench.add_argument("bench", choices=["offline", "serve", "report", "overhead", "tp"])
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_cmd_bench)


def _add_sim(sub) -> None:
    from sim.cli import add_plan, add_sim  # (light: the simulator loads when a command runs)

    add_sim(sub)
    add_plan(sub)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_add_make_model, _add_pull, _add_generate, _add_up, _add_request, _add_status, _add_bench, _add_sim):
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, ModelFetchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
