"""The simulator keeps the house rules: no torch or Ray, public classes documented, short
functions; and ``tandem sim`` / ``tandem plan`` run from the command line."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SIM = sorted((ROOT / "sim").rglob("*.py"))


def test_the_simulator_imports_no_torch_ray_or_network_library():
    code = ("import sys, sim.simulator, sim.planner, sim.cli, sim.scaling, sim.report, sim.bounds\n"
            "print(' '.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         timeout=120)
    loaded = set(out.stdout.split())
    heavy = sorted(m for m in ("torch", "ray", "grpc", "fastapi", "httpx") if m in loaded)
    assert not heavy, f"the simulator must stay pure, but importing it loaded {heavy}"
    assert {"engine.core.scheduler", "engine.core.block_pool", "router.placement", "router.admission",
            "cluster.autoscaler"} <= loaded


def test_every_public_class_in_sim_has_a_docstring_and_no_function_is_over_60_lines():
    missing, long = [], []
    for path in SIM:
        tree = ast.parse(path.read_text())
        missing += [f"{path.name}:{n.lineno} {n.name}" for n in tree.body
                    if isinstance(n, ast.ClassDef) and not n.name.startswith("_") and ast.get_docstring(n) is None]
        long += [f"{path.name}:{n.lineno} {n.name}" for n in ast.walk(tree)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60]
    assert not missing, f"public classes without a docstring: {missing}"
    assert not long, f"functions over 60 lines: {long}"
    assert all(ast.get_docstring(ast.parse(p.read_text())) for p in SIM), "every sim module says what it owns"


def test_tandem_sim_replays_a_workload_and_writes_its_summary(tmp_path, capsys):
    from tandem.cli import main

    out = tmp_path / "s.json"
    rc = main(["sim", "--workload", "synthetic:n=30,in=200,out=20,rate=5", "--prefill-workers", "1",
               "--decode-workers", "1", "--slo", "ttft:500,itl:50", "--result-json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "completed / failed:          30 / 0" in text and "SLO attainment" in text
    written = json.loads(out.read_text())
    assert written["completed"] == 30
    assert written["queue_samples"][0]["t"] == 0.0 and "decode_running" in written["queue_samples"][-1]


def test_tandem_sim_reads_a_topology_file(tmp_path, capsys):
    from tandem.cli import main

    config = tmp_path / "topology.yaml"
    config.write_text("prefill_workers: 0\ndecode_workers: 2\nengine: {max_num_seqs: 8}\n")
    assert main(["sim", "--config", str(config), "--workload", "sharegpt:n=20,rate=50"]) == 0
    assert "colocated 2 on H100" in capsys.readouterr().out


def test_tandem_sim_names_a_bad_workload():
    from tandem.cli import main

    assert main(["sim", "--workload", "poisson:n=3"]) == 2


def test_tandem_plan_prints_and_writes_a_topology_that_tandem_loads(tmp_path, capsys):
    from cluster.config import ClusterConfig
    from tandem.cli import main

    rc = main(["plan", "--slo", "ttft:200,itl:20", "--rate", "10", "--devices", "2", "--chunks", "2048",
               "--batch-caps", "64", "--iters", "1", "--trial-s", "2", "--out-dir", str(tmp_path), "--explain"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "best on 2 x H100" in text and "# Helm values" in text
    # --explain: why the best won, by the cost model and by its simulation, and the runner-up's shortfall.
    assert "per-token limit 20 ms" in text and "chosen: " in text and "runner-up: " in text, text
    assert "a decode worker: " in text and "simulated at its rate: " in text
    cluster = ClusterConfig.from_yaml(tmp_path / "topology.yaml")
    assert cluster.prefill_workers + cluster.decode_workers == 2
    assert "replicas" in (tmp_path / "values.yaml").read_text()


def test_tandem_plan_with_a_low_rate_plans_elastic_pools_that_tandem_loads(tmp_path, capsys):
    from cluster.config import ClusterConfig
    from tandem.cli import main

    rc = main(["plan", "--slo", "ttft:200,itl:20", "--rate", "10", "--devices", "2", "--chunks", "2048",
               "--batch-caps", "64", "--iters", "1", "--trial-s", "2", "--warmup-s", "2", "--low-rate", "2",
               "--phase-s", "10", "--worker-start-s", "1", "--scale-up-shares", "0,1", "--out-dir", str(tmp_path)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "elastic pools over a day between 2 and 10 req/s" in text and "fixed colocated 2" in text
    # 2 req/s needs one of the two colocated workers: the floor is 1, the ceiling 2; each
    # scale-up share is tried on it, and the first of equals is chosen.
    assert "elastic colocated 1-2 scale-up 0 " in text and "elastic colocated 1-2 scale-up 1 " in text
    assert "chosen: elastic colocated 1-2 scale-up 0, 50% fewer device-seconds than fixed pools" in text
    cluster = ClusterConfig.from_yaml(tmp_path / "topology.yaml")
    assert (cluster.decode_workers, cluster.autoscaling.decode.max_workers) == (1, 2)
    assert cluster.autoscaling.scale_up_share == 0
    values = yaml.safe_load((tmp_path / "values.yaml").read_text())
    assert values["autoscaling"]["enabled"] and values["decode"]["maxReplicas"] == 2
    assert values["autoscaling"]["scaleUpShare"] == 0


def test_tandem_plan_refuses_a_low_rate_over_the_rate(capsys):
    from tandem.cli import main

    assert main(["plan", "--slo", "ttft:200,itl:20", "--rate", "10", "--devices", "2", "--low-rate", "20"]) == 2
    assert "--low-rate must be > 0 and below --rate (10)" in capsys.readouterr().err
    assert main(["plan", "--slo", "ttft:200,itl:20", "--rate", "10", "--devices", "2", "--low-rate", "2",
                 "--scale-up-shares", "0.5,5"]) == 2
    assert "--scale-up-shares values must be in [0, 4], got '0.5,5'" in capsys.readouterr().err
