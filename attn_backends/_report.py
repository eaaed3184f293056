"""`python -m attn_backends`: versions, build, devices, CPU features, every backend with whether it
can run here and why not, and the support matrix (backend x device x feature) generated from the
C registry.  Modelled on `python -m xformers.info`."""

from __future__ import annotations

import os
import platform
import sys

import torch

from . import _C, _planner
from ._names import ID


def _table():
    """The registry as it stands now: the CUDA switches (_planner, at import, or _C.enable_cuda_* later)
    change a backend's capabilities after import."""
    return tuple(_C.backend_table())


DEVICES = ("cpu", "cuda", "mps", "other")

FEATURES = (  # (registry name, column title)
    ("bool_mask", "bool mask"), ("float_mask", "float mask"), ("mask_grad", "mask grad"),
    ("causal_top_left", "causal TL"), ("causal_bottom_right", "causal BR"), ("window", "window"),
    ("softcap", "softcap"), ("dropout", "dropout"), ("backward", "backward"),
    ("deterministic", "determ. bwd"), ("lse", "lse"), ("gqa", "GQA"), ("dv_ne_d", "Dv != D"),
    ("dense", "dense"), ("varlen", "varlen"), ("kvcache", "KV cache"), ("sinks", "sinks"), ("alibi", "ALiBi"),
    ("sinks_alibi_grad", "sinks/ALiBi bwd"),
)


def _present_devices() -> dict:
    """Which device types this machine has, and for CUDA the capability facts the planner uses."""
    present = {"cpu": True, "cuda": False, "mps": False, "other": False}
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        present["cuda"] = True
    mps = getattr(torch.backends, "mps", None)
    present["mps"] = bool(mps is not None and mps.is_available())
    return present


def _cuda_facts() -> tuple:
    return _planner.cuda_device_info(torch.cuda.current_device())


# the kinds of call a backend may serve, as the planner's layout field numbers them (ab_call.varlen)
CALL_KINDS = (("dense", 0, "dense"), ("varlen", 1, "packed (varlen)"), ("kvcache", 2, "KV-cache"))


def call_layout(feats) -> int:
    """The layout of the plain call a backend is asked about: dense where it serves dense calls, else
    the first kind it does serve (flash_varlen: packed; paged_attention: KV cache), so that a backend
    for one kind of call is not reported unavailable for not serving another."""
    return next((layout for key, layout, _ in CALL_KINDS if key in feats), 0)


def calls_note(feats) -> str:
    """"packed (varlen) calls only" for a backend that serves one kind of call and not dense ones."""
    kinds = [title for key, _, title in CALL_KINDS if key in feats]
    return f"{kinds[0]} calls only" if "dense" not in feats and len(kinds) == 1 else ""


def backend_rows() -> list:
    """(name, aliases, kind, available, why_not, devices, lossy, supports_backward) per backend.

    Each backend is asked about a plain call of the kind it serves (dense, packed or KV-cache; see
    call_layout) on each device this machine has."""
    present = _present_devices()
    rows = []
    for i, (name, aliases, kind, _summary, lossy, _provider, caps) in enumerate(_table()):
        devices = tuple(d for d, c in zip(DEVICES, caps) if c[0] is None)
        supports_backward = any(c[0] is None and "backward" in c[2] for c in caps)
        if kind == "planner":
            rows.append((name, aliases, kind, True, "", devices, bool(lossy), True))
            continue
        why = ""
        available = False
        for dev in ("cuda", "mps", "cpu"):
            if not present[dev]:
                continue
            cc, lib_ok, _, smem = (_cuda_facts() if dev == "cuda" else (0, 0, "", 0))
            feats = caps[DEVICES.index(dev)][2]
            layout = call_layout(feats)
            # float16 on an emulated CUDA device (the CPU under ATTN_BACKENDS_CUDA_EMULATE), else float32
            dtype = 1 if dev == "cpu" and _C.cuda_emulation() else 0
            call = _planner.new_call(DEVICES.index(dev), cc, int(lib_ok), dtype, varlen=layout, mps_fix=0, requested=i,
                                     cuda_smem=smem)
            reason = _C.plan(call)[2][i]
            if not reason:
                available = True
                break
            why = why or f"{dev}: {reason}"
        if not any(present[d] for d in devices):
            why = why or "no device of a type it runs on"
        rows.append((name, aliases, kind, available, "" if available else why, devices, bool(lossy),
                     supports_backward))
    return rows


def auto_cpu_note(dtype) -> str:
    """Why auto's order differs on this CPU for a plain call of this dtype ("" when it does not)."""
    return _C.plan(_planner.new_call(dtype=_planner.DTYPE_IDS[dtype], mps_fix=0))[4]


