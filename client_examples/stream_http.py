"""Streamed text-to-image over HTTP: Triton's generate_stream endpoint (server-sent events), the
flags of stream_grpc.py, default URL localhost:8000. JSON has no BF16, so the KV prefixes travel
as COND_KV_B64/UNCOND_KV_B64 (base64 of their raw bfloat16 bytes) and the image and previews come
back as base64 (BASE64_OUTPUT). Previews go to --preview-dir. A refused request is one line on
stderr and exit code 1."""

from __future__ import annotations

import base64
import http.client
import json
from typing import Any

import numpy as np
import torch
from stream_common import save_preview, show_progress, stream_parser
from t2i_common import HTTP_URL, api_headers, request_inputs, run_client, save_result
from tritonclient.utils import InferenceServerException


def json_body(args) -> dict[str, Any]:
    """The request as generate's JSON: one field per input; arrays as lists, one value as itself."""
    body: dict[str, Any] = {"PREVIEW_EVERY": args.preview_every, "BASE64_OUTPUT": 1}
    if args.preview_size:
        body["PREVIEW_SIZE"] = list(args.preview_size)
    for name, array, datatype in request_inputs(args):
        if datatype == "BF16":
            raw = torch.from_numpy(array).to(torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes()
            body[f"{name}_B64"] = base64.b64encode(raw).decode()
        elif datatype == "BYTES":
            body[name] = array[0].decode()
        else:
            values = array.tolist()
            body[name] = values[0] if len(values) == 1 and name != "RNG_STATE" else values
    return body


class FinalEvent:
    """The last event, read like a Triton result (what save_result expects)."""

    def __init__(self, event: dict[str, Any]) -> None:
        self.event = event

    def as_numpy(self, name: str) -> np.ndarray:
        if name == "IMAGE":
            return np.array([base64.b64decode(self.event["IMAGE"])], dtype=np.object_)
        return np.array(self.event[name], dtype=np.uint8)


def events(args, body: dict[str, Any]):
    """Each event's JSON as the server sends it."""
    host, _, port = args.url.rpartition(":")
    conn = http.client.HTTPConnection(host or "localhost", int(port), timeout=args.timeout)
    try:
        conn.request("POST", f"/v2/models/{args.model}/generate_stream", body=json.dumps(body),
                     headers={"Content-Type": "application/json", **(api_headers(grpc=False) or {})})
        resp = conn.getresponse()
        if not (resp.getheader("Content-Type") or "").startswith("text/event-stream"):
            raise InferenceServerException(_error_text(resp.read()), status=str(resp.status))
        while line := resp.readline():
            if line.startswith(b"data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    raise InferenceServerException(event["error"], status=str(resp.status))
                yield event
    finally:
        conn.close()


def _error_text(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:200]


def main() -> None:
    args = stream_parser(__doc__, HTTP_URL, "stream_http.py").parse_args()
    for event in events(args, json_body(args)):
        show_progress(event["STEP"], event["TOTAL_STEPS"])
        if "IMAGE" in event:  # the last step's event carries the image
            save_result(args, FinalEvent(event))
            return
        if "PREVIEW" in event:
            save_preview(args, event["STEP"], base64.b64decode(event["PREVIEW"]))
    raise InferenceServerException("the stream ended without an image")


if __name__ == "__main__":
    raise SystemExit(run_client(main))
