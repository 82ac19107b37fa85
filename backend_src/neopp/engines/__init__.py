"""Engines: every way a request runs, behind one interface, chosen by one factory.

``engine`` (the ``Engine`` interface: validate, submit with step events, generate, close; the
tickets and the queue bound the queueing engines share), ``spec`` (``EngineSpec``: what to
load, where, how fast, how much at once), ``scheduler`` (which requests run the next batched
step: the budget, no head-of-line blocking, cancellation, close) and ``step_loop`` (the
batched loop around it), both driven by ``batch_engine`` (a thread, for a one-process mode) and
by ``rank_loop`` on rank 0 of ``rank_pool`` (rank processes, for a multi-rank mode; kept alive
by ``lifeline``); ``in_process`` (one pipeline in the caller's thread: a torchrun rank),
``remote`` (a Triton server), ``warmup`` and ``factory`` (``build_engine``). It may import
``neopp.parallel``, ``neopp.sampling``, ``neopp.model`` and the foundation; nothing of serving.
"""
