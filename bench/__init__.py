"""Benchmarks runnable with `python -m bench.<name>`; each writes its report under bench/."""
