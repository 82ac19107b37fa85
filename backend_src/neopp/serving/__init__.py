"""What runs inside Triton's Python stubs: the models' ``model.py`` files delegate here.

``triton_model`` (the generation models), ``stream_model`` (their streamed twins),
``session_model`` and ``sessions`` (``neopp_session``), ``t2i_model`` and
``prompt_encoder_model`` (prompt in, image out), with the request parsing, settings, placement
and metrics they share. It may import the core package and ``neopp.procs``; nothing of
``neopp.launcher`` (the process that starts and supervises tritonserver), which imports nothing
of this package either. Nothing here is imported by the core package, so the runner works
without Triton.
"""
