"""Build of attn_backends: one abi3 extension module plus an optional CUDA library.

    pip install --no-build-isolation -e .     # torch must already be installed (see README.md)

What gets built:
  attn_backends/_C.abi3.so   C11 core + the C++ torch shim (LibTorch stable ABI, target 2.10),
                             CPython limited API (3.10+).  Loading it registers the torch ops.
  attn_backends/libattn_backends_cuda.so
                             CUDA kernels (static cudart), built when nvcc is found and torch has
                             CUDA; loaded by the core the first time a CUDA tensor arrives.
  attn_backends/libattn_backends_cuda_emu.so
                             the same CUDA sources built with g++ against the CUDA emulator
                             (csrc/cuda/emu), no nvcc needed; loaded under ATTN_BACKENDS_CUDA_EMULATE=1
                             (docs/cuda.md).

Environment:
  ATTN_BACKENDS_CUDA=0|1          skip the CUDA library even if nvcc is found, or build it even for a
                                  CPU-only torch (default: build it when nvcc is found and torch has CUDA)
  ATTN_BACKENDS_CUDA_ARCHS=...    targets, e.g. "80" or "80+PTX;90a" (default "80+PTX;86;89;90a");
                                  "+PTX" also embeds PTX for that arch, so newer GPUs can JIT it
  ATTN_BACKENDS_NVCC_THREADS=N    parallel nvcc (and emulator g++) jobs (default: CPU count)
  ATTN_BACKENDS_CUDA_EMULATOR=0   skip the emulated CUDA library (also skipped in sanitizer builds)
  ATTN_BACKENDS_SANITIZE=address,undefined
                                  build the C/C++ code with those sanitizers (.ci/sanitize runs the
                                  CPU tests against such a build)
  CUDA_HOME                       where to look for bin/nvcc (else PATH)
"""

import os
import platform
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
TORCH_TARGET_VERSION = "0x020a000000000000"  # 2.10: the oldest torch one build must run on
PY_LIMITED_API = "0x030A0000"  # CPython 3.10
DEFAULT_ARCHS = "80+PTX;86;89;90a"
EMU_LIB = "libattn_backends_cuda_emu.so"

C_FLAGS = ["-std=c11", "-D_POSIX_C_SOURCE=200809L", "-O3", "-fvisibility=hidden", "-Wall", "-Wextra", "-Wno-unused-parameter"]
X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
# the per-ISA builds of every CPU kernel family: csrc/cpu/cpu_<isa>.c get that ISA's flags (and FMA
# contraction); each exports one table (csrc/cpu/cpu_kernels.h)
AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"]
ISA_FLAGS = {
    "cpu_generic.c": ["-ffp-contract=fast"],
    "cpu_avx2.c": ["-ffp-contract=fast"] + (["-mavx2", "-mfma", "-mf16c"] if X86 else []),
    "cpu_avx512.c": ["-ffp-contract=fast"] + (AVX512_FLAGS if X86 else []),
    # the AMX tile kernel: real tiles (flags from amx_flags(), probed) and emulated ones (generic flags)
    "cpu_amx.c": ["-ffp-contract=fast"] + (AVX512_FLAGS if X86 else []),
    "cpu_amx_emu.c": ["-ffp-contract=fast"],
}
CXX_FLAGS = ["-std=c++17", "-O3", "-fvisibility=hidden", "-Wall", "-Wno-unused-parameter"]
AMX_FLAGS = ["-mamx-tile", "-mamx-bf16", "-mamx-int8"]
# tdpfp16ps from inline assembly, where the compiler has no -mamx-fp16 (gcc 12) but the assembler
# knows the instruction (GNU as >= 2.40)
AMX_FP16_ASM_PROBE = 'void f(void) { __asm__ volatile("{tdpfp16ps %%tmm2, %%tmm1, %%tmm0|tdpfp16ps %%tmm0, %%tmm1, %%tmm2}" ::); }\n'


