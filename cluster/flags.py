"""The service's command-line flags, defined once.

``tandem up``, ``bench serve --launch``, ``bench overhead`` and ``bench soak`` all start
the same service from flags: topology (``--config`` file, pools, KV transfer, engine
settings), admission and placement, ingress. ``add_service_flags`` puts them on a
parser (or an argument group) with per-program defaults, ``cluster_config`` reads the
pools' settings back (file first, flags over it), and ``ServiceConfig.from_flags``
(cluster/service.py) builds the whole service's configuration from them.

Torch-free and Ray-free: parsing flags must not start anything.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from cluster.ingress import DEFAULT_INGRESS, INGRESSES, check_ingress
from engine.config import EngineConfig
from kv_transfer import BACKENDS
from router.admission import AdmissionConfig
from router.api_config import ApiConfig
from router.reasoning import REASONING_SETTINGS

# Keys of a topology file that configure the service around the pools, not the pools.
SERVICE_KEYS = ("ingress", "router")
PLACEMENTS = ("load", "round_robin")
# Where a service listens by default (``tandem up``; the chart's ``service`` and ``metrics`` ports).
HTTP_PORT, GRPC_PORT, METRICS_PORT = 8000, 9000, 8081
LOCAL_URL = f"http://127.0.0.1:{HTTP_PORT}"
LOCAL_GRPC = f"127.0.0.1:{GRPC_PORT}"


def engine_item(text: str) -> tuple[str, object]:
    """``key=value``, the value read as YAML: ``false`` is a bool, ``4096`` an int."""
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, yaml.safe_load(value)


# Suffixes of a size in bytes on the command line: binary (Ki, Mi, Gi, Ti, also written KiB ...)
# and decimal (k or K, M, G, T, also kB ...), as Kubernetes quantities and the Helm chart write them.
SIZE_UNITS = {"": 1, **{u: 1 << (10 * (i + 1)) for i, u in enumerate(("Ki", "Mi", "Gi", "Ti"))},
              **{u: 1000 ** (i + 1) for i, u in enumerate(("K", "M", "G", "T"))}, "k": 1000}


def byte_size(text: str) -> int:
    """A size in bytes: ``17179869184``, ``16Gi`` / ``16GiB`` (binary), ``16G`` / ``16GB``
    (decimal), ``1.5Gi``."""
    number = text.rstrip("iBKkMGT")
    unit = text[len(number):].removesuffix("B")
    try:
        value = float(number) * SIZE_UNITS[unit]
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(
            f"expected a size in bytes (e.g. 17179869184, 16Gi, 16GiB or 16G), got {text!r}") from None
    if not (math.isfinite(value) and value >= 0 and value == int(value)):
        raise argparse.ArgumentTypeError(f"expected a whole, non-negative number of bytes, got {text!r}")
    return int(value)


def adapter_item(text: str) -> tuple[str, str]:
    """``NAME=PATH``: a LoRA adapter's name and its PEFT directory, made absolute (the
    workers that load it run in processes of their own, not in this directory)."""
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(
            f"expected NAME=PATH (an adapter's name and its PEFT directory), got {text!r}")
    return name.strip(), str(Path(path.strip()).expanduser().absolute())


class AdaptersAction(argparse.Action):
    """Repeated ``--lora NAME=PATH`` gathered into one ``{name: path}``; a name given twice
    is an argparse error naming both paths."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        name, path = values
        adapters = dict(getattr(namespace, self.dest) or {})
        if name in adapters:
            parser.error(f"{option_string} {name}: named twice ({adapters[name]} and {path})")
        adapters[name] = path
        setattr(namespace, self.dest, adapters)


def add_lora_flag(parser, help_text: str) -> None:
    """The repeatable ``--lora NAME=PATH`` (into ``args.lora``: a dict, None when not given)."""
    parser.add_argument("--lora", type=adapter_item, action=AdaptersAction, default=None, metavar="NAME=PATH",
                        help=help_text)


