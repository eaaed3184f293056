"""Shared fixtures: deterministic seeds per test, CUDA tests skipped cleanly without a GPU."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed(request):
    # a fixed seed per test name: failures reproduce, and every test still draws fresh random
    # inputs of its own
    torch.manual_seed(abs(hash(request.node.nodeid)) % (2**31))
    yield


@pytest.fixture
def gen(request):
    g = torch.Generator()
    g.manual_seed(abs(hash(request.node.nodeid)) % (2**31))
    return g
