"""Engines: what runs a mode's requests, behind one interface, chosen by one factory.

``engine`` (the ``Engine`` interface: validate, submit with step events, generate, close; the
step events and the submission path the step-batching engines share), ``in_process`` (the
pipeline in this process, one request at a time), ``batch_engine`` (step batching in this
process) and ``factory`` (``build_engine``: which of them, or of the rank pools in
``neopp.parallel``, a mode runs on). It may import ``neopp.sampling``, ``neopp.model``,
``neopp.parallel`` and the foundation modules; nothing of serving.
"""
