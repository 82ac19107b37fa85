"""Prompt in, picture out on an A3B-shaped checkpoint, through the real launcher and tritonserver:
``neopp_prompt_encoder`` runs an understanding tower whose MLPs route over experts and answers
the prefixes this process's tower computes (itself checked against the float64 reference in
tests/test_a3b_prompt_encoder.py); ``neopp_t2i`` draws on them with ``neopp_moe``, the same
bytes as ``neopp_moe`` given those prefixes directly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from neopp.ports import LOOPBACK
from neopp.text.language_tower import LanguageTower
from testing import tiny_u1
from testing.launched import serving
from testing.model_calls import ModelCalls, text
from tests.reference.u1_prompts import cond_pieces, expected_ids

MODELS = ("neopp_moe", "neopp_prompt_encoder", "neopp_t2i")
PROMPT = "a red cat on the mat — 猫!"
PREFIXES = ("COND_KV", "UNCOND_KV", "INDEX_OFFSET_COND", "INDEX_OFFSET_UNCOND")
SMALL = {"SIZE": np.array([64, 96], np.int64), "STEPS": np.array([2], np.int64), "SEED": np.array([7], np.int64),
         "OUTPUT_FORMAT": np.array([b"png"], np.object_)}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_u1.write_tiny_u1_checkpoint(tmp_path_factory.mktemp("a3b") / "moe", seed=6, a3b=True)


@pytest.fixture(scope="module")
def client(ckpt, tmp_path_factory):
    log = tmp_path_factory.mktemp("a3b-serve") / "serve.log"
    with serving(log, {"NEOPP_CHECKPOINT": str(ckpt)}, MODELS, max_restarts=1,  # as test_prefill_batch_e2e
                 no_traceback=True) as handle:
        calls = ModelCalls(f"{LOOPBACK}:{handle.grpc_port}")
        yield calls
        calls.close()


def test_the_encoder_routes_over_experts_and_t2i_draws_on_its_prefixes(client, ckpt):
    out = client.infer("neopp_prompt_encoder", PREFIXES, PROMPT=text(PROMPT))
    ids = expected_ids(tiny_u1.bare_bpe(), cond_pieces(PROMPT))
    assert out["INDEX_OFFSET_COND"].tolist() == [len(ids)]
    local = LanguageTower.from_pretrained(ckpt).encode_ids(ids)[0]
    got = torch.from_numpy(out["COND_KV"])
    assert got.shape == local.shape
    assert (got - local).abs().max().item() <= 2 ** -8 * local.abs().max().item()  # one bf16 rounding
    image = client.infer("neopp_t2i", ("IMAGE",), PROMPT=text(PROMPT), MODEL=text("neopp_moe"), **SMALL)["IMAGE"][0]
    direct = client.infer("neopp_moe", ("IMAGE",), COND_KV=(out["COND_KV"], "BF16"),
                          UNCOND_KV=(out["UNCOND_KV"], "BF16"), INDEX_OFFSET_COND=out["INDEX_OFFSET_COND"],
                          INDEX_OFFSET_UNCOND=out["INDEX_OFFSET_UNCOND"], **SMALL)["IMAGE"][0]
    assert image[:4] == b"\x89PNG" and image == direct
