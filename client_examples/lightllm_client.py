"""A drop-in for the in-process NeoPP runner that LightLLM's image server calls, over Triton gRPC.

LightLLM calls ``set_kvcache(cond, uncond)`` (image editing: ``set_kvcache_i2i(cond, text_uncond,
img_uncond)``), ``set_inference_params(...)`` and
``generate(seed=None, save_result_path="", target_shape=[h, w])`` (base64 image back).
This class offers the same calls against the Triton server, in one of two ways:

* ``NeoPPTritonClient(url)`` (default): through ``neopp_session``. One client object is one
  chat session = one Triton ``sequence_id``; its first image starts the sequence, and the
  server keeps the session's random stream. ``end_session()`` frees it on the server. The first
  answer carries the session's ``SESSION_TOKEN``; the client sends it with every later turn and
  the close, so that no other client can take, end or restart its session.
* ``NeoPPTritonClient(url, stateless=True, model="neopp_dense")``: straight to a generation
  model. The client keeps the stream itself (the last ``NEXT_RNG_STATE``, sent back as
  ``RNG_STATE``), so any server replica can take any turn.

Behind a load balancer with several replicas, every session request carries the header
``neopp-session: <sequence_id>``, which the balancer hashes so that all turns of a chat reach the
replica holding it (docs/scale-out.md). When that replica is gone, a turn that failed UNAVAILABLE
is sent once more; once a server answers that it does not hold the session (NOT_FOUND, unknown
session), the client says so and continues the chat statelessly from the last
``NEXT_RNG_STATE``, through the session's generation model: the same images, byte for byte.

KV tensors (tens of MB) go through system shared memory when the server is on this host
(a loopback URL; ``shared_memory=True/False`` forces a choice), over the wire otherwise,
as raw bf16 bytes spliced into the serialized request (one copy of the KV on the client, where
tritonclient copies it three times; ``raw_bf16=False`` uses tritonclient's own, much slower,
BF16 encoder).
Registering a shared-memory region needs the server's operator key (``admin_key=``,
``$NEOPP_ADMIN_KEY`` or ``--admin-key-file``; sent as a header on register/unregister only);
without it the registration is refused, and the client says so once and sends the KV over
the wire instead. Both ways, and both transports, give the same image bytes. The shared memory segment is
POSIX shm created with the standard library (``tritonclient.utils.shared_memory`` needs
``pkg_resources``, which recent setuptools no longer ships); Triton opens it by key.

Run as a script, it plays three turns of a chat from KV files (see ``--help``).
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import tritonclient.grpc as grpcclient
from kv_transport import KVSharedMemory, SplicedInfer, as_bf16, refused_for_key, set_bf16
from tritonclient.utils import InferenceServerException

DEMO = """Three turns of one chat from KV files, as LightLLM's image server drives them: the first
seeded, the next two continuing the session's random stream on the server. A request the
server refuses is one line on stderr (status and message) and exit code 1.

example (after `make serve`, from the repository root):
  python client_examples/lightllm_client.py --url localhost:8001 \\
    --cond-kv demo/checkpoints/dense/sample_kv/cond_kv.pt --uncond-kv demo/checkpoints/dense/sample_kv/uncond_kv.pt \\
    --offsets 11 1 --size 256 256 --admin-key-file build/admin.key
