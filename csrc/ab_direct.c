/* ab_direct.c -- the calls of attn_backends._C that skip the dispatcher (limited API, abi3).
 *
 * flash_fwd_cpu: the CPU flash forward for a call that needs no autograd and is not being traced
 * (attn_backends/_providers.py decides: CPU tensors of the plain torch.Tensor type, no gradient, no
 * dropout, no torch.compile, tracing, dispatch or function mode, functorch transform or inference
 * mode): the metadata is read here, the outputs are allocated through torch (q.new_empty_strided, and
 * torch.empty_strided for lse) in the layout the op gives them, and ab_flash_cpu_fwd runs on torch's
 * thread pool (ab_shim_cpu_pool), with the GIL released unless the call is tiny.  Same kernel, same
 * checks (ab_attn_params_check), same pool: the same bits as the flash_fwd op (tests/test_direct.py).
 * What it saves is the op call's fixed cost (the dispatcher, the boxed stable-ABI call), which
 * dominates small calls (docs/benchmarks.md, "Per-call cost").
 *
 * attention: ab.attention's fast path, the same call with the validation, the call descriptor and the
 * plan lookup done here too (below).
 *
 * kvcache_fwd_cpu: the CPU decode kernel (decode_cpu.h) for an attention_with_kvcache call, on the same
 * terms as flash_fwd_cpu (inference mode allowed in both); the outputs and the workspace as the
 * kvcache_fwd op makes them.  A decode call is small, so the op's fixed cost is a third of it.  A call
 * that writes new keys and values into the cache then bumps the caches' version counters
 * (torch._C._increment_version, what torch.autograd.graph.increment_version calls), as the op's
 * Tensor(a!) arguments have the dispatcher do: autograd still sees the write (a cache saved for a
 * backward and then written raises there), and inference tensors, which have no counter, are skipped
 * as the op skips them.
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ab_module.h"
#include "ab_shim.h"
#include "cpu/decode_cpu.h"
#include "cpu/decode_tune.h"
#include "cuda/ab_cuda.h"

static int small_int(PyObject* o, long long least, long long* x);

/* A RuntimeError worded as the shim's (torch_shim.cpp: fail). */
static PyObject* direct_error(const char* msg) {
  PyErr_Format(PyExc_RuntimeError, "attn_backends: %s", msg);
  return NULL;
}

/* The ab_dtype of a torch dtype object (identity with the ones set_tensor_api gave). */
static ab_dtype dtype_of(const ab_state* st, PyObject* dt) {
  for (int i = 0; i < AB_DTYPE_OTHER; ++i)
    if (dt == st->dtypes[i]) return (ab_dtype)i;
  return AB_DTYPE_OTHER;
}

/* 1 when t is a CPU tensor, 0 when not, -1 with an exception set. */
static int is_cpu(const ab_state* st, PyObject* t) {
  PyObject* r = PyObject_GetAttr(t, st->s_is_cpu);
  if (!r) return -1;
  const int yes = PyObject_IsTrue(r);
  Py_DECREF(r);
  return yes;
}

/* 1 when every one of the n objects that is not None is a CPU tensor, 0 when one is not (the op then
 * says what is wrong), -1 with an exception set. */
static int all_cpu(const ab_state* st, PyObject* const* tensors, int n) {
  for (int i = 0; i < n; ++i) {
    if (tensors[i] == Py_None) continue;
    const int cpu = is_cpu(st, tensors[i]);
    if (cpu <= 0) return cpu;
  }
  return 1;
}

/* Fills v from a CPU tensor's shape, strides, dtype and data pointer: 0; -1 with an exception set; 1
 * (no exception) when its elements are not plain strided memory a kernel may read: a negative view
 * (x.conj().imag, torch._neg_view: the sign lives in a bit, not in memory), a zero tensor (no memory:
 * a NULL data pointer), a sparse or mkldnn tensor (no strides or no storage).  The direct calls hand
 * such a call back (None), and the op, whose dispatcher resolves those views first, or the Python
 * path's checks serve it.  A rank other than 1..4 is an error naming the tensor, unless any_rank:
 * then only v->ndim is set (the caller words the error, as the shim does for q, k and v). */
static int read_view(const ab_state* st, PyObject* t, ab_tensor* v, const char* name, int any_rank) {
  memset(v, 0, sizeof *v);
  PyObject* shape = PyObject_GetAttr(t, st->s_shape);
  if (!shape) return -1;
  PyObject* stride = PyObject_CallMethodObjArgs(t, st->s_stride, NULL);
  PyObject* dt = stride ? PyObject_GetAttr(t, st->s_dtype) : NULL;
  PyObject* neg = dt ? PyObject_CallMethodObjArgs(t, st->s_is_neg, NULL) : NULL;
  int rc = -1;
  if (!stride) { /* a sparse or mkldnn tensor has no strides */
    PyErr_Clear();
    rc = 1;
    goto done;
  }
  if (!neg) goto done;
  if (neg != Py_False) {
    rc = 1;
    goto done;
  }
  const Py_ssize_t nd = PyTuple_Size(shape);
  if (nd < 0 || PyTuple_Size(stride) != nd) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_TypeError, "%s: shape and stride() disagree", name);
    goto done;
  }
  if (nd < 1 || nd > AB_MAX_DIMS) {
    if (any_rank) {
      v->ndim = (int32_t)nd;
      rc = 0;
    } else {
      PyErr_Format(PyExc_RuntimeError, "attn_backends: %s must have 1 to 4 dims, got %zd", name, nd);
    }
    goto done;
  }
  int64_t numel = 1;
  for (Py_ssize_t d = 0; d < nd; ++d) {
    v->sizes[d] = PyLong_AsLongLong(PyTuple_GetItem(shape, d));
    v->strides[d] = PyLong_AsLongLong(PyTuple_GetItem(stride, d));
    numel *= v->sizes[d];
  }
  if (PyErr_Occurred()) goto done;
  v->ndim = (int32_t)nd;
  v->dtype = dtype_of(st, dt);
  v->device = AB_DEVICE_CPU;
  v->device_index = -1;
  if (numel) {
    PyObject* ptr = PyObject_CallMethodObjArgs(t, st->s_data_ptr, NULL);
    if (!ptr) { /* no storage */
      PyErr_Clear();
      rc = 1;
      goto done;
    }
    v->data = PyLong_AsVoidPtr(ptr);
    Py_DECREF(ptr);
    if (PyErr_Occurred()) goto done;
    if (!v->data) { /* a zero tensor */
      rc = 1;
      goto done;
    }
  }
  rc = 0;
done:
  Py_DECREF(shape);
  Py_XDECREF(stride);
  Py_XDECREF(dt);
  Py_XDECREF(neg);
  return rc;
}

/* read_view's result where a direct call must hand the call back on 1 (None) and fail on -1. */
#define READ_OR_HAND_BACK(expr)                          \
  do {                                                   \
    const int rc_ = (expr);                              \
    if (rc_) return rc_ < 0 ? NULL : Py_NewRef(Py_None); \
  } while (0)

/* Contiguous strides of sizes (a dim of size 0 or 1 counts as 1), as the shim computes them. */
static void contiguous_strides(const int64_t* sizes, int n, int64_t* strides) {
  int64_t s = 1;
  for (int d = n - 1; d >= 0; --d) {
    strides[d] = s;
    s *= sizes[d] > 1 ? sizes[d] : 1;
  }
}

/* like.new_empty_strided(sizes, strides) when like is given (its dtype and device, and no keyword
 * arguments to parse: the cheaper call), else torch.empty_strided(sizes, strides, dtype=..., device="cpu") */
static PyObject* empty_strided(const ab_state* st, PyObject* like, const int64_t* sizes, const int64_t* strides,
                               int n, ab_dtype dtype) {
  PyObject* sz = PyTuple_New(n);
  PyObject* sd = sz ? PyTuple_New(n) : NULL;
  if (!sd) {
    Py_XDECREF(sz);
    return NULL;
  }
  for (int d = 0; d < n; ++d) {
    PyTuple_SetItem(sz, d, PyLong_FromLongLong(sizes[d]));
    PyTuple_SetItem(sd, d, PyLong_FromLongLong(strides[d]));
  }
  if (like && !PyErr_Occurred()) {
    PyObject* t = PyObject_CallMethodObjArgs(like, st->s_new_empty_strided, sz, sd, NULL);
    Py_DECREF(sz);
    Py_DECREF(sd);
    return t;
  }
  PyObject* args = PyErr_Occurred() ? NULL : PyTuple_Pack(2, sz, sd);
  Py_DECREF(sz);
  Py_DECREF(sd);
  if (!args) return NULL;
  PyObject* t = PyObject_Call(st->empty_strided, args, st->alloc_kw[dtype]);
  Py_DECREF(args);
  return t;
}

/* The out and lse views of a tensor torch.empty_strided just made (their data pointer only). */
static int set_data(const ab_state* st, PyObject* t, ab_tensor* v) {
  v->data = NULL;
  for (int d = 0; d < v->ndim; ++d)
    if (v->sizes[d] == 0) return 0;
  PyObject* ptr = PyObject_CallMethodObjArgs(t, st->s_data_ptr, NULL);
  if (!ptr) return -1;
  v->data = PyLong_AsVoidPtr(ptr);
  Py_DECREF(ptr);
  return PyErr_Occurred() ? -1 : 0;
}

/* The mask as a (B, Hq, Sq, Sk) view: trailing dims aligned, size-1 dims broadcast with stride 0 (the
 * shim's mask_view). */
static int broadcast_mask(ab_tensor* m, int64_t B, int64_t Hq, int64_t Sq, int64_t Sk) {
  const ab_tensor src = *m;
  const int64_t want[4] = {B, Hq, Sq, Sk};
  const int shift = 4 - src.ndim;
  for (int d = 0; d < 4; ++d) {
    const int sd = d - shift;
    const int64_t size = sd >= 0 ? src.sizes[sd] : 1, stride = sd >= 0 ? src.strides[sd] : 0;
    if (size != want[d] && size != 1) {
      char shape[160];
      size_t used = 0;
      for (int s = 0; s < src.ndim && used < sizeof shape; ++s)
        used += (size_t)snprintf(shape + used, sizeof shape - used, "%s%lld", s ? ", " : "",
                                 (long long)src.sizes[s]);
      PyErr_Format(PyExc_RuntimeError,
                   "attn_backends: attn_mask of shape (%s) is not broadcastable to (B, Hq, Sq, Sk) = "
                   "(%lld, %lld, %lld, %lld)",
                   shape, (long long)B, (long long)Hq, (long long)Sq, (long long)Sk);
      return -1;
    }
    m->sizes[d] = want[d];
    m->strides[d] = size == 1 ? 0 : stride;
  }
  m->ndim = 4;
  return 0;
}

/* Allocates out and, with want_lse, lse as the flash_fwd op returns them (out (B, Hq, Sq, Dv), stored
 * (B, Sq, Hq, Dv), in q's dtype; lse (B, Hq, Sq) float32, float64 for float64), or for a packed call
 * (p->cu_seqlens_q set) as flash_varlen_fwd does (out (Tq, Hq, Dv) and lse (Hq, Tq), contiguous), and
 * runs the CPU flash forward on p (its q, k, v, mask, cu_seqlens and scalars filled).  -> (out, lse or
 * None), or NULL with an exception.  Without want_lse the kernel writes lse to a buffer of its own. */
