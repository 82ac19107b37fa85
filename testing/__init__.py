"""Test and load harness: tiny checkpoints, request fuzzing, load generation, fault injection, soak.

Not part of the installed runtime: the tests, ``make soak`` and the benchmarks import it from
the repository root.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
