"""A replica crash under load, through the router: what is lost, how fast the rest recovers.

Two replicas of the demo model behind HAProxy (`deploy.replicas`, the cluster's routing rules).
Chats are opened through `neopp_session` with the LightLLM client (each chat on the replica its
``neopp-session`` header hashes to), then clients send plain generations in a loop while one
replica's tritonserver is killed (SIGKILL, its stubs with it). Afterwards every chat takes its
next turns: those whose replica is gone continue statelessly from their last ``NEXT_RNG_STATE``.
Every image of every chat is compared with the same chat run statelessly on the survivor.

    python -m bench.failover [--repeats 3] [--out bench]
"""

from __future__ import annotations

import argparse
import base64
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from bench.common import REPO, section_main, stats
from deploy.replicas import ReplicaSet
from neopp.model.kv_cache import load_kv_file

sys.path.insert(0, str(REPO / "client_examples"))
from lightllm_client import NeoPPTritonClient  # noqa: E402 - a client example, beside the package

MODELS = ("neopp_dense", "neopp_session")
KV = REPO / "demo" / "checkpoints" / "dense" / "sample_kv"
SIZE, STEPS, LOAD_STEPS = [64, 64], 2, 6
# 64x64 keeps the drill quick; the demo is trained at 128-320, so the replicas serve untrained sizes too
ENV = {"NEOPP_ALLOW_UNTRAINED_SIZES": "true"}


@dataclass
class Outcome:
    """One plain request of the load: when it started and ended (seconds after the crash), its error."""

    start: float
    end: float
    error: str | None


@dataclass
class Drill:
    """What one crash did."""

    outcomes: list[Outcome] = field(default_factory=list)
    chats: int = 0
    chats_moved: int = 0   # chats whose replica crashed: they went on statelessly
    chats_exact: int = 0   # chats whose every image equals the stateless reference
    down_after_s: float | None = None  # the router took the replica out
    detail: list = field(default_factory=list)  # per chat: (replica, exact per turn, went stateless)

    @property
    def in_flight_failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error and o.start < 0]

    @property
    def lost_after(self) -> list[Outcome]:
        """Requests sent after the crash that failed: nothing should be lost but what was running."""
        return [o for o in self.outcomes if o.error and o.start >= 0]

    @property
    def first_success_s(self) -> float:
        """How soon after the crash a request sent after it was answered."""
        return min((o.end for o in self.outcomes if o.start >= 0 and not o.error), default=float("inf"))


def _tensor(name: str, array: np.ndarray, datatype: str) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def plain_inputs(steps: int, seed: int | None = None, rng_state: np.ndarray | None = None) -> list:
    kv = [load_kv_file(KV / f"{b}_kv.pt").float().numpy() for b in ("cond", "uncond")]
    inputs = [_tensor("COND_KV", kv[0], "BF16"), _tensor("UNCOND_KV", kv[1], "BF16"),
              _tensor("INDEX_OFFSET_COND", np.array([11]), "INT64"),
              _tensor("INDEX_OFFSET_UNCOND", np.array([1]), "INT64"),
              _tensor("SIZE", np.array(SIZE), "INT64"), _tensor("STEPS", np.array([steps]), "INT64"),
              _tensor("OUTPUT_FORMAT", np.array([b"png"], object), "BYTES")]
    if seed is not None:
        inputs.append(_tensor("SEED", np.array([seed]), "INT64"))
    if rng_state is not None:
        inputs.append(_tensor("RNG_STATE", rng_state, "UINT8"))
    return inputs


def reference_chat(url: str, seed: int, turns: int) -> list[bytes]:
    """The chat's images from a stateless chain: SEED, then each NEXT_RNG_STATE as RNG_STATE."""
    client, images, state = grpcclient.InferenceServerClient(url), [], None
    for turn in range(turns):
        result = client.infer("neopp_dense", plain_inputs(STEPS, seed if turn == 0 else None, state))
        images.append(bytes(result.as_numpy("IMAGE")[0]))
        state = result.as_numpy("NEXT_RNG_STATE")
    client.close()
    return images


def replica_of(rs: ReplicaSet, sequence_id: int, timeout_s: float = 10.0) -> int:
    """The replica whose log shows the chat's first turn (each logs every session turn it runs)."""
    line = f"session {sequence_id} turn 0 "
    deadline = time.monotonic() + timeout_s
    while True:
        found = [i for i, r in enumerate(rs.running) if line in r.log.read_text(errors="replace")]
        if len(found) == 1:
            return found[0]
        if len(found) > 1 or time.monotonic() > deadline:
            raise AssertionError(f"chat {sequence_id}'s first turn logged by replicas {found}")
        time.sleep(0.05)