static PyObject* run_direct(ab_state* st, PyObject* q, ab_attn_params* pp, int want_lse) {
  ab_attn_params p = *pp;
  const ab_dtype dt = p.q.dtype < AB_DTYPE_BOOL ? p.q.dtype : AB_DTYPE_F32;
  const ab_dtype lse_dt = dt == AB_DTYPE_F64 ? AB_DTYPE_F64 : AB_DTYPE_F32;
  p.out.dtype = p.q.dtype;
  p.out.device = AB_DEVICE_CPU;
  p.out.device_index = -1;
  if (p.cu_seqlens_q) {
    const int64_t Tq = p.q.sizes[0];
    p.out.ndim = 3;
    const int64_t out_sizes[3] = {Tq, p.Hq, p.Dv};
    memcpy(p.out.sizes, out_sizes, sizeof out_sizes);
    contiguous_strides(out_sizes, 3, p.out.strides);
    p.lse = p.out;
    p.lse.ndim = 2;
    const int64_t lse_sizes[2] = {p.Hq, Tq};
    memcpy(p.lse.sizes, lse_sizes, sizeof lse_sizes);
    contiguous_strides(lse_sizes, 2, p.lse.strides);
  } else {
    /* out (B, Hq, Sq, Dv) laid out (B, Sq, Hq, Dv); lse (B, Hq, Sq) contiguous */
    const int64_t phys_sizes[4] = {p.B, p.Sq, p.Hq, p.Dv};
    int64_t phys[4];
    contiguous_strides(phys_sizes, 4, phys);
    p.out.ndim = 4;
    const int64_t out_sizes[4] = {p.B, p.Hq, p.Sq, p.Dv}, out_strides[4] = {phys[0], phys[2], phys[1], phys[3]};
    memcpy(p.out.sizes, out_sizes, sizeof out_sizes);
    memcpy(p.out.strides, out_strides, sizeof out_strides);
    p.lse = p.out;
    p.lse.ndim = 3;
    const int64_t lse_sizes[3] = {p.B, p.Hq, p.Sq};
    memcpy(p.lse.sizes, lse_sizes, sizeof lse_sizes);
    contiguous_strides(lse_sizes, 3, p.lse.strides);
  }
  p.lse.dtype = lse_dt;
  /* out in q's dtype (a dtype the kernel rejects still gets an out: the kernel's check then fails) */
  PyObject* out = empty_strided(st, p.q.dtype < AB_DTYPE_BOOL ? q : NULL, p.out.sizes, p.out.strides, p.out.ndim, dt);
  if (!out || set_data(st, out, &p.out) < 0) {
    Py_XDECREF(out);
    return NULL;
  }
  PyObject* lse = NULL;
  void* own_lse = NULL;
  if (want_lse) {
    lse = empty_strided(st, NULL, p.lse.sizes, p.lse.strides, p.lse.ndim, lse_dt);
    if (!lse || set_data(st, lse, &p.lse) < 0) {
      Py_DECREF(out);
      Py_XDECREF(lse);
      return NULL;
    }
  } else {
    /* (an empty out, Dv = 0, lets the rows of an expanded q reach 2**62 here: the bytes must not wrap) */
    const double rows = p.lse.ndim == 2 ? (double)p.lse.sizes[0] * (double)p.lse.sizes[1]
                                        : (double)p.B * (double)p.Hq * (double)p.Sq;
    const size_t es = ab_dtype_size(lse_dt);
    own_lse = rows > 0 && rows * (double)es < 0x1p62 ? malloc((size_t)rows * es) : NULL;
    if (rows > 0 && !own_lse) {
      Py_DECREF(out);
      return direct_error("allocation failed"); /* as the op words it */
    }
    p.lse.data = own_lse;
  }
  ab_error err;
  err.msg[0] = 0;
  ab_status status;
  const ab_cpu_pool pool = ab_shim_cpu_pool();
  /* other Python threads run while the kernel does, except in calls too small to pay for the switch
   * (the size below which the kernels stay on the calling thread, ab_cpu.h) */
  if ((double)p.B * p.Hq * p.Sq * p.Sk * (p.D + p.Dv) >= (double)(1 << 18)) {
    Py_BEGIN_ALLOW_THREADS
    status = ab_flash_cpu_fwd(&p, &pool, &err);
    Py_END_ALLOW_THREADS
  } else {
    status = ab_flash_cpu_fwd(&p, &pool, &err);
  }
  free(own_lse);
  if (status != AB_OK) {
    Py_DECREF(out);
    Py_XDECREF(lse);
    return direct_error(err.msg);
  }
  return Py_BuildValue("(NN)", out, lse ? lse : Py_NewRef(Py_None));
}


/* flash_fwd_cpu(q, k, v, attn_mask, causal, scale, window_left, window_right, softcap, want_lse)
 *   -> (out, lse or None), or None when this call must take the op (a tensor is not on the CPU, the
 *   CUDA emulation is on, or set_tensor_api was never called).  q (B, Hq, Sq, D), k (B, Hkv, Sk, D),
 *   v (B, Hkv, Sk, Dv) and the mask are plain tensors (the caller checked); out (B, Hq, Sq, Dv) is stored (B, Sq, Hq, Dv) and
 *   lse (B, Hq, Sq) is float32, as the flash_fwd op returns them.  Without want_lse the kernel writes
 *   lse to a buffer of its own. */
static PyObject* ab_py_flash_fwd_cpu(PyObject* self, PyObject* args) {
  ab_state* st = ab_module_state(self);
  PyObject *q, *k, *v, *mask;
  int causal, want_lse;
  double scale, softcap;
  long long wl, wr;
  if (!PyArg_ParseTuple(args, "OOOOidLLdp", &q, &k, &v, &mask, &causal, &scale, &wl, &wr, &softcap, &want_lse))
    return NULL;
  if (!st->empty_strided || ab_cuda_emulation()) Py_RETURN_NONE;
  PyObject* const tensors[4] = {q, k, v, mask};
  const int cpu = all_cpu(st, tensors, 4);
  if (cpu < 0) return NULL;
  if (!cpu) Py_RETURN_NONE;
  ab_attn_params p;
  memset(&p, 0, sizeof p);
  READ_OR_HAND_BACK(read_view(st, q, &p.q, "q", 1));
  READ_OR_HAND_BACK(read_view(st, k, &p.k, "k", 1));
  READ_OR_HAND_BACK(read_view(st, v, &p.v, "v", 1));
  if (p.q.ndim != 4 || p.k.ndim != 4 || p.v.ndim != 4)
    return direct_error("q, k and v must be 4-D: (B, Hq, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, Dv)");
  p.B = p.q.sizes[0];
  p.Hq = p.q.sizes[1];
  p.Sq = p.q.sizes[2];
  p.D = p.q.sizes[3];
  p.Hkv = p.k.sizes[1];
  p.Sk = p.k.sizes[2];
  p.Dv = p.v.sizes[3];
  if (mask != Py_None) {
    READ_OR_HAND_BACK(read_view(st, mask, &p.mask, "attn_mask", 0));
    if (broadcast_mask(&p.mask, p.B, p.Hq, p.Sq, p.Sk) < 0) return NULL;
  }
  p.causal = (ab_causal)causal;
  p.scale = scale;
  p.window_left = wl;
  p.window_right = wr;
  p.softcap = softcap;
  return run_direct(st, q, &p, want_lse);
}

/* The version bump of the two caches a call wrote into, as the op's Tensor(a!) arguments get it. */
static int bump_versions(ab_state* st, PyObject* kc, PyObject* vc) {
  if (!st->increment_version) {
    PyErr_SetString(PyExc_RuntimeError, "attn_backends: set_kvcache_guards was never called");
    return -1;
  }
  PyObject* pair = PyTuple_Pack(2, kc, vc);
  if (!pair) return -1;
  PyObject* r = PyObject_CallFunctionObjArgs(st->increment_version, pair, NULL);
  Py_DECREF(pair);
  Py_XDECREF(r);
  return r ? 0 : -1;
}

/* Allocates out (B, Sq, Hq, D) contiguous in q's dtype and lse (B, Hq, Sq) float32, as the kvcache_fwd
 * op returns them, and runs the CPU decode kernel on p (every input view and option filled), its
 * workspace from malloc; with new keys and values (p->k_new) the caches kc and vc then get their
 * version bumps.  -> (out, lse), or out alone without want_lse (lse then lives in the workspace: one
 * tensor fewer to make), or NULL with an exception.  A bad index value is a ValueError with the
 * kernel's message when value_error (what _kvcache.py makes of it), else worded as the op words it
 * (a RuntimeError that _kvcache.py turns into that ValueError). */
static PyObject* run_kvcache(ab_state* st, PyObject* q, PyObject* kc, PyObject* vc, ab_kvcache_params* pp,
                             int value_error, int want_lse) {
  ab_kvcache_params p = *pp;
  if (p.q.dtype >= AB_DTYPE_BOOL) return direct_error("q must be a floating tensor");
  /* out (B, Sq, Hq, D) and lse (B, Hq, Sq), contiguous */
  p.out.ndim = 4;
  p.out.dtype = p.q.dtype;
  p.out.device = AB_DEVICE_CPU;
  p.out.device_index = -1;
  memcpy(p.out.sizes, p.q.sizes, sizeof p.out.sizes);
  contiguous_strides(p.out.sizes, 4, p.out.strides);
  p.lse = p.out;
  p.lse.ndim = 3;
  p.lse.dtype = AB_DTYPE_F32;
  const int64_t lse_sizes[3] = {p.B, p.Hq, p.Sq};
  memcpy(p.lse.sizes, lse_sizes, sizeof lse_sizes);
  contiguous_strides(lse_sizes, 3, p.lse.strides);
  PyObject* out = empty_strided(st, q, p.out.sizes, p.out.strides, 4, p.q.dtype);
  if (!out || set_data(st, out, &p.out) < 0) {
    Py_XDECREF(out);
    return NULL;
  }
  PyObject* lse = NULL;
  if (want_lse) {
    lse = empty_strided(st, NULL, p.lse.sizes, p.lse.strides, 3, AB_DTYPE_F32);
    if (!lse || set_data(st, lse, &p.lse) < 0) {
      Py_DECREF(out);
      Py_XDECREF(lse);
      return NULL;
    }
  }
  const ab_cpu_pool pool = ab_shim_cpu_pool();
  const size_t bytes = ab_kvcache_cpu_workspace_size(&p, pool.num_threads);
  /* without want_lse, lse's floats after the kernel's workspace */
  const size_t lse_at = (bytes + 63) & ~(size_t)63;
  const size_t total = want_lse ? bytes : lse_at + (size_t)(p.B * p.Hq * p.Sq) * sizeof(float);
  void* ws = NULL;
  if (total && posix_memalign(&ws, 64, total) != 0) {
    Py_DECREF(out);
    Py_XDECREF(lse);
    return PyErr_NoMemory();
  }
  if (!want_lse) p.lse.data = ws ? (char*)ws + lse_at : NULL;
  ab_error err;
  err.msg[0] = 0;
  ab_status status;
  /* other Python threads run while the kernel does, except in calls too small to pay for the switch */
  if ((double)p.B * p.Sq * p.Hq * p.D * (double)p.k_cache.sizes[1] >= (double)(1 << 18)) {
    Py_BEGIN_ALLOW_THREADS
    status = ab_kvcache_cpu_fwd(&p, ws, bytes, &pool, &err);
    Py_END_ALLOW_THREADS
  } else {
    status = ab_kvcache_cpu_fwd(&p, ws, bytes, &pool, &err);
  }
  free(ws);
  if (status != AB_OK) {
    Py_DECREF(out);
    Py_XDECREF(lse);
    /* worded as the op words it, so that _kvcache.py raises a bad index value as a ValueError */
    if (status == AB_ERR_INVALID) {
      if (value_error) {
        err.msg[strcspn(err.msg, "\n")] = 0; /* its first line, as _kvcache._kernel_op keeps */
        PyErr_SetString(PyExc_ValueError, err.msg);
      } else {
        PyErr_Format(PyExc_RuntimeError, "attn_backends: invalid argument: %s", err.msg);
      }
      return NULL;
    }
    return direct_error(err.msg);
  }
  if (p.k_new.ndim && bump_versions(st, kc, vc) < 0) {
    Py_DECREF(out);
    Py_XDECREF(lse);
    return NULL;
  }
  return want_lse ? Py_BuildValue("(NN)", out, lse) : out;
}

