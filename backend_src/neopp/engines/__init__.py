"""Engines: what runs a mode's requests, in this process or on rank processes, behind one face.

``factory`` (the ``GenerationEngine`` interface and the two builders every caller uses),
``streaming`` (the ``StreamEngine`` interface, its step events and the submission path that the
step-batching engine and the rank pool share) and ``batch_engine`` (step batching in this
process). The rank pools live in ``neopp.parallel``. It may import ``neopp.sampling``,
``neopp.model``, ``neopp.parallel`` and the foundation modules; nothing of serving.
"""
