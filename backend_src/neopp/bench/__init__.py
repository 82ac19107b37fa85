"""Benchmarks runnable with `python -m neopp.bench.<name>`; each writes its report under bench/."""