def add_service_flags(
    parser,
    *,
    model_help: str = "a named model, a Hugging Face checkpoint directory or a .gguf file",
    config_file: bool = True,
    model: bool = True,
    admission: bool = True,
    **defaults,
) -> None:
    """The topology flags, and with ``admission`` the router's admission and placement
    flags, on ``parser`` (a parser or an argument group). ``defaults`` overrides a flag's
    default by its destination name (``prefill_workers=1``, ``num_cpus=2``, ...); None
    everywhere else means "the topology file's value, else the configuration's default".
    """
    if config_file:
        parser.add_argument("--config", default=None, help="topology YAML (see cluster/config.py); flags override it")
    if model:
        parser.add_argument("--model", default=None, help=model_help)
    parser.add_argument("--prefill-workers", type=int, default=None, help="0 runs colocated workers")
    parser.add_argument("--decode-workers", type=int, default=None)
    parser.add_argument("--prefill-tp", type=int, default=None, metavar="N",
                        help="tensor_parallel_size of each prefill worker: its ranks, one GPU each (default 1)")
    parser.add_argument("--decode-tp", type=int, default=None, metavar="N",
                        help="tensor_parallel_size of each decode (or colocated) worker; above 1 the service "
                             "must be colocated (--prefill-workers 0) for now (default 1)")
    backend = defaults.get("kv_transfer_backend") or "nixl where installed, else collective"
    parser.add_argument("--kv-transfer-backend", default=None, choices=BACKENDS, help=f"default: {backend}")
    _add_engine_flags(parser)
    parser.add_argument(
        "--stream-interval-s", type=float, default=None,
        help="least time between two messages of one stream; tokens meanwhile go together (default 0)",
    )  # fmt: skip
    parser.add_argument("--token-channel", default=None, choices=("tcp", "ray"),
                        help="how decode workers stream to routers: TCP (default), or Ray streaming")  # fmt: skip
    parser.add_argument("--ingress", default=None, choices=INGRESSES,
                        help="Serve's ingress: HAProxy (default), or its Python proxy where HAProxy cannot run")
    cpus = defaults.get("num_cpus") or "all"
    parser.add_argument("--num-cpus", type=int, default=None, help=f"CPUs for the local Ray (default: {cpus})")
    if admission:
        parser.add_argument("--max-outstanding-requests", type=int, default=None,
                            help=f"admission bound (default {AdmissionConfig.max_requests})")
        parser.add_argument("--max-outstanding-prompt-tokens", type=int, default=None,
                            help=f"admission bound (default {AdmissionConfig.max_prompt_tokens})")
        parser.add_argument("--placement", default=None, choices=PLACEMENTS,
                            help="worker choice: load-aware with prefix affinity (default), or round-robin")
        parser.add_argument("--local-prefill-tokens", type=int, default=None,
                            help="compute a prompt with at most this many tokens uncached on its decode worker "
                                 "there, not in the prefill pool (default 0: never)")  # fmt: skip
        parser.add_argument("--local-prefill-backlog-tokens", type=int, default=None,
                            help="compute every prompt on its decode worker while each prefill worker has this "
                                 "many tokens queued (default 0: never)")  # fmt: skip
        parser.add_argument("--reasoning-parser", default=None, choices=REASONING_SETTINGS,
                            help=f"how chat outputs' thinking is told from the answer (default "
                                 f"{ApiConfig.reasoning_parser}: qwen3 for a chat template that thinks)")  # fmt: skip
        parser.add_argument("--max-stored-responses", type=int, default=None,
                            help=f"Responses API responses a router replica keeps for GET and previous_response_id "
                                 f"(default {ApiConfig.max_stored_responses}; 0: none)")  # fmt: skip
    parser.set_defaults(**defaults)


def _add_engine_flags(parser) -> None:
    """The engine settings for both roles: any (``--engine KEY=VALUE``), and the KV blocks',
    the host KV tier's and LoRA's by name."""
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="per worker (default: the engine's)")
    parser.add_argument("--engine", type=engine_item, action="append", default=[], metavar="KEY=VALUE",
                        help="engine setting for both roles, repeatable (e.g. enable_prefix_caching=false)")
    parser.add_argument("--host-kv-cache-memory", type=byte_size, default=None, metavar="BYTES",
                        help="host memory per rank for the host KV tier behind the prefix cache: evicted "
                             "prefix blocks wait there to be restored (e.g. 16Gi; default 0: off)")
    parser.add_argument("--max-loras", type=int, default=None, metavar="N",
                        help="LoRA adapters resident on each worker at once (default: as many as --lora "
                             "names, else 0: none)")
    parser.add_argument("--max-lora-rank", type=int, default=None, metavar="N",
                        help=f"the largest LoRA rank an adapter may have (default {EngineConfig.max_lora_rank})")
    add_lora_flag(parser, "a LoRA adapter every worker loads at start, repeatable: its name and PEFT directory "
                          "(adapter_config.json, adapter_model.safetensors)")