/* The tensors of a KV-cache call, in the order both direct calls take them (attention_with_kvcache's). */
enum { KVT_Q, KVT_KC, KVT_VC, KVT_K, KVT_V, KVT_COS, KVT_SIN, KVT_SEQ, KVT_BIDX, KVT_LEFT, KVT_BT, KVT_ALIBI,
       KVT_SINKS, KVT_N };

/* Zeroes *p and fills its views from the KVT_N tensors (None: left empty); any_rank as read_view's.
 * 0; 1 when read_view says a tensor is not for a direct call; -1 with an exception set. */
static int read_kv_views(const ab_state* st, PyObject* const* tensors, ab_kvcache_params* p, int any_rank) {
  memset(p, 0, sizeof *p);
  ab_tensor* const views[KVT_N] = {&p->q,          &p->k_cache,    &p->v_cache,       &p->k_new,
                                   &p->v_new,      &p->rotary_cos, &p->rotary_sin,    &p->cache_seqlens,
                                   &p->cache_batch_idx, &p->cache_leftpad, &p->block_table, &p->alibi_slopes,
                                   &p->sinks};
  static const char* const names[KVT_N] = {"q",          "k_cache",       "v_cache",         "k",
                                           "v",          "rotary_cos",    "rotary_sin",      "cache_seqlens",
                                           "cache_batch_idx", "cache_leftpad", "block_table", "alibi_slopes",
                                           "sinks"};
  for (int i = 0; i < KVT_N; ++i)
    if (tensors[i] != Py_None) {
      const int rc = read_view(st, tensors[i], views[i], names[i], any_rank);
      if (rc) return rc;
    }
  return 0;
}

/* The sizes (from q and k_cache, both 4-D) and the options of *p; num_splits clamped as the op clamps it. */
static void set_kv_options(ab_kvcache_params* p, long long seqlen, double scale, double softcap, int causal,
                           long long wl, long long wr, int interleaved, long long num_splits) {
  p->B = p->q.sizes[0];
  p->Sq = p->q.sizes[1];
  p->Hq = p->q.sizes[2];
  p->D = p->q.sizes[3];
  p->Hkv = p->k_cache.sizes[2];
  p->cache_seqlen = seqlen;
  p->scale = scale;
  p->softcap = softcap;
  p->causal = causal;
  p->window_left = wl;
  p->window_right = wr;
  p->rotary_interleaved = interleaved;
  p->num_splits = (int32_t)(num_splits < 0 ? -1 : num_splits > 1 << 20 ? 1 << 20 : num_splits);
}

/* kvcache_fwd_cpu(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlen,
 *                 cache_batch_idx, cache_leftpad, block_table, alibi_slopes, scale, causal, window_left,
 *                 window_right, softcap, rotary_interleaved, num_splits, sinks[, attn_mask])
 *   -> (out, lse), or None when this call must take the op (a tensor is not on the CPU, the CUDA
 *   emulation is on, or set_tensor_api was never called).  The kvcache_fwd op's arguments; the caller
 *   (attn_backends/_kvcache.py) checked them, the kernel checks the index values before it writes
 *   anything.  out (B, Sq, Hq, D) contiguous in q's dtype, lse (B, Hq, Sq) float32.  attn_mask (for flash's
 *   calls: a dense cache of S_cache keys, no new ones) broadcasts to (B, Hq, Sq, S_cache), as flash_fwd_cpu's. */
static PyObject* ab_py_kvcache_fwd_cpu(PyObject* self, PyObject* args) {
  ab_state* st = ab_module_state(self);
  PyObject *q, *kc, *vc, *kn, *vn, *cos, *sin, *seqlens, *batch_idx, *leftpad, *block_table, *alibi, *sinks;
  PyObject* mask = Py_None;
  long long seqlen, wl, wr, num_splits;
  double scale, softcap;
  int causal, interleaved;
  if (!PyArg_ParseTuple(args, "OOOOOOOOLOOOOdpLLdpLO|O", &q, &kc, &vc, &kn, &vn, &cos, &sin, &seqlens, &seqlen,
                        &batch_idx, &leftpad, &block_table, &alibi, &scale, &causal, &wl, &wr, &softcap,
                        &interleaved, &num_splits, &sinks, &mask))
    return NULL;
  if (!st->empty_strided || ab_cuda_emulation()) Py_RETURN_NONE;
  PyObject* const tensors[KVT_N] = {q,       kc,      vc,          kn,    vn,    cos, sin,
                                    seqlens, batch_idx, leftpad, block_table, alibi, sinks};
  const int cpu = all_cpu(st, tensors, KVT_N);
  if (cpu < 0) return NULL;
  if (!cpu) Py_RETURN_NONE;
  const int mask_cpu = all_cpu(st, &mask, 1);
  if (mask_cpu < 0) return NULL;
  if (!mask_cpu) Py_RETURN_NONE;
  ab_kvcache_params p;
  READ_OR_HAND_BACK(read_kv_views(st, tensors, &p, 0));
  if (p.q.ndim != 4 || p.k_cache.ndim != 4)
    return direct_error("q must be (B, Sq, Hq, D) and k_cache (B_cache, S_cache, Hkv, D) or "
                        "(num_blocks, block_size, Hkv, D)");
  set_kv_options(&p, seqlen, scale, softcap, causal, wl, wr, interleaved, num_splits);
  if (mask != Py_None) {
    READ_OR_HAND_BACK(read_view(st, mask, &p.mask, "attn_mask", 0));
    if (broadcast_mask(&p.mask, p.B, p.Hq, p.Sq, p.k_cache.sizes[1]) < 0) return NULL;
  }
  return run_kvcache(st, q, kc, vc, &p, 0, 1);
}

/* *slot = value (a new reference), dropping the old one (Py_XSETREF is not in the limited API). */
static void replace_ref(PyObject** slot, PyObject* value) {
  PyObject* old = *slot;
  *slot = value;
  Py_XDECREF(old);
}

/* set_tensor_api(empty_strided, cpu_device, (float32, float16, bfloat16, float64, bool, int32, int64,
 * uint8)): what flash_fwd_cpu allocates with and the dtypes it recognises (ab_dtype's order). */
static PyObject* ab_py_set_tensor_api(PyObject* self, PyObject* args) {
  ab_state* st = ab_module_state(self);
  PyObject *fn, *device, *dtypes;
  if (!PyArg_ParseTuple(args, "OOO", &fn, &device, &dtypes)) return NULL;
  if (!PyTuple_Check(dtypes) || PyTuple_Size(dtypes) != AB_DTYPE_OTHER) {
    PyErr_SetString(PyExc_TypeError, "set_tensor_api: dtypes must be a tuple of 8 torch dtypes (ab_dtype's order)");
    return NULL;
  }
  PyObject* kw[4] = {NULL, NULL, NULL, NULL};
  for (int i = 0; i < 4; ++i) {
    kw[i] = Py_BuildValue("{sOsO}", "dtype", PyTuple_GetItem(dtypes, i), "device", device);
    if (!kw[i]) {
      for (int j = 0; j < i; ++j) Py_DECREF(kw[j]);
      return NULL;
    }
  }
  replace_ref(&st->empty_strided, Py_NewRef(fn));
  for (int i = 0; i < AB_DTYPE_OTHER; ++i) replace_ref(&st->dtypes[i], Py_NewRef(PyTuple_GetItem(dtypes, i)));
  for (int i = 0; i < 4; ++i) replace_ref(&st->alloc_kw[i], kw[i]);
  Py_RETURN_NONE;
}

/* ---- the fast path of ab.attention ------------------------------------------------------------------
 *
 * attention(q, k, v, backend, causal, scale, want_lse, window, softcap, sinks, alibi_slopes, attn_mask): the
 * whole of a plain eager CPU call in C.  It serves a call only when everything below holds, and otherwise
 * returns None, and the Python path (attn_backends/_dispatch.py) serves the call as before, with its
 * checks and its errors:
 *   - the arguments the caller left at their defaults are the ones attn_backends/__init__.py checks
 *     before calling here (no dropout or deterministic; not while torch.compile traces);
 *   - q, k, v plain torch.Tensors on the CPU, of one floating dtype, 4-D, shapes that agree (the
 *     rules of _validate.check_qkv); causal False, True or a name; scale None or a finite float
 *     (within float32's range below float64); want_lse a bool; window None or two ints >= -1; softcap
 *     an int or float >= 0; sinks None or (Hq,) floating (a gradient counts as q's does), alibi_slopes
 *     None or float32 (Hq,) or (B, Hq) (a module's nn.Parameter for either); attn_mask None or a plain
 *     CPU bool or floating tensor of 1 to 4 dims that broadcasts to (B, Hq, Sq, Sk), a float one not
 *     requiring grad (fast_mask);
 *   - none of the guards set_fast_api gave (dispatch and function modes, jit tracing, functorch
 *     transforms, forward-mode AD; inference mode may be on) is active, and no gradient is needed;
 *   - the call's descriptor (the same ab_call the Python path builds: the requested backend as
 *     ab.use() / the process default / the argument make it, the CPU path, the deterministic flag)
 *     is remembered: the Python path planned it once, logged it, did not fall back, and chose flash.
 * Then it runs the same kernel as flash_fwd_cpu.  Same bits as the op (tests/test_direct.py). */

/* The ab_backend_id of a backend name as the caller spelt it (any accepted spelling), -1 when
 * unknown (the Python path then raises the error that lists the names). */
static int backend_id(ab_state* st, PyObject* name) {
  if (name == Py_None) return AB_BK_AUTO;
  PyObject* id = PyDict_GetItemWithError(st->backend_ids, name);
  if (id) return (int)PyLong_AsLong(id);
  if (PyErr_Occurred() || !PyUnicode_Check(name)) {
    PyErr_Clear();
    return -1;
  }
  Py_ssize_t len = 0;
  const char* s = PyUnicode_AsUTF8AndSize(name, &len);
  /* a name with a NUL inside is no name (the lookup would stop at the NUL): the Python path words it */
  const int found = s && strlen(s) == (size_t)len ? ab_backend_lookup(s) : -1;
  if (found < 0) {
    PyErr_Clear();
    return -1;
  }
  PyObject* v = PyLong_FromLong(found);
  if (v && PyDict_Size(st->backend_ids) < 256) PyDict_SetItem(st->backend_ids, name, v);
  Py_XDECREF(v);
  PyErr_Clear();
  return found;
}

/* 1 when callable() returns something true, 0 when false, -1 with an exception. */
static int call_truth(PyObject* callable) {
  PyObject* r = PyObject_CallNoArgs(callable);
  if (!r) return -1;
  const int t = PyObject_IsTrue(r);
  Py_DECREF(r);
  return t;
}

/* The backend a call asks for: the argument, and for "auto" _planner.default_backend() (the innermost
 * use(), else the process default).  -1 when the fast path cannot tell (the Python path decides), -2
 * with an exception. */
static int requested_backend(ab_state* st, PyObject* backend) {
  int requested = backend_id(st, backend);
  if (requested != AB_BK_AUTO) return requested;
  PyObject* name = PyObject_CallNoArgs(st->context_get);
  if (!name) return -2;
  if (name == Py_None) {
    Py_DECREF(name);
    PyObject* first = PyList_GetItem(st->process_default, 0); /* borrowed; NULL for an empty list */
    if (!first || first == Py_None) {
      PyErr_Clear();
      return -1;
    }
    name = Py_NewRef(first);
  }
  requested = backend_id(st, name);
  Py_DECREF(name);
  return requested;
}

/* 1 when none of the guards (callables that return something true while a mode, trace or transform
 * is active) is, 0 when one is, -1 with an exception. */
static int no_guard_active(PyObject* guards) {
  const Py_ssize_t n = PyTuple_Size(guards);
  for (Py_ssize_t i = 0; i < n; ++i) {
    const int active = call_truth(PyTuple_GetItem(guards, i));
    if (active <= 0) {
      if (active < 0) return -1;
      continue;
    }
    return 0;
  }
  return 1;
}

