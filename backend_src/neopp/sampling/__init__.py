"""Sampling: from a request and noise to the pixels, in one process.

``schedule`` (the shifted time grid, the starting noise scale), ``guidance`` (which steps and
branches are guided, how their velocities combine), ``plan`` (a request's step plan and the
rules it must meet, computed once), ``sampler`` (the start state, the velocity and the Euler
step with its finite check, used by every path; the ``StepEvent`` a step reports), ``pipeline``
(the denoising loop of one request), ``batching`` (one step over several requests) and ``rng``
(the noise stream that makes turns reproducible). It may import ``neopp.model`` and the
foundation modules; nothing of engines, parallel ranks or serving.
"""
