"""The prompt encoder's owner behind a real socket, in one process: prompts that arrive together
are prefilled in one forward and each equals its prefix served alone; a refusal, a cancellation
and a loop that dies each end only what they touch, with the answer a client can act on. Through
Triton the same path is covered by tests/e2e/test_prefill_batch_e2e.py."""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from neopp.contract.inputs import MAX_EDIT_IMAGE_BYTES, MAX_EDIT_IMAGES
from neopp.engines.fault_point import FAULT_ENV, HOLD
from neopp.serving.engine_link import EngineLink
from neopp.serving.prefill_host import PrefillHost
from neopp.serving.prompt_encoding import encode_prompts
from neopp.serving.prompt_parsing import PromptRequest
from neopp.serving.wire import unpack_tensors
from neopp.text.language_tower import LanguageTower
from testing.demo_checkpoint import write_demo_checkpoint
from testing.faults import wait_for
from testing.local_tensors import LocalTensor

TIMEOUT_S = 120
BF16_STEP = 2.0 ** -7  # one bf16 rounding, relative: the most a prefix moves when its forward's sums reorder


@pytest.fixture(scope="module")
def tower(tmp_path_factory: pytest.TempPathFactory) -> LanguageTower:
    return LanguageTower.from_pretrained(write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "ckpt"))


class Served:
    """A host on ``tower`` whose loop a fault file can hold, what it reported, and a link to it."""

    def __init__(self, tower: LanguageTower, fault: Path, max_batch: int = 16) -> None:
        self.fault, self.batches, self.errors = fault, [], []
        self.stopping = threading.Event()
        self.host = PrefillHost(f"prefill_test_{os.getpid()}", tower, max_batch, self.stopping, self.errors.append,
                                self.batches.append)
        self.link = EngineLink(self.host.owner, "prefill_front", "plain")

    def submit(self, prompt: str, negative: str | None = None, cancelled=lambda: False, **extra) -> queue.Queue:
        tensors = [LocalTensor("PROMPT", np.array([prompt.encode()], dtype=np.object_))]
        if negative is not None:
            tensors.append(LocalTensor("NEGATIVE_PROMPT", np.array([negative.encode()], dtype=np.object_)))
        tensors += [LocalTensor(name, value) for name, value in extra.items()]
        answer: queue.Queue = queue.Queue()
        self.link.submit(tensors, None, lambda header, blobs: answer.put((header, blobs)), cancelled, True)
        return answer

    def close(self) -> None:
        self.link.close()
        self.host.close()


@pytest.fixture()
def served(tower, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, str(tmp_path / "fault"))
    handle = Served(tower, tmp_path / "fault")
    yield handle
    handle.close()


def outcome(answer: queue.Queue) -> tuple[dict, dict]:
    header, blobs = answer.get(timeout=TIMEOUT_S)
    if header["type"] != "final":
        return header, {}
    return header, unpack_tensors(header["tensors"], blobs, [], 1 << 30)


def held_together(served: Served, requests: list[tuple]) -> list[queue.Queue]:
    """``requests`` queued behind a held loop, then let go at once."""
    served.fault.write_text(HOLD)
    answers = [served.submit(*args) for args in requests]
    wait_for(lambda: served.host.held() == len(requests), TIMEOUT_S, poll=0.01)
    served.fault.unlink()
    return answers


def assert_same_prefixes(got: dict, solo: dict) -> None:
    assert set(got) == set(solo)
    for name, value in solo.items():
        if isinstance(value, torch.Tensor):
            assert got[name].dtype == torch.bfloat16 and got[name].shape == value.shape
            scale = value.float().abs().max().item()
            assert (got[name].float() - value.float()).abs().max().item() <= BF16_STEP * scale, name
        else:
            assert np.array_equal(got[name], value), name


