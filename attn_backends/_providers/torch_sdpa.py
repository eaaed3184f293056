"""torch's SDPA as runners: F.scaled_dot_product_attention as torch chooses (sdpa), or with one of its
kernels forced (_native_flash, _native_efficient, _native_cudnn, _native_math)."""

from __future__ import annotations

import math

import torch

from .. import _eager, _ops
from .ours import dual_level

_is_compiling = torch.compiler.is_compiling
# whether the running backward keeps its graph (retain_graph=True); private to torch, hence the fallback
# (keep: the inputs then live as long as the node, never shorter than a kept graph needs)
_keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", lambda: True)
_functorch_layer = torch._C._functorch.peek_interpreter_stack

# torch's own function, captured before anyone (ab.patch_sdpa included) can replace it: the sdpa
# backends call this, so a patched F.scaled_dot_product_attention never calls itself
ORIGINAL_SDPA = torch.nn.functional.scaled_dot_product_attention


def sdpa_mask(q, k, mask, causal, wl, wr, scale=None):
    """(attn_mask, is_causal) for F.sdpa: its is_causal is top-left only, so bottom-right causal and
    windows become an explicit bool mask, combined with the caller's mask.  So does top-left causal
    under a negative scale: there torch's fused CPU kernel (2.13) returns NaN rows with is_causal=True
    and the right values with the same mask given explicitly (tests/test_fidelity.py)."""
    Sq, Sk = q.shape[2], k.shape[2]
    if mask is not None and mask.dim() < 4:  # ours broadcasts any trailing shape; F.sdpa wants 2-D+
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    if causal == 1 and mask is None and wl < 0 and wr < 0 and not (scale is not None and scale < 0):
        return None, True
    vis = _eager.visible_keys(Sq, Sk, causal, wl, wr, q.device)
    if vis is None:
        combined = mask
    elif mask is None:
        combined = vis
    elif mask.dtype == torch.bool:
        combined = mask & vis
    else:
        combined = mask.masked_fill(~vis, -math.inf)
    if combined is not None and combined.dtype != torch.bool and combined.dtype != q.dtype:
        # F.sdpa takes a floating mask in q's dtype or in float32.  On CPU it adds a float32 one in
        # float32, so a bfloat16 or float16 call keeps the mask's values (a float32 mask cast to
        # bfloat16 first gave 1.6-6x torch's error against float64, docs/backends.md); float32 holds
        # float16 and bfloat16 masks exactly.  On CUDA, where that is unmeasured, q's dtype as before.
        combined = combined.to(torch.float32 if q.device.type == "cpu" and q.dtype != torch.float64 else q.dtype)
    return combined, False


class _SecondOrder(torch.autograd.Function):
    """An identity on torch SDPA's output that gives it a second derivative.  torch's fused kernels (its CPU
    flash, CUDA flash, efficient and cuDNN) have a backward that autograd cannot differentiate, so a
    gradient of a gradient raised in torch.  This node passes the gradient on to torch's own backward
    (the same bits, torch's graph and memory); when autograd records the backward (create_graph=True with
    an input that requires grad) it gives the gradient of q, k, v (and a float mask) from the eager
    composite instead, as for our kernels (_ops.composite_backward), whose own autograd then gives the
    second derivative, and torch's backward gets none.  docs/semantics.md, "Double backward"."""

    @staticmethod
    def forward(ctx, opts, out, q, k, v, mask):
        ctx.opts = opts
        # the inputs as references, not through save_for_backward: torch's node saves them already, and saving
        # them again ran saved-tensor hooks twice (save_on_cpu copied q, k and v to the host twice); their
        # versions are checked as save_for_backward would, and they go when the backward frees the graph
        ctx.inputs = (q, k, v, mask)
        ctx.versions = tuple(t._version if t is not None else 0 for t in ctx.inputs)
        # a new tensor on out's memory and version counter, not a view: an in-place change to it is what it is
        # on torch's own output (refused at backward only where torch's node saved out; a view made in a custom
        # Function refused it at once)
        return out.detach()

    @staticmethod
    def backward(ctx, grad_out):
        inputs, versions = ctx.inputs, ctx.versions
        if not _keep_graph():
            ctx.inputs = None
        q, k, v, mask = inputs
        causal, scale, wl, wr, p = ctx.opts
        # with dropout the composite cannot redraw torch's mask: torch's own backward then, as torch has it (its
        # math kernel's has a derivative; its fused kernels' raise torch's error)
        if p > 0 or not _ops.records_graph(q, k, v, mask):
            return None, grad_out, None, None, None, None
        for name, t, seen in zip(("q", "k", "v", "attn_mask"), inputs, versions):
            if t is not None and t._version != seen:
                raise RuntimeError(f"attn_backends: {name} was modified in place after the attention call that "
                                   "needs it for its gradient (as torch's saved tensors report)")
        dq, dk, dv, dmask, _ = _ops.composite_backward(q, k, v, mask, None, (causal, scale, wl, wr, 0.0, 0.0),
                                                       grad_out, None)
        return None, None, dq, dk, dv, dmask if mask is not None and mask.dtype != torch.bool else None


