"""Sampling: from a request and noise to the pixels, in one process.

``schedule`` (the shifted time grid, the starting noise scale), ``guidance`` (which steps and
branches are guided, how their velocities combine), ``sampler`` (the start state, the velocity
and the Euler step with its finite check, used by every path), ``pipeline`` (the denoising loop
of one request), ``batching`` (one step over several requests) and ``rng`` (the noise stream
that makes turns reproducible). It may import ``neopp.model``, ``neopp.request`` and the
foundation modules; nothing of engines, parallel ranks or serving.
"""
