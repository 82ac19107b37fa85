"""Command-line tools that run without a server (KV replay)."""
