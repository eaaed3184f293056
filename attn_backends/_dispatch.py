"""From a call to a kernel: validate, describe the call for the planner, run the chosen backend.

Per-call cost matters (benchmarks/bench_overhead.py).  A plain eager CPU forward takes the fast path,
all in C (_C.attention, and _C.attention_varlen for packed calls; csrc/ab_direct.c): the checks, the call descriptor and the plan lookup, then the
kernel, with no Python in between; it serves only calls whose plan the Python path below has made
once (``remember``), and hands anything else back.  The Python path validates with one expression,
builds the call descriptor from metadata already read, finds the plan in a dict, and calls the op
below the autograd layer when no gradient is needed.
"""

from __future__ import annotations

import torch

from . import _C, _kvcache, _planner, _validate
from ._names import ID, resolve
from ._providers import RUNNERS, Attn, new_attn, read_guards
from ._providers.ours import dual_level, run_composite
from ._providers.torch_sdpa import breaks_cpu_rule

_DTYPE_IDS = _planner.DTYPE_IDS
_DEVICE_IDS = _planner.DEVICE_IDS
_deterministic = torch.are_deterministic_algorithms_enabled
_is_compiling = torch.compiler.is_compiling
cuda_device_info = _planner.cuda_device_info
cuda_math_ready = _planner.cuda_math_ready
_static_int = _planner.static_int


_CAUSAL = _validate._CAUSAL


def _sinks_alibi(q, B, Hq, sinks, alibi_slopes):
    """(sinks, alibi) checked, and the two planner fields for them."""
    if sinks is not None:
        sinks = _validate.check_sinks(sinks, q, Hq)
    if alibi_slopes is not None:
        alibi_slopes = _validate.check_alibi(alibi_slopes, q, B, Hq)
    return sinks, alibi_slopes, (sinks is not None, alibi_slopes is not None)


def prepare(q, k, v, backend, causal, attn_mask, dropout_p, scale, window, softcap, return_lse, deterministic=False,
            sinks=None, alibi_slopes=None):
    """Validates a dense call; returns (the runner's Attn, the call descriptor).

    The common case (no mask, no window, no softcap, no dropout, default scale) touches only what
    it needs; anything unusual goes through the full checks in _validate."""
    B, Hq, Sq, D, Hkv, Sk, Dv = _validate.check_qkv(q, k, v)
    causal_i = _CAUSAL.get(causal) if causal.__class__ in (bool, str) else None
    if causal_i is None:
        causal_i = _validate.check_causal(causal)
    wl, wr = _validate.clamp_window(*_validate.check_window(window), Sq, Sk) if window is not None else (-1, -1)
    scale_f = D ** -0.5 if scale is None else _validate.check_scale(scale, D, q.dtype)
    softcap_f = _validate.check_softcap(softcap, q.dtype) if softcap else 0.0
    p = _validate.check_dropout(dropout_p) if dropout_p else 0.0
    mask_kind = mask_grad = 0
    if attn_mask is not None:
        attn_mask = _validate.check_mask(attn_mask, q, B, Hq, Sq, Sk)
        mask_kind = 1 if attn_mask.dtype == torch.bool else 2
        mask_grad = mask_kind == 2 and attn_mask.requires_grad
    requested = "auto" if backend == "auto" else (resolve(backend) if backend is not None else "auto")
    if requested == "auto":
        requested = _planner.default_backend()
    need_grad = (q.requires_grad or k.requires_grad or v.requires_grad or bool(mask_grad)) and torch.is_grad_enabled()
    if q.is_cpu:
        dev = cc = lib_ok = smem = 0
    else:
        device = q.device
        dev = _DEVICE_IDS.get(device.type, 3)
        cc, lib_ok, _, smem = cuda_device_info(device.index) if dev == 1 else (0, 0, "", 0)
    gqa, square, few, capped, dropped = Hq != Hkv, Sq == Sk, Sq <= _FEW_QUERIES, softcap_f > 0, p > 0
    compiling = _is_compiling()
    if compiling:  # with dynamic=True sizes and float arguments are symbolic: constants for the plan
        D, Dv = _static_int(D), _static_int(Dv)
        gqa, square, few, capped, dropped = _planner.static_flags(gqa, square, few, capped, dropped)
    has_sinks = has_alibi = False
    if sinks is not None or alibi_slopes is not None:
        sinks, alibi_slopes, (has_sinks, has_alibi) = _sinks_alibi(q, B, Hq, sinks, alibi_slopes)
        if sinks is not None and sinks.requires_grad and torch.is_grad_enabled():
            need_grad = True
    args = new_attn(Attn, (q, k, v, attn_mask, causal_i, scale_f, wl, wr, softcap_f, p, need_grad, bool(return_lse),
                           bool(deterministic), sinks, alibi_slopes, None, None, None, None, None, None, 0, 0))
    sig = _new_call(dev, cc, lib_ok, _DTYPE_IDS[q.dtype], D, Dv, gqa, square, mask_kind, mask_grad, causal_i,
                    wl >= 0 or wr >= 0, capped, dropped, need_grad, bool(deterministic) or _deterministic(),
                    bool(return_lse), 0, _SETTINGS["mps_fix"], ID[requested], _cpu_isa(), _CPU_UNITS, smem,
                    has_sinks, has_alibi, compiling, few_queries=few)
    return args, sig


