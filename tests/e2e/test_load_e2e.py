"""8 concurrent clients (gRPC and HTTP) send valid requests to several models and sessions for a
bounded time: no errors, every image the bytes its seed gave alone, server memory flat.
``make soak`` runs the same load for longer (testing.soak)."""

from __future__ import annotations

import os

from testing.loadgen import LoadRun, LoadSpec

SECONDS = float(os.environ.get("NEOPP_LOAD_SECONDS", "25"))


def test_concurrent_load_is_exact_and_memory_flat(triton):
    spec = LoadSpec(cond=triton.cond.float().numpy(), uncond=triton.uncond.float().numpy(), offsets=(24, 7))
    report = LoadRun(spec, triton.server.grpc_url, triton.server.http_url, triton.server.process.pid).run(SECONDS)
    print(report.summary())
    assert not report.errors, report.errors[:10]
    assert not report.mismatches, report.mismatches[:10]
    assert report.requests >= 4 * spec.clients and report.sessions >= 1, report.summary()
    assert set(report.per_model) == {*spec.models, spec.session_model}, report.per_model
    assert abs(report.rss_change) <= 0.10, report.summary()
    assert triton.grpc.is_server_ready()
