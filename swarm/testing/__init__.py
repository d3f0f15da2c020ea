"""The test harness: local swarms, chaos, network labs, WAN links, tiny models, the simulation. For tests, benchmarks
and the demo only: nothing in swarm/ or peers/ outside this package imports it."""