_SETTINGS = _planner.settings
_cpu_isa = _planner.cpu_isa
_CPU_UNITS = _planner.CPU_UNITS
_new_call = _planner.new_call
_FEW_QUERIES = _planner.FEW_QUERIES
_chosen = ({}, {})  # Call -> backend id, for strict False and True: the Python path's one lookup
_FLASH = ID["flash"]
# what the fast path reads (csrc/ab_direct.c): the same facts prepare() reads below
_C.set_fast_api(torch.Tensor, torch.nn.Parameter, read_guards, torch.is_grad_enabled, _deterministic, _planner._context_backend.get,
                _planner._process_default, _SETTINGS)
fast_attention = _C.attention
_PLAIN = (ID["auto"], _FLASH)  # requests under which flash serving a call is not a fallback
_AUTO, _SDPA = ID["auto"], ID["sdpa"]
_SDPA_AUTO: dict = {}  # Call -> the runner of torch SDPA as auto's choice (_sdpa_as_auto)
_EXACT_OURS = ("flash", "flash_varlen", "math", "eager")  # our kernels that keep the rule for NaN (not sage)
_CHECK_TORCH_NAN = _planner._env_flag("ATTN_BACKENDS_CHECK_TORCH_NAN")
_anomaly = torch.is_anomaly_enabled
_FLASH_VARLEN = ID["flash_varlen"]
_PLAIN_VARLEN = (ID["auto"], _FLASH_VARLEN)
_CPU = _planner.DEVICE_IDS["cpu"]
fast_attention_varlen = _C.attention_varlen


def reset_caches() -> None:
    """Forgets every plan and every fallback already reported (tests; after changing providers)."""
    for d in (*_chosen, *_kvcache._chosen, _SDPA_AUTO):
        d.clear()
    _transform_warned.clear()
    _C.forget()
    _planner._plans.clear()
    _planner._warned.clear()


def _runner(sig, strict):
    """The runner for a call descriptor: the plan cache (one dict lookup), else the planner."""
    # bool(): _chosen is indexed by it, and a strict that is not a bool (1, "yes", a tensor) is read by its
    # truth, as the KV-cache and explain paths read it (it used to raise "tuple indices must be integers")
    strict = bool(strict or _planner.STRICT)
    chosen = None if _is_compiling() else _chosen[strict].get(sig)
    if chosen is None:
        chosen = ID[_planner.choose(sig, strict)]
        # _is_compiling() first: dynamo would otherwise guard the graph on the dict's length, and every eager
        # call of a new kind (one more plan) would recompile every compiled caller
        if not _is_compiling() and len(_chosen[strict]) < 65536:
            _chosen[strict][sig] = chosen
            _arm_fast_path(sig, chosen)
    elif sig.device == _CPU and not (sig.need_grad or sig.mask_grad or sig.dropout):
        # a call the fast path could have served: its table (ab_direct.c) is bounded, and a plan it let go
        # of comes back here
        _arm_fast_path(sig, chosen)
    # not while tracing: there torch's own ops run, unchecked (and the descriptor is a plain tuple to dynamo)
    if chosen == _SDPA and not _is_compiling() and sig.requested == _AUTO and (_CHECK_TORCH_NAN or _anomaly()):
        run = _SDPA_AUTO.get(sig)
        if run is None:
            run = _sdpa_as_auto(sig)
            if len(_SDPA_AUTO) < 65536:
                _SDPA_AUTO[sig] = run
        return run
    return RUNNERS[chosen]


