"""The door's bounds, in one place: connections, uploads, bodies per route and JSON.

Each bound answers one way of starving other clients: connections that never send a request
(timed out, and the idle ones evicted first when a cap is reached), uploads that trickle (a
minimum rate), one client's bodies (a share of the budget), and documents that would keep the
door's interpreter busy (bytes and values per route, parsed away from the event loop).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...contract.inputs import MAX_EDIT_IMAGE_BYTES, MAX_EDIT_IMAGES

KiB, MiB = 1 << 10, 1 << 20
HEADER_LIMIT = 64 * KiB  # bytes of request line and headers, however they arrive
FORM_FRAMING = 64 * KiB  # a form's part headers and boundaries, beside its contents
BYTE_COUNT = re.compile(r"^[0-9]{1,15}$")  # a size in a header: ASCII digits only (str.isdigit takes others)


@dataclass(frozen=True)
class RouteCap:
    """What one kind of route reads: at most ``body`` bytes (after gzip/deflate) holding at most
    ``values`` JSON values (counted as the commas and colons of the body)."""

    name: str
    body: int
    values: int


@dataclass(frozen=True)
class DoorLimits:
    """Defaults fit one 8B request's two KV prefixes (~88 MB) with room."""

    max_body: int = 128 * MiB  # an inference body after decompression
    max_json_bytes: int = MiB  # the JSON header of an infer request (tensors go in the binary part)
    max_json_values: int = 65_536  # values in an inference JSON body (a RNG_STATE is 5056)
    bodies_in_flight: int = 384 * MiB  # all bodies being read or held at once
    client_bodies: int = 128 * MiB  # what one client address may hold of that budget
    read_timeout_s: float = 10.0  # how far an upload may fall behind the minimum rate
    min_upload_rate: float = 1 * MiB  # bytes per second an upload must average
    idle_timeout_s: float = 15.0  # a connection's wait for a complete request head
    max_connections: int = 1024  # open connections, all clients
    max_client_connections: int = 512  # open connections of one client address
    max_inference: int = 768  # inference requests in flight; health and metrics are not counted
    client_inference: int = 32  # generations one client may have running or queued; 0: no limit
    client_prompt_calls: int = 2  # of them, neopp_t2i calls (each holds one of its instances) running at once
    region_min_bytes: int = MiB  # binary parts this large go through the tensor region; 0: never
    openai_body: int = 64 * KiB  # a /v1 body: a prompt and a few options
    control_body: int = 4 * MiB  # a control route's body (a config override, a model file)
    allowed_hosts: frozenset[str] | None = frozenset({"loopback"})  # Host names answered; None: any

    def cap(self, route: str) -> RouteCap:
        """The bound of ``route``: "inference" (infer, generate), "openai", "edits" or "control".

        An edit's form holds its pictures (each within the contract's bound), the fields of a
        generation's body and their framing, never more than an inference body; it holds no JSON."""
        if route == "openai":
            return RouteCap(route, self.openai_body, 1024)
        if route == "edits":
            return RouteCap(route, min(self.max_body, MAX_EDIT_IMAGES * MAX_EDIT_IMAGE_BYTES + self.openai_body
                                         + FORM_FRAMING), 0)
        if route == "control":
            return RouteCap(route, self.control_body, 16_384)
        return RouteCap("inference", self.max_body, self.max_json_values)
