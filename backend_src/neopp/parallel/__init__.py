"""How a step is split across ranks: CFG-parallel and Ulysses sequence parallelism.

``mesh`` (the ``cfg_p x seq_p`` layout of ranks and its process groups), ``parallel_pipeline``
(one rank's pipeline: its branches, its token shard, the collectives that join them),
``rank_step`` (what each rank is sent, and its share of a batched step), ``status`` (whether a
request ran in parallel and, if not, why) and ``torchrun`` (a rank launched by torchrun). The
processes that run the ranks are ``neopp.engines.rank_pool``'s. It may import
``neopp.sampling``, ``neopp.model`` and the foundation.
"""
