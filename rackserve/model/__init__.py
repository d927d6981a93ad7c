"""model/: HOW a step computes. Layers, architectures (models/), checkpoint loaders, the paged
attention backends and the sampler. Everything here is torch; nothing here decides what runs
(that is core/) or where (that is executor/).
"""
