"""The Python side of the planner: describes a call for the C planner (csrc/ab_planner.c), caches
plans by call signature, logs fallbacks once, raises in strict mode, renders explanations.

A call is described by a Call (attn_backends._C.Call, the mirror of the C planner's ab_call: device,
dtype, head dims, mask kind, flags, requested backend, ...; fields by name, csrc/ab_planner.h
AB_CALL_FIELDS defines them), built by new_call.  Plans are cached per Call, so planning costs one
dict lookup after the first call of a kind.  Under torch.compile, ``choose`` runs at trace time
(``assume_constant_result``) and the chosen backend is baked into the graph.
"""

from __future__ import annotations

import contextvars
import dataclasses
import importlib.util
import logging
import os

import torch

from . import _C
from ._names import CANONICAL, ID, resolve

logger = logging.getLogger("attn_backends")

# the call descriptor's enums, names indexed by value, from the C core (csrc/ab_core.h, ab_planner.h)
_ENUMS = _C.enum_names()
DEVICE_NAMES = _ENUMS["device"]  # ab_device_type: cpu, cuda, mps, other
DEVICE_IDS = {name: i for i, name in enumerate(DEVICE_NAMES) if name != "other"}
DTYPE_NAMES = _ENUMS["dtype"]  # the floating ab_dtype values: float32, float16, bfloat16, float64
DTYPE_IDS = {getattr(torch, name): i for i, name in enumerate(DTYPE_NAMES)}
CAUSAL_NAMES = _ENUMS["causal"]  # ab_causal
MASK_NAMES = _ENUMS["mask"]  # ab_call.mask
ISA_NAMES = _ENUMS["cpu_isa"]  # ab_cpu_isa
UNIT_NAMES = _ENUMS["cpu_units"]  # bit i of cpu_units (AB_UNIT_*)
VENDOR_NAMES = _ENUMS["cpu_vendor"]  # ab_cpu_vendor: other, Intel, AMD

# the call descriptor: its type and fields come from the C core (csrc/ab_planner.h, AB_CALL_FIELDS)
Call = _C.Call
FIELDS = _C.call_fields()


