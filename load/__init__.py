"""What a serving run sends and how its results read: the workloads (prompts, output
lengths, arrival times: ``load.workloads``) and the per-request results with their summary
(``load.results``). The live benchmarks (``bench``) and the simulator (``sim``) both use
them, so they sit below both."""
