"""The devices the CUDA tests run on (tests/test_cuda.py, test_sage_cuda.py, test_cuda_emu.py).

"cuda": a GPU (marked `cuda`, skipped without one).  "emu": CPU tensors through the CUDA emulator
(marked `cuda_emu`, docs/cuda.md): with the emulation on, flash, flash_varlen, sage and math run the
CUDA kernels of libattn_backends_cuda_emu.so on the CPU, through the usual planner, shim and launcher
table.  Tests take the device as the `dev` fixture (tests/conftest.py), parametrized indirectly."""

import contextlib
import ctypes
import os

import pytest

import attn_backends as ab
from attn_backends import _dispatch, _planner

EMU_LIB = os.path.join(os.path.dirname(ab.__file__), "libattn_backends_cuda_emu.so")

DEVICES = [pytest.param("cuda", marks=pytest.mark.cuda), pytest.param("emu", marks=pytest.mark.cuda_emu)]


def both(gpu_cases, emu_cases, name=str):
    """(dev, case) parameters: the GPU's cases on "cuda", the emulator's (smaller) ones on "emu"."""
    return ([pytest.param("cuda", c, marks=pytest.mark.cuda, id=f"cuda-{name(c)}") for c in gpu_cases]
            + [pytest.param("emu", c, marks=pytest.mark.cuda_emu, id=f"emu-{name(c)}") for c in emu_cases])


def set_emulation(on: bool) -> None:
    ab._C.set_cuda_emulation(on)
    _dispatch.reset_caches()


def emulation_default() -> bool:
    """The process's emulation setting (ATTN_BACKENDS_CUDA_EMULATE, read as the library reads it)."""
    return _planner._env_flag("ATTN_BACKENDS_CUDA_EMULATE")


@contextlib.contextmanager
def cuda_kernels(on=True):
    """The CUDA kernels (flash forward and backward, flash_varlen, sage, math) for CPU tensors: the emulation
    and the opt-in CUDA flash kernels on, both back to the process's settings after; calls the kernels do
    not serve fall back as on a GPU.  A no-op when `on` is false."""
    if not on:
        yield
        return
    set_emulation(True)
    ab._C.enable_cuda_flash(True)
    try:
        yield
    finally:
        ab._C.enable_cuda_flash(_planner._env_flag("ATTN_BACKENDS_CUDA_FLASH"))
        set_emulation(emulation_default())


class Device:
    """dev.type is the torch device type of the test's tensors, dev(t) moves t there."""

    def __init__(self, name: str):
        self.name = name
        self.emulated = name == "emu"
        self.type = "cpu" if self.emulated else "cuda"

    def __call__(self, t):
        return t.to(self.type)

    @contextlib.contextmanager
    def off(self):
        """The CPU kernels for a while (a no-op on a GPU, whose tests compare against the CPU anyway)."""
        if not self.emulated:
            yield
            return
        set_emulation(False)
        try:
            yield
        finally:
            set_emulation(True)


def emulator():
    """The emulator's library (ctypes; the same instance the core loaded): its launch log, device."""
    lib = ctypes.CDLL(EMU_LIB)
    lib.ab_cuda_emu_launch_log.restype = ctypes.c_char_p
    lib.ab_cuda_emu_launch_blocks.restype = ctypes.c_char_p
    lib.ab_cuda_emu_device_cc.restype = ctypes.c_int
    lib.ab_cuda_emu_set_device_cc.argtypes = [ctypes.c_int]
    lib.ab_cuda_emu_set_seed.argtypes = [ctypes.c_uint64]
    lib.ab_cuda_emu_selftest.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int]
    return lib


def _counts(lines: bytes) -> dict:
    """{label: n} of the emulator's "label\tn" lines."""
    return {label: int(n) for label, n in (line.rsplit("\t", 1) for line in lines.decode().splitlines())}


def launched(lib) -> dict:
    """{kernel label: launches} since the last lib.ab_cuda_emu_reset_launch_log()."""
    return _counts(lib.ab_cuda_emu_launch_log())


def launched_blocks(lib) -> dict:
    """{kernel label: blocks of all its launches} since the last lib.ab_cuda_emu_reset_launch_log()."""
    return _counts(lib.ab_cuda_emu_launch_blocks())
