"""Simulated engines for the demo, the tests and the benchmarks: a synthetic workload, a
vLLM-format encoder and engines that publish it over real ZMQ sockets with a replay socket."""