/* The ab_causal of a causal argument as _validate reads it (False, True, "top_left", "bottom_right"),
 * -1 for anything else (the Python path words it). */
static int causal_arg(PyObject* o) {
  if (o == Py_False) return AB_CAUSAL_NONE;
  if (o == Py_True) return AB_CAUSAL_TOP_LEFT;
  if (!PyUnicode_CheckExact(o)) return -1;
  if (PyUnicode_CompareWithASCIIString(o, "bottom_right") == 0) return AB_CAUSAL_BOTTOM_RIGHT;
  if (PyUnicode_CompareWithASCIIString(o, "top_left") == 0) return AB_CAUSAL_TOP_LEFT;
  return -1;
}

/* Whether o may stand for sinks or ALiBi slopes on a fast path: a plain torch.Tensor, or a
 * torch.nn.Parameter (a module's weights, as GPT-OSS hands its sinks over as s_aux: Parameter turns
 * __torch_function__ off, so it dispatches as a plain tensor; its gradient counts as any tensor's). */
static int weight_arg(const ab_state* st, PyObject* o) {
  PyObject* t = (PyObject*)Py_TYPE(o);
  return t == st->tensor_type || (st->parameter_type && t == st->parameter_type);
}

/* Whether sinks and ALiBi slopes (NULL where the call has none) meet _validate.check_sinks and
 * check_alibi's rules for a fast path: sinks (Hq,) of a floating dtype, slopes float32 (Hq,) or (B, Hq)
 * (the CPU kernels read any strides, and the sinks in any floating dtype).  Anything else goes to the
 * Python path, which words the error. */
static int sinks_alibi_ok(const ab_tensor* sinks, const ab_tensor* alibi, int64_t B, int64_t Hq) {
  if (sinks && (sinks->ndim != 1 || sinks->sizes[0] != Hq || sinks->dtype > AB_DTYPE_F64)) return 0;
  if (!alibi) return 1;
  return alibi->dtype == AB_DTYPE_F32 && ((alibi->ndim == 1 && alibi->sizes[0] == Hq) ||
                                          (alibi->ndim == 2 && alibi->sizes[0] == B && alibi->sizes[1] == Hq));
}

/* What the fast paths check first: causal a bool (the KV-cache call's) or, with causal_names, any
 * spelling causal_arg reads; want_lse a bool; the scale None or a float; the backend asked for; none of
 * the guards active; no gradient needed for any of the n tensors.  -> 1 to go on (*causal, *want_lse,
 * *requested set), 0 to hand the call back, -1 with an exception. */
static int fast_opening(ab_state* st, PyObject* guards, PyObject* causal_o, int causal_names, PyObject* lse_o,
                        PyObject* scale_o, PyObject* backend, PyObject* const* tensors, int n, int* causal,
                        int* want_lse, int* requested) {
  *causal = causal_names ? causal_arg(causal_o) : causal_o == Py_False ? 0 : causal_o == Py_True ? 1 : -1;
  *want_lse = lse_o == Py_False ? 0 : lse_o == Py_True ? 1 : -1;
  if (*causal < 0 || *want_lse < 0 || (scale_o != Py_None && !PyFloat_CheckExact(scale_o))) return 0;
  *requested = requested_backend(st, backend);
  if (*requested == -2) return -1;
  if (*requested < 0) return 0;
  const int quiet = no_guard_active(guards);
  if (quiet <= 0) return quiet;
  const int grad = call_truth(st->grad_enabled);
  if (grad < 0) return -1;
  for (int i = 0; grad && i < n; ++i) {
    PyObject* rg = PyObject_GetAttr(tensors[i], st->s_requires_grad);
    if (!rg) return -1;
    Py_DECREF(rg);
    if (rg != Py_False) return 0; /* a gradient: the autograd Function, or the Python path's error */
  }
  return 1;
}

/* *c zeroed as a CPU call, with the fields of a call descriptor that come from the process
 * (settings["mps_fix"], the CPU path, units and vendor) as _planner.new_call fills them; the caller
 * sets the call's own.  1, 0 to hand the call back, -1 with an exception. */
static int cpu_call(ab_state* st, ab_call* c) {
  memset(c, 0, sizeof *c);
  c->device = AB_DEVICE_CPU;
  PyObject* mps_fix_o = PyDict_GetItemWithError(st->settings, st->s_mps_fix);
  if (!mps_fix_o) return PyErr_Occurred() ? -1 : 0;
  const int mps_fix = PyObject_IsTrue(mps_fix_o);
  if (mps_fix < 0) return -1;
  c->mps_fix = mps_fix;
  c->cpu_isa = (int32_t)ab_cpu_isa_get();
  c->cpu_units = ab_cpu_units_detect();
  c->cpu_vendor = (int32_t)ab_cpu_vendor_detect();
  c->cpu_family = (int32_t)ab_cpu_features_get()->family;
  return 1;
}

/* Whether two call descriptors hold the same values, field by field (the struct has padding, which
 * neither a copy nor memcmp need treat alike). */
static int same_call(const ab_call* a, const ab_call* b) {
#define AB_CALL_SAME(type, name, doc) &&a->name == b->name
  return 1 AB_CALL_FIELDS(AB_CALL_SAME);
#undef AB_CALL_SAME
}

/* The chosen backend remembered for *c, or -1; a plan found is marked used (the clock of remember). */
static int remembered(ab_state* st, const ab_call* c) {
  for (int i = 0; i < st->n_remembered; ++i)
    if (same_call(&st->remembered[i].call, c)) {
      st->remembered[i].used = 1;
      return st->remembered[i].chosen;
    }
  return -1;
}

/* A softcap as _validate.check_softcap reads it: an exact float or int, >= 0 and finite.  1 with *x
 * set, 0 when it is not one (the Python path words it). */
static int softcap_arg(PyObject* o, double* x) {
  if (PyFloat_CheckExact(o)) {
    *x = PyFloat_AsDouble(o);
  } else if (PyLong_CheckExact(o)) {
    *x = PyLong_AsDouble(o);
    if (*x == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      return 0;
    }
  } else {
    return 0;
  }
  return *x >= 0.0 && isfinite(*x);
}

/* A fast path's window and softcap, as _validate reads them: window None or (left, right) of ints >= -1,
 * a side that hides no key (>= span, the longest query and key lengths summed) made unbounded as
 * _validate.clamp_window makes it; softcap an int or float >= 0, within float32's range unless dt is
 * float64.  -> 1 with *wl, *wr, *softcap set, 0 to hand the call back. */
static int window_softcap_args(PyObject* win, PyObject* cap, int64_t span, ab_dtype dt, long long* wl,
                               long long* wr, double* softcap) {
  *wl = *wr = -1;
  if (win != Py_None && (!PyTuple_CheckExact(win) || PyTuple_Size(win) != 2 ||
                         !small_int(PyTuple_GetItem(win, 0), -1, wl) || !small_int(PyTuple_GetItem(win, 1), -1, wr)))
    return 0;
  *wl = *wl >= span ? -1 : *wl;
  *wr = *wr >= span ? -1 : *wr;
  return softcap_arg(cap, softcap) && (dt == AB_DTYPE_F64 || *softcap <= FLT_MAX);
}

/* Reads a fast path's sinks and ALiBi slopes (None: none) into p, for B sequences of p->Hq heads.
 * -> 1 when they meet sinks_alibi_ok, 0 to hand the call back, -1 with an exception. */
static int read_sinks_alibi(ab_state* st, PyObject* sinks, PyObject* alibi, ab_attn_params* p) {
  const int rs = sinks != Py_None ? read_view(st, sinks, &p->sinks, "sinks", 1) : 0;
  if (rs) return rs < 0 ? -1 : 0;
  const int ra = alibi != Py_None ? read_view(st, alibi, &p->alibi, "alibi_slopes", 1) : 0;
  if (ra) return ra < 0 ? -1 : 0;
  return sinks_alibi_ok(sinks != Py_None ? &p->sinks : NULL, alibi != Py_None ? &p->alibi : NULL, p->B, p->Hq);
}

/* Whether the fast path may take every one of the n tensors: plain torch.Tensors, or sinks and ALiBi
 * slopes that weight_arg accepts; None too where none_ok (an absent optional argument). */
static int fast_tensors(const ab_state* st, PyObject* const* tensors, int n, PyObject* sinks, PyObject* alibi,
                        int none_ok) {
  for (int i = 0; i < n; ++i)
    if ((PyObject*)Py_TYPE(tensors[i]) != st->tensor_type && !(none_ok && tensors[i] == Py_None) &&
        !((tensors[i] == sinks || tensors[i] == alibi) && weight_arg(st, tensors[i])))
      return 0;
  return 1;
}

/* What both plain fast paths end with: the scale (None: D ** -0.5 for a dense call, as
 * _dispatch.prepare computes it, and 1 / sqrt(D) for a packed one, as _validate.check_scale does for
 * prepare_varlen: the two differ by an ulp for some D), the call descriptor the Python path builds for
 * the call (_dispatch.prepare, or prepare_varlen with varlen 1; square as the caller says), the plan
 * remembered for it (served only where `chosen` is), then the kernel on p (q, k, v, sizes and
 * cu_seqlens filled).  -> out or (out, lse), None to hand the call back, or NULL with an exception. */
static PyObject* serve_plain(ab_state* st, PyObject* q, ab_attn_params* pp, PyObject* scale_o, int causal,
                             int64_t wl, int64_t wr, double softcap, int want_lse, int requested, int varlen,
                             int square, int chosen) {
  ab_attn_params p = *pp;
  const ab_dtype dt = p.q.dtype;
  double scale = varlen ? 1.0 / sqrt((double)p.D) : pow((double)p.D, -0.5);
  if (scale_o != Py_None) {
    scale = PyFloat_AsDouble(scale_o);
    if (!isfinite(scale) || (dt != AB_DTYPE_F64 && fabs(scale) > FLT_MAX)) Py_RETURN_NONE;
  }
  const int det = call_truth(st->deterministic);
  if (det < 0) return NULL;
  ab_call c;
  const int known = cpu_call(st, &c);
  if (known <= 0) return known < 0 ? NULL : Py_NewRef(Py_None);
  c.dtype = dt;
  c.D = p.D;
  c.Dv = p.Dv;
  c.gqa = p.Hq != p.Hkv;
  c.square = square;
  c.causal = (ab_causal)causal;
  c.window = wl >= 0 || wr >= 0;
  c.softcap = softcap > 0;
  c.deterministic = det;
  c.want_lse = want_lse;
  c.varlen = varlen;
  c.requested = requested;
  c.sinks = p.sinks.ndim > 0;
  c.alibi = p.alibi.ndim > 0;
  c.mask = !p.mask.ndim ? 0 : p.mask.dtype == AB_DTYPE_BOOL ? 1 : 2; /* _dispatch.prepare's mask_kind */
  c.few_queries = !varlen && p.Sq <= AB_FEW_QUERIES;
  if (remembered(st, &c) != chosen) Py_RETURN_NONE;
  p.causal = (ab_causal)causal;
  p.scale = scale;
  p.window_left = wl;
  p.window_right = wr;
  p.softcap = softcap;
  PyObject* res = run_direct(st, q, &p, want_lse);
  if (!res || want_lse) {
    if (res) ++st->fast_calls;
    return res;
  }
  PyObject* out = Py_NewRef(PyTuple_GetItem(res, 0));
  Py_DECREF(res);
  ++st->fast_calls;
  return out;
}

enum { AT_Q, AT_K, AT_V, AT_BACKEND, AT_CAUSAL, AT_SCALE, AT_LSE, AT_WINDOW, AT_SOFTCAP, AT_SINKS, AT_ALIBI,
       AT_MASK, AT_NARGS };

