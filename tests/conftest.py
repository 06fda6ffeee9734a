"""Shared test settings."""
import sys

import pytest

# The shared helpers' asserts (factories.drive, check_outcome, ...) say what failed as a test's do.
pytest.register_assert_rewrite("factories")


@pytest.fixture(autouse=True)
def one_torch_thread():
    """One torch thread per test: the test workers share this machine's two cores, and torch
    with two threads on shared cores can be ten times slower. Tests that never import torch are
    left alone (it is not imported for them)."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