def engine_flags(args: argparse.Namespace) -> dict:
    """The engine settings the flags give for both roles (``--engine`` items, then the
    flags named for one setting)."""
    engine = dict(getattr(args, "engine", None) or [])
    for name in ("num_kv_blocks", "host_kv_cache_memory", "max_loras", "max_lora_rank"):
        if getattr(args, name, None) is not None:
            engine[name] = getattr(args, name)
    if getattr(args, "lora", None):
        engine["lora_adapters"] = dict(args.lora)
    return engine


def _with_adapters(engine: dict, section: dict) -> dict:
    """``engine`` (the flags' engine settings) over the file's ``section``: ``--lora``
    adapters join the file's ``lora_adapters``, and where neither names ``max_loras``,
    as many stay resident as there are adapters."""
    if "lora_adapters" in engine:
        adapters = {**(section.get("lora_adapters") or {}), **engine["lora_adapters"]}
        engine = {**engine, "lora_adapters": adapters}
        if "max_loras" not in engine and "max_loras" not in section:
            engine["max_loras"] = max(1, len(adapters))
    return engine


def topology_file(path: str) -> dict:
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a topology file must be a mapping")
    return data


def cluster_config(args: argparse.Namespace):
    """The pools' ``ClusterConfig``: the topology file's settings, the flags over them
    (``--kv-transfer-backend``, the engine flags (``engine_flags``) and ``--prefill-tp`` /
    ``--decode-tp`` refine the file's ``transfer``, ``engine``, ``prefill_engine`` and
    ``decode_engine`` sections rather than replace them; ``--lora`` adds to the file's
    ``lora_adapters``)."""
    from cluster.config import ClusterConfig

    engine = engine_flags(args)
    overrides = {
        "model": args.model,
        "prefill_workers": args.prefill_workers,
        "decode_workers": args.decode_workers,
        "stream_interval_s": getattr(args, "stream_interval_s", None),
        "token_channel": getattr(args, "token_channel", None),
        "transfer": {"backend": args.kv_transfer_backend} if args.kv_transfer_backend is not None else None,
        "engine": engine or None,
    }
    for role in ("prefill", "decode"):
        size = getattr(args, f"{role}_tp", None)
        overrides[f"{role}_engine"] = {"tensor_parallel_size": size} if size is not None else None
    data = {}
    if getattr(args, "config", None):
        data = {k: v for k, v in topology_file(args.config).items() if k not in SERVICE_KEYS}
    if engine:
        section = data.get("engine") if isinstance(data.get("engine"), dict) else {}
        overrides["engine"] = _with_adapters(engine, section)
    for key in ("transfer", "engine", "prefill_engine", "decode_engine"):
        if overrides[key] is not None and isinstance(data.get(key), dict):
            overrides[key] = {**data[key], **overrides[key]}
    data.update({k: v for k, v in overrides.items() if v is not None})
    return ClusterConfig.from_dict(data)


def router_settings(args: argparse.Namespace, names: tuple[str, ...]) -> dict:
    """The router's settings ``names`` (as ``cluster.service.ROUTER_SETTINGS`` names them): the
    topology file's ``router`` section, the flags over it; unset ones are left out."""
    settings = {}
    if getattr(args, "config", None):
        section = topology_file(args.config).get("router") or {}
        if not isinstance(section, dict) or set(section) - set(names):
            raise ValueError(f"{args.config}: router must be a mapping of {', '.join(names)}; got {section!r}")
        settings.update(section)
    settings.update({name: getattr(args, name) for name in names if getattr(args, name, None) is not None})
    return settings


def ingress(args: argparse.Namespace) -> str:
    """``--ingress``, else the topology file's ``ingress``, else the default (HAProxy)."""
    if args.ingress:
        return args.ingress
    if getattr(args, "config", None):
        return check_ingress(topology_file(args.config).get("ingress", DEFAULT_INGRESS))
    return DEFAULT_INGRESS
