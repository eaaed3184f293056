"""`python -m attn_backends`: versions, build, devices, CPU features and every backend with
whether it is available here and, if not, why (modelled on `python -m xformers.info`)."""

from __future__ import annotations

import os
import platform
import sys

import torch

from . import _C, _dispatch
from ._names import TABLE


def backend_status() -> list[tuple[str, str, str, str]]:
    """(name, aliases, kind, status) for every registry row; status is 'available' or 'no: why'."""
    rows = []
    cuda_lib = os.path.exists(_dispatch._cuda_lib)
    for name, aliases, kind, summary in TABLE:
        if name in ("auto", "math", "eager"):
            status = "available"
            if name == "math":
                status += " (CPU forward+backward" + ("; CUDA forward)" if cuda_lib else ")")
        elif kind == "torch" and name in ("sdpa", "_native_math"):
            status = "no: routing to torch SDPA is not built in this version"
        elif kind == "external":
            status = "no: external packages are not wired in this version"
        else:
            status = "no: not built in this version (falls back to math with a warning)"
        rows.append((name, ", ".join(aliases), kind, status))
    return rows


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
    archs = info["cuda_archs"] or "none (built without nvcc)"
    present = os.path.exists(info["cuda_library"])
    add(f"  CUDA archs             {archs}")
    add(f"  CUDA library           {info['cuda_library'] if present else 'not built'}")
    add("")
    add("devices")
    add(f"  cpu                    {feats['brand'].strip() or feats['vendor'] or platform.processor()}"
        f", {torch.get_num_threads()} threads")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cc = torch.cuda.get_device_capability(i)
            add(f"  cuda:{i}                 {torch.cuda.get_device_name(i)} (compute capability {cc[0]}.{cc[1]})")
    else:
        add(f"  cuda                   not available (torch CUDA build: {torch.version.cuda or 'no'})")
    mps = getattr(torch.backends, "mps", None)
    add(f"  mps                    {'available' if mps is not None and mps.is_available() else 'not available'}")
    add("")
    add("cpu features")
    flags = [k for k, v in feats.items() if isinstance(v, bool) and v]
    add("  " + (" ".join(flags) if flags else "none detected (generic C paths)"))
    add("")
    add("backends")
    rows = backend_status()
    w = max(len(r[0]) for r in rows)
    for name, aliases, kind, status in rows:
        add(f"  {name:<{w}}  {kind:<8}  {status}")
        if aliases:
            add(f"  {'':<{w}}  {'':<8}  aliases: {aliases}")
    return "\n".join(out)
