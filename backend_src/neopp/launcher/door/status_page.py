"""``GET /status``: per model, ready or not, requests in flight and queued, recent latency, errors
and restarts; per client, its HTTP generations in flight (under a label that names no one); as
JSON (``Accept: application/json`` or ``?format=json``) or as a small HTML page.

Read at each call from what already counts them: the repository index (ready), Triton's metrics
port (``nv_inference_pending_request_count``: queued; ``neopp_engine_requests``: held by the
engine; a generation model's own ``neopp_generations_total``/``_seconds_total``: served requests
and their whole time, a stream's included; ``neopp_failures_total`` by reason: errors of the
server apart from refused and cancelled requests; for other models Triton's
``nv_inference_request_success``/``_duration_us``/``_failure``), and the launcher's health
(reloads of a model's stubs, restarts of the server). ``c2pa_signed`` says whether a generation
model signs its final pictures with a C2PA manifest (``neopp_model_signing``; null for the
models that draw nothing). Recent latency is the mean over the
requests served since the previous look (the mean since start on the first look): a refusal
never enters it.
"""

from __future__ import annotations

import html
from typing import Any

from . import triton_metrics
from .client_load import ClientLoad
from .door_error import DoorError
from .upstream import Upstream

WANTED = {"nv_inference_pending_request_count": "queued", "neopp_engine_requests": "in_flight",
          "nv_inference_request_success": "successes", "nv_inference_request_failure": "failed_in_triton",
          "nv_inference_request_duration_us": "duration_us", "neopp_generations_total": "generations",
          "neopp_generation_seconds_total": "generation_s", "neopp_model_signing": "signing"}
FAILURES = "neopp_failures_total"  # a generation model's failed requests, by reason
SERVER_FAULTS = ("internal", "config", "worker_failure")  # the server's doing; the rest were refused or cancelled
REFUSALS = ("invalid_input", "queue_full")


class StatusBoard:
    """The status of every model, with the previous look kept for the recent latency."""

    def __init__(self, upstream: Upstream, admin_key: str | None, metrics_address: tuple[str, int] | None,
                 health: Any = None, clients: ClientLoad | None = None) -> None:
        self.upstream, self.admin_key, self.metrics_address = upstream, admin_key, metrics_address
        self.health, self.clients = health, clients
        self._last: dict[str, tuple[float, float]] = {}  # model: (successes, duration_us)

    async def look(self, server_restarts: int) -> dict[str, Any]:
        try:
            states = await self.upstream.model_states(self.admin_key)
        except DoorError as exc:
            return {"ready": False, "why": exc.message, "server_restarts": server_restarts, "models": [],
                    "clients": self._clients()}
        text = await triton_metrics.fetch(self.metrics_address)
        counts = triton_metrics.samples(text, WANTED)
        for model, reasons in triton_metrics.by_label(text, FAILURES, "reason").items():
            counts.setdefault(model, {}).update({f"failed:{reason}": n for reason, n in reasons.items()})
        reloads = self.health.reloads() if self.health is not None and hasattr(self.health, "reloads") else {}
        why = self.health.not_ready() if self.health is not None else None
        models = [self._model(name, state, counts.get(name, {}), reloads.get(name, 0))
                  for name, state in sorted(states.items())]
        return {"ready": why is None and any(m["ready"] for m in models), "why": why,
                "server_restarts": server_restarts, "models": models, "clients": self._clients()}

    def _clients(self) -> dict[str, Any] | None:
        return self.clients.look() if self.clients is not None else None

    def _model(self, name: str, state: str, counts: dict[str, float], reloads: int) -> dict[str, Any]:
        """A generation model's figures are its own (served requests whole, a stream included, and
        failures by reason); other models' are Triton's."""
        own = "generations" in counts
        done = counts.get("generations") if own else counts.get("successes")
        spent = counts["generation_s"] * 1e6 if own and "generation_s" in counts else counts.get("duration_us")
        latency = None
        if done is not None and spent is not None:
            before_done, before_spent = self._last.get(name, (0.0, 0.0))
            if done < before_done:  # the server restarted: its counters began again
                before_done, before_spent = 0.0, 0.0
            if done > before_done:
                latency = round((spent - before_spent) / (done - before_done) / 1000.0, 1)
                self._last[name] = (done, spent)
        return {"model": name, "ready": state == "READY", "state": state or "UNLOADED",
                "in_flight": _int(counts.get("in_flight")), "queued": _int(counts.get("queued")),
                "recent_latency_ms": latency, "successes": _int(done), **_failures(counts, own),
                "restarts": reloads, "c2pa_signed": None if "signing" not in counts else counts["signing"] > 0}


def _failures(counts: dict[str, float], own: bool) -> dict[str, int | None]:
    """``errors``: requests that failed by the server's doing; ``refused``: requests refused for
    what they asked (bad input, a full queue; Triton's own refusals, which never reach the model,
    are the part of its failure count the model did not see); ``cancelled``: by their clients."""
    triton = counts.get("failed_in_triton")
    if not own:
        return {"errors": _int(triton), "refused": None, "cancelled": None}
    reasons = {k.split(":", 1)[1]: v for k, v in counts.items() if k.startswith("failed:")}
    before_model = max(0.0, (triton or 0.0) - sum(reasons.values()))
    return {"errors": int(sum(reasons.get(r, 0.0) for r in SERVER_FAULTS)),
            "refused": int(sum(reasons.get(r, 0.0) for r in REFUSALS) + before_model),
            "cancelled": int(reasons.get("cancelled", 0.0))}


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def render_html(doc: dict[str, Any]) -> str:
    """The status as a page a person reads; the same figures as the JSON."""
    columns = ("model", "state", "in_flight", "queued", "recent_latency_ms", "successes", "errors", "refused",
               "cancelled", "restarts", "c2pa_signed")
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(_shown(m[c]))}</td>" for c in columns) + "</tr>"
                   for m in doc["models"])
    head = "".join(f"<th>{c.replace('_', ' ')}</th>" for c in columns)
    verdict = "ready" if doc["ready"] else f"not ready: {doc.get('why') or 'no model is ready'}"
    return ("<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>NeoPP status</title>"
            "<meta http-equiv=\"refresh\" content=\"5\"><style>body{font-family:system-ui,sans-serif;margin:1.5rem}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.3rem .6rem;text-align:left}"
            "</style></head><body><h1>NeoPP status</h1>"
            f"<p id=\"verdict\">Server {html.escape(verdict)}; restarts of the server: {doc['server_restarts']}. "
            "<a href=\"/\">playground</a> &middot; <a href=\"/status?format=json\">JSON</a> &middot; "
            "<a href=\"/openapi.json\">API</a></p>"
            f"<table id=\"models\"><tr>{head}</tr>{rows}</table>{_clients_html(doc.get('clients'))}</body></html>")


def _clients_html(clients: dict[str, Any] | None) -> str:
    if not clients:
        return ""
    rows = "".join(f"<tr><td>{html.escape(c['client'])}</td><td>{c['in_flight']}</td></tr>" for c in clients["busiest"])
    return (f"<p id=\"clients\">{clients['clients']} client(s) with {clients['in_flight']} HTTP generation(s) in "
            f"flight; at most {_shown(clients['limit_per_client'])} per client.</p>"
            f"<table><tr><th>client</th><th>in flight</th></tr>{rows}</table>")


def _shown(value: Any) -> str:
    return "-" if value is None else str(value)
