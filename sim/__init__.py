"""Tandem's simulator and planner: the project's own scheduler, block pool, placement,
admission and autoscaling policy on simulated time, with a cost model in place of the
model and the KV transfers (docs/SIMULATOR.md).

- ``sim.cost``: device kinds, model sizes, the roofline with fitted corrections, profile tables;
- ``sim.service_path``: a request's way through a live service, measured by requests in flight;
- ``sim.workload``: traces and workload specs to replay;
- ``sim.topology``: what is deployed (a topology file's pools and engine settings);
- ``sim.worker``: one worker, the engine's scheduler stepped on simulated time;
- ``sim.router``: the router's placement policies over the simulated workers;
- ``sim.simulator``: the event loop and the request's way through the cluster;
- ``sim.records``: a run's data, each replayed request's record and the run's result;
- ``sim.client_tokens``: when the clients got their tokens, and what the latency window saw;
- ``sim.scaling``: the pools' control loop on simulated time;
- ``sim.report``: a run in the serving benchmark's terms;
- ``sim.planner``: the search for the configuration that sustains the most load under SLOs;
- ``sim.cli``: ``tandem sim`` and ``tandem plan``.

Pure Python (no torch, no Ray, no clock but the simulated one).
"""
