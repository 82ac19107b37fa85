"""KV files of one prompt from the demo's language tower, for the clients that send KV.

``python -m demo.sample_kv`` writes ``cond_kv.pt`` and ``uncond_kv.pt`` (replay layout, what
LightLLM's capture writes) and the same prefixes as ``*.online.safetensors`` next to the demo
checkpoint; their index offsets are the prompt's token count (with ``<bos>``) and 1.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from neopp.model.kv_cache import ONLINE, save_kv_file
from neopp.text.language_tower import LanguageTower

PROMPT = "a red circle on the left on a blue background"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=Path("demo/checkpoints/dense"))
    parser.add_argument("--prompt", default=PROMPT)
    args = parser.parse_args(argv)
    tower = LanguageTower.from_pretrained(args.checkpoint)
    out = args.checkpoint / "sample_kv"
    out.mkdir(exist_ok=True)
    cond, off_c = tower.conditional(args.prompt)
    uncond, off_u = tower.unconditional("")
    for name, kv in (("cond", cond), ("uncond", uncond)):
        save_kv_file(kv.to(torch.bfloat16), out / f"{name}_kv.pt")
        save_kv_file(kv.to(torch.bfloat16), out / f"{name}_kv.online.safetensors", ONLINE)
    (out / "offsets.json").write_text(json.dumps({"prompt": args.prompt, "index_offset_cond": off_c,
                                                  "index_offset_uncond": off_u}) + "\n")
    print(f"wrote {out}: offsets {off_c} (cond), {off_u} (uncond)")


if __name__ == "__main__":
    main()
