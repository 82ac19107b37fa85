"""What runs in the launcher's process, next to tritonserver and never inside it.

The launcher (``python -m neopp.launcher serve``, what ``make serve`` and the container run)
starts tritonserver with safe defaults and keeps it up (``supervisor``, ``tritonserver``,
``triton_install``, ``shm_regions``, ``server_log``, ``load_rescue``, ``model_states``), replaces
a model's dead, stopped or hung stub (``watchdog``, from ``stub_facts``, through ``stub_kill``),
knows whether the server can serve now (``health``), guards the administrative APIs with
the operator key (``admin``), and serves the public HTTP port (``door``).

It may import ``neopp.procs`` and ``neopp.ports`` (process and port helpers both sides use) and
its own modules; nothing of ``neopp.serving`` (the code that runs inside Triton's Python stubs),
and the stubs nothing of this package.
"""