/* The attn_mask of a fast call into p->mask, broadcast to (B, Hq, Sq, Sk): 1; 0 to hand the call back where
 * the Python path has more to say (_validate.check_mask's errors: not bool or floating, more than 4 dims,
 * not broadcastable; a float mask that requires grad, whose gradient the autograd Function computes); -1
 * with an exception.  p's sizes are set. */
static int fast_mask(ab_state* st, PyObject* mask, ab_attn_params* p) {
  const int rc = read_view(st, mask, &p->mask, "attn_mask", 1);
  if (rc) return rc < 0 ? -1 : 0;
  const ab_tensor* m = &p->mask;
  if (m->ndim < 1 || m->ndim > 4) return 0;
  if (m->dtype != AB_DTYPE_BOOL) {
    if (!ab_dtype_is_floating(m->dtype)) return 0;
    PyObject* rg = PyObject_GetAttr(mask, st->s_requires_grad);
    if (!rg) return -1;
    Py_DECREF(rg);
    if (rg != Py_False) return 0;
  }
  const int64_t want[4] = {p->B, p->Hq, p->Sq, p->Sk};
  for (int d = 0; d < m->ndim; ++d) {
    const int64_t size = m->sizes[d], need = want[4 - m->ndim + d];
    if (size != need && size != 1) return 0;
  }
  return broadcast_mask(&p->mask, p->B, p->Hq, p->Sq, p->Sk) < 0 ? -1 : 1;
}

static PyObject* ab_py_attention(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  ab_state* st = ab_module_state(self);
  if (nargs != AT_NARGS) {
    PyErr_SetString(PyExc_TypeError, "attention(q, k, v, backend, causal, scale, want_lse, window, softcap, sinks, "
                                     "alibi_slopes, attn_mask) takes 12 arguments");
    return NULL;
  }
  PyObject *q = args[AT_Q], *k = args[AT_K], *v = args[AT_V], *scale_o = args[AT_SCALE];
  PyObject *sinks = args[AT_SINKS], *alibi = args[AT_ALIBI], *mask = args[AT_MASK];
  if (!st->tensor_type || !st->empty_strided || st->n_remembered == 0 || ab_cuda_emulation()) Py_RETURN_NONE;
  /* q, k, v, then the sinks (whose gradient counts), then the ALiBi slopes (no gradient, as in flash-attn) and
   * the mask (a float one that requires grad goes to the Python path: fast_mask) */
  PyObject* tensors[6] = {q, k, v};
  int n = 3;
  if (sinks != Py_None) tensors[n++] = sinks;
  const int n_grad = n;
  if (alibi != Py_None) tensors[n++] = alibi;
  if (mask != Py_None) tensors[n++] = mask;
  if (!fast_tensors(st, tensors, n, sinks, alibi, 0)) Py_RETURN_NONE;
  int causal, want_lse, requested;
  const int go = fast_opening(st, st->guards, args[AT_CAUSAL], 1, args[AT_LSE], scale_o, args[AT_BACKEND], tensors,
                              n_grad, &causal, &want_lse, &requested);
  if (go <= 0) return go < 0 ? NULL : Py_NewRef(Py_None);
  const int cpu = all_cpu(st, tensors, n);
  if (cpu < 0) return NULL;
  if (!cpu) Py_RETURN_NONE;
  ab_attn_params p;
  memset(&p, 0, sizeof p);
  READ_OR_HAND_BACK(read_view(st, q, &p.q, "q", 1));
  READ_OR_HAND_BACK(read_view(st, k, &p.k, "k", 1));
  READ_OR_HAND_BACK(read_view(st, v, &p.v, "v", 1));
  if (p.q.ndim != 4 || p.k.ndim != 4 || p.v.ndim != 4) Py_RETURN_NONE;
  const ab_dtype dt = p.q.dtype;
  /* _validate.check_qkv's rule; anything else is the Python path's to word */
  if (dt > AB_DTYPE_F64 || p.k.dtype != dt || p.v.dtype != dt || p.k.sizes[0] != p.q.sizes[0] ||
      p.v.sizes[0] != p.q.sizes[0] || p.v.sizes[1] != p.k.sizes[1] || p.v.sizes[2] != p.k.sizes[2] ||
      p.k.sizes[3] != p.q.sizes[3] || p.q.sizes[3] <= 0 || p.k.sizes[1] <= 0 || p.q.sizes[1] % p.k.sizes[1] != 0)
    Py_RETURN_NONE;
  p.B = p.q.sizes[0];
  p.Hq = p.q.sizes[1];
  p.Sq = p.q.sizes[2];
  p.D = p.q.sizes[3];
  p.Hkv = p.k.sizes[1];
  p.Sk = p.k.sizes[2];
  p.Dv = p.v.sizes[3];
  const int weights = read_sinks_alibi(st, sinks, alibi, &p);
  if (weights <= 0) return weights < 0 ? NULL : Py_NewRef(Py_None);
  if (mask != Py_None) {
    const int ok = fast_mask(st, mask, &p);
    if (ok <= 0) return ok < 0 ? NULL : Py_NewRef(Py_None);
  }
  long long wl, wr;
  double softcap;
  if (!window_softcap_args(args[AT_WINDOW], args[AT_SOFTCAP], p.Sq + p.Sk, dt, &wl, &wr, &softcap)) Py_RETURN_NONE;
  return serve_plain(st, q, &p, scale_o, causal, wl, wr, softcap, want_lse, requested, 0, p.Sq == p.Sk, AB_BK_FLASH);
}

/* ---- the fast path of ab.attention_varlen and flash_attn_varlen_func ------------------------------
 *
 * attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, backend, causal,
 * scale, window, softcap, want_lse, sinks, alibi_slopes): a packed call on the terms of attention()'s
 * fast path: plain CPU tensors q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv) of one floating dtype,
 * cu_seqlens contiguous CPU int32 (B + 1,) within _varlen.check_cu_seqlens's rules (from 0, never
 * decreasing, to the totals, no sequence longer than its max_seqlen, an int), window None or a tuple
 * of two ints >= -1, softcap an int or float >= 0, sinks None or (Hq,) floating without a gradient
 * (GPT-OSS's s_aux), alibi_slopes None or float32 (Hq,) or (B, Hq), no dropout (the caller passes only
 * such calls), and the descriptor _dispatch.prepare_varlen builds remembered with flash_varlen chosen.
 * Then the kernel runs as the Python path's flash_varlen runner runs it: ab_flash_cpu_fwd on the packed
 * call, which hands calls of a few queries per sequence to the decode kernel as
 * _providers/ours.py's _run_by_decode does (csrc/cpu/flash_cpu.c).  HF's continuous batching makes
 * such a call per layer and step (docs/benchmarks.md, "Short queries"). */

/* The longest sequence of cu (B + 1 values) when cu holds _varlen.check_cu_seqlens's rules for total
 * rows and the bound max_len, else -1. */
static int64_t cu_longest(const int32_t* cu, int64_t B, int64_t total, long long max_len) {
  if (cu[0] != 0 || cu[B] != total) return -1;
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = (int64_t)cu[b + 1] - cu[b];
    if (len < 0 || len > max_len) return -1;
    if (len > longest) longest = len;
  }
  return longest;
}

enum { VL_Q, VL_K, VL_V, VL_CU_Q, VL_CU_K, VL_MAX_Q, VL_MAX_K, VL_BACKEND, VL_CAUSAL, VL_SCALE, VL_WINDOW,
       VL_SOFTCAP, VL_LSE, VL_SINKS, VL_ALIBI, VL_NARGS };

static PyObject* ab_py_attention_varlen(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  ab_state* st = ab_module_state(self);
  if (nargs != VL_NARGS) {
    PyErr_SetString(PyExc_TypeError, "attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, "
                                     "max_seqlen_k, backend, causal, scale, window, softcap, want_lse, sinks, "
                                     "alibi_slopes) takes 15 arguments");
    return NULL;
  }
  PyObject *q = args[VL_Q], *k = args[VL_K], *v = args[VL_V], *cq = args[VL_CU_Q], *ck = args[VL_CU_K];
  PyObject* scale_o = args[VL_SCALE];
  if (!st->tensor_type || !st->empty_strided || st->n_remembered == 0 || ab_cuda_emulation()) Py_RETURN_NONE;
  /* q, k, v, then the sinks (whose gradient counts, as _dispatch.prepare_varlen's need_grad counts it),
   * then cu_seqlens and the ALiBi slopes (no gradient, as in flash-attn) */
  PyObject *sinks = args[VL_SINKS], *alibi = args[VL_ALIBI];
  PyObject* tensors[7] = {q, k, v};
  int n = 3;
  if (sinks != Py_None) tensors[n++] = sinks;
  const int n_grad = n;
  tensors[n++] = cq;
  tensors[n++] = ck;
  if (alibi != Py_None) tensors[n++] = alibi;
  if (!fast_tensors(st, tensors, n, sinks, alibi, 0)) Py_RETURN_NONE;
  long long max_q, max_k;
  if (!small_int(args[VL_MAX_Q], 0, &max_q) || !small_int(args[VL_MAX_K], 0, &max_k) || max_q > INT32_MAX ||
      max_k > INT32_MAX)
    Py_RETURN_NONE;
  int causal, want_lse, requested;
  const int go = fast_opening(st, st->guards, args[VL_CAUSAL], 1, args[VL_LSE], scale_o, args[VL_BACKEND], tensors,
                              n_grad, &causal, &want_lse, &requested);
  if (go <= 0) return go < 0 ? NULL : Py_NewRef(Py_None);
  const int cpu = all_cpu(st, tensors, n);
  if (cpu < 0) return NULL;
  if (!cpu) Py_RETURN_NONE;
  ab_attn_params p;
  memset(&p, 0, sizeof p);
  ab_tensor tcq, tck;
  READ_OR_HAND_BACK(read_view(st, q, &p.q, "q", 1));
  READ_OR_HAND_BACK(read_view(st, k, &p.k, "k", 1));
  READ_OR_HAND_BACK(read_view(st, v, &p.v, "v", 1));
  READ_OR_HAND_BACK(read_view(st, cq, &tcq, "cu_seqlens_q", 1));
  READ_OR_HAND_BACK(read_view(st, ck, &tck, "cu_seqlens_k", 1));
  if (p.q.ndim != 3 || p.k.ndim != 3 || p.v.ndim != 3) Py_RETURN_NONE;
  const ab_dtype dt = p.q.dtype;
  /* _varlen.check_qkv's rule; anything else is the Python path's to word */
  if (dt > AB_DTYPE_F64 || p.k.dtype != dt || p.v.dtype != dt || p.v.sizes[0] != p.k.sizes[0] ||
      p.v.sizes[1] != p.k.sizes[1] || p.k.sizes[2] != p.q.sizes[2] || p.q.sizes[2] <= 0 || p.k.sizes[1] <= 0 ||
      p.q.sizes[1] % p.k.sizes[1] != 0)
    Py_RETURN_NONE;
  /* cu_seqlens: 1-D contiguous int32 of one length; the values as _varlen.check_cu_seqlens wants them */
  if (tcq.ndim != 1 || tck.ndim != 1 || tcq.dtype != AB_DTYPE_I32 || tck.dtype != AB_DTYPE_I32 ||
      tcq.sizes[0] < 1 || tcq.sizes[0] != tck.sizes[0] || tcq.strides[0] != 1 || tck.strides[0] != 1)
    Py_RETURN_NONE;
  p.B = tcq.sizes[0] - 1;
  p.cu_seqlens_q = (const int32_t*)tcq.data;
  p.cu_seqlens_k = (const int32_t*)tck.data;
  const int64_t longest_q = cu_longest(p.cu_seqlens_q, p.B, p.q.sizes[0], max_q);
  const int64_t longest_k = cu_longest(p.cu_seqlens_k, p.B, p.k.sizes[0], max_k);
  if (longest_q < 0 || longest_k < 0) Py_RETURN_NONE;
  p.Hq = p.q.sizes[1];
  p.D = p.q.sizes[2];
  p.Hkv = p.k.sizes[1];
  p.Dv = p.v.sizes[2];
  p.Sq = longest_q; /* the kernels get the real longest sequences, as prepare_varlen gives them */
  p.Sk = longest_k;
  const int weights = read_sinks_alibi(st, sinks, alibi, &p);
  if (weights <= 0) return weights < 0 ? NULL : Py_NewRef(Py_None);
  long long wl, wr;
  double softcap;
  if (!window_softcap_args(args[VL_WINDOW], args[VL_SOFTCAP], longest_q + longest_k, dt, &wl, &wr, &softcap))
    Py_RETURN_NONE;
  return serve_plain(st, q, &p, scale_o, causal, wl, wr, softcap, want_lse, requested, 1, longest_q == longest_k,
                     AB_BK_FLASH_VARLEN);
}

