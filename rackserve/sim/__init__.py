"""sim/: projects serving at rack scale on a small machine. The real EngineCore, Scheduler and KV
cache manager run over a simulated executor that prices each step with a hardware cost model on a
virtual clock, driven by bench's own workloads and lanes (`rackserve sim`, docs/simulator.md).

Nothing here imports torch or reads the wall clock inside a simulation.
"""
