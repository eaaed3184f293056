"""Shared fixtures: deterministic seeds per test, CUDA tests skipped cleanly without a GPU (and the
emulated ones without the emulator's library), the device of the CUDA tests (`dev`: a GPU or the CUDA
emulator, tests/cuda_devices.py), the CPU kernel paths (ISAs) this machine can run."""

import os
import zlib

import pytest
import torch
from hypothesis import HealthCheck, settings

from attn_backends import _C
from attn_backends._testing import cpu_isas

import cuda_devices

# property tests (test_properties.py): the same examples on every CI run unless asked otherwise;
# `-m fuzz` selects them alone with the long profile (20x the examples), still seeded
_FUZZ = dict(derandomize=os.environ.get("ATTN_BACKENDS_FUZZ_RANDOM", "0") != "1", deadline=None,
             suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
settings.register_profile("attn_backends", max_examples=int(os.environ.get("ATTN_BACKENDS_FUZZ_EXAMPLES", "100")),
                          **_FUZZ)
settings.register_profile("attn_backends_long",
                          max_examples=int(os.environ.get("ATTN_BACKENDS_FUZZ_EXAMPLES", "2000")), **_FUZZ)
settings.load_profile("attn_backends")


def _seed_of(request) -> int:
    # crc32, not hash(): str hashes change from run to run, and a failure must reproduce; the node id
    # from the tests folder on, so that a run from another folder (.ci/sanitize) draws the same numbers
    path, sep, rest = request.node.nodeid.partition("::")
    if "tests/" in path:
        path = "tests/" + path.rsplit("tests/", 1)[1]
    return zlib.crc32((path + sep + rest).encode())


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda_emu: runs CUDA kernels on the CUDA emulator (CPU tensors)")
    if "fuzz" in (config.getoption("markexpr") or "").replace("not fuzz", ""):
        settings.load_profile("attn_backends_long")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_emu = pytest.mark.skip(reason="the CUDA emulator library is not built (ATTN_BACKENDS_CUDA_EMULATOR=0?)")
    gpu, emu = torch.cuda.is_available(), os.path.exists(cuda_devices.EMU_LIB)
    for item in items:
        if "cuda" in item.keywords and not gpu:
            item.add_marker(skip_gpu)
        elif "cuda_emu" in item.keywords and not emu:
            item.add_marker(skip_emu)


@pytest.fixture
def dev(request):
    # the device of a CUDA test, parametrized indirectly: "cuda" (a GPU) or "emu" (CPU tensors through
    # the CUDA emulator, switched on for the test and back to the process's setting after it)
    device = cuda_devices.Device(request.param)
    if device.emulated:
        cuda_devices.set_emulation(True)
    try:
        yield device
    finally:
        if device.emulated:
            cuda_devices.set_emulation(cuda_devices.emulation_default())


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


@pytest.fixture(params=cpu_isas())
def isa(request):
    # runs the test once on each CPU kernel path this machine has (the emulated AMX tiles included;
    # grid tests give those a reduced grid through indirect parametrization, test_flash_cpu.py)
    # the avx512 param is the vector kernels: on a CPU with AMX, decode on that path takes the amx path's tiles
    # where the caller's environment says ATTN_BACKENDS_DECODE_AMX=1 (csrc/cpu/decode_cpu.c decode_table); the
    # amx and amx_emu params test the tiles
    if request.param == "avx512":
        request.getfixturevalue("monkeypatch").setenv("ATTN_BACKENDS_DECODE_AMX", "0")
    before = _C.cpu_isa()
    assert _C.set_cpu_isa(request.param)
    yield request.param
    _C.set_cpu_isa(before)


@pytest.fixture
def torch_first_path():
    # the CPU kernel path on which auto sends a float32 forward at D >= 128 with no mask to torch SDPA on
    # every CPU (csrc/ab_registry.c, the torch-faster rows): avx2 where the CPU has it, else generic.  On the
    # avx512 path that row does not hold on AMD's family 26 and later (our kernel measured 2x torch there).
    before = _C.cpu_isa()
    path = "avx2" if _C.cpu_isa_supported("avx2") else "generic"
    assert _C.set_cpu_isa(path)
    yield path
    _C.set_cpu_isa(before)


@pytest.fixture
def hf_flash_reload():
    # transformers keeps the flash functions it loaded last (per implementation name) in module
    # globals; a test that wraps ours starts and ends with that cache empty, so it counts its own
    # calls and leaves no wrapper behind for the next test
    fau = pytest.importorskip("transformers.modeling_flash_attention_utils")
    fau._loaded_implementation = None
    yield
    fau._loaded_implementation = None