def _sdpa_as_auto(sig):
    """torch SDPA where auto chose it, checked: on CPU tensors, a call whose output breaks our rule for
    non-finite inputs (torch_sdpa.breaks_cpu_rule: torch's fused CPU kernel turns NaN rows into zeros and
    empty rows into NaN) is served again by the first of our exact kernels in auto's order that can serve it
    (flash, or math where flash cannot), which keep the rule; torch's output stands where none can.  Only
    under torch's anomaly mode (torch.autograd.detect_anomaly / set_detect_anomaly, where NaN is being
    hunted) or with ATTN_BACKENDS_CHECK_TORCH_NAN=1 (read at import): the check cost 3-26% of torch's time
    on this machine's calls (docs/reliability.md), and auto is never to be slower than torch."""
    run_torch = RUNNERS[_SDPA]

    def run(a):
        out, lse = run_torch(a)
        if breaks_cpu_rule(a, out):
            plan = _planner.build(sig)
            for name in plan.order:
                if name in _EXACT_OURS and not plan.reasons[name]:
                    return RUNNERS[ID[name]](a)
        return out, lse

    return run


def _arm_fast_path(sig, chosen) -> None:
    if chosen == _FLASH and sig.requested in _PLAIN:
        _C.remember(sig, _FLASH)  # ab.attention's fast path may serve such calls now (ab_direct.c)
    elif chosen == _FLASH_VARLEN and sig.requested in _PLAIN_VARLEN:
        _C.remember(sig, _FLASH_VARLEN)  # and attention_varlen's these


# ---- forward-mode AD and functorch transforms --------------------------------------------------------
# The kernels are custom ops with a backward only: under forward-mode AD (torch.autograd.forward_ad,
# torch.func.jvp / jacfwd) their outputs carried no tangent (a silent 0), and functorch's grad (and vmap
# of a call that needs a gradient) refused their autograd.Function.  Such calls run the eager composite
# (plain aten ops, the same semantics), which every transform differentiates and batches.
_functorch_layer = torch._C._functorch.peek_interpreter_stack
_BY_ID = {i: name for name, i in ID.items()}
_TRANSFORM_OK = (ID["auto"], ID["eager"])
_transform_warned: set = set()


def transformed(need_grad: bool = True) -> bool:
    """Whether forward-mode AD (a dual level) is active, or a functorch transform (grad, vmap) with a gradient
    to take (the ops' autograd.Function has no functorch rules; a forward alone under vmap runs the op, a
    loop over the batch); never while torch.compile traces (AOTAutograd differentiates its graph, through
    the ops' backward)."""
    return not _is_compiling() and (dual_level() or (need_grad and _functorch_layer() is not None))


def _transform_runner(sig, strict):
    """The runner under a transform: the aten composite (eager's semantics), or torch SDPA where it was asked
    for; a kernel asked for by name falls back to it with one warning, or raises when strict."""
    if sig.requested == ID["sdpa"]:
        return RUNNERS[ID["sdpa"]]  # torch's own, as torch runs it under the transform
    if sig.requested not in _TRANSFORM_OK:
        name = _BY_ID[sig.requested]
        why = "forward-mode AD and functorch transforms (jvp, jacfwd, grad, vmap) need plain torch ops"
        if strict or _planner.STRICT:
            raise RuntimeError(f"attn_backends: {name!r} cannot serve this call: {why}; the 'eager' backend can")
        if name not in _transform_warned:
            _transform_warned.add(name)
            _planner.logger.warning("attn_backends: %r cannot serve this call: %s; using 'eager' instead", name, why)
    return run_composite


def attention(q, k, v, backend, causal, attn_mask, dropout_p, scale, window, softcap, return_lse, strict,
              deterministic=False, sinks=None, alibi_slopes=None):
    args, sig = prepare(q, k, v, backend, causal, attn_mask, dropout_p, scale, window, softcap, return_lse,
                        deterministic, sinks, alibi_slopes)
    runner = _transform_runner(sig, strict) if transformed(sig.need_grad) else _runner(sig, strict)
    out, lse = runner(args)
    return (out, lse) if return_lse else out


def explain(q, k, v, backend="auto", causal=False, attn_mask=None, dropout_p=0.0, scale=None, window=None,
            softcap=0.0, return_lse=False, strict=False, deterministic=False, sinks=None, alibi_slopes=None):
    _, sig = prepare(q, k, v, backend, causal, attn_mask, dropout_p, scale, window, softcap, return_lse,
                     deterministic, sinks, alibi_slopes)
    return _planner.build(sig)


