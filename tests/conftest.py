"""Shared fixtures: deterministic seeds per test, CUDA tests skipped cleanly without a GPU."""

import zlib

import pytest
import torch


def _seed_of(request) -> int:
    # crc32, not hash(): str hashes change from run to run, and a failure must reproduce
    return zlib.crc32(request.node.nodeid.encode())


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
    torch.manual_seed(_seed_of(request))
    yield


@pytest.fixture
def gen(request):
    g = torch.Generator()
    g.manual_seed(_seed_of(request))
    return g