"""
START_FLAG_MISSING = "must specify the START flag"  # Triton: the sequence has no slot (any more)
ROUTE_HEADER = "neopp-session"  # what a load balancer hashes: a chat's turns go to one replica
QUEUE_FULL = "Exceeds maximum queue size"  # UNAVAILABLE from a live replica that is busy: not a lost session
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")
SAMPLING_INPUTS = {"cfg_scale": ("CFG_SCALE", np.float32), "timestep_shift": ("TIMESTEP_SHIFT", np.float32),
                   "infer_steps": ("STEPS", np.int64), "cfg_interval": ("CFG_INTERVAL", np.float32),
                   "resize": ("RESIZE", np.int64), "image_guidance_scale": ("IMAGE_GUIDANCE_SCALE", np.float32)}
STRING_INPUTS = {"cfg_norm": "CFG_NORM", "output_format": "OUTPUT_FORMAT", "task": "TASK"}
KEY_ENV = "NEOPP_ADMIN_KEY"
API_KEY_ENV = "NEOPP_API_KEY"
GRPC_API_HEADER = "triton-grpc-protocol-authorization"  # Authorization, as Triton's gRPC reads a restricted header


class NeoPPTritonClient:
    """LightLLM's runner calls, served by Triton (see the module docstring)."""

    def __init__(self, url: str = "localhost:8001", model: str | None = None, stateless: bool = False,
                 sequence_id: int | None = None, shared_memory: bool | None = None, default_seed: int = 0,
                 generation_model: str | None = None, timeout_s: float = 600.0, raw_bf16: bool = True,
                 splice_kv: bool = True, admin_key: str | None = None, api_key: str | None = None) -> None:
        """``admin_key`` (default ``$NEOPP_ADMIN_KEY``) is needed only to register shared memory;
        ``api_key`` (default ``$NEOPP_API_KEY``) by a server that wants it for inference (one
        beyond loopback)."""
        self.url, self.stateless = url, stateless
        self.admin_key = admin_key or os.environ.get(KEY_ENV, "").strip() or None
        api_key = api_key or os.environ.get(API_KEY_ENV, "").strip() or None
        self.api_headers = {GRPC_API_HEADER: f"Bearer {api_key}"} if api_key else {}
        self.model = model or ("neopp_dense" if stateless else "neopp_session")
        self._session_mode, self._session_model = not stateless, self.model
        self.generation_model = generation_model  # session mode: MODEL input (None: the server's default)
        self.client = grpcclient.InferenceServerClient(url)
        self._wire: SplicedInfer | None = None  # opened on the first wire request with raw bf16
        host = url.rsplit(":", 1)[0]
        self.use_shm = host in LOCAL_HOSTS or host.startswith("127.") if shared_memory is None else shared_memory
        self.sequence_id = sequence_id if sequence_id is not None else uuid.uuid4().int % (2**63 - 1) + 1
        self.default_seed, self.timeout_s, self.raw_bf16 = default_seed, timeout_s, raw_bf16
        self.splice_kv = splice_kv  # False: tritonclient builds the wire request (kept for comparison)
        self.started = False  # session mode: has the sequence been started on the server?
        self.session_token: bytes | None = None  # its owner's proof, from the first answer
        self.rng_state: np.ndarray | None = None  # stateless mode: the stream to continue
        self.last_turn: int | None = None
        self._kv: list[torch.Tensor] = []
        self._kv_names: list[str] = []  # the input each entry of _kv is sent as
        self._shm: KVSharedMemory | None = None
        self._params: dict[str, Any] = {}

    # ------------------------------------------------------------------ LightLLM's calls

    def set_kvcache(self, cond: Any, uncond: Any = None) -> None:
        """Prefixes in the online layout [layers, 2, seq, kv_heads, head_dim] (torch or numpy)."""
        self.set_kvcache_i2i(cond, uncond)

    def set_kvcache_i2i(self, cond: Any, text_uncond: Any = None, img_uncond: Any = None) -> None:
        """Image editing: prompt + images, the empty prompt, and the images without the prompt."""
        given = (("COND_KV", cond), ("UNCOND_KV", text_uncond), ("IMAGE_KV", img_uncond))
        self._kv_names = [name for name, kv in given if kv is not None]
        self._kv = [as_bf16(kv) for _, kv in given if kv is not None]
        if not self.use_shm:
            return
        if self._shm is not None and self._shm.fits(self._kv):
            self._shm.write(self._kv)  # reuse the registered segment
        else:
            self._release_shm()
            self._shm = self._register_shm()

    def _register_shm(self) -> KVSharedMemory | None:
        """A registered segment, or None (KV over the wire from now on) when the server wants a key."""
        try:
            return KVSharedMemory(self.client, self._kv, self.admin_key)
        except InferenceServerException as exc:
            if not refused_for_key(exc):
                raise
        self.use_shm = False
        why = "with this key" if self.admin_key else f"without the operator key (${KEY_ENV} or --admin-key-file)"
        print(f"neopp client: shared-memory registration refused {why}; sending the KV over the wire",
              file=sys.stderr)
        return None

    def set_inference_params(self, index_offset_cond: int, index_offset_uncond: int | None = None,
                             cfg_interval: Sequence[float] | None = None, cfg_scale: float | None = None,
                             cfg_norm: str | None = None, timestep_shift: float | None = None,
                             infer_steps: int | None = None, output_format: str | None = None,
                             enable_cfg: bool | None = None, resize: Sequence[int] | None = None,
                             task: str | None = None, image_guidance_scale: float | None = None,
                             index_offset_image: int | None = None, **unknown: Any) -> None:
        """Offsets and overrides of the following turns; what is left out keeps the server's mode values.

        Every value is sent or refused, never dropped: an unknown name raises ValueError.
        """
        if unknown:
            raise ValueError(f"{sorted(unknown)[0]}: unknown inference parameter; this client sends "
                             f"{sorted(SAMPLING_INPUTS) + sorted(STRING_INPUTS) + ['enable_cfg']}")
        if enable_cfg is False:
            if image_guidance_scale is not None and image_guidance_scale != 1.0:  # the server's own wording
                raise ValueError(f"image_guidance_scale: {image_guidance_scale:g} refused; guidance is disabled "
                                 "(enable_cfg false, e.g. the 8-step mode), only 1.0 is accepted")
            cfg_scale = 1.0  # no step uses guidance; the uncond prefix is then not needed
        given = dict(cfg_interval=cfg_interval, cfg_scale=cfg_scale, cfg_norm=cfg_norm, timestep_shift=timestep_shift,
                     infer_steps=infer_steps, output_format=output_format, resize=resize, task=task,
                     image_guidance_scale=image_guidance_scale)
        self._params = {"index_offset_cond": int(index_offset_cond),
                        "index_offset_uncond": None if index_offset_uncond is None else int(index_offset_uncond),
                        "index_offset_image": None if index_offset_image is None else int(index_offset_image),
                        **{k: v for k, v in given.items() if v is not None}}

    def generate(self, seed: int | None = None, save_result_path: str = "", target_shape: Sequence[int] | None = None,
                 size: Sequence[int] | None = None) -> str:
        """One image, base64-encoded. A seed restarts the stream; None continues it."""
        if not self._kv or "index_offset_cond" not in self._params:
            raise ValueError("call set_kvcache and set_inference_params before generate")
        size = size if size is not None else target_shape
        inputs = self._inputs(size)
        if self.stateless:
            data = self._generate_stateless(inputs, seed)
        else:
            data = self._generate_session(inputs, seed)
        if save_result_path:  # its folder is made, as for any image file this project writes
            Path(save_result_path).parent.mkdir(parents=True, exist_ok=True)
            Path(save_result_path).write_bytes(data)
        return base64.b64encode(data).decode("ascii")

    # ------------------------------------------------------------------ sessions

    def end_session(self) -> None:
        """Free the session on the server (a sequence_end request without an image)."""
        if self.stateless or not self.started:
            return
        self.client.infer(self.model, self._token(), sequence_id=self.sequence_id, sequence_end=True,
                          client_timeout=self.timeout_s, headers={ROUTE_HEADER: str(self.sequence_id),
                                                                  **self.api_headers})
        self.started, self.session_token = False, None

    def new_session(self, sequence_id: int | None = None) -> None:
        """Start over as a new chat (the next image starts a new sequence / stream)."""
        self.end_session()
        self.sequence_id = sequence_id if sequence_id is not None else uuid.uuid4().int % (2**63 - 1) + 1
        self.rng_state, self.last_turn = None, None
        if self._session_mode:  # a chat that went on statelessly leaves the next one a session again
            self.stateless, self.model = False, self._session_model

    def close(self) -> None:
        try:
            self.end_session()
        finally:
            self._release_shm()
            if self._wire is not None:
                self._wire.close()
            self.client.close()

    def __enter__(self) -> NeoPPTritonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _generate_session(self, base: list[grpcclient.InferInput], seed: int | None) -> bytes:
        try:
            return self._session_turn(list(base), seed)
        except InferenceServerException as exc:
            if not (self.started and self.rng_state is not None):
                raise
            lost = exc
        if unavailable(lost):  # its replica died mid-turn, or is busy reloading: once more, through the router
            try:
                return self._session_turn(list(base), seed)
            except InferenceServerException as exc:
                lost = exc
        if not session_unknown(lost):
            raise lost
        print(f"neopp client: session {self.sequence_id} is gone ({lost.status()}: {lost.message()[:160]}); "
              "continuing its stream statelessly", file=sys.stderr)
        # The chat's stream is the last NEXT_RNG_STATE this client received: continuing it through the
        # session's generation model gives the images the session would have given.
        self.model = self.generation_model or self._session_default_model()
        self.stateless, self.started, self.session_token = True, False, None
        return self._generate_stateless(base, seed)

    def _session_default_model(self) -> str:
        """The generation model a session turn without MODEL uses (neopp_session's default_model)."""
        try:
            config = self.client.get_model_config(self.model, as_json=True)["config"]
            return config["parameters"]["default_model"]["string_value"]
        except (InferenceServerException, KeyError):
            return "neopp_dense"  # the shipped default

    def _session_turn(self, inputs: list[grpcclient.InferInput], seed: int | None) -> bytes:
        if seed is not None:
            inputs.append(_tensor("SEED", np.array([seed], np.int64)))
        if self.generation_model:
            inputs.append(_tensor("MODEL", np.array([self.generation_model.encode()], np.object_)))
        inputs += self._token()
        try:
            result = self._infer(inputs, sequence_id=self.sequence_id, sequence_start=not self.started)
        except InferenceServerException as exc:
            if not (self.started and START_FLAG_MISSING in exc.message()):
                raise
            # Triton freed the sequence's slot (a sequence_end this session refused, or its idle
            # bound): a START with the session's token continues the session where it was
            result = self._infer(inputs, sequence_id=self.sequence_id, sequence_start=True)
        self.started = True
        self.session_token = bytes(result.as_numpy("SESSION_TOKEN")[0])
        self.last_turn = int(result.as_numpy("TURN")[0])
        self.rng_state = result.as_numpy("NEXT_RNG_STATE")
        return bytes(result.as_numpy("IMAGE")[0])

    def _token(self) -> list[grpcclient.InferInput]:
        """The session's token, for every turn after the first (none before it)."""
        if not self.started or not self.session_token:
            return []
        return [_tensor("SESSION_TOKEN", np.array([self.session_token], np.object_))]

    def _generate_stateless(self, inputs: list[grpcclient.InferInput], seed: int | None) -> bytes:
        if seed is None and self.rng_state is None:
            seed = self.default_seed  # as neopp_session does for a first turn without a seed
        if seed is not None:
            inputs.append(_tensor("SEED", np.array([seed], np.int64)))
        else:
            inputs.append(_tensor("RNG_STATE", self.rng_state))
        result = self._infer(inputs)
        self.rng_state = result.as_numpy("NEXT_RNG_STATE")  # kept only once an image came back
        self.last_turn = 0 if self.last_turn is None or seed is not None else self.last_turn + 1
        return bytes(result.as_numpy("IMAGE")[0])

    def _spliced(self) -> bool:
        """KV over the wire as raw bf16: spliced into the serialized request by SplicedInfer."""
        return self._shm is None and self.raw_bf16 and self.splice_kv

    def _infer(self, inputs: list[grpcclient.InferInput], sequence_id: int = 0,
               sequence_start: bool = False) -> grpcclient.InferResult:
        headers = {**({ROUTE_HEADER: str(sequence_id)} if sequence_id else {}), **self.api_headers} or None
        if not self._spliced():
            return self.client.infer(self.model, inputs, sequence_id=sequence_id, sequence_start=sequence_start,
                                     client_timeout=self.timeout_s, headers=headers)
        if self._wire is None:
            self._wire = SplicedInfer(self.url)
        return self._wire.infer(self.model, inputs, self._kv, sequence_id, sequence_start, self.timeout_s, headers)

    def _inputs(self, size: Sequence[int] | None) -> list[grpcclient.InferInput]:
        p = self._params
        inputs = []
        for i, (name, kv) in enumerate(zip(self._kv_names, self._kv)):
            tensor = grpcclient.InferInput(name, list(kv.shape), "BF16")
            if self._shm is not None:
                self._shm.attach(tensor, i)
            elif not self._spliced():
                set_bf16(tensor, kv, self.raw_bf16)
            inputs.append(tensor)
        inputs.append(_tensor("INDEX_OFFSET_COND", np.array([p["index_offset_cond"]], np.int64)))
        for branch in ("uncond", "image"):
            offset, has_kv = p[f"index_offset_{branch}"], f"{branch.upper()}_KV" in self._kv_names
            if offset is None and has_kv:
                raise ValueError(f"index_offset_{branch} is required with an {branch} KV")
            # LightLLM passes the uncond offset even when it sends no uncond KV (guidance off); an
            # image offset without the image KV is sent, so the server refuses it by name.
            if offset is not None and (has_kv or branch == "image"):
                inputs.append(_tensor(f"INDEX_OFFSET_{branch.upper()}", np.array([offset], np.int64)))
        if size is not None:
            inputs.append(_tensor("SIZE", np.array([int(v) for v in size], np.int64)))
        for key, (name, dtype) in SAMPLING_INPUTS.items():
            if key in p:
                inputs.append(_tensor(name, np.array(p[key] if key in ("cfg_interval", "resize") else [p[key]], dtype)))
        for key, name in STRING_INPUTS.items():
            if key in p:
                inputs.append(_tensor(name, np.array([str(p[key]).encode()], np.object_)))
        return inputs

    def _release_shm(self) -> None:
        if self._shm is not None:
            shm, self._shm = self._shm, None
            shm.close()


