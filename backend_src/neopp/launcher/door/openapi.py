"""``GET /openapi.json``: an OpenAPI 3.1 document of the door's own routes, made from the route
table itself (so a route cannot be served and left out), with a line for each and the schema of
the bodies a person writes by hand: the OpenAI images requests (a generation's JSON, an edit's
form) and the models list. The edit's schema also types its form's text fields (``openai_edits``)."""

from __future__ import annotations

import re
from typing import Any

from starlette.routing import Route

from ...contract.inputs import EDIT_IMAGE_FORMATS, MAX_EDIT_IMAGE_BYTES, MAX_EDIT_IMAGES
from . import openai_images as oa

SUMMARIES = {
    "/": "The playground: a prompt in, a picture out, in the browser",
    "/favicon.ico": "The playground's icon (SVG)",
    "/status": "Per model: ready, in flight, queued, recent latency, errors apart from refusals, restarts; per "
               "client, its share (HTML, or JSON when asked)",
    "/openapi.json": "The OpenAPI 3.1 document of these routes",
    "/neopp/addresses": "The server's HTTP and gRPC addresses as this client reaches them (JSON): one URL finds both",
    "/v2/models/stats": "Every model's statistics",
    "/metrics": "The door's own counters (Prometheus text); the models' are on Triton's metrics port",
    "/v1/images/generations": "OpenAI's image generation: a prompt in, images out (streamed with 'stream')",
    "/v1/models": "The models that draw, each with what it advertises under 'neopp'",
    "/v1/images/edits": "OpenAI's image editing: pictures and a prompt in (multipart/form-data), images out "
                        "(streamed with 'stream'); a checkpoint that cannot edit refuses it",
    "/v1/images/variations": "Not served: answers, in OpenAI's shape, that edits take a prompt instead",
    "/v2": "Triton's server metadata",
    "/v2/health/live": "Live: the server process answers",
    "/v2/health/ready": "Ready: the launcher knows of nothing broken and Triton is ready",
}
KINDS = (("/infer", "KServe v2 inference (JSON, or JSON with binary tensors)"),
         ("/generate_stream", "Triton's generate extension, streamed as server-sent events"),
         ("/generate", "Triton's generate extension: named inputs as JSON in, outputs as JSON out"),
         ("/ready", "Whether the model is ready"), ("/config", "The model's configuration (operator key)"),
         ("/stats", "The model's statistics"), ("sharedmemory", "Shared-memory regions (operator key)"),
         ("/repository", "Load, unload and list models (operator key)"), ("/trace", "Tracing (operator key)"),
         ("/logging", "Logging (operator key)"))
PARAM = re.compile(r"{([a-z]+)(?::path)?}")

NEOPP_EXTENSION = {
    "type": "object", "description": "What the model can draw (sizes are WxH, as OpenAI's size)",
    "properties": {
        "sizes": {"type": "array", "items": {"type": "string"}, "description": "the trained sizes, offered"},
        "default_size": {"type": "string"}, "default_steps": {"type": "integer"},
        "steps": {"type": "object", "properties": {"min": {"type": "integer"}, "max": {"type": "integer"}}},
        "untrained_sizes": {"type": "boolean", "description": "sizes outside 'sizes' are drawn too"},
        "size_range": {"type": "object", "properties": {"min": {"type": "integer"}, "max": {"type": "integer"},
                                                        "multiple": {"type": "integer"}}}}}
IMAGES_REQUEST = {
    "type": "object", "required": ["prompt"], "additionalProperties": False,
    "properties": {
        "prompt": {"type": "string", "maxLength": oa.MAX_PROMPT},
        "model": {"type": "string", "default": oa.DEFAULT_MODEL},
        "n": {"type": "integer", "minimum": 1, "maximum": oa.MAX_IMAGES},
        "size": {"type": "string", "description": "'auto' or WIDTHxHEIGHT, one the model advertises"},
        "response_format": {"const": "b64_json"}, "output_format": {"enum": list(oa.FORMATS)},
        "stream": {"type": "boolean"}, "partial_images": {"type": "integer", "minimum": 0, "maximum": 3},
        "seed": {"type": "integer", "minimum": 0}, "negative_prompt": {"type": "string"},
        "num_inference_steps": {"type": "integer", "minimum": 1, "description": "at most the model's steps.max"},
        "guidance_scale": {"type": "number", "minimum": 0, "maximum": 100}, "progress": {"type": "boolean"},
        "user": {"type": "string"}, "output_compression": {"type": "integer", "minimum": 0, "maximum": 100},
        "lora": {"type": "string", "maxLength": oa.MAX_LORA_NAME, "description": "an adapter of /v1/models' loras"},
        "lora_scale": {"type": "number", "minimum": -oa.SCALE_MAX_ABS, "maximum": oa.SCALE_MAX_ABS},
        "cache": {"type": "string", "description": "a step-cache method the model offers"},
        "cache_threshold": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "think": {"type": "boolean", "description": "the model reasons before the image (U1 checkpoints); "
                                                    "each image's 'think' holds the reasoning"},
        "think_max_tokens": {"type": "integer", "minimum": 1, "maximum": oa.MAX_THINK_TOKENS},
        "cfg_norm": {"type": "string", "description": "the guidance's renormalisation: global, channel or none"},
        "timestep_shift": {"type": "number", "exclusiveMinimum": 0, "description": "the schedule's time shift"},
        "cfg_interval": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2,
                         "description": "[low, high]: the times guidance runs at"},
        **{key: {"enum": list(values)} for key, values in oa.ACCEPTED_AND_IGNORED.items()}}}