_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _env_switch(name: str, default: bool) -> bool:
    """An on/off environment variable: 1, true, yes, on or 0, false, no, off (any case, spaces around
    ignored); unset or empty gives the default, and any other value the default with one warning."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in _ON or raw in _OFF:
        return raw in _ON
    if raw:
        logger.warning("ignoring %s=%r: expected 1 or 0 (true/false, yes/no, on/off)", name, os.environ[name])
    return default


def _env_flag(name: str) -> bool:
    return _env_switch(name, False)


def _env_backend() -> str:
    raw = os.environ.get("ATTN_BACKENDS_BACKEND", "").strip()
    if not raw:
        return "auto"
    try:
        return resolve(raw)
    except ValueError as e:
        logger.warning("ignoring ATTN_BACKENDS_BACKEND: %s", e)
        return "auto"


ENV_BACKEND = _env_backend()
STRICT = _env_flag("ATTN_BACKENDS_STRICT")
settings = {"mps_fix": not _env_flag("ATTN_BACKENDS_DISABLE_MPS_FIX")}

_context_backend = contextvars.ContextVar("attn_backends_backend", default=None)
_process_default = [ENV_BACKEND]


def set_process_default(name: str) -> None:
    """The default outside any ab.use(...) (apply_args sets it from --attn_implementation)."""
    _process_default[0] = resolve(name)


@torch.compiler.assume_constant_result
def default_backend() -> str:
    """The backend ``backend="auto"`` means here: the innermost ab.use(...), else the process default
    (--attn_implementation through apply_args, else ATTN_BACKENDS_BACKEND), else auto."""
    name = _context_backend.get()
    return _process_default[0] if name is None else name


@torch.compiler.assume_constant_result
def cpu_isa() -> int:
    """The CPU kernels' ISA path, asked of the C core on every call (ATTN_BACKENDS_CPU_ISA and
    _C.set_cpu_isa decide it; under torch.compile it is read once, at trace time)."""
    return _cpu_isa_index()


_cpu_isa_index = _C.cpu_isa_index
_is_compiling = torch.compiler.is_compiling
# the matrix units this CPU may use are fixed for the process
CPU_UNITS = _C.cpu_units()
CPU_VENDOR = _C.cpu_vendor()
CPU_FAMILY = _C.cpu_features()["family"]  # CPUID's display family (AMD Zen 4: 25, Zen 5: 26)
FEW_QUERIES = _C.FEW_QUERIES  # a dense call of at most this many query tokens has few_queries set
KV_MANY_ROWS = _C.KV_MANY_ROWS  # a KV-cache call of at least this many query rows per KV head
KV_MANY_TOKENS = _C.KV_MANY_TOKENS  # and this many query tokens has many_rows set


# ---- the device facts a call descriptor holds ----------------------------------------------------

_cuda_lib = os.path.join(os.path.dirname(__file__), "libattn_backends_cuda.so")
_cuda_devices: dict = {}


def cuda_device_info(index) -> tuple:
    """(compute capability x10, our CUDA library holds code for it, why not, bytes of shared memory a
    block may opt in to (0 when not known)) for cuda:index.  Asked once per device, the first time a
    tensor of that device arrives."""
    index = index or 0
    info = _cuda_devices.get(index)
    if info is None:
        if not os.path.exists(_cuda_lib):
            major, minor = torch.cuda.get_device_capability(index)
            info = (major * 10 + minor, False, "the CUDA library was not built (no nvcc at install time)", 0)
        else:
            cc, ok, why, smem = _C.cuda_device(index)
            info = (cc, bool(ok), why, smem)
        _cuda_devices[index] = info
    return info


def cuda_math_ready(index) -> str:
    """'' when our CUDA kernels can run on cuda:index, else why not."""
    cc, ok, why = cuda_device_info(index)[:3]
    if ok and cc < 80:
        return f"compute capability {cc // 10}.{cc % 10} < 8.0"
    return "" if ok else why


def static_int(x) -> int:
    """A size as a Python int while torch.compile traces with dynamic shapes.

    The planner's signature must be constants, but with dynamic shapes sizes are symbolic, and
    neither int() nor bool() turns them into constants under dynamo.  Comparisons in control flow
    do: each becomes a guard.  This bisection pins x to its value with ~40 guards, so the graph is
    reused only for that value (head dims, in practice, never change).  Trace time only.
    """
    lo, hi = 0, 1 << 40
    while lo < hi:
        mid = (lo + hi) // 2
        if x <= mid:
            hi = mid
        else:
            lo = mid + 1
    return lo


def static_flags(*flags) -> tuple:
    """Flags (bool, or symbolic ones) as Python bools while torch.compile traces: with dynamic=True
    comparisons of sizes and float arguments are symbolic, and bool() does not make them constants
    under dynamo; a branch on each does (a guard, as in static_int).  Trace time only."""
    return tuple(True if f else False for f in flags)  # noqa: SIM210


def new_call(device=0, cuda_cc=0, cuda_lib_ok=0, dtype=0, D=64, Dv=64, gqa=False, square=True, mask=0,
             mask_grad=False, causal=0, window=False, softcap=False, dropout=False, need_grad=False,
             deterministic=False, want_lse=False, varlen=0, mps_fix=None, requested=0, cpu_isa=None,
             cpu_units=None, cuda_smem=0, sinks=False, alibi=False, compiling=None, cpu_vendor=None,
             few_queries=False, cpu_family=None, many_rows=False) -> Call:
    """The one constructor of the call descriptor (fields: csrc/ab_planner.h, AB_CALL_FIELDS).  Ids, not
    names: device (DEVICE_IDS), dtype (DTYPE_IDS), causal (CAUSAL_NAMES), requested (_names.ID).  Left as
    None, mps_fix, cpu_isa, cpu_units, cpu_vendor and cpu_family are this process's; the rest default to a
    plain dense CPU float32 call of D=64 with more than FEW_QUERIES query tokens (many_rows: a KV-cache call's,
    _kvcache.signature).  _dispatch passes every
    field but cpu_vendor and cpu_family by position and few_queries by keyword (the per-call path).  While
    torch.compile traces, the fields as a plain tuple (dynamo cannot rebuild a struct sequence as a
    constant); build() turns it into a Call, and tuples and Calls of the same fields are equal keys.
    compiling: whether torch.compile traces, when the caller already knows (None: asked here)."""
    if compiling is None:
        compiling = _is_compiling()
    return (tuple if compiling else Call)((device, cuda_cc, cuda_lib_ok, dtype, D, Dv, gqa, square, mask, mask_grad, causal, window,
                 softcap, dropout, need_grad, deterministic, want_lse, varlen,
                 settings["mps_fix"] if mps_fix is None else mps_fix, requested,
                 _cpu_isa_index() if cpu_isa is None else cpu_isa, CPU_UNITS if cpu_units is None else cpu_units,
                 cuda_smem, sinks, alibi, CPU_VENDOR if cpu_vendor is None else cpu_vendor, few_queries,
                 CPU_FAMILY if cpu_family is None else cpu_family, many_rows))


def _detect_providers() -> None:
    """Tells the C registry which torch features and optional packages this process has.
    Packages are looked up, not imported: importing them is deferred to their first use."""
    from torch.nn.attention import SDPBackend

    sdpa = {"_native_flash": "FLASH_ATTENTION", "_native_efficient": "EFFICIENT_ATTENTION",
            "_native_cudnn": "CUDNN_ATTENTION", "_native_math": "MATH"}
    _C.set_provider(ID["sdpa"], True, "")
    for name, member in sdpa.items():
        ok = hasattr(SDPBackend, member)
        _C.set_provider(ID[name], ok, "" if ok else f"this torch has no SDPBackend.{member}")
    try:
        import torch.nn.attention.flex_attention  # noqa: F401

        _C.set_provider(ID["flex"], True, "")
    except ImportError as e:  # pragma: no cover - every supported torch has it
        _C.set_provider(ID["flex"], False, f"torch FlexAttention is unavailable ({e})")
    for name, module in (("xformers", "xformers"), ("flash_attn_pkg", "flash_attn"),
                         ("sageattention_pkg", "sageattention")):
        ok = importlib.util.find_spec(module) is not None
        _C.set_provider(ID[name], ok, "" if ok else f"the {module} package is not installed")


_detect_providers()
# our CUDA flash kernels pass their tests on a GPU but run slower than torch's there: opt-in
# (docs/benchmarks.md, "GPU")
_C.enable_cuda_flash(_env_flag("ATTN_BACKENDS_CUDA_FLASH"))
# the same for our CUDA sage forward, slower than our CUDA flash (docs/sage.md, "CUDA")
_C.enable_cuda_sage(_env_flag("ATTN_BACKENDS_CUDA_SAGE"))
# our CUDA decode kernel, paged_attention, is on unless ATTN_BACKENDS_CUDA_DECODE=0 (docs/decode.md, "The
# CUDA kernel"): without it eager serves the KV-cache calls on CUDA that torch SDPA does not
_C.enable_cuda_decode(_env_switch("ATTN_BACKENDS_CUDA_DECODE", True))
# the CUDA emulator (docs/cuda.md): CPU tensors of flash, flash_varlen, sage, math and paged_attention run
# the CUDA kernels
if _env_flag("ATTN_BACKENDS_CUDA_EMULATE"):
    try:
        _C.set_cuda_emulation(True)
    except RuntimeError as e:
        logger.warning("ignoring ATTN_BACKENDS_CUDA_EMULATE: %s", e)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The planner's answer for one kind of call: what serves it and why the others cannot."""

    requested: str
    chosen: str | None
    path: str
    order: tuple
    reasons: dict
    call: dict
    note: str = ""

    @property
    def fell_back(self) -> bool:
        return self.requested != "auto" and self.chosen != self.requested

    def describe_call(self) -> str:
        c = self.call
        dev = c["device"] + (f" (compute capability {c['cuda_cc'] // 10}.{c['cuda_cc'] % 10})" if c["cuda_cc"] else "")
        parts = [dev, c["dtype"], f"D={c['D']}" + (f" Dv={c['Dv']}" if c["Dv"] != c["D"] else "")]
        if c["gqa"]:
            parts.append("GQA")
        if c["few_queries"]:
            parts.append(f"Sq <= {FEW_QUERIES} (decode)")
        if c["varlen"] == 2:  # its mask field: what attending to the cache as a dense call needs (0, 2, 1)
            parts.append("KV cache" + {"none": ", no mask needed", "float": ", only a bottom-right causal mask"}.get(
                c["mask"], ""))
            if c["many_rows"]:
                parts.append(f"at least {KV_MANY_ROWS} query rows per KV head and {KV_MANY_TOKENS} tokens")
        elif c["varlen"]:
            parts.append("varlen")
        if c["causal"] != "none":
            parts.append(f"causal={c['causal']}")
        if c["mask"] != "none" and c["varlen"] != 2:
            parts.append(f"{c['mask']} mask" + (" (needs grad)" if c["mask_grad"] else ""))
        for flag in ("window", "softcap", "dropout", "sinks", "alibi"):
            if c.get(flag):
                parts.append("ALiBi" if flag == "alibi" else flag)
        parts.append("training" if c["need_grad"] else "inference")
        if c["deterministic"]:
            parts.append("deterministic")
        if c["want_lse"]:
            parts.append("lse")
        return ", ".join(parts)

    def __str__(self) -> str:
        lines = [f"call:      {self.describe_call()}",
                 f"requested: {self.requested}",
                 f"chosen:    {self.chosen or 'nothing can serve this call'}" + (f" ({self.path})" if self.chosen else "")]
        if self.order:
            lines.append(f"tried:     {' -> '.join(self.order)}")
        if self.note:
            lines.append(f"note:      {self.note}")
        w = max(len(n) for n in CANONICAL)
        lines.append("")
        lines.append(f"  {'backend':<{w}}  can serve?")
        for name in CANONICAL[1:]:
            why = self.reasons[name]
            mark = "yes (chosen)" if name == self.chosen else ("yes" if not why else f"no: {why}")
            lines.append(f"  {name:<{w}}  {mark}")
        return "\n".join(lines)