def open_chats(rs: ReplicaSet, count: int) -> list[tuple[NeoPPTritonClient, int, list[bytes], int]]:
    """(client, seed, images so far, replica index) of ``count`` chats after their first turn."""
    kv = [load_kv_file(KV / f"{b}_kv.pt") for b in ("cond", "uncond")]
    chats = []
    for i in range(count):
        client = NeoPPTritonClient(rs.url("grpc"), sequence_id=7000 + i, shared_memory=False)
        client.set_kvcache(*kv)
        client.set_inference_params(11, 1, infer_steps=STEPS, output_format="png")
        seed = 300 + i
        image = base64.b64decode(client.generate(seed=seed, target_shape=SIZE))
        chats.append((client, seed, [image], replica_of(rs, client.sequence_id)))
    return chats


REFUSED_STREAM = "RST_STREAM with error code 7"  # HTTP/2 REFUSED_STREAM: the router took it to a dead replica


def load(rs: ReplicaSet, stop: threading.Event, crashed_at: list[float], out: list[Outcome]) -> None:
    client = grpcclient.InferenceServerClient(rs.url("grpc"))
    while not stop.is_set():
        start = time.monotonic()
        error = None
        for attempt in range(2):
            try:
                client.infer("neopp_dense", plain_inputs(LOAD_STEPS, seed=1), client_timeout=120)
                error = None
                break
            except InferenceServerException as exc:
                error = f"{exc.status()}: {exc.message()[:120]}"
                if attempt or REFUSED_STREAM not in error:
                    break  # a refused stream was never processed: gRPC clients send it once more
        end = time.monotonic()
        zero = crashed_at[0] if crashed_at else float("inf")
        out.append(Outcome(start - zero, end - zero, error))
    client.close()


def drill(rs: ReplicaSet, chats: int = 6, clients: int = 3, before_s: float = 2.0, after_s: float = 5.0,
          turns: int = 3) -> Drill:
    """Open chats, load, crash the replica holding the first chat mid-load, then finish every chat."""
    result = Drill(chats=chats)
    opened = open_chats(rs, chats)
    victim = opened[0][3]
    stop, crashed_at, outcomes = threading.Event(), [], []
    threads = [threading.Thread(target=load, args=(rs, stop, crashed_at, outcomes)) for _ in range(clients)]
    for t in threads:
        t.start()
    time.sleep(before_s)
    rs.crash(victim)
    crashed_at.append(time.monotonic())  # after the kill: a request sent before it counts as in flight
    deadline = time.monotonic() + 30
    while result.down_after_s is None and time.monotonic() < deadline:
        if f"r{victim} is DOWN" in (rs.workdir / "router.log").read_text(errors="replace"):
            result.down_after_s = time.monotonic() - crashed_at[0]
        time.sleep(0.05)
    time.sleep(max(0.0, after_s - (time.monotonic() - crashed_at[0])))
    stop.set()
    for t in threads:
        t.join()
    for o in outcomes:  # requests that started before the crash was known to the threads
        if o.start == -float("inf"):
            o.start = -1.0
    result.outcomes = outcomes
    survivor = rs.running[1 - victim].replica
    for client, seed, images, replica in opened:
        for _ in range(turns - 1):
            images.append(base64.b64decode(client.generate(target_shape=SIZE)))
        client.close()
        result.chats_moved += replica == victim
        reference = reference_chat(f"{survivor.host}:{survivor.grpc_port}", seed, turns)
        result.chats_exact += images == reference
        result.detail.append((replica, [a == b for a, b in zip(images, reference)], client.stateless))
    return result


def run(args: argparse.Namespace) -> str:
    drills = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            rs = ReplicaSet(Path(tmp), 2, MODELS, env=ENV).start()
            try:
                drills.append(drill(rs))
            finally:
                rs.stop()
    rows = ["| drill | requests | failed, in flight at the crash | failed, sent after it | router took the replica "
            "out after s | first answer sent after the crash, s | chats moved / exact of all |",
            "|---|---|---|---|---|---|---|"]
    for i, d in enumerate(drills):
        rows.append(f"| {i + 1} | {len(d.outcomes)} | {len(d.in_flight_failed)} | {len(d.lost_after)} | "
                    f"{d.down_after_s:.2f} | {d.first_success_s:.2f} | {d.chats_moved} / {d.chats_exact} of "
                    f"{d.chats} |")
    down = stats([d.down_after_s for d in drills])
    errors = sorted({o.error.split(":")[0] for d in drills for o in d.in_flight_failed})
    return (f"Two replicas of the demo model (neopp_dense, neopp_session) behind HAProxy with the cluster's rules; "
            f"3 clients sending plain {SIZE[0]}x{SIZE[1]} {LOAD_STEPS}-step generations without pause; one "
            f"replica's tritonserver killed 2 s in; 6 chats of 3 turns ({STEPS} steps) opened before and "
            "finished after. \"Exact\": every image of the chat equals the same chat run statelessly on the "
            "survivor.\n\n" + "\n".join(rows) + "\n\n"
            f"The router took the replica out {down[0]:.2f} s (median; {down[1]:.2f}-{down[2]:.2f}) after the "
            f"crash; the requests that failed were running on it when it died, with {', '.join(errors) or 'none'}.")


def main(argv: list[str] | None = None) -> Path:
    return section_main(argv, __doc__, "failover.md", "Replicas: a crash under load", run, repeats=3)


if __name__ == "__main__":
    main()