def support_matrix_markdown() -> str:
    """The registry as one markdown table per device (generated; docs/backends.md embeds it)."""
    out = []
    for d, dev in enumerate(DEVICES):
        out.append(f"### {dev}")
        out.append("")
        head = ["backend", "dtypes", "head dim"] + [t for _, t in FEATURES]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for name, _aliases, kind, _s, lossy, _p, caps in _table()[1:]:
            why, dtypes, feats, min_d, max_d, mult, min_cc, lib = caps[d]
            label = f"`{name}`" + (" (lossy)" if lossy else "")
            if why is not None:
                out.append(f"| {label} | - | - | " + " | ".join(["-"] * len(FEATURES)) + f" |")
                continue
            dts = ", ".join(x.replace("float", "f").replace("bf", "bf") for x in dtypes)
            dim = "any" if not (min_d or max_d or mult) else f"{min_d or 1}..{max_d or 'any'}" + (f", %{mult}" if mult else "")
            if min_cc:
                dim += f"; sm{min_cc}+"
            cells = []
            for key, _ in FEATURES:
                if key == "causal_top_left" and "bottom_right_aligned" in feats:
                    cells.append("Sq=Sk")
                else:
                    cells.append("yes" if key in feats else "")
            out.append(f"| {label} | {dts} | {dim} | " + " | ".join(cells) + " |")
        out.append("")
    out.append("A `-` row: no kernel or route on that device (the report says why). For torch SDPA, bottom-right "
               "causal and windows are passed as an explicit mask. `flash_attn_pkg` aligns causal and windows "
               "bottom-right, so it serves top-left calls only when Sq == Sk.")
    return "\n".join(out)


def names_markdown() -> str:
    lines = ["| canonical | kind | accepted aliases |", "|---|---|---|"]
    for name, aliases, kind, summary, *_ in _table():
        lines.append(f"| `{name}` | {kind} | {', '.join(f'`{a}`' for a in aliases) or '-'} |")
    return "\n".join(lines)


def report() -> str:
    info = _C.build_info()
    feats = _C.cpu_features()
    out = []
    add = out.append
    add("attn_backends environment report")
    add("")
    add("versions")
    add(f"  attn_backends          {info['version']}")
    add(f"  torch                  {torch.__version__}")
    add(f"  python                 {platform.python_version()} ({sys.implementation.name})")
    add(f"  platform               {platform.platform()}")
    add("")
    add("build")
    add(f"  torch stable ABI       target {info['torch_target_version']} (headers {info['torch_headers_version']})")
    add(f"  compiler               {info['compiler']}")
    present = os.path.exists(info["cuda_library"])
    add(f"  CUDA archs             {info['cuda_archs'] or 'none (built without nvcc)'}")
    add(f"  CUDA library           {info['cuda_library'] if present else 'not built'}")
    emu = os.path.exists(info["cuda_emu_library"])
    add(f"  CUDA emulator          {info['cuda_emu_library'] if emu else 'not built'}")
    add(f"  CPU kernel path        {_C.cpu_isa()}")
    if _C.cpu_isa_error():
        add(f"  CPU kernel error       {_C.cpu_isa_error()}")
    add("")
    add("devices")
    add(f"  cpu                    {feats['brand'].strip() or feats['vendor'] or platform.processor()}"
        f", {torch.get_num_threads()} threads")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cc = torch.cuda.get_device_capability(i)
            add(f"  cuda:{i:<17}{torch.cuda.get_device_name(i)} (compute capability {cc[0]}.{cc[1]})")
    else:
        add(f"  cuda                   not available (torch CUDA build: {torch.version.cuda or 'no'})")
    mps = getattr(torch.backends, "mps", None)
    add(f"  mps                    {'available' if mps is not None and mps.is_available() else 'not available'}")
    add("")
    add("cpu features")
    flags = [k for k, v in feats.items() if isinstance(v, bool) and v]
    add("  " + (" ".join(flags) if flags else "none detected (generic C paths)"))
    add(f"  AMX                    {feats['amx_state']}")
    for dtype in (torch.bfloat16, torch.float16):
        note = auto_cpu_note(dtype)
        if note:
            add(f"  auto, {str(dtype)[6:]:<16} {note}")
    add("")
    add("settings")
    add(f"  default backend        {_planner.default_backend()} (ATTN_BACKENDS_BACKEND)")
    add(f"  strict                 {_planner.STRICT} (ATTN_BACKENDS_STRICT)")
    add(f"  MPS mask fix           {_planner.settings['mps_fix']} (ATTN_BACKENDS_DISABLE_MPS_FIX)")
    add(f"  CUDA emulation         {_C.cuda_emulation()} (ATTN_BACKENDS_CUDA_EMULATE)"
        + (": CPU tensors of flash, flash_varlen, sage, math and paged_attention run the CUDA kernels on the emulator"
           if _C.cuda_emulation() else ""))
    add("")
    add("backends (available on this machine, or why not)")
    rows, table = backend_rows(), _table()
    w = max(len(r[0]) for r in rows)
    for name, aliases, kind, available, why, devices, lossy, bwd in rows:
        status = "available" if available else f"no: {why}"
        extra = []
        if devices and kind != "planner":
            extra.append("devices " + ",".join(devices))
        if lossy:
            extra.append("lossy")
        if kind != "planner" and devices and not bwd:
            extra.append("forward only")
        note = calls_note(set().union(*(c[2] for c in table[ID[name]][6] if c[0] is None)))
        if note:
            extra.append(note)
        add(f"  {name:<{w}}  {kind:<8}  {status}" + (f"  [{'; '.join(extra)}]" if extra else ""))
    return "\n".join(out)


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m attn_backends", description="environment and backend report")
    ap.add_argument("--matrix", action="store_true", help="print the support matrix (markdown) instead")
    ap.add_argument("--names", action="store_true", help="print the accepted names (markdown) instead")
    args = ap.parse_args(argv)
    if args.matrix:
        print(support_matrix_markdown())
    elif args.names:
        print(names_markdown())
    else:
        print(report())
