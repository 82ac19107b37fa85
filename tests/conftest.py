"""Fixtures that several unit-test modules share (each module opts in; nothing here is autouse)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny tensors run fastest on one thread, and a loaded small machine avoids spin-wait stalls.

    A module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`; the previous
    thread count comes back after the module.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