def compiles(cc, flags, code):
    """Whether the C compiler cc accepts flags and code (a probe of the toolchain)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "probe.c"
        src.write_text(code)
        res = subprocess.run([cc, *flags, "-c", str(src), "-o", str(Path(d) / "probe.o")], capture_output=True)
        return res.returncode == 0


def amx_flags(cc):
    """Flags for csrc/cpu/cpu_amx.c: AMX where the toolchain has it (else the file builds an
    empty table and the amx path reports that it was not built), AMX-FP16 by flag or by assembler."""
    if not X86 or not compiles(cc, AMX_FLAGS, "int x;\n"):
        return []
    if compiles(cc, AMX_FLAGS + ["-mamx-fp16"], "int x;\n"):
        return AMX_FLAGS + ["-mamx-fp16"]
    if compiles(cc, AMX_FLAGS, AMX_FP16_ASM_PROBE):
        return AMX_FLAGS + ["-DAB_AMX_FP16_ASM=1"]
    return AMX_FLAGS


def torch_paths():
    import torch  # imported here so `setup.py --help` works without torch

    base = Path(torch.__file__).resolve().parent
    return str(base / "include"), str(base / "lib")


def find_nvcc():
    """nvcc when the CUDA library is to be built: ATTN_BACKENDS_CUDA=1 builds it whenever nvcc is
    found; unset, only for a torch built with CUDA (a CPU-only torch never hands the library a
    CUDA tensor, so building it there only costs minutes); 0 never."""
    want = os.environ.get("ATTN_BACKENDS_CUDA", "").strip()
    if want == "0":
        return None
    if want != "1":
        import torch

        if torch.version.cuda is None:
            print("attn_backends: this torch has no CUDA, so the CUDA library is not built "
                  "(ATTN_BACKENDS_CUDA=1 builds it anyway)", file=sys.stderr)
            return None
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def parse_archs(spec):
    """'80+PTX;90a' -> (['80', '90a'], ['80']): cubin targets and PTX targets."""
    cubins, ptx = [], []
    for tok in re.split(r"[;,\s]+", spec.strip()):
        if not tok:
            continue
        tok = tok.replace(".", "").lower()
        with_ptx = tok.endswith("+ptx")
        arch = tok[:-4] if with_ptx else tok
        if not re.fullmatch(r"\d{2,3}a?", arch):
            raise SystemExit(f"ATTN_BACKENDS_CUDA_ARCHS: cannot parse {tok!r} (expected e.g. 80, 90a, 80+PTX)")
        cubins.append(arch)
        if with_ptx:
            ptx.append(arch)
    if not cubins:
        raise SystemExit("ATTN_BACKENDS_CUDA_ARCHS is empty; use ATTN_BACKENDS_CUDA=0 to skip CUDA")
    return cubins, ptx


def run_jobs(jobs, what):
    """Runs compiler command lines in parallel (ATTN_BACKENDS_NVCC_THREADS at a time); stops the build
    with the first failure's output."""
    threads = int(os.environ.get("ATTN_BACKENDS_NVCC_THREADS", os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        results = list(pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True), jobs))
    for cmd, res in zip(jobs, results):
        if res.returncode != 0:
            sys.stderr.write(res.stdout + res.stderr)
            raise SystemExit(f"attn_backends: {what} failed: {' '.join(cmd)}")