_plans: dict = {}
_warned: set = set()


def describe(call: Call) -> dict:
    """The call's fields by name, with names in place of ids."""
    d = dict(zip(FIELDS, call))
    d["device"] = DEVICE_NAMES[d["device"]]
    d["dtype"] = DTYPE_NAMES[d["dtype"]] if d["dtype"] < len(DTYPE_NAMES) else "other"
    d["causal"] = CAUSAL_NAMES[d["causal"]]
    d["mask"] = MASK_NAMES[d["mask"]]
    d["requested"] = CANONICAL[d["requested"]]
    d["cpu_isa"] = ISA_NAMES[d["cpu_isa"]]
    d["cpu_units"] = tuple(n for i, n in enumerate(UNIT_NAMES) if d["cpu_units"] >> i & 1)
    d["cpu_vendor"] = VENDOR_NAMES[d["cpu_vendor"]]
    return d


def build(sig: Call) -> Plan:
    """The plan for a call, cached."""
    plan = _plans.get(sig)
    if plan is None:
        sig = sig if sig.__class__ is Call else Call(sig)
        chosen, order, reasons, path, note = _C.plan(sig)
        plan = Plan(
            requested=CANONICAL[sig.requested],
            chosen=CANONICAL[chosen] if chosen >= 0 else None,
            path=path,
            order=tuple(CANONICAL[i] for i in order),
            reasons={CANONICAL[i]: r for i, r in enumerate(reasons)},
            call=describe(sig),
            note=note,
        )
        if len(_plans) < 65536:  # bounded: signatures are few in practice
            _plans[sig] = plan
    return plan


