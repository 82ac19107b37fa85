"""NeoPP: pixel-space flow-matching image generation over a language model's KV prefix."""

__version__ = "0.1.0"
