"""The Makefile's smoke subset names tests that exist: a test renamed or moved fails `make test`
here, not the next person's `make test-quick`."""

from __future__ import annotations

import re

from testing import REPO


def quick_tests() -> list[str]:
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    return re.search(r"^QUICK_TESTS \?=(.*)$", text, re.MULTILINE).group(1).split()


def test_every_quick_test_exists_and_the_subset_spans_units_and_one_server_test():
    names = quick_tests()
    assert len(names) >= 8
    for name in names:
        path, _, test = name.partition("::")
        assert (REPO / path).is_file(), name
        if test:
            assert re.search(rf"^def {re.escape(test)}\(", (REPO / path).read_text(), re.MULTILINE), name
    assert any(n.startswith("tests/e2e/") for n in names) and any(not n.startswith("tests/e2e/") for n in names)