def strict_message(plan: Plan) -> str:
    lines = [f"backend {plan.requested!r} cannot serve this call ({plan.describe_call()}): "
             f"{plan.reasons.get(plan.requested) or 'nothing can'}",
             "every backend and why not:"]
    for name in CANONICAL[1:]:
        lines.append(f"  {name}: {plan.reasons[name] or 'can serve'}")
    return "\n".join(lines)


@torch.compiler.assume_constant_result
def choose(sig: Call, strict: bool) -> str:
    """The backend that serves a call of this signature; logs a fallback once per (requested,
    chosen, reason) and the backend used once per signature; raises when strict and the named
    backend cannot serve, or when nothing can."""
    plan = build(sig)
    if plan.chosen is None or (strict and plan.fell_back):
        raise RuntimeError(strict_message(plan))
    if plan.fell_back:
        _warn_once(plan.requested, plan.chosen, plan.reasons[plan.requested], plan)
    elif plan.call["device"] == "mps" and plan.chosen == "eager" and plan.reasons["sdpa"].startswith("torch SDPA on MPS"):
        _warn_once(plan.requested, plan.chosen, plan.reasons["sdpa"], plan)
    if sig not in _warned:
        _warned.add(sig)
        logger.info("attn_backends: %s serves %s (requested %s, %s)", plan.chosen, plan.describe_call(),
                    plan.requested, plan.path)
    return plan.chosen


def _warn_once(requested: str, chosen: str, reason: str, plan: Plan) -> None:
    key = (requested, chosen, reason)
    if key not in _warned:
        _warned.add(key)
        logger.warning("attn_backends: %r cannot serve this call (%s): %s; using %r instead", requested,
                       plan.describe_call(), reason, chosen)