# the bits of a dtype's values as integers: (integer dtype, exponent mask, magnitude mask)
_BITS = {torch.bfloat16: (torch.int16, 0x7F80, 0x7FFF), torch.float16: (torch.int16, 0x7C00, 0x7FFF),
         torch.float32: (torch.int32, 0x7F800000, 0x7FFFFFFF), torch.float64: (torch.int64, 0x7FF << 52, (1 << 63) - 1)}


def _magnitudes(t):
    """t's values as their bits without the sign (numpy, a view where it can): NaN and inf are those at or
    above the exponent mask, zeros are 0.  torch's own isfinite and comparisons took 0.3-0.7 ms over one
    element a row of a (1, 32, 1024, 128) bfloat16 output (strided), the bits through numpy 0.28."""
    it, _, mag = _BITS[t.dtype]
    return t.detach().view(it).numpy() & mag


def breaks_cpu_rule(a, out) -> bool:
    """Whether torch SDPA's output for the call a, on CPU tensors, may break our rule for non-finite inputs
    (docs/reliability.md), so that auto, which chose torch, serves the call with one of our kernels instead
    (attn_backends/_dispatch.py).  torch's fused CPU kernel (2.13) breaks it, whatever the dtype, with and
    without a mask: a row whose visible scores hold a NaN or +inf (a NaN in q or in a key the row sees, an inf
    key) comes out zeros where the float64 reference and our kernels give NaN, and a row a mask hides
    entirely comes out NaN where it should be zeros if q's row holds a NaN.  A row torch zeroes is 0 V: zeros,
    NaN in a column where some v is not finite.  So: a row of out whose first element is not finite (from
    non-finite inputs alone, where ours gives the reference's answer, NaN or not), or whose first element is
    exactly zero while q or k holds a value that is not finite.  With finite q and k every score is finite
    and torch's rows are right (a zero row is one the mask hides, or values whose weighted sum is 0).  The
    check reads one element a row of the output torch has just written, and q and k only where one of those
    is zero (a padded batch's empty rows): 1.03-1.05x torch's time at B=1 H=32 S=1024 D=128 bfloat16, 1.23-1.26x
    at H=8 S=128 D=64 (docs/reliability.md, "A fifth fuzz run"), hence only when asked (_dispatch._runner)."""
    if not out.is_cpu or out.numel() == 0 or out.dtype not in _BITS or _is_compiling():
        return False
    expo = _BITS[out.dtype][1]
    first = _magnitudes(out[..., 0])
    if bool((first >= expo).any()):
        return True
    if not bool((first == 0).any()):
        return False
    return any(bool((_magnitudes(t) >= expo).any()) for t in (a.q, a.k))


def runner(forced=None):
    """The runner of torch SDPA, with SDPBackend.<forced> when given.  A call that needs a gradient gets
    _SecondOrder on its output; not while torch.compile traces (AOTAutograd differentiates torch's ops), nor
    under functorch's transforms or forward-mode AD, which run torch's own as torch runs it there (an
    autograd.Function without functorch rules would refuse them)."""

    def run(a):
        out, _ = plain(a)
        if a.need_grad and not _is_compiling() and _functorch_layer() is None and not dual_level():
            out = _SecondOrder.apply((a.causal, a.scale, a.wl, a.wr, a.p), out, a.q, a.k, a.v, a.mask)
        return out, None

    def plain(a):
        q, k = a.q, a.k
        attn_mask, is_causal = sdpa_mask(q, k, a.mask, a.causal, a.wl, a.wr, a.scale)
        kwargs = dict(attn_mask=attn_mask, dropout_p=a.p, is_causal=is_causal, scale=a.scale,
                      # a Python bool (a branch: a guard) where dynamic=True makes the comparison a SymBool,
                      # which F.sdpa's enable_gqa refuses
                      enable_gqa=True if q.shape[1] != k.shape[1] else False)  # noqa: SIM210
        if forced is None:
            return ORIGINAL_SDPA(q, k, a.v, **kwargs), None
        v = a.v
        if forced != "MATH":
            # torch's fused kernels refuse a last dim that is not contiguous ("No available kernel"), where
            # every backend takes any strides (DESIGN.md section 3: copy if you must): copy those operands.
            # A last dim of size 1 counts too (torch checks the stride alone), and contiguous() may leave such
            # a view as it is (its stride does not count for is_contiguous()): clone to contiguous strides
            q, k, v = (t if t.stride(-1) == 1 else t.clone(memory_format=torch.contiguous_format) for t in (q, k, v))
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, forced)):
            return ORIGINAL_SDPA(q, k, v, **kwargs), None

    return run