EDIT_REQUEST = {
    "type": "object", "required": ["image", "prompt"], "additionalProperties": False,
    "properties": {
        "image": {"type": "array", "maxItems": MAX_EDIT_IMAGES, "items": {"type": "string", "format": "binary"},
                  "description": f"the pictures, as files: 'image', or 'image[]' once per picture, in the order the "
                                 f"prompt names them; {', '.join(EDIT_IMAGE_FORMATS)}, each at most "
                                 f"{MAX_EDIT_IMAGE_BYTES >> 20} MiB"},
        **IMAGES_REQUEST["properties"],
        "image_guidance_scale": {"type": "number", "minimum": 0, "maximum": 100,
                                 "description": "how closely the result keeps to the pictures (the official "
                                                "img_cfg_scale; 1: no image guidance; default the model's)"}}}
MODELS_LIST = {"type": "object", "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {
    "type": "object", "properties": {"id": {"type": "string"}, "object": {"const": "model"},
                                     "owned_by": {"type": "string"}, "neopp": NEOPP_EXTENSION}}}}}
OPENAI_ERROR = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
    "code": {"type": ["string", "null"]}}}}}


def summary(path: str) -> str:
    if path in SUMMARIES:
        return SUMMARIES[path]
    return next((text for part, text in KINDS if part in path), "Triton's model metadata")


def operation(path: str, method: str) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary(path), "responses": {"200": {"description": "OK"}}}
    names = PARAM.findall(path)
    if names:
        op["parameters"] = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}} for n in names]
    if path.startswith("/v1"):
        op["responses"]["default"] = {"description": "an error in OpenAI's shape",
                                      "content": {"application/json": {"schema": OPENAI_ERROR}}}
    if path == "/v1/images/generations":
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": IMAGES_REQUEST}}}
    if path == "/v1/images/edits":
        op["requestBody"] = {"required": True, "content": {"multipart/form-data": {"schema": EDIT_REQUEST}}}
    if path == "/v1/models":
        op["responses"]["200"]["content"] = {"application/json": {"schema": MODELS_LIST}}
    return op


def document(routes: list[Route]) -> dict[str, Any]:
    """The OpenAPI document of ``routes`` (the catch-all of ``/v1`` left out)."""
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        if not isinstance(route, Route) or ":path}" in route.path:
            continue
        path = route.path
        for method in sorted((route.methods or {"GET"}) - {"HEAD"}):
            paths.setdefault(path, {})[method.lower()] = operation(path, method)
    return {"openapi": "3.1.0",
            "info": {"title": "NeoPP serving: the HTTP door", "version": "1",
                     "description": "The routes of the door in front of Triton: OpenAI's images API, the "
                                    "playground, the status page, and Triton's KServe v2 routes, checked"},
            "paths": paths}


def markdown(doc: dict[str, Any]) -> str:
    """The document as the page in the docs (``docs/openapi.md``), written by ``main``."""
    lines = ["# The door's HTTP routes", "",
             "Written from the door's route table by `python -m neopp.launcher.door.openapi_page` (a test checks it);",
             "a running server serves the same as OpenAPI 3.1 at `/openapi.json`. Model routes also take",
             "`/versions/{version}` after the model.", "", "| route | methods | what |", "|---|---|---|"]
    for path, ops in doc["paths"].items():
        if "/versions/{version}" in path:
            continue
        methods = ", ".join(m.upper() for m in ops)
        lines.append(f"| `{path}` | {methods} | {next(iter(ops.values()))['summary']} |")
    lines += ["", "## `POST /v1/images/generations`", "", "| field | schema |", "|---|---|"]
    body = doc["paths"]["/v1/images/generations"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    for name, schema in body["properties"].items():
        lines.append(f"| `{name}` | {_schema_text(schema)} |")
    lines += ["", "## `POST /v1/images/edits`", "",
              "A form (`multipart/form-data`) with every field of a generation above, as text, and these:", "",
              "| field | schema |", "|---|---|"]
    edit = doc["paths"]["/v1/images/edits"]["post"]["requestBody"]["content"]["multipart/form-data"]["schema"]
    for name, schema in edit["properties"].items():
        if name not in body["properties"]:
            lines.append(f"| `{name}` | {_schema_text(schema)} |")
    lines += ["", "## `GET /v1/models`: the `neopp` object of each model", "", "| field | schema |", "|---|---|"]
    for name, schema in NEOPP_EXTENSION["properties"].items():
        lines.append(f"| `{name}` | {_schema_text(schema)} |")
    return "\n".join(lines) + "\n"


def _schema_text(schema: dict[str, Any]) -> str:
    parts = [f"{k} {v}" for k, v in schema.items() if k not in ("description", "properties", "items")]
    if "description" in schema:
        parts.append(schema["description"])
    if "properties" in schema:
        parts.append("fields " + ", ".join(schema["properties"]))
    return "; ".join(parts).replace("|", "/")