class BuildExt(build_ext):
    """Compiles .c and .cpp with their own flags, then the CUDA library when nvcc is present."""

    def build_extensions(self):
        self.nvcc = find_nvcc()
        self.archs = parse_archs(os.environ.get("ATTN_BACKENDS_CUDA_ARCHS", DEFAULT_ARCHS)) if self.nvcc else ([], [])
        arch_str = " ".join([f"sm_{a}" for a in self.archs[0]] + [f"compute_{a}" for a in self.archs[1]])
        for ext in self.extensions:
            ext.define_macros.append(("AB_CUDA_ARCHS", f'"{arch_str}"'))
        sanitize = os.environ.get("ATTN_BACKENDS_SANITIZE", "").strip()
        san_flags = []
        if sanitize:
            # -O2 and line tables only (-g1, enough for ASan's stack traces): the build takes about 110 s
            # on 2 cores instead of 392 s at -O3 -g. -O1 (with small functions inlined) took 65-88 s, but
            # its float32 sums rounded differently from the real build's, and a whole-model gradient
            # check (test_hf's T5, avx512 path, 2026-11-27) failed there alone: 3.5x eager's error at -O1,
            # within 3x at -O2 and in the real build. ATTN_BACKENDS_SANITIZE_OPT overrides these flags.
            san_flags = [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"]
            san_flags += os.environ.get("ATTN_BACKENDS_SANITIZE_OPT", "-O2 -g1").split()
            if "undefined" in sanitize:
                san_flags.append("-fno-sanitize=vptr")  # torch's classes have no RTTI we can see
            for ext in self.extensions:
                ext.extra_link_args = list(ext.extra_link_args or []) + [f"-fsanitize={sanitize}"]
        compiler = self.compiler
        original = compiler._compile
        isa_flags = dict(ISA_FLAGS)
        isa_flags["cpu_amx.c"] = isa_flags["cpu_amx.c"] + amx_flags(compiler.compiler_so[0])

        def _compile(obj, src, ext, cc_args, extra_postargs, pp_opts):
            flags = CXX_FLAGS if src.endswith(".cpp") else C_FLAGS
            flags = flags + next((f for suffix, f in isa_flags.items() if src.endswith(suffix)), []) + san_flags
            return original(obj, src, ext, cc_args, list(extra_postargs) + flags, pp_opts)

        compiler._compile = _compile

        def compile_parallel(sources, output_dir=None, macros=None, include_dirs=None, debug=0,
                             extra_preargs=None, extra_postargs=None, depends=None):
            # setuptools compiles one file at a time; the per-ISA kernels are the slow part, so they go
            # through a pool (same steps as CCompiler.compile)
            macros, objects, extra_postargs, pp_opts, build = compiler._setup_compile(
                output_dir, macros, include_dirs, sources, depends, extra_postargs)
            cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)
            with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
                list(pool.map(lambda obj: _compile(obj, *build[obj], cc_args, extra_postargs, pp_opts),
                              [o for o in objects if o in build]))
            return objects

        compiler.compile = compile_parallel
        if "-Wstrict-prototypes" in compiler.compiler_so:
            compiler.compiler_so.remove("-Wstrict-prototypes")
        super().build_extensions()
        out_dir = Path(self.get_ext_fullpath("attn_backends._C")).parent
        lib = out_dir / "libattn_backends_cuda.so"
        if self.nvcc:
            self.build_cuda_library(lib, arch_str)
        elif lib.exists():
            lib.unlink()  # a stale library from an earlier build must not be picked up
        emu = out_dir / EMU_LIB
        self.emulator = os.environ.get("ATTN_BACKENDS_CUDA_EMULATOR", "1") != "0" and not sanitize
        if self.emulator:
            self.build_emulated_library(emu)
        elif emu.exists():
            emu.unlink()

    def build_emulated_library(self, lib):
        """The CUDA kernels and launchers, unchanged, compiled by g++ for the host against the CUDA
        emulator (csrc/cuda/emu: its include/ stands in for the CUDA headers; AB_CUDA_EMULATE picks
        the emulated PTX wrappers)."""
        build = Path(self.build_temp) / "cuda_emu"
        build.mkdir(parents=True, exist_ok=True)
        (build / "ab_cuda_config.h").write_text(
            '/* generated by setup.py */\n#define AB_CUDA_ARCHS "emulated"\n#define AB_CUDA_SM_LIST 80\n'
            "#define AB_CUDA_PTX_SM 0\n")
        emu_dir = CSRC / "cuda" / "emu"
        # -fno-strict-aliasing: the kernels pun 16-bit pairs and vectors through pointer casts, which
        # nvcc allows; -U_FORTIFY_SOURCE: the fault handler longjmps from the signal stack to the
        # block's caller, which the fortified longjmp refuses
        flags = ["g++", "-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden", "-fno-strict-aliasing",
                 "-U_FORTIFY_SOURCE", "-DAB_CUDA_EMULATE", f"-I{emu_dir / 'include'}", f"-I{CSRC}",
                 f"-I{CSRC / 'cuda'}", f"-I{build}", "-Wall", "-Wno-unknown-pragmas", "-Wno-unused-parameter"]
        # the kernels trap on a misaligned typed access (a uint4 store at an 8-byte boundary), which
        # x86 would let pass and a GPU refuses; the emulator turns the trap into the call's error
        kernel_flags = ["-fsanitize=alignment", "-fsanitize-undefined-trap-on-error"]
        jobs = []
        for src in sorted((CSRC / "cuda").glob("*.cu")):
            jobs.append([*flags, *kernel_flags, "-x", "c++", "-c", str(src), "-o", str(build / (src.stem + ".o"))])
        for src in sorted(emu_dir.glob("*.cpp")):
            extra = kernel_flags if src.name == "emu_selftest.cpp" else []
            jobs.append([*flags, *extra, "-c", str(src), "-o", str(build / (src.stem + ".o"))])
        jobs.append(["gcc", *C_FLAGS, "-fPIC", f"-I{CSRC}", "-c", str(CSRC / "ab_params.c"),
                     "-o", str(build / "ab_params.o")])
        print("attn_backends: building the emulated CUDA library with g++", flush=True)
        run_jobs(jobs, "emulated CUDA build")
        link = ["g++", "-shared", "-o", str(lib), *[j[-1] for j in jobs], "-lpthread"]
        res = subprocess.run(link, capture_output=True, text=True)
        if res.returncode != 0:
            sys.stderr.write(res.stdout + res.stderr)
            raise SystemExit("attn_backends: linking the emulated CUDA library failed")

    def build_cuda_library(self, lib, arch_str):
        cubins, ptx = self.archs
        gencode = []
        for a in cubins:
            gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
        for a in ptx:
            gencode += ["-gencode", f"arch=compute_{a},code=compute_{a}"]
        sms = ",".join(str(int(re.sub("a$", "", a))) for a in cubins)
        ptx_sm = min((int(re.sub("a$", "", a)) for a in ptx), default=0)
        build = Path(self.build_temp) / "cuda"
        build.mkdir(parents=True, exist_ok=True)
        # the build facts go through a generated header: nvcc splits -D values at commas and spaces
        (build / "ab_cuda_config.h").write_text(
            "/* generated by setup.py */\n"
            f'#define AB_CUDA_ARCHS "{arch_str}"\n'
            f"#define AB_CUDA_SM_LIST {sms}\n"
            f"#define AB_CUDA_PTX_SM {ptx_sm}\n"
        )
        common = ["-O3", "-std=c++17", f"-I{CSRC}", f"-I{build}", "-Xcompiler", "-fPIC,-fvisibility=hidden"]
        jobs = []
        for src in sorted((CSRC / "cuda").glob("*.cu")):
            obj = build / (src.stem + ".o")
            jobs.append([self.nvcc, *common, *gencode, "-c", str(src), "-o", str(obj)])
        # the core's parameter checks and error formatting, shared with the C module
        params_obj = build / "ab_params.o"
        jobs.append(["gcc", *C_FLAGS, "-fPIC", f"-I{CSRC}", "-c", str(CSRC / "ab_params.c"), "-o", str(params_obj)])
        print(f"attn_backends: building the CUDA library for {arch_str} with {self.nvcc}", flush=True)
        run_jobs(jobs, "CUDA build")
        objs = [j[-1] for j in jobs]
        link = [self.nvcc, "-shared", "-cudart", "static", *gencode, "-o", str(lib), *objs,
                "-Xlinker", "--exclude-libs,ALL", "-lrt", "-ldl", "-lpthread"]
        res = subprocess.run(link, capture_output=True, text=True)
        if res.returncode != 0:
            sys.stderr.write(res.stdout + res.stderr)
            raise SystemExit("attn_backends: linking the CUDA library failed")

    def copy_extensions_to_source(self):
        # --inplace and editable installs: the CUDA library travels with the module it sits beside
        super().copy_extensions_to_source()
        package_dir = Path(self.get_finalized_command("build_py").get_package_dir("attn_backends"))
        for name in ("libattn_backends_cuda.so", EMU_LIB):
            built = Path(self.build_lib) / "attn_backends" / name
            target = package_dir / built.name
            if built.exists():
                shutil.copyfile(built, target)
            elif target.exists():
                target.unlink()

    def get_outputs(self):
        outputs = super().get_outputs()
        if getattr(self, "nvcc", None):
            outputs.append(str(Path(self.get_ext_fullpath("attn_backends._C")).parent / "libattn_backends_cuda.so"))
        if getattr(self, "emulator", False):
            outputs.append(str(Path(self.get_ext_fullpath("attn_backends._C")).parent / EMU_LIB))
        return outputs


def extensions():
    torch_include, torch_lib = torch_paths()
    sources = sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("*.c"))
    sources += sorted(str(p.relative_to(ROOT)) for p in (CSRC / "cpu").glob("*.c"))
    sources += sorted(str(p.relative_to(ROOT)) for p in CSRC.glob("torch_shim*.cpp"))  # common, CPU, CUDA
    return [
        Extension(
            "attn_backends._C",
            sources=sources,
            # a changed header rebuilds everything: the kernels are headers included per ISA
            depends=sorted(str(p.relative_to(ROOT)) for p in CSRC.rglob("*.h")),
            include_dirs=[str(CSRC), torch_include],
            define_macros=[("Py_LIMITED_API", PY_LIMITED_API), ("TORCH_TARGET_VERSION", TORCH_TARGET_VERSION)],
            library_dirs=[torch_lib],
            libraries=["torch_cpu"],
            extra_link_args=["-ldl", "-lpthread"],
            language="c++",
            py_limited_api=True,
        )
    ]


setup(
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExt},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