/* ---- the fast path of ab.attention_with_kvcache -----------------------------------------------------
 *
 * kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
 *         cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
 *         alibi_slopes, num_splits, want_lse, backend, sinks): ab.attention_with_kvcache's arguments in
 * its order, a plain eager CPU decode call in C, on the terms of attention()'s fast path above (None:
 * the Python path, attn_backends/_kvcache.py, serves the call with its checks and its errors):
 *   - attn_backends/__init__.py calls here unless torch.compile traces;
 *   - every tensor a plain torch.Tensor on the CPU, and every argument within _kvcache.check's rules:
 *     the dtypes and shapes of q, the caches, k and v, the rotary tables, the index tensors
 *     (cache_seqlens, cache_batch_idx, cache_leftpad: (B,) int32/int64; block_table (B, n)), the ALiBi
 *     slopes and the sinks; cache_seqlens None, an int >= 0 or a tensor (not None with k and v);
 *     softmax_scale None or a finite float; causal, rotary_interleaved and want_lse bools;
 *     window_size a tuple of two ints >= -1; softcap a finite float or int >= 0; num_splits an int >= 0;
 *   - none of set_kvcache_guards' guards is active (inference mode may be on) and no gradient is
 *     needed; the query rows of a KV head fit the kernel (Sq * Hq / Hkv <= 64, _kvcache.run_kernel);
 *   - the descriptor _kvcache.signature builds is remembered with paged_attention chosen.
 * Then the kernel runs as kvcache_fwd_cpu runs it: the same bits, the same writes into the cache and
 * the same version bumps. */

/* The rank, dtype and shape rules of _kvcache.check for k and v (both given; dtype dt, shape (B, Snew,
 * Hkv, D), v's shape k's) and for rotary_cos and rotary_sin (NULL when absent: 2-D, floating, one
 * shape, 1 <= rotary_dim / 2 <= D / 2).  1 when they hold, 0 when the Python path must word it. */
static int new_rows_ok(const ab_tensor* k, const ab_tensor* v, const ab_tensor* cos, const ab_tensor* sin,
                       ab_dtype dt, int64_t B, int64_t Hkv, int64_t D) {
  if (k->ndim != 4 || k->dtype != dt || v->dtype != dt || v->ndim != 4 || k->sizes[0] != B ||
      k->sizes[2] != Hkv || k->sizes[3] != D || memcmp(k->sizes, v->sizes, sizeof k->sizes) != 0)
    return 0;
  if (!cos) return 1;
  return cos->ndim == 2 && sin->ndim == 2 && cos->dtype <= AB_DTYPE_F64 && sin->dtype <= AB_DTYPE_F64 &&
         cos->sizes[0] == sin->sizes[0] && cos->sizes[1] == sin->sizes[1] && cos->sizes[1] >= 1 &&
         cos->sizes[1] <= D / 2;
}

/* An exact int >= least as *x: 1, 0 when it is not one (the Python path words it). */
static int small_int(PyObject* o, long long least, long long* x) {
  if (!PyLong_CheckExact(o)) return 0;
  *x = PyLong_AsLongLong(o);
  if (*x == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return 0;
  }
  return *x >= least;
}

enum { KV_Q, KV_KC, KV_VC, KV_K, KV_V, KV_COS, KV_SIN, KV_SEQ, KV_BIDX, KV_LEFT, KV_BT, KV_SCALE, KV_CAUSAL,
       KV_WINDOW, KV_SOFTCAP, KV_INTER, KV_ALIBI, KV_SPLITS, KV_LSE, KV_BACKEND, KV_SINKS, KV_NARGS };

static PyObject* ab_py_kvcache(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  ab_state* st = ab_module_state(self);
  if (nargs != KV_NARGS) {
    PyErr_SetString(PyExc_TypeError, "kvcache() takes attention_with_kvcache's 21 arguments, in its order");
    return NULL;
  }
  if (!st->tensor_type || !st->kv_guards || !st->empty_strided || st->n_remembered == 0 || ab_cuda_emulation())
    Py_RETURN_NONE;
  PyObject *q = args[KV_Q], *kc = args[KV_KC], *vc = args[KV_VC], *kn = args[KV_K], *vn = args[KV_V];
  PyObject *cos = args[KV_COS], *sin = args[KV_SIN], *seq_o = args[KV_SEQ], *inter_o = args[KV_INTER];
  const int has_new = kn != Py_None, has_rot = cos != Py_None;
  const int seq_tensor = seq_o != Py_None && !PyLong_CheckExact(seq_o);
  /* every tensor argument: None or a plain torch.Tensor (cache_seqlens may also be an int) */
  static const int tensor_args[KVT_N] = {
      [KVT_Q] = KV_Q,     [KVT_KC] = KV_KC,     [KVT_VC] = KV_VC,     [KVT_K] = KV_K,   [KVT_V] = KV_V,
      [KVT_COS] = KV_COS, [KVT_SIN] = KV_SIN,   [KVT_SEQ] = KV_SEQ,   [KVT_BIDX] = KV_BIDX,
      [KVT_LEFT] = KV_LEFT, [KVT_BT] = KV_BT, [KVT_ALIBI] = KV_ALIBI, [KVT_SINKS] = KV_SINKS};
  PyObject* tensors[KVT_N];
  for (int i = 0; i < KVT_N; ++i)
    tensors[i] = tensor_args[i] == KV_SEQ && !seq_tensor ? Py_None : args[tensor_args[i]];
  if (!fast_tensors(st, tensors, KVT_N, args[KV_SINKS], args[KV_ALIBI], 1)) Py_RETURN_NONE;
  if (q == Py_None || kc == Py_None || vc == Py_None || (vn != Py_None) != has_new || (sin != Py_None) != has_rot ||
      (has_new && seq_o == Py_None) || (has_rot && !has_new) || (inter_o != Py_True && inter_o != Py_False))
    Py_RETURN_NONE;
  /* the scalars: window (-1 unbounded), softcap, num_splits */
  PyObject* win = args[KV_WINDOW];
  long long wl, wr, splits;
  if (!PyTuple_CheckExact(win) || PyTuple_Size(win) != 2 || !small_int(PyTuple_GetItem(win, 0), -1, &wl) ||
      !small_int(PyTuple_GetItem(win, 1), -1, &wr) || !small_int(args[KV_SPLITS], 0, &splits) ||
      splits >= (1LL << 31)) /* _kvcache.check's error (flash-attn's num_splits is a C int) */
    Py_RETURN_NONE;
  double softcap;
  if (!softcap_arg(args[KV_SOFTCAP], &softcap)) Py_RETURN_NONE;
  PyObject* grad_checked[9] = {q, kc, vc}; /* the tensors _kvcache.check wants no gradient for */
  int n_grad = 3;
  if (args[KV_SINKS] != Py_None) grad_checked[n_grad++] = args[KV_SINKS];
  if (args[KV_ALIBI] != Py_None) grad_checked[n_grad++] = args[KV_ALIBI];
  if (has_rot) {
    grad_checked[n_grad++] = cos;
    grad_checked[n_grad++] = sin;
  }
  if (has_new) {
    grad_checked[n_grad++] = kn;
    grad_checked[n_grad++] = vn;
  }
  int causal, want_lse, requested;
  const int go = fast_opening(st, st->kv_guards, args[KV_CAUSAL], 0, args[KV_LSE], args[KV_SCALE], args[KV_BACKEND],
                              grad_checked, n_grad, &causal, &want_lse, &requested);
  if (go <= 0) return go < 0 ? NULL : Py_NewRef(Py_None);
  const int cpu = all_cpu(st, tensors, KVT_N);
  if (cpu < 0) return NULL;
  if (!cpu) Py_RETURN_NONE;
  ab_kvcache_params p;
  READ_OR_HAND_BACK(read_kv_views(st, tensors, &p, 1));
  const ab_tensor *tq = &p.q, *tk = &p.k_cache, *tv = &p.v_cache;
  if (tq->ndim != 4 || tk->ndim != 4 || tv->ndim != 4) Py_RETURN_NONE;
  const ab_dtype dt = tq->dtype;
  const int64_t B = tq->sizes[0], Hq = tq->sizes[2], D = tq->sizes[3], Hkv = tk->sizes[2];
  const int paged = args[KV_BT] != Py_None;
  /* _kvcache.check's rules for these arguments; anything else is the Python path's to word */
  if (dt > AB_DTYPE_F64 || tk->dtype != dt || tv->dtype != dt || tk->strides[3] != 1 || tv->strides[3] != 1 ||
      memcmp(tk->sizes, tv->sizes, sizeof tk->sizes) != 0 || tk->sizes[3] != D || Hkv < 1 || Hq % Hkv != 0)
    Py_RETURN_NONE;
  if (has_new &&
      !new_rows_ok(&p.k_new, &p.v_new, has_rot ? &p.rotary_cos : NULL, has_rot ? &p.rotary_sin : NULL, dt, B,
                   Hkv, D))
    Py_RETURN_NONE;
  for (int d = 0; d < 4; ++d)
    if (tk->sizes[d] == 0) Py_RETURN_NONE; /* an empty cache: the Python path */
  const ab_tensor* const ix[4] = {seq_tensor ? &p.cache_seqlens : NULL,
                                  args[KV_BIDX] != Py_None ? &p.cache_batch_idx : NULL,
                                  args[KV_LEFT] != Py_None ? &p.cache_leftpad : NULL, paged ? &p.block_table : NULL};
  for (int i = 0; i < 4; ++i)
    if (ix[i] && (ix[i]->ndim != (i == 3 ? 2 : 1) ||
                  (ix[i]->dtype != AB_DTYPE_I32 && ix[i]->dtype != AB_DTYPE_I64) || ix[i]->sizes[0] != B))
      Py_RETURN_NONE;
  if (paged && ix[1]) Py_RETURN_NONE;                       /* cache_batch_idx with block_table: an error */
  if (!paged && !ix[1] && tk->sizes[0] < B) Py_RETURN_NONE; /* too few cache rows: an error */
  if (!sinks_alibi_ok(args[KV_SINKS] != Py_None ? &p.sinks : NULL, args[KV_ALIBI] != Py_None ? &p.alibi_slopes : NULL,
                      B, Hq))
    Py_RETURN_NONE;
  /* queries run_kernel gives to flash over the cache (long ones, with bfloat16 products only) */
  const int64_t rows = tq->sizes[1] * (Hq / Hkv); /* query rows per KV head */
  if (rows > ab_kvcache_cpu_max_rows(dt, !paged && !ix[1], tk->sizes[1])) Py_RETURN_NONE;
  long long seqlen = -1;
  if (seq_o != Py_None && !seq_tensor && !small_int(seq_o, 0, &seqlen)) Py_RETURN_NONE;
  PyObject* scale_o = args[KV_SCALE];
  double scale = pow((double)D, -0.5); /* D ** -0.5, as _kvcache.check computes it */
  if (scale_o != Py_None) {
    scale = PyFloat_AsDouble(scale_o);
    if (!isfinite(scale)) Py_RETURN_NONE;
  }
  /* a window side of the cache's capacity or more: unbounded, as _kvcache.check makes it */
  const int64_t cap = tk->sizes[1] * (paged ? p.block_table.sizes[1] : 1);
  if (wl >= cap) wl = -1;
  if (wr >= cap) wr = -1;
  /* factors past float32's range (float32 scores): _kvcache.check's error */
  if (dt != AB_DTYPE_F64 && (fabs(scale) > FLT_MAX || softcap > FLT_MAX)) Py_RETURN_NONE;
  ab_call c; /* as _kvcache.signature describes this call */
  const int known = cpu_call(st, &c);
  if (known <= 0) return known < 0 ? NULL : Py_NewRef(Py_None);
  c.dtype = dt;
  c.D = D;
  c.Dv = D;
  c.gqa = Hq != Hkv;
  c.causal = causal ? AB_CAUSAL_BOTTOM_RIGHT : AB_CAUSAL_NONE;
  c.window = wl >= 0 || wr >= 0;
  c.softcap = softcap > 0;
  c.want_lse = want_lse;
  /* _kvcache.mask_kind: attending to the cache as a dense call needs no mask (0), only a bottom-right causal
   * one of host-known sizes (2), or a mask or the index values (1) */
  const int plain = !seq_tensor && !paged && !ix[1] && !ix[2] && wl < 0 && wr < 0 && args[KV_ALIBI] == Py_None;
  c.mask = !plain ? 1 : causal && tq->sizes[1] > 1 ? 2 : 0;
  c.many_rows = rows >= AB_KV_MANY_ROWS && tq->sizes[1] >= AB_KV_MANY_TOKENS;
  c.varlen = 2;
  c.requested = requested;
  c.sinks = args[KV_SINKS] != Py_None;
  c.alibi = args[KV_ALIBI] != Py_None;
  if (remembered(st, &c) != AB_BK_PAGED) Py_RETURN_NONE;
  set_kv_options(&p, seqlen, scale, softcap, causal, wl, wr, inter_o == Py_True, splits);
  PyObject* res = run_kvcache(st, q, kc, vc, &p, 1, want_lse);
  if (res) ++st->fast_calls;
  return res;
}