def test_prompts_that_arrive_together_share_one_forward_each_as_served_alone(served, tower):
    requests = [("a red circle",), ("a blue square on the left",), ("a green triangle", "red"),
                ("a red dragon",), ("a circle at the top",)]
    answers = held_together(served, requests)
    results = [outcome(a) for a in answers]
    refused, message = results[3][0], results[3][0].get("message", "")
    assert refused["type"] == "error" and refused["status"] == "INVALID_ARG"
    assert "unknown words ['dragon']" in message  # refused alone, at its tokenizing
    assert served.batches == [5]  # four prompts and one negative prompt, one forward
    for (prompt, *negative), (header, got) in zip(requests, results, strict=True):
        if prompt != "a red dragon":
            assert header["type"] == "final"
            assert_same_prefixes(got, encode_prompts(tower, PromptRequest(prompt, *negative)))
    assert served.host.held() == 0 and served.host.failure() is None


def test_the_batch_is_bounded_and_the_rest_wait_their_turn(tower, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, str(tmp_path / "fault"))
    small = Served(tower, tmp_path / "fault", max_batch=2)
    try:
        prompts = ["a red circle", "a blue circle", "a green circle", "a red square", "a blue square"]
        answers = held_together(small, [(prompt,) for prompt in prompts])
        assert all(outcome(a)[0]["type"] == "final" for a in answers)
        assert small.batches == [2, 2, 1]
    finally:
        small.close()


def test_a_cancelled_request_ends_alone_and_its_neighbours_are_served(served):
    gone = threading.Event()
    served.fault.write_text(HOLD)
    answers = [served.submit("a red circle", None, gone.is_set), served.submit("a blue circle")]
    wait_for(lambda: served.host.held() == 2, TIMEOUT_S, poll=0.01)
    gone.set()  # its client leaves while it waits: the link's watcher tells the host
    wait_for(lambda: any(job.cancelled() for job in list(served.host._waiting)), TIMEOUT_S, poll=0.01)
    served.fault.unlink()
    first, second = outcome(answers[0])[0], outcome(answers[1])[0]
    assert first["type"] == "error" and first["status"] == "CANCELLED"
    assert second["type"] == "final"
    assert served.batches == [1]


def test_an_oversized_request_is_refused_naming_its_input(served):
    pictures = np.array([b"x" * MAX_EDIT_IMAGE_BYTES] * (MAX_EDIT_IMAGES + 1), dtype=np.object_)
    header, _ = outcome(served.submit("a red circle", IMAGES=pictures))
    assert header["status"] == "INVALID_ARG" and header["message"].startswith("IMAGES: the request's inputs are over")
    assert outcome(served.submit("a red circle"))[0]["type"] == "final"


def test_a_loop_that_dies_answers_what_it_held_and_refuses_what_comes(served):
    served.fault.write_text("fail")  # the drill: the loop raises at its next take
    held = [served.submit("a red circle"), served.submit("a blue circle")]
    for answer in held:
        header, _ = outcome(answer)
        assert header["status"] == "UNAVAILABLE" and "its prefill loop stopped" in header["message"]
    assert "its prefill loop stopped" in (served.host.failure() or "")
    header, _ = outcome(served.submit("a red circle"))
    assert header["status"] == "UNAVAILABLE"  # at once, until the model is replaced
    assert any("prefill loop stopped" in line for line in served.errors)


def test_one_prompt_asked_together_many_times_is_its_solo_prefix_bit_for_bit(served, tower):
    answers = held_together(served, [("a red circle",)] * 3)
    solo = encode_prompts(tower, PromptRequest("a red circle"))
    for answer in answers:
        got = outcome(answer)[1]
        for name, value in solo.items():
            same = torch.equal if isinstance(value, torch.Tensor) else np.array_equal
            assert same(got[name], value), name
    assert served.batches == [1]  # the prompt once, for all three


@pytest.mark.parametrize("value", ["0", "257", "-1"])
def test_max_prefill_batch_is_bounded_at_load(value):
    from neopp.errors import ConfigError
    from neopp.serving.prompt_encoder_model import max_prefill_batch

    with pytest.raises(ConfigError, match=f"max_prefill_batch: must be 1..256, got {value}"):
        max_prefill_batch({"max_prefill_batch": value})
    assert max_prefill_batch({"max_prefill_batch": "16"}) == 16


def test_a_request_that_arrives_while_the_model_unloads_is_refused_not_left(served):
    assert outcome(served.submit("a red circle"))[0]["type"] == "final"  # the link is connected
    served.host.close()
    header, _ = outcome(served.submit("a blue circle"))
    assert header["status"] == "UNAVAILABLE" and "unloading" in header["message"]
