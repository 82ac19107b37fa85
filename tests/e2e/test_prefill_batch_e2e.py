"""Prompts that arrive together on the prompt encoder's instances are prefilled in one forward,
through the real launcher and tritonserver: the loop is held (the fault drill's hold file) while
four clients' requests reach the tower's owner, then let go. The metrics show one forward of all
their sequences; each answer equals the same prompt served alone (within one bf16 rounding: a
matrix product over more rows may sum in another order); a prompt the tokenizer refuses ends
alone, naming its input, and the model keeps serving."""

from __future__ import annotations

import re
import threading
import urllib.request

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from neopp.engines.fault_point import FAULT_ENV, HOLD
from neopp.ports import LOOPBACK
from testing import REPO
from testing.faults import wait_for
from testing.launched import serving
from testing.model_calls import ModelCalls, text

MODEL = "neopp_prompt_encoder"
DEMO = REPO / "demo" / "checkpoints" / "dense"
OUTPUTS = ("COND_KV", "UNCOND_KV", "INDEX_OFFSET_COND", "INDEX_OFFSET_UNCOND")
BF16_STEP = 2.0 ** -7
# three prompts (one with a negative prompt) and one the demo's words refuse: one per instance
REQUESTS = [("a red circle", None), ("a blue square on the left", "red"), ("a green triangle at the top", None),
            ("a red dragon", None)]
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefill")
    fault = root / "fault"
    # max_restarts: Triton 2.51 can abort while four stubs start on a loaded machine (a starved stub's
    # shared lock, docs/reliability.md); the launcher's restart is the product's answer to that
    with serving(root / "serve.log", {"NEOPP_CHECKPOINT": str(DEMO), FAULT_ENV: str(fault)}, (MODEL,),
                 max_restarts=1) as handle:
        yield handle, fault


def encode(handle, prompt: str, negative: str | None) -> dict:
    calls = ModelCalls(f"{LOOPBACK}:{handle.grpc_port}")
    try:
        extra = {} if negative is None else {"NEGATIVE_PROMPT": text(negative)}
        return calls.infer(MODEL, OUTPUTS, PROMPT=text(prompt), **extra)
    finally:
        calls.close()


def metric(handle, series: str) -> float:
    body = urllib.request.urlopen(f"http://{LOOPBACK}:{handle.metrics_port}/metrics", timeout=10).read().decode()
    found = re.search(rf'^{series}\{{model="{MODEL}"\}} (\S+)$', body, re.M)
    return float(found.group(1)) if found else 0.0


def test_prompts_held_together_share_one_forward_and_each_equals_its_solo_prefix(served):
    handle, fault = served
    solo = {(prompt, negative): encode(handle, prompt, negative) for prompt, negative in REQUESTS[:3]}
    forwards = metric(handle, "neopp_prefill_batch_size_count")
    sequences = metric(handle, "neopp_prefill_batch_size_sum")
    fault.write_text(HOLD)
    answers: dict[int, dict | Exception] = {}

    def one(i: int) -> None:
        try:
            answers[i] = encode(handle, *REQUESTS[i])
        except InferenceServerException as exc:
            answers[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(REQUESTS))]
    try:
        for t in threads:
            t.start()
        # all four wait at the held tower (a prompt is tokenized in the loop, where it is refused)
        wait_for(lambda: metric(handle, "neopp_prefill_requests") == len(REQUESTS), TIMEOUT_S, poll=0.1)
    finally:
        fault.unlink(missing_ok=True)
        for t in threads:
            t.join(timeout=TIMEOUT_S)
    refused = answers[3]
    assert isinstance(refused, InferenceServerException) and refused.status() == "StatusCode.INVALID_ARGUMENT"
    assert "PROMPT: unknown words ['dragon']" in refused.message()
    assert metric(handle, "neopp_prefill_batch_size_count") == forwards + 1  # one forward ...
    assert metric(handle, "neopp_prefill_batch_size_sum") == sequences + 4  # ... of three prompts and one negative
    for i, key in enumerate(REQUESTS[:3]):
        got, want = answers[i], solo[key]
        for name in OUTPUTS:
            assert got[name].shape == want[name].shape, name
            if name.endswith("_KV"):
                scale = np.abs(want[name]).max()
                assert np.abs(got[name] - want[name]).max() <= BF16_STEP * scale, (key, name)
            else:
                assert np.array_equal(got[name], want[name]), (key, name)
    assert metric(handle, "neopp_prefill_requests") == 0
    assert encode(handle, "a red circle", None)["INDEX_OFFSET_COND"][0] > 0  # the model keeps serving
