"""``neopp``: the command a person draws from, talking to a running server's HTTP door.

It needs nothing but the standard library, so that it works from any Python that has the
package, and it speaks only the door's public routes (``/v1``, ``/status``), as any client would.
"""
