"""The public HTTP door: an ASGI application that runs in the launcher's process, not in a stub.

It parses every client byte once, strictly, and hands Triton only what it produced itself:
inference goes to Triton over gRPC, a socket under the launcher (a client that hangs up cancels its request),
the few control routes are re-serialised to Triton's own HTTP, a socket only this door reaches.
The public gRPC port, when the launcher serves one, is here too (``grpc_front``): it needs the
same extra, and counts clients in the door's table. The package imports the rest of the launcher
only for the operator-key names (``neopp.launcher.admin``), the form of Triton's socket address
(``neopp.launcher.inner_http``) and what the launcher knows of the server (``neopp.launcher.health``).
"""