def prepare_varlen(q, k, v, cu_q, cu_k, max_q, max_k, backend, causal, dropout_p, scale, window, softcap,
                   return_lse, deterministic=False, sinks=None, alibi_slopes=None):
    from . import _varlen

    Tq, Hq, D, Tk, Hkv, Dv = _varlen.check_qkv(q, k, v)
    if _is_compiling():  # no host read of cu_seqlens: the caller's bounds (attention_varlen below)
        hcu_q, hcu_k, B, max_q, max_k = _varlen.traced_cu_seqlens(cu_q, cu_k, max_q, max_k, q.device)
        len_q = len_k = None
    else:
        hcu_q, hcu_k, B, len_q, len_k = _varlen.check_cu_seqlens(cu_q, cu_k, max_q, max_k, Tq, Tk, q.device)
        # the kernels and the padding get the real longest sequence, not the caller's bound: work scales
        # with the data, and the result does not depend on how loose the bound is
        max_q, max_k = _varlen.longest(len_q), _varlen.longest(len_k)
    causal_i = _validate.check_causal(causal)
    wl, wr = _validate.clamp_window(*_validate.check_window(window), max_q, max_k) if window is not None else (-1, -1)
    scale_f = _validate.check_scale(scale, D, q.dtype)
    softcap_f = _validate.check_softcap(softcap, q.dtype) if softcap else 0.0
    p = _validate.check_dropout(dropout_p) if dropout_p else 0.0
    requested = resolve(backend) if backend is not None else "auto"
    if requested == "auto":
        requested = _planner.default_backend()
    sinks, alibi_slopes, flags = _sinks_alibi(q, B, Hq, sinks, alibi_slopes)
    need_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or
                                             (sinks is not None and sinks.requires_grad))
    device = q.device
    dev = _DEVICE_IDS.get(device.type, 3)
    cc, lib_ok, _, smem = cuda_device_info(device.index) if dev == 1 else (0, 0, "", 0)
    gqa, square, capped, dropped = Hq != Hkv, max_q == max_k, softcap_f > 0, p > 0
    if _is_compiling():  # constants for the plan, as in prepare()
        D, Dv = _static_int(D), _static_int(Dv)
        gqa, square, capped, dropped = _planner.static_flags(gqa, square, capped, dropped)
    sig = _new_call(dev, cc, lib_ok, _DTYPE_IDS[q.dtype], D, Dv, gqa, square, 0, 0, causal_i,
                    wl >= 0 or wr >= 0, capped, dropped, need_grad, bool(deterministic) or _deterministic(),
                    bool(return_lse), 1, _SETTINGS["mps_fix"], ID[requested], _cpu_isa(), _CPU_UNITS, smem, *flags)
    args = new_attn(Attn, (q, k, v, None, causal_i, scale_f, wl, wr, softcap_f, p, need_grad, bool(return_lse),
                           bool(deterministic), sinks, alibi_slopes, cu_q, cu_k, hcu_q, hcu_k, len_q, len_k, max_q, max_k))
    return args, sig


def attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, backend, causal, dropout_p, scale, window, softcap,
                     return_lse, strict, deterministic=False, sinks=None, alibi_slopes=None):
    call = (q, k, v, cu_q, cu_k, max_q, max_k, backend, causal, dropout_p, scale, window, softcap, return_lse,
            strict, deterministic, sinks, alibi_slopes)
    if _is_compiling() and (not isinstance(dropout_p, (int, float)) or dropout_p):
        return _eager_varlen(*call)  # dropout numbers rows by the longest sequence, which the trace does not know
    if _is_compiling() and (isinstance(max_q, torch.Tensor) or isinstance(max_k, torch.Tensor)):
        # a 0-d tensor bound has no value while tracing: read eagerly (with fullgraph=True dynamo captured it as
        # an unbacked SymInt, which the op's `int max_seqlen_q` refused: BackendCompilerFailed; the schema takes
        # SymInt since, and without this graph break such a call traced whole in a trial, not yet adopted)
        return _eager_varlen(*call)
    args, sig = prepare_varlen(q, k, v, cu_q, cu_k, max_q, max_k, backend, causal, dropout_p, scale, window,
                               softcap, return_lse, deterministic, sinks, alibi_slopes)
    runner = _transform_runner(sig, strict) if transformed(sig.need_grad) else _runner(sig, strict)
    if _is_compiling() and runner is not RUNNERS[_FLASH_VARLEN]:
        return _eager_varlen(*call)  # the others pad by the lengths on the host (_varlen.pad)
    out, lse = runner(args)
    return (out, lse) if return_lse else out


@torch.compiler.disable  # (no reason= argument: torch 2.10, the oldest torch we take, may not have it)
def _eager_varlen(*call):
    """attention_varlen run eagerly under torch.compile: the graph breaks here, as for any such call before
    the flash_varlen kernel was traced (the calls with dropout, and those planned to another backend)."""
    return attention_varlen(*call)
