"""Custom Prometheus metrics of the generation models (Triton's metrics port).

Triton's own ``nv_inference_*`` metrics count requests; these add what only the model
knows: denoising steps (so progress and cancellation are observable while a request
runs), time per step, and failures by reason. Families are registered by name in the
server, so every instance and every generation model shares them, told apart by the
``model`` label.
"""

from __future__ import annotations

from typing import Any

FAILURE_REASONS = ("invalid_input", "cancelled", "worker_failure", "queue_full", "config", "internal")

_COUNTERS = {
    "generations": ("neopp_generations_total", "Images generated successfully"),
    "steps": ("neopp_denoising_steps_total", "Denoising steps run (advances during a request)"),
    "generation_seconds": ("neopp_generation_seconds_total", "Seconds spent in generation, encoding included"),
    "step_seconds": ("neopp_step_seconds_total", "Seconds spent inside denoising steps"),
}
SIGNING_METRIC = "neopp_model_signing"
_FAILURES = ("neopp_failures_total", "Failed requests by reason: " + ", ".join(FAILURE_REASONS))


class GenerationMetrics:
    """Counters for one model; ``pb_utils`` is passed in so this imports outside Triton."""

    def __init__(self, pb_utils: Any, model_name: str, signing: bool = False) -> None:
        counter = pb_utils.MetricFamily.COUNTER
        labels = {"model": model_name}
        # whether final pictures carry a signed C2PA manifest (the door's /status shows it)
        self._signing_family = pb_utils.MetricFamily(name=SIGNING_METRIC, kind=pb_utils.MetricFamily.GAUGE,
                                                     description="1: final pictures carry a signed C2PA manifest")
        self._signing = self._signing_family.Metric(labels=labels)
        self._signing.set(1.0 if signing else 0.0)
        # Keep the families referenced: a family that is garbage-collected unregisters.
        self._families = {
            key: pb_utils.MetricFamily(name=name, description=desc, kind=counter)
            for key, (name, desc) in _COUNTERS.items()
        }
        self._metrics = {key: fam.Metric(labels=labels) for key, fam in self._families.items()}
        self._fail_family = pb_utils.MetricFamily(name=_FAILURES[0], description=_FAILURES[1], kind=counter)
        self._failures = {
            reason: self._fail_family.Metric(labels={**labels, "reason": reason}) for reason in FAILURE_REASONS
        }

    def step(self, seconds: float) -> None:
        """Called after every denoising step of a request; ``seconds``: the (batched) step's time."""
        self._metrics["steps"].increment(1)
        self._metrics["step_seconds"].increment(float(seconds))

    def success(self, seconds: float) -> None:
        self._metrics["generations"].increment(1)
        self._metrics["generation_seconds"].increment(float(seconds))

    def failure(self, reason: str) -> None:
        self._failures.get(reason, self._failures["internal"]).increment(1)


# Histograms of the step-batching engine (Triton 2.51's Python backend has HISTOGRAM families:
# ``family.Metric(labels, buckets=[...])`` then ``observe``), fed by the engine's callbacks and
# labelled by the model that loads the engine.
SECONDS_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0]
BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64]
_HISTOGRAMS = {
    "queue_wait": ("neopp_queue_wait_seconds", "Seconds a request waited before its first step", SECONDS_BUCKETS),
    "batch": ("neopp_batch_size", "Requests run together per engine step", BATCH_BUCKETS),
    "step_time": ("neopp_batch_step_seconds", "Seconds per batched denoising step", SECONDS_BUCKETS),
}


class EngineMetrics:
    """Queue wait, batch size and step time as histograms labelled by model; the requests held as a gauge."""

    def __init__(self, pb_utils: Any, model_name: str) -> None:
        kind = pb_utils.MetricFamily.HISTOGRAM
        self._families = {key: pb_utils.MetricFamily(name=name, description=desc, kind=kind)
                          for key, (name, desc, _) in _HISTOGRAMS.items()}
        self._metrics = {key: self._families[key].Metric(labels={"model": model_name}, buckets=list(buckets))
                         for key, (_, _, buckets) in _HISTOGRAMS.items()}
        self._held_family = pb_utils.MetricFamily(
            name="neopp_engine_requests", kind=pb_utils.MetricFamily.GAUGE,
            description="Requests the engine holds: running, or waiting for their first step")
        self._held = self._held_family.Metric(labels={"model": model_name})

    def held(self, requests: int) -> None:
        self._held.set(float(requests))

    def queue_wait(self, seconds: float) -> None:
        self._metrics["queue_wait"].observe(float(seconds))

    def batch(self, size: int) -> None:
        self._metrics["batch"].observe(float(size))

    def step_time(self, seconds: float) -> None:
        self._metrics["step_time"].observe(float(seconds))


class PrefillMetrics:
    """The prompt encoder's tower: sequences prefilled together per forward, and the requests it holds."""

    def __init__(self, pb_utils: Any, model_name: str) -> None:
        labels = {"model": model_name}
        self._family = pb_utils.MetricFamily(
            name="neopp_prefill_batch_size", kind=pb_utils.MetricFamily.HISTOGRAM,
            description="Prompt sequences prefilled together in one forward of the language tower")
        self._metric = self._family.Metric(labels=labels, buckets=list(BATCH_BUCKETS))
        self._held_family = pb_utils.MetricFamily(
            name="neopp_prefill_requests", kind=pb_utils.MetricFamily.GAUGE,
            description="Requests the prompt encoder's tower holds: waiting, or in its forward")
        self._held = self._held_family.Metric(labels=labels)

    def batch(self, sequences: int) -> None:
        self._metric.observe(float(sequences))

    def held(self, requests: int) -> None:
        self._held.set(float(requests))
