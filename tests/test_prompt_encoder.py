"""The prompt encoder's request rules and outputs, without a server: every refusal names its
input; the outputs are the generation models' prefix inputs (BF16 online layout, INT64 offsets)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from neopp.contract.inputs import MAX_EDIT_IMAGE_BYTES, MAX_EDIT_IMAGES, MAX_PROMPT_BYTES
from neopp.errors import ConfigError, InputError
from neopp.serving.parameters import model_allowlist
from neopp.serving.prompt_encoding import encode_prompts
from neopp.serving.prompt_parsing import PromptRequest, parse_prompts
from neopp.serving.t2i_model import chosen_model, default_size
from neopp.text.language_tower import LanguageTower
from neopp.text.tokenizer import TOKENIZER_FILE
from testing.demo_checkpoint import write_demo_checkpoint

REPO = Path(__file__).resolve().parents[1] / "model_repository"


def text(value: bytes | str) -> np.ndarray:
    return np.array([value], dtype=np.object_)


@pytest.fixture(scope="module")
def demo_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "ckpt")


def test_prompts_are_decoded_and_the_negative_defaults_to_empty():
    # passed on as written: a U1 template holds the text byte for byte (the demo drops the spaces itself)
    assert parse_prompts({"PROMPT": text(b"  a red circle ")}) == PromptRequest("  a red circle ", "")
    both = parse_prompts({"PROMPT": text("à gauche".encode()), "NEGATIVE_PROMPT": text(b"blue")})
    assert both == PromptRequest("à gauche", "blue")
    thinking = parse_prompts({"PROMPT": text(b"a"), "THINK": np.array([True]), "THINK_MAX_TOKENS": np.array([9])})
    assert thinking == PromptRequest("a", "", True, 9)
    assert parse_prompts({"PROMPT": text(b"a"), "THINK": np.array([True])}).think_max_tokens == 1024
    files = np.array([b"\x89PNG one", b"RIFF two"], dtype=np.object_)
    assert parse_prompts({"PROMPT": text(b"a"), "IMAGES": files}).images == (b"\x89PNG one", b"RIFF two")


@pytest.mark.parametrize("inputs, message", [
    ({}, "PROMPT: required input is missing"),
    ({"PROMPT": np.array([], dtype=np.object_)}, r"PROMPT: shape must be \[1\] \(one prompt\), got \[0\]"),
    ({"PROMPT": np.array([b"a", b"b"], dtype=np.object_)}, r"PROMPT: shape must be \[1\].*got \[2\]"),
    ({"PROMPT": text(b"\xff\xfe red")}, "PROMPT: must be UTF-8 text"),
    ({"PROMPT": text(b"a"), "NEGATIVE_PROMPT": text(b"\xc3")}, "NEGATIVE_PROMPT: must be UTF-8 text"),
    ({"PROMPT": text(b"a" * (MAX_PROMPT_BYTES + 1))}, f"PROMPT: at most {MAX_PROMPT_BYTES} bytes"),
    ({"PROMPT": np.array([7], dtype=np.int64)}, "PROMPT: must be a BYTES"),
    ({"PROMPT": text(b"a"), "SEED": np.array([1])}, "SEED: unknown input"),
    ({"PROMPT": text(b"a"), "THINK": np.array([1], np.int64)}, r"THINK: must be a BOOL tensor of shape \[1\]"),
    ({"PROMPT": text(b"a"), "THINK": np.array([True, False])}, r"THINK: must be a BOOL tensor of shape \[1\]"),
    ({"PROMPT": text(b"a"), "THINK_MAX_TOKENS": np.array([8], np.int64)}, "THINK_MAX_TOKENS: given without THINK"),
    ({"PROMPT": text(b"a"), "THINK": np.array([False]), "THINK_MAX_TOKENS": np.array([8], np.int64)},
     "THINK_MAX_TOKENS: given without THINK"),
    ({"PROMPT": text(b"a"), "THINK": np.array([True]), "THINK_MAX_TOKENS": np.array([0], np.int64)},
     r"THINK_MAX_TOKENS: must be in 1\.\.4096, got 0"),
    ({"PROMPT": text(b"a"), "THINK": np.array([True]), "THINK_MAX_TOKENS": np.array([8.0], np.float32)},
     "THINK_MAX_TOKENS: must be an INT64 tensor"),
    ({"PROMPT": text(b"a"), "IMAGES": np.array([], dtype=np.object_)}, r"IMAGES: shape must be \[N\] with 1 <= N"),
    ({"PROMPT": text(b"a"), "IMAGES": np.array([b"x"] * (MAX_EDIT_IMAGES + 1), dtype=np.object_)},
     rf"IMAGES: shape must be \[N\] .*got \[{MAX_EDIT_IMAGES + 1}\]"),
    ({"PROMPT": text(b"a"), "IMAGES": np.array([[b"x"]], dtype=np.object_)}, r"IMAGES: shape must be \[N\]"),
    ({"PROMPT": text(b"a"), "IMAGES": np.array([b"x", b""], dtype=np.object_)},
     "IMAGES: picture 2 has 0 bytes; each must have 1 to"),
    ({"PROMPT": text(b"a"), "IMAGES": np.array([b"x" * (MAX_EDIT_IMAGE_BYTES + 1)], dtype=np.object_)},
     f"IMAGES: picture 1 has {MAX_EDIT_IMAGE_BYTES + 1} bytes"),
    ({"PROMPT": text(b"a"), "IMAGES": np.array([3, 4])}, "IMAGES: must be a BYTES"),
])
def test_bad_prompt_inputs_are_refused_naming_the_input(inputs, message):
    with pytest.raises(InputError, match=message):
        parse_prompts(inputs)


def test_outputs_are_the_towers_prefixes_in_bf16_with_int64_offsets(demo_ckpt: Path):
    tower = LanguageTower.from_pretrained(demo_ckpt)
    out = encode_prompts(tower, PromptRequest("a red circle on the left", "blue"))
    cond, offset = tower.conditional("a red circle on the left")
    assert out["COND_KV"].dtype == torch.bfloat16 and out["COND_KV"].is_contiguous()
    assert torch.equal(out["COND_KV"], cond.to(torch.bfloat16))
    assert out["INDEX_OFFSET_COND"].dtype == np.int64 and out["INDEX_OFFSET_COND"].tolist() == [offset] == [7]
    assert list(out["UNCOND_KV"].shape) == [*tower.config.kv_dims[:1], 2, 2, *tower.config.kv_dims[1:]]
    assert out["INDEX_OFFSET_UNCOND"].tolist() == [2]


def test_the_demo_refuses_to_edit_in_words(demo_ckpt: Path):
    tower = LanguageTower.from_pretrained(demo_ckpt)
    with pytest.raises(InputError, match="IMAGES: this checkpoint cannot edit pictures: the demo model has no image"):
        encode_prompts(tower, PromptRequest("a red circle", images=(b"\x89PNG",)))


def test_too_many_words_name_the_input_they_came_from(demo_ckpt: Path):
    tower = LanguageTower.from_pretrained(demo_ckpt)
    with pytest.raises(InputError, match="NEGATIVE_PROMPT: 40 words, at most 31"):
        encode_prompts(tower, PromptRequest("red", "red " * 40))


def test_a_checkpoint_without_tokenizer_has_no_prompt_encoder(demo_ckpt: Path, tmp_path: Path):
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).symlink_to(demo_ckpt / name)
    with pytest.raises(ConfigError, match=f"no {TOKENIZER_FILE}"):
        LanguageTower.from_pretrained(tmp_path)


def test_t2i_model_choice_is_an_allowlist():
    allowed, default = model_allowlist({"allowed_models": "neopp_dense, neopp_moe", "default_model": "neopp_dense"},
                                       REPO / "neopp_t2i")
    assert chosen_model(None, allowed, default) == "neopp_dense"
    assert chosen_model(text(b"neopp_moe"), allowed, default) == "neopp_moe"
    for bad in (b"neopp_session", b"neopp_t2i", b"neopp_prompt_encoder"):
        with pytest.raises(InputError, match=r"MODEL: .* is not a generation model this server offers"):
            chosen_model(text(bad), allowed, default)
    with pytest.raises(InputError, match=r"MODEL: shape must be \[1\]"):
        chosen_model(np.array([], dtype=np.object_), allowed, default)
    with pytest.raises(ConfigError, match="default_model"):
        model_allowlist({"allowed_models": "neopp_moe", "default_model": "neopp_dense"}, REPO / "neopp_t2i")
    # unset: the repository's plain generation models, read from what each folder serves
    allowed, _ = model_allowlist({"allowed_models": "", "default_model": "neopp_dense"}, REPO / "neopp_t2i")
    assert allowed == ("neopp_dense", "neopp_dense_8steps", "neopp_dense_cfg", "neopp_dense_cfg_seq",
                       "neopp_dense_fp8", "neopp_moe", "neopp_moe_cfg")


def test_t2i_default_size_is_checked_at_load():
    assert default_size("256x256").tolist() == [256, 256] and default_size("128X320").tolist() == [128, 320]
    for bad in ("256", "250x256", "0x256", "axb"):
        with pytest.raises(ConfigError, match="default_size"):
            default_size(bad)