/* flash_decode_route(q, k, v, has_mask, dropout_p, causal, window_left, window_right, cu_seqlens_q,
 * cu_seqlens_k) -> int: ab_flash_cpu_decode_route (ab_core.h) for a CPU flash call, for the calls
 * without a gradient that take the op (attn_backends/_providers/ours.py): the query tokens per sequence
 * when the decode kernel serves it, else 0.  Dense: q, k, v as the op takes them, (B, H, S, D).  Packed:
 * (T, H, D) and the host int32 cu_seqlens (contiguous, checked already); None for a dense call. */
static PyObject* ab_py_flash_decode_route(PyObject* self, PyObject* args) {
  ab_state* st = ab_module_state(self);
  PyObject *q, *k, *v, *cq, *ck;
  int has_mask, causal;
  double dropout;
  long long wl, wr;
  if (!PyArg_ParseTuple(args, "OOOpdiLLOO", &q, &k, &v, &has_mask, &dropout, &causal, &wl, &wr, &cq, &ck))
    return NULL;
  ab_attn_params p;
  memset(&p, 0, sizeof p);
  /* a view read_view will not hand a kernel: no route (the op serves the call) */
  PyObject* const qkv[3] = {q, k, v};
  ab_tensor* const views[3] = {&p.q, &p.k, &p.v};
  for (int i = 0; i < 3; ++i) {
    const int rc = read_view(st, qkv[i], views[i], i == 0 ? "q" : i == 1 ? "k" : "v", 0);
    if (rc) return rc < 0 ? NULL : PyLong_FromLong(0);
  }
  const int packed = cq != Py_None;
  if (p.q.ndim != 4 - packed || p.k.ndim != p.q.ndim || p.v.ndim != p.q.ndim) {
    PyErr_SetString(PyExc_ValueError, "flash_decode_route: q, k and v must be (B, H, S, D), or (T, H, D) with "
                                      "cu_seqlens");
    return NULL;
  }
  const int last = p.q.ndim - 1;
  p.Hq = p.q.sizes[last - 1 - !packed], p.Hkv = p.k.sizes[last - 1 - !packed];
  p.D = p.q.sizes[last], p.Dv = p.v.sizes[last];
  p.causal = (ab_causal)causal;
  p.window_left = wl, p.window_right = wr;
  p.dropout_p = dropout;
  if (has_mask && packed) return PyLong_FromLong(0); /* packed calls take no mask */
  if (has_mask) p.mask.ndim = 4; /* only its presence is read */
  ab_tensor tcq, tck;
  if (packed) {
    const int rq = read_view(st, cq, &tcq, "cu_seqlens_q", 0), rk = rq ? rq : read_view(st, ck, &tck, "cu_seqlens_k", 0);
    if (rk) return rk < 0 ? NULL : PyLong_FromLong(0);
    if (tcq.ndim != 1 || tck.ndim != 1 || tcq.dtype != AB_DTYPE_I32 || tck.dtype != AB_DTYPE_I32 ||
        tcq.sizes[0] < 1 || tcq.sizes[0] != tck.sizes[0] || tcq.strides[0] != 1 || tck.strides[0] != 1) {
      PyErr_SetString(PyExc_ValueError, "flash_decode_route: cu_seqlens must be contiguous 1-D int32 of one length");
      return NULL;
    }
    p.B = tcq.sizes[0] - 1;
    p.cu_seqlens_q = (const int32_t*)tcq.data;
    p.cu_seqlens_k = (const int32_t*)tck.data;
    p.Sq = cu_longest(p.cu_seqlens_q, p.B, p.q.sizes[0], INT32_MAX);
    p.Sk = cu_longest(p.cu_seqlens_k, p.B, p.k.sizes[0], INT32_MAX);
    if (p.Sq < 0 || p.Sk < 0) return PyLong_FromLong(0); /* cu_seqlens that do not describe q and k: no route */
  } else {
    p.B = p.q.sizes[0], p.Sq = p.q.sizes[2], p.Sk = p.k.sizes[2];
  }
  return PyLong_FromLongLong(ab_flash_cpu_decode_route(&p));
}

/* kvcache_max_rows(dtype, in_place, positions) -> int: ab_kvcache_cpu_max_rows (decode_cpu.h), for
 * _kvcache.run_kernel; dtype an ab_dtype id. */
static PyObject* ab_py_kvcache_max_rows(PyObject* self, PyObject* args) {
  (void)self;
  int dt, in_place;
  long long positions;
  if (!PyArg_ParseTuple(args, "ipL", &dt, &in_place, &positions)) return NULL;
  return PyLong_FromLongLong(ab_kvcache_cpu_max_rows((ab_dtype)dt, in_place, positions));
}

/* kvcache_working_set() -> int: the K and V bytes the CPU decode kernel's last calls read from their
 * caches (ab_kvcache_cpu_working_set, decode_cpu.h). */
static PyObject* ab_py_kvcache_working_set(PyObject* self, PyObject* unused) {
  (void)self;
  (void)unused;
  return PyLong_FromLongLong(ab_kvcache_cpu_working_set());
}

/* decode_q_bf16(row: bytes of float32, qexp) -> (bytes of bfloat16, lost): the current CPU path's rounding of
 * a q row for the decode kernel's bfloat16 products (ab_kvcache_cpu_q_bf16, decode_cpu.h), for tests. */
static PyObject* ab_py_decode_q_bf16(PyObject* self, PyObject* args) {
  (void)self;
  PyObject* row;
  int qexp;
  if (!PyArg_ParseTuple(args, "Si", &row, &qexp)) return NULL;
  char* data;
  Py_ssize_t nbytes;
  if (PyBytes_AsStringAndSize(row, &data, &nbytes) < 0) return NULL;
  if (nbytes % 4) {
    PyErr_Format(PyExc_ValueError, "decode_q_bf16: row has %zd bytes, not a whole number of float32", nbytes);
    return NULL;
  }
  const Py_ssize_t n = nbytes / 4;
  float* in = (float*)PyMem_Malloc((size_t)(n ? n : 1) * sizeof(float));
  uint16_t* out = (uint16_t*)PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint16_t));
  if (!in || !out) {
    PyMem_Free(in);
    PyMem_Free(out);
    return PyErr_NoMemory();
  }
  memcpy(in, data, (size_t)nbytes);
  const int lost = ab_kvcache_cpu_q_bf16(in, out, n, qexp);
  PyObject* r = Py_BuildValue("(y#N)", (const char*)out, n * 2, PyBool_FromLong(lost));
  PyMem_Free(in);
  PyMem_Free(out);
  return r;
}

/* decode_tune_state() -> list of dicts: each kind of call whose prefetch requests the CPU decode kernel
 * times (decode_tune.h): its kind, the rule's set and the switches timed (bits: 1 keys_next,
 * 2 values_ahead, 4 pages_ahead, 8 pv_keys), the arms, the arm kept (-1 before the first timing ends) and
 * its set, whether its arms are being timed, its calls, its timings finished and each arm's calls. */
static PyObject* ab_py_decode_tune_state(PyObject* self, PyObject* unused) {
  (void)self;
  (void)unused;
  ab_decode_tune_report reports[64];
  int n = ab_decode_tune_state(reports, 64);
  if (n > 64) n = 64;
  PyObject* list = PyList_New(0);
  for (int i = 0; list && i < n; ++i) {
    const ab_decode_tune_report* r = &reports[i];
    PyObject* arm_calls = PyList_New(0);
    for (int a = 0; arm_calls && a < r->arms; ++a) {
      PyObject* x = PyLong_FromLongLong(r->arm_calls[a]);
      if (!x || PyList_Append(arm_calls, x) < 0) Py_CLEAR(arm_calls);
      Py_XDECREF(x);
    }
    PyObject* d = arm_calls ? Py_BuildValue(
                                  "{s:i,s:i,s:i,s:i,s:i,s:i,s:I,s:I,s:I,s:i,s:i,s:O,s:L,s:L,s:N}", "isa", r->kind.isa,
                                  "dtype", r->kind.dtype, "bf16_dot", r->kind.bf16_dot, "block_size", r->kind.block_size,
                                  "group", r->kind.group, "one_token", r->kind.one_token, "rule", r->rule, "free",
                                  r->free, "kept", r->kept, "arms", r->arms, "chosen", r->chosen, "timing",
                                  r->timing ? Py_True : Py_False, "calls", (long long)r->calls, "timings",
                                  (long long)r->timings, "arm_calls", arm_calls)
                            : NULL;
    if (!d || PyList_Append(list, d) < 0) Py_CLEAR(list);
    Py_XDECREF(d);
  }
  return list;
}

static PyObject* ab_py_decode_tune_reset(PyObject* self, PyObject* unused) {
  (void)self;
  (void)unused;
  ab_decode_tune_reset();
  Py_RETURN_NONE;
}

/* decode_tune_choose(times, margin) -> int: ab_decode_tune_choose over rounds of arms' times (a list of
 * rounds, each a list of the arms' times). */
static PyObject* ab_py_decode_tune_choose(PyObject* self, PyObject* args) {
  (void)self;
  PyObject* rounds;
  double margin;
  if (!PyArg_ParseTuple(args, "Od", &rounds, &margin)) return NULL;
  /* tuples of floats made first: a float's __float__ then cannot change the lists under the loop */
  PyObject* rows = PySequence_Tuple(rounds);
  if (!rows) return NULL;
  const Py_ssize_t nr = PyTuple_Size(rows);
  Py_ssize_t arms = -1;
  double times[64 * AB_TUNE_MAX_ARMS];
  PyObject* result = NULL;
  if (nr < 1 || nr > 64) {
    PyErr_Format(PyExc_ValueError, "decode_tune_choose: times needs 1 to 64 rounds, got %zd", nr);
    goto done;
  }
  for (Py_ssize_t r = 0; r < nr; ++r) {
    PyObject* row = PySequence_Tuple(PyTuple_GetItem(rows, r));
    if (!row) goto done;
    const Py_ssize_t n = PyTuple_Size(row);
    if ((arms >= 0 && n != arms) || n < 1 || n > AB_TUNE_MAX_ARMS) {
      Py_DECREF(row);
      PyErr_SetString(PyExc_ValueError, "decode_tune_choose: each round of times must hold the same 1 to 16 arms");
      goto done;
    }
    arms = n;
    for (Py_ssize_t a = 0; a < arms; ++a) {
      times[r * arms + a] = PyFloat_AsDouble(PyTuple_GetItem(row, a));
      if (PyErr_Occurred()) {
        Py_DECREF(row);
        goto done;
      }
    }
    Py_DECREF(row);
  }
  result = PyLong_FromLong(ab_decode_tune_choose((int)arms, (int)nr, times, margin));
done:
  Py_DECREF(rows);
  return result;
}