def _tensor(name: str, arr: np.ndarray) -> grpcclient.InferInput:
    dtype = {np.dtype(np.int64): "INT64", np.dtype(np.float32): "FP32", np.dtype(np.uint8): "UINT8",
             np.dtype(np.object_): "BYTES"}[arr.dtype]
    tensor = grpcclient.InferInput(name, list(arr.shape), dtype)
    tensor.set_data_from_numpy(arr)
    return tensor


def unavailable(exc: InferenceServerException) -> bool:
    """UNAVAILABLE, but not a full queue (a busy replica that still holds the session)."""
    return str(exc.status() or "").endswith("UNAVAILABLE") and QUEUE_FULL not in exc.message()


def session_unknown(exc: InferenceServerException) -> bool:
    """The server says it does not hold the session (its replica is gone, or it expired)."""
    return str(exc.status() or "").endswith("NOT_FOUND") and "unknown session" in exc.message()


def main(argv: Sequence[str] | None = None) -> int:
    """Three turns (seed, then continued) from KV files, as LightLLM would drive them."""
    parser = argparse.ArgumentParser(description=DEMO, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="the server's gRPC address (default: the one NEOPP_URL's server names, "
                                      "else localhost:8001)")
    parser.add_argument("--stateless", action="store_true", help="call a generation model directly")
    parser.add_argument("--model", help="neopp_session (default) or, with --stateless, a generation model")
    parser.add_argument("--cond-kv", required=True, help="replay-layout KV file (.pt/.safetensors)")
    parser.add_argument("--uncond-kv")
    parser.add_argument("--offsets", type=int, nargs=2, required=True, metavar=("COND", "UNCOND"))
    parser.add_argument("--seeds", nargs="+", default=["200", "none", "none"], help="one per turn; none continues")
    parser.add_argument("--size", type=int, nargs=2, metavar=("H", "W"),
                        help="default: the model's own (its checkpoint's, 256x256 for the demo)")
    parser.add_argument("--out-prefix", default="lightllm_turn")
    parser.add_argument("--admin-key-file", help=f"operator key for shared memory (default ${KEY_ENV})")
    args = parser.parse_args(argv)
    from t2i_common import GRPC_URL, run_client  # beside this file: found when it runs as a script

    args.url = args.url or GRPC_URL

    from neopp.model.kv_cache import load_kv_file  # the project's loader: weights_only, either layout

    return run_client(lambda: _demo(args, load_kv_file))


def _demo(args: argparse.Namespace, load_kv_file: Any) -> None:
    key = Path(args.admin_key_file).read_text().strip() if args.admin_key_file else None
    with NeoPPTritonClient(args.url, model=args.model, stateless=args.stateless, admin_key=key) as client:
        client.set_kvcache(load_kv_file(args.cond_kv), load_kv_file(args.uncond_kv) if args.uncond_kv else None)
        client.set_inference_params(args.offsets[0], args.offsets[1], output_format="png")
        for turn, seed in enumerate(args.seeds):
            path = f"{args.out_prefix}_{turn}.png"
            client.generate(seed=None if seed.lower() == "none" else int(seed), save_result_path=path,
                            target_shape=args.size)
            print(f"{path} turn {client.last_turn}")


if __name__ == "__main__":
    raise SystemExit(main())