/* set_kvcache_guards(guards, increment_version): kvcache()'s guards (set_fast_api's), and torch._C._increment_version for the direct calls that write into a cache. */
static PyObject* ab_py_set_kvcache_guards(PyObject* self, PyObject* args) {
  ab_state* st = ab_module_state(self);
  PyObject *guards, *bump;
  if (!PyArg_ParseTuple(args, "O!O", &PyTuple_Type, &guards, &bump)) return NULL;
  replace_ref(&st->kv_guards, Py_NewRef(guards));
  replace_ref(&st->increment_version, Py_NewRef(bump));
  Py_RETURN_NONE;
}

/* set_fast_api(tensor_type, parameter_type, guards, is_grad_enabled, are_deterministic_algorithms_enabled,
 *              context_get, process_default, settings): what the fast path reads (see above). */
static PyObject* ab_py_set_fast_api(PyObject* self, PyObject* args) {
  ab_state* st = ab_module_state(self);
  PyObject *tensor_type, *parameter_type, *guards, *grad, *det, *ctx_get, *process_default, *settings;
  if (!PyArg_ParseTuple(args, "OOO!OOOO!O!", &tensor_type, &parameter_type, &PyTuple_Type, &guards, &grad, &det,
                        &ctx_get, &PyList_Type, &process_default, &PyDict_Type, &settings))
    return NULL;
  if (PyList_Size(process_default) != 1) {
    PyErr_SetString(PyExc_ValueError, "set_fast_api: process_default must be a list of one name");
    return NULL;
  }
  replace_ref(&st->tensor_type, Py_NewRef(tensor_type));
  replace_ref(&st->parameter_type, Py_NewRef(parameter_type));
  replace_ref(&st->guards, Py_NewRef(guards));
  replace_ref(&st->grad_enabled, Py_NewRef(grad));
  replace_ref(&st->deterministic, Py_NewRef(det));
  replace_ref(&st->context_get, Py_NewRef(ctx_get));
  replace_ref(&st->process_default, Py_NewRef(process_default));
  replace_ref(&st->settings, Py_NewRef(settings));
  Py_RETURN_NONE;
}

/* remember(call, chosen): the Python path planned call (a Call) and chose backend id chosen without
 * falling back; the fast paths may serve such calls from now on.  Only what they build is kept: plain
 * CPU forwards, dense (attention(), with or without a mask that needs no gradient) and packed
 * (attention_varlen()), and CPU KV-cache calls (kvcache()), each with or without a window, softcap,
 * sinks and ALiBi. */
static PyObject* ab_py_remember(PyObject* self, PyObject* args) {
  ab_state* st = ab_module_state(self);
  PyObject* call;
  int chosen;
  if (!PyArg_ParseTuple(args, "Oi", &call, &chosen)) return NULL;
  ab_call c;
  if (ab_call_from_py(call, &c) < 0) return NULL;
  /* A KV-cache call is kept under its own want_lse, mask and many_rows fields (ab_py_kvcache builds them as
   * _kvcache.signature does; mask and many_rows may change a CPU plan: chunked prefill to torch), and the
   * Python path logs each descriptor once, so the fast path serves only a descriptor the Python path planned
   * and logged (until
   * 2026-12-06 one plan under want_lse 1 and mask 0 served them all, and the other variants' INFO line
   * never came).  Only plans of paged_attention under auto or its own name are remembered. */
  const int cpu = c.device == AB_DEVICE_CPU && !c.cuda_cc && !c.cuda_lib_ok && !(c.mask && c.varlen == 1) &&
                  !c.mask_grad && !c.dropout && !c.need_grad && !c.cuda_smem;
  if (cpu && remembered(st, &c) < 0) {
    int slot = st->n_remembered;
    if (slot < AB_REMEMBERED_MAX) {
      ++st->n_remembered;
    } else { /* full: the first plan the hand finds unused since it last passed makes way */
      while (st->remembered[st->next_evicted].used) {
        st->remembered[st->next_evicted].used = 0;
        st->next_evicted = (st->next_evicted + 1) % AB_REMEMBERED_MAX;
      }
      slot = st->next_evicted;
      st->next_evicted = (st->next_evicted + 1) % AB_REMEMBERED_MAX;
    }
    st->remembered[slot].call = c;
    st->remembered[slot].chosen = chosen;
    st->remembered[slot].used = 0;
  }
  Py_RETURN_NONE;
}

void ab_direct_forget(ab_state* st) { st->n_remembered = st->next_evicted = 0; }

/* forget(): drops the remembered plans (attn_backends._dispatch.reset_caches). */
static PyObject* ab_py_forget(PyObject* self, PyObject* unused) {
  (void)unused;
  ab_direct_forget(ab_module_state(self));
  Py_RETURN_NONE;
}

/* fast_calls() -> how many calls the fast path has served (tests). */
static PyObject* ab_py_fast_calls(PyObject* self, PyObject* unused) {
  (void)unused;
  return PyLong_FromLongLong(ab_module_state(self)->fast_calls);
}

PyMethodDef ab_direct_methods[] = {
    {"flash_fwd_cpu", ab_py_flash_fwd_cpu, METH_VARARGS,
     "flash_fwd_cpu(q, k, v, attn_mask, causal, scale, window_left, window_right, softcap, want_lse) -> "
     "(out, lse or None), or None: the CPU flash forward without the dispatcher (checked CPU tensors, no autograd)."},
    {"kvcache_fwd_cpu", ab_py_kvcache_fwd_cpu, METH_VARARGS,
     "kvcache_fwd_cpu(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_seqlen, "
     "cache_batch_idx, cache_leftpad, block_table, alibi_slopes, scale, causal, window_left, window_right, softcap, "
     "rotary_interleaved, num_splits, sinks[, attn_mask]) -> (out, lse), or None: the CPU decode kernel without "
     "the dispatcher (checked CPU tensors; k and v written into the caches, whose versions are then bumped; "
     "attn_mask for flash's calls over a dense cache)."},
    {"attention", (PyCFunction)(void (*)(void))ab_py_attention, METH_FASTCALL,
     "attention(q, k, v, backend, causal, scale, want_lse, window, softcap, sinks, alibi_slopes, attn_mask) -> out, "
     "(out, lse), or None: ab.attention's fast "
     "path for plain eager CPU calls whose plan is remembered (None: take the Python path)."},
    {"attention_varlen", (PyCFunction)(void (*)(void))ab_py_attention_varlen, METH_FASTCALL,
     "attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, backend, causal, scale, "
     "window, softcap, want_lse) -> out, (out, lse), or None: the packed calls' fast path for plain eager CPU calls whose plan is "
     "remembered (None: take the Python path)."},
    {"kvcache", (PyCFunction)(void (*)(void))ab_py_kvcache, METH_FASTCALL,
     "kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad, "
     "block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved, alibi_slopes, num_splits, "
     "want_lse, backend, sinks) -> out, "
     "(out, lse), or None: ab.attention_with_kvcache's fast path for eager CPU calls whose plan is "
     "remembered (None: take the Python path)."},
    {"flash_decode_route", ab_py_flash_decode_route, METH_VARARGS,
     "flash_decode_route(q, k, v, has_mask, dropout_p, causal, window_left, window_right, cu_seqlens_q, "
     "cu_seqlens_k) -> int: the query tokens per sequence when the CPU flash forward would run the call on the "
     "decode kernel (without row statistics), else 0."},
    {"kvcache_max_rows", ab_py_kvcache_max_rows, METH_VARARGS,
     "kvcache_max_rows(dtype, in_place, positions) -> int: the query rows per KV head up to which the CPU decode "
     "kernel serves a call (more go to flash over the cache)."},
    {"decode_q_bf16", ab_py_decode_q_bf16, METH_VARARGS,
     "decode_q_bf16(row, qexp) -> (bytes, lost): float32 bytes times 2**qexp rounded to bfloat16 by the current "
     "CPU path's decode kernel, and whether a nonzero element came out subnormal or 0 (tests)."},
    {"kvcache_working_set", ab_py_kvcache_working_set, METH_NOARGS,
     "kvcache_working_set() -> int: the K and V bytes the CPU decode kernel's last 64 calls read, each cache "
     "counted once at its latest call (decides the next-keys prefetch on AMD's AVX-512 path)."},
    {"decode_tune_state", ab_py_decode_tune_state, METH_NOARGS,
     "decode_tune_state() -> list of dicts: each kind of call whose prefetch requests the CPU decode kernel "
     "chooses by timing (arms, the arm kept, calls per arm; docs/decode.md)."},
    {"decode_tune_reset", ab_py_decode_tune_reset, METH_NOARGS,
     "decode_tune_reset(): forgets the CPU decode kernel's timings of its prefetch requests."},
    {"decode_tune_choose", ab_py_decode_tune_choose, METH_VARARGS,
     "decode_tune_choose(times, margin) -> int: the arm the CPU decode kernel keeps from rounds of its arms' "
     "times (a list of rounds, each a list of times; arm 0 the rule's own)."},
    {"set_kvcache_guards", ab_py_set_kvcache_guards, METH_VARARGS,
     "set_kvcache_guards(guards, increment_version): the guards of kvcache()'s fast path, and the version "
     "bump of a cache the direct calls write into."},
    {"set_tensor_api", ab_py_set_tensor_api, METH_VARARGS,
     "set_tensor_api(empty_strided, cpu_device, dtypes): what the direct calls allocate outputs with."},
    {"set_fast_api", ab_py_set_fast_api, METH_VARARGS,
     "set_fast_api(tensor_type, parameter_type, guards, is_grad_enabled, are_deterministic_algorithms_enabled, "
     "context_get, "
     "process_default, settings): what attention's fast path reads."},
    {"remember", ab_py_remember, METH_VARARGS,
     "remember(call, chosen): a plan the fast path may reuse (a plain CPU forward that did not fall back)."},
    {"forget", ab_py_forget, METH_NOARGS, "forget(): drop the plans the fast path remembered."},
    {"fast_calls", ab_py_fast_calls, METH_NOARGS, "fast_calls() -> calls the fast path has served."},
    {NULL, NULL, 0, NULL},
};

int ab_direct_init(ab_state* st) {
  if (!(st->s_shape = PyUnicode_InternFromString("shape")) || !(st->s_stride = PyUnicode_InternFromString("stride")) ||
      !(st->s_data_ptr = PyUnicode_InternFromString("data_ptr")) ||
      !(st->s_dtype = PyUnicode_InternFromString("dtype")) || !(st->s_is_cpu = PyUnicode_InternFromString("is_cpu")) ||
      !(st->s_is_neg = PyUnicode_InternFromString("is_neg")) ||
      !(st->s_requires_grad = PyUnicode_InternFromString("requires_grad")) ||
      !(st->s_mps_fix = PyUnicode_InternFromString("mps_fix")) ||
      !(st->s_new_empty_strided = PyUnicode_InternFromString("new_empty_strided")) ||
      !(st->backend_ids = PyDict_New()))
    return -1;
  st->n_remembered = 0;
  st->fast_calls = 0;
  return 0;
}

