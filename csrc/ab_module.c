/* ab_module.c -- the CPython module attn_backends._C (limited API, abi3): the only file that
 * includes Python.h.
 *
 * Loading this shared object also runs torch_shim.cpp's static registration of the
 * attn_backends::* ops, which is why attn_backends/__init__.py imports torch first.  The functions
 * here expose the tensor-free parts of the core (build facts, CPU features, backend names, the
 * planner) and one direct call of the CPU flash forward for calls that need no autograd
 * (flash_fwd_cpu).  Multi-phase initialisation, state in the module (no global Python state), so it
 * is safe in subinterpreters.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ab_core.h"
#include "ab_planner.h"
#include "ab_shim.h"
#include "cuda/ab_cuda.h"

#ifndef AB_CUDA_ARCHS
#define AB_CUDA_ARCHS ""
#endif

/* Module state: what the direct call of the CPU flash forward (flash_fwd_cpu below) needs from torch,
 * handed over once by attn_backends/_providers.py (set_tensor_api), and the attribute names it reads
 * tensors' metadata through. */
typedef struct ab_state {
  PyObject* s_shape;    /* "shape" */
  PyObject* s_stride;   /* "stride" */
  PyObject* s_data_ptr; /* "data_ptr" */
  PyObject* s_dtype;    /* "dtype" */
  PyObject* s_is_cpu;   /* "is_cpu" */
  PyObject* s_new_empty_strided; /* "new_empty_strided" */
  PyObject* empty_strided; /* torch.empty_strided; NULL until set_tensor_api */
  PyObject* dtypes[AB_DTYPE_OTHER]; /* torch.float32, float16, bfloat16, float64, bool, int32, int64, uint8:
                                       indexed by ab_dtype */
  PyObject* alloc_kw[4];   /* {"dtype": torch.<float dtype>, "device": cpu} per floating ab_dtype */
} ab_state;

static ab_state* state_of(PyObject* module) { return (ab_state*)PyModule_GetState(module); }

static int dict_set_str(PyObject* d, const char* key, const char* value) {
  PyObject* v = PyUnicode_FromString(value);
  if (!v) return -1;
  int rc = PyDict_SetItemString(d, key, v);
  Py_DECREF(v);
  return rc;
}

static int dict_set_bool(PyObject* d, const char* key, int value) {
  return PyDict_SetItemString(d, key, value ? Py_True : Py_False);
}

static PyObject* ab_py_cpu_features(PyObject* self, PyObject* unused) {
  (void)self;
  (void)unused;
  const ab_cpu_features* f = ab_cpu_features_get();
  PyObject* d = PyDict_New();
  if (!d) return NULL;
#define FLAG(name) \
  if (dict_set_bool(d, #name, f->name) < 0) goto fail;
  FLAG(sse42) FLAG(avx) FLAG(avx2) FLAG(fma) FLAG(f16c)
  FLAG(avx512f) FLAG(avx512bw) FLAG(avx512vl) FLAG(avx512dq) FLAG(avx512_vnni)
  FLAG(avx512_bf16) FLAG(avx512_fp16) FLAG(avx_vnni) FLAG(amx_tile) FLAG(amx_bf16) FLAG(amx_int8)
  FLAG(amx_fp16)
#undef FLAG
  if (dict_set_str(d, "amx_state", f->amx_state) < 0) goto fail;
  if (dict_set_str(d, "vendor", f->vendor) < 0) goto fail;
  if (dict_set_str(d, "brand", f->brand) < 0) goto fail;
  return d;
fail:
  Py_DECREF(d);
  return NULL;
}

static PyObject* ab_py_build_info(PyObject* self, PyObject* unused) {
  (void)self;
  (void)unused;
  ab_shim_info shim = ab_shim_info_get();
  PyObject* d = PyDict_New();
  if (!d) return NULL;
  if (dict_set_str(d, "version", AB_VERSION) < 0) goto fail;
  char ver[32];
  /* torch packs versions as major << 56 | minor << 48 | patch << 40 */
  snprintf(ver, sizeof ver, "%d.%d", (int)(shim.torch_target_version >> 56),
           (int)((shim.torch_target_version >> 48) & 0xff));
  if (dict_set_str(d, "torch_target_version", ver) < 0) goto fail;
  snprintf(ver, sizeof ver, "%d.%d", (int)(shim.torch_abi_version >> 56),
           (int)((shim.torch_abi_version >> 48) & 0xff));
  if (dict_set_str(d, "torch_headers_version", ver) < 0) goto fail;
  if (dict_set_str(d, "cuda_archs", AB_CUDA_ARCHS) < 0) goto fail;
  if (dict_set_str(d, "cuda_library", ab_cuda_library_path()) < 0) goto fail;
  if (dict_set_str(d, "cuda_emu_library", ab_cuda_emu_library_path()) < 0) goto fail;
#if defined(__clang__)
  if (dict_set_str(d, "compiler", "clang " __clang_version__) < 0) goto fail;
#elif defined(__GNUC__)
  if (dict_set_str(d, "compiler", "gcc " __VERSION__) < 0) goto fail;
#else
  if (dict_set_str(d, "compiler", "unknown") < 0) goto fail;
#endif
  return d;
fail:
  Py_DECREF(d);
  return NULL;
}

static const char* kind_name(ab_backend_kind kind) {
  switch (kind) {
    case AB_KIND_BUNDLED: return "bundled";
    case AB_KIND_TORCH: return "torch";
    case AB_KIND_EXTERNAL: return "external";
    default: return "planner";
  }
}

static const char* const k_feature_names[] = {
    "bool_mask", "float_mask", "mask_grad", "causal_top_left", "bottom_right_aligned",
    "causal_bottom_right", "window", "softcap", "dropout", "backward", "deterministic", "lse",
    "gqa", "dv_ne_d", "dense", "varlen", "kvcache", "sinks", "alibi", "sinks_alibi_grad"};

static PyObject* str_tuple(const char* const* items, Py_ssize_t n) {
  PyObject* t = PyTuple_New(n);
  if (!t) return NULL;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* s = PyUnicode_FromString(items[i]);
    if (!s) {
      Py_DECREF(t);
      return NULL;
    }
    PyTuple_SetItem(t, i, s); /* steals s */
  }
  return t;
}

/* (unavailable or None, dtypes, features, min_d, max_d, d_multiple, min_cc, needs_cuda_lib) */
static PyObject* caps_tuple(const ab_caps* k) {
  const char* dts[4];
  const char* fts[sizeof k_feature_names / sizeof k_feature_names[0]];
  Py_ssize_t nd = 0, nf = 0;
  static const ab_dtype order[] = {AB_DTYPE_F16, AB_DTYPE_BF16, AB_DTYPE_F32, AB_DTYPE_F64};
  for (int i = 0; i < 4; ++i)
    if (k->dtypes & AB_DTYPE_BIT(order[i])) dts[nd++] = ab_dtype_name(order[i]);
  for (size_t i = 0; i < sizeof k_feature_names / sizeof k_feature_names[0]; ++i)
    if (k->features & (1u << i)) fts[nf++] = k_feature_names[i];
  PyObject* dt = str_tuple(dts, nd);
  PyObject* ft = dt ? str_tuple(fts, nf) : NULL;
  if (!ft) {
    Py_XDECREF(dt);
    return NULL;
  }
  PyObject* why = k->unavailable ? PyUnicode_FromString(k->unavailable) : Py_NewRef(Py_None);
  if (!why) {
    Py_DECREF(dt);
    Py_DECREF(ft);
    return NULL;
  }
  return Py_BuildValue("(NNNiiiii)", why, dt, ft, k->min_d, k->max_d, k->d_multiple, k->min_cc,
                       k->needs_cuda_lib);
}

/* [(name, aliases, kind, summary, lossy, provider, (caps cpu, cuda, mps, other)), ...] in id order. */
static PyObject* ab_py_backend_table(PyObject* self, PyObject* unused) {
  (void)self;
  (void)unused;
  const int n = ab_backend_count();
  PyObject* list = PyList_New(n);
  if (!list) return NULL;
  for (int i = 0; i < n; ++i) {
    const ab_backend_info* b = ab_backend_at(i);
    Py_ssize_t na = 0;
    while (b->aliases[na]) ++na;
    PyObject* aliases = str_tuple(b->aliases, na);
    PyObject* caps = aliases ? PyTuple_New(AB_DEV_COUNT) : NULL;
    if (!caps) {
      Py_XDECREF(aliases);
      goto fail;
    }
    for (int d = 0; d < AB_DEV_COUNT; ++d) {
      PyObject* c = caps_tuple(&b->caps[d]);
      if (!c) {
        Py_DECREF(aliases);
        Py_DECREF(caps);
        goto fail;
      }
      PyTuple_SetItem(caps, d, c);
    }
    PyObject* row = Py_BuildValue("(sNssiiN)", b->name, aliases, kind_name(b->kind), b->summary,
                                  b->lossy, b->provider, caps);
    if (!row) goto fail;
    PyList_SetItem(list, i, row); /* steals row */
  }
  return list;
fail:
  Py_DECREF(list);
  return NULL;
}

/* set_provider(id, available, why_not) */
static PyObject* ab_py_set_provider(PyObject* self, PyObject* args) {
  (void)self;
  int id, available;
  const char* why;
  if (!PyArg_ParseTuple(args, "ips", &id, &available, &why)) return NULL;
  if (id < 0 || id >= AB_BK_COUNT) {
    PyErr_SetString(PyExc_ValueError, "backend id out of range");
    return NULL;
  }
  ab_provider_set(id, available, why);
  Py_RETURN_NONE;
}

/* enable_cuda_flash(on): see ab_registry_enable_cuda_flash. */
static PyObject* ab_py_enable_cuda_flash(PyObject* self, PyObject* arg) {
  (void)self;
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return NULL;
  ab_registry_enable_cuda_flash(on);
  Py_RETURN_NONE;
}

/* enable_cuda_sage(on): see ab_registry_enable_cuda_sage. */
static PyObject* ab_py_enable_cuda_sage(PyObject* self, PyObject* arg) {
  (void)self;
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return NULL;
  ab_registry_enable_cuda_sage(on);
  Py_RETURN_NONE;
}

/* enable_cuda_decode(on): see ab_registry_enable_cuda_decode. */
static PyObject* ab_py_enable_cuda_decode(PyObject* self, PyObject* arg) {
  (void)self;
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return NULL;
  ab_registry_enable_cuda_decode(on);
  Py_RETURN_NONE;
}

/* set_cuda_emulation(on): CPU tensors of flash, flash_varlen, sage, math and paged_attention run the
 * CUDA kernels on the emulator (docs/cuda.md); loads its library (RuntimeError when it is missing)
 * and tells the planner, which then plans those backends on the CPU with their CUDA capabilities. */
static PyObject* ab_py_set_cuda_emulation(PyObject* self, PyObject* arg) {
  (void)self;
  const int on = PyObject_IsTrue(arg);
  if (on < 0) return NULL;
  ab_error err;
  err.msg[0] = 0;
  if (ab_cuda_set_emulation(on, &err) != AB_OK) {
    PyErr_SetString(PyExc_RuntimeError, err.msg);
    return NULL;
  }
  ab_registry_set_cuda_emulation(on);
  Py_RETURN_NONE;
}

/* cuda_emulation() -> whether the CUDA emulation is on. */
static PyObject* ab_py_cuda_emulation(PyObject* self, PyObject* unused) {
  (void)self;
  (void)unused;
  return PyBool_FromLong(ab_cuda_emulation() != NULL);
}

/* plan(call) -> (chosen id or -1, (order...), (reason per id...), path, note).  call is the tuple
 * (device, cuda_cc, cuda_lib_ok, dtype, D, Dv, gqa, square, mask, mask_grad, causal, window,
 *  softcap, dropout, need_grad, deterministic, want_lse, varlen, mps_fix, requested, cpu_isa,
 *  cpu_units, cuda_smem[, sinks, alibi]). */
static PyObject* ab_py_plan(PyObject* self, PyObject* arg) {
  (void)self;
  ab_call c;
  int device, dtype, causal;
  long long D, Dv;
  memset(&c, 0, sizeof c);
  unsigned int units = 0;
  if (!PyArg_ParseTuple(arg, "iiiiLLiiiiiiiiiiiiiiiIi|ii", &device, &c.cuda_cc, &c.cuda_lib_ok, &dtype,
                        &D, &Dv, &c.gqa, &c.square, &c.mask, &c.mask_grad, &causal, &c.window,
                        &c.softcap, &c.dropout, &c.need_grad, &c.deterministic, &c.want_lse,
                        &c.varlen, &c.mps_fix, &c.requested, &c.cpu_isa, &units, &c.cuda_smem, &c.sinks,
                        &c.alibi))
    return NULL;
  c.cpu_units = units;
  if (device < 0 || device >= AB_DEV_COUNT || dtype < 0 || dtype > AB_DTYPE_OTHER || causal < 0 ||
      causal > 2 || c.requested < 0 || c.requested >= AB_BK_COUNT) {
    PyErr_SetString(PyExc_ValueError, "plan: a field of the call is out of range");
    return NULL;
  }
  c.device = (ab_device_type)device;
  c.dtype = (ab_dtype)dtype;
  c.causal = (ab_causal)causal;
  c.D = D;
  c.Dv = Dv;
  ab_plan p;
  ab_plan_build(&c, &p);
  PyObject* order = PyTuple_New(p.norder);
  PyObject* reasons = order ? PyTuple_New(AB_BK_COUNT) : NULL;
  if (!reasons) {
    Py_XDECREF(order);
    return NULL;
  }
  for (int i = 0; i < p.norder; ++i) PyTuple_SetItem(order, i, PyLong_FromLong(p.order[i]));
  for (int i = 0; i < AB_BK_COUNT; ++i) {
    PyObject* s = PyUnicode_FromString(p.reason[i]);
    if (!s) {
      Py_DECREF(order);
      Py_DECREF(reasons);
      return NULL;
    }
    PyTuple_SetItem(reasons, i, s);
  }
  return Py_BuildValue("(iNNss)", p.chosen, order, reasons, p.path, p.note);
}

/* lookup(name) -> canonical name, or None when the name is unknown. */
static PyObject* ab_py_lookup(PyObject* self, PyObject* arg) {
  (void)self;
  if (!PyUnicode_Check(arg)) {
    PyErr_SetString(PyExc_TypeError, "backend name must be a str");
    return NULL;
  }
  const char* name = PyUnicode_AsUTF8AndSize(arg, NULL);
  if (!name) return NULL;
  int idx = ab_backend_lookup(name);
  if (idx < 0) Py_RETURN_NONE;
  return PyUnicode_FromString(ab_backend_at(idx)->name);
}

/* cuda_device(index) -> (compute capability as int, e.g. 90, bool: our library has code for it, why
 * not, bytes of shared memory a block may opt in to), or (0, False, reason, 0) when the library or the
 * device is missing.  Loads the CUDA library: call it only once a CUDA tensor has arrived. */
static PyObject* ab_py_cuda_device(PyObject* self, PyObject* arg) {
  (void)self;
  long index = PyLong_AsLong(arg);
  if (index == -1 && PyErr_Occurred()) return NULL;
  ab_error err;
  err.msg[0] = 0;
  const ab_cuda_api* api = ab_cuda_load(&err);
  if (!api) return Py_BuildValue("(iOsi)", 0, Py_False, err.msg, 0);
  int cc = 0, smem = 0;
  if (api->device_capability((int)index, &cc, &err) != AB_OK ||
      api->device_smem_optin((int)index, &smem, &err) != AB_OK)
    return Py_BuildValue("(iOsi)", 0, Py_False, err.msg, 0);
  const int ok = api->supports_cc(cc);
  return Py_BuildValue("(iOsi)", cc, ok ? Py_True : Py_False,
                       ok ? "" : "the CUDA library was not built for this compute capability", smem);
}

static int isa_from_name(PyObject* arg) {
  const char* name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8AndSize(arg, NULL) : NULL;
  if (!name) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "ISA name must be a str");
    return -1;
  }
  for (int i = AB_ISA_GENERIC; i < AB_ISA_COUNT; ++i)
    if (strcmp(name, ab_cpu_isa_name((ab_cpu_isa)i)) == 0) return i;
  PyErr_Format(PyExc_ValueError, "unknown CPU ISA %R; valid: generic, avx2, avx512, amx, amx_emu", arg);
  return -1;
}

/* cpu_isa() -> the path the CPU kernels use now ("generic", "avx2", "avx512", "amx", "amx_emu"). */
static PyObject* ab_py_cpu_isa(PyObject* self, PyObject* unused) {
  (void)self;
  (void)unused;
  return PyUnicode_FromString(ab_cpu_isa_name(ab_cpu_isa_get()));
}

/* cpu_isa_index() -> the path as its ab_cpu_isa number (the planner's call field; cheap per call). */
static PyObject* ab_py_cpu_isa_index(PyObject* self, PyObject* unused) {
  (void)self;
  (void)unused;
  return PyLong_FromLong((long)ab_cpu_isa_get());
}

/* cpu_isa_error() -> why ATTN_BACKENDS_CPU_ISA cannot be honoured, or None. */
static PyObject* ab_py_cpu_isa_error(PyObject* self, PyObject* unused) {
  (void)self;
  (void)unused;
  const char* e = ab_cpu_isa_error();
  if (!e) Py_RETURN_NONE;
  return PyUnicode_FromString(e);
}

/* cpu_units() -> the AB_UNIT_* bits this CPU has and this process may use (AMX tiles). */
static PyObject* ab_py_cpu_units(PyObject* self, PyObject* unused) {
  (void)self;
  (void)unused;
  return PyLong_FromUnsignedLong(ab_cpu_units_detect());
}

/* cpu_isa_supported(name) -> bool */
static PyObject* ab_py_cpu_isa_supported(PyObject* self, PyObject* arg) {
  (void)self;
  int isa = isa_from_name(arg);
  if (isa < 0) return NULL;
  return PyBool_FromLong(ab_cpu_isa_supported((ab_cpu_isa)isa));
}

/* set_cpu_isa(name) -> bool: switches the path for the whole process (False if unsupported). */
static PyObject* ab_py_set_cpu_isa(PyObject* self, PyObject* arg) {
  (void)self;
  int isa = isa_from_name(arg);
  if (isa < 0) return NULL;
  return PyBool_FromLong(ab_cpu_isa_set((ab_cpu_isa)isa));
}

/* sage_cpu_isa() -> the path the sage kernel uses now ("generic", "avx2", "avx512_vnni", "amx_int8",
 * "amx_emu"). */
static PyObject* ab_py_sage_cpu_isa(PyObject* self, PyObject* unused) {
  (void)self;
  (void)unused;
  return PyUnicode_FromString(ab_sage_cpu_isa_name());
}

/* fma_peak(seconds, threads) -> float32 flop/s of FMA chains on that many threads (GIL released). */
static PyObject* ab_py_fma_peak(PyObject* self, PyObject* args) {
  (void)self;
  double seconds = 0.3;
  int threads = 1;
  if (!PyArg_ParseTuple(args, "|di", &seconds, &threads)) return NULL;
  double rate;
  Py_BEGIN_ALLOW_THREADS rate = ab_cpu_fma_peak(seconds, threads);
  Py_END_ALLOW_THREADS return PyFloat_FromDouble(rate);
}

/* _amx_emu_dot(op, a, b, c, (rows_c, colsb_c, rows_a, colsb_a, rows_b, colsb_b)) -> bytes: one
 * product on the emulated tiles (tests of the emulation; ab_amx_emu_dot). */
static PyObject* ab_py_amx_emu_dot(PyObject* self, PyObject* args) {
  (void)self;
  int op, shape[6];
  PyObject *a, *b, *c;
  if (!PyArg_ParseTuple(args, "iSSS(iiiiii)", &op, &a, &b, &c, &shape[0], &shape[1], &shape[2], &shape[3],
                        &shape[4], &shape[5]))
    return NULL;
  char *pa, *pb, *pc;
  Py_ssize_t na, nb, nc;
  if (PyBytes_AsStringAndSize(a, &pa, &na) < 0 || PyBytes_AsStringAndSize(b, &pb, &nb) < 0 ||
      PyBytes_AsStringAndSize(c, &pc, &nc) < 0)
    return NULL;
  const Py_ssize_t want[3] = {(Py_ssize_t)shape[0] * shape[1], (Py_ssize_t)shape[2] * shape[3],
                              (Py_ssize_t)shape[4] * shape[5]};
  const Py_ssize_t have[3] = {nc, na, nb};
  for (int i = 0; i < 6; ++i)
    if (shape[i] < 0 || shape[i] > 255) {
      PyErr_Format(PyExc_ValueError, "_amx_emu_dot: shape[%d] = %d is not in [0, 255]", i, shape[i]);
      return NULL;
    }
  static const char* const names[3] = {"c", "a", "b"};
  Py_ssize_t room = 1024; /* a whole tile, at least: a valid configuration never reads past it */
  for (int i = 0; i < 3; ++i) {
    if (have[i] != want[i]) {
      PyErr_Format(PyExc_ValueError, "_amx_emu_dot: %s has %zd bytes, its shape says %zd", names[i], have[i],
                   want[i]);
      return NULL;
    }
    if (have[i] > room) room = have[i];
  }
  char* out = (char*)PyMem_Calloc((size_t)room * 3, 1);
  if (!out) return PyErr_NoMemory();
  memcpy(out, pc, (size_t)nc);
  memcpy(out + room, pa, (size_t)na);
  memcpy(out + 2 * room, pb, (size_t)nb);
  ab_amx_emu_dot(op, out + room, out + 2 * room, out, shape);
  PyObject* r = PyBytes_FromStringAndSize(out, nc);
  PyMem_Free(out);
  return r;
}

/* ---- the CPU flash forward, called directly -----------------------------------------------------
 *
 * A call that needs no autograd and is not being traced (attn_backends/_providers.py decides: CPU
 * tensors of the plain torch.Tensor type, no gradient, no dropout, no torch.compile, tracing,
 * dispatch or function mode, functorch transform or inference mode) skips the dispatcher: the
 * metadata is read here, the outputs are allocated through torch (q.new_empty_strided, and
 * torch.empty_strided for lse) in the layout the op gives them, and ab_flash_cpu_fwd runs on torch's
 * thread pool (ab_shim_cpu_pool), with the GIL released unless the call is tiny.  Same kernel, same checks (ab_attn_params_check), same pool: the same bits as the
 * flash_fwd op (tests/test_direct.py).  What it saves is the op call's fixed cost (the dispatcher,
 * the boxed stable-ABI call), which dominates small calls (docs/benchmarks.md, "Per-call cost"). */

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

/* Fills v from a CPU tensor's shape, strides, dtype and data pointer; -1 with an exception set.  A
 * rank other than 1..4 is an error naming the tensor, unless any_rank: then only v->ndim is set (the
 * caller words the error, as the shim does for q, k and v). */
static int read_view(const ab_state* st, PyObject* t, ab_tensor* v, const char* name, int any_rank) {
  memset(v, 0, sizeof *v);
  PyObject* shape = PyObject_GetAttr(t, st->s_shape);
  if (!shape) return -1;
  PyObject* stride = PyObject_CallMethodObjArgs(t, st->s_stride, NULL);
  PyObject* dt = stride ? PyObject_GetAttr(t, st->s_dtype) : NULL;
  int rc = -1;
  if (!dt) goto done;
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
    if (!ptr) goto done;
    v->data = PyLong_AsVoidPtr(ptr);
    Py_DECREF(ptr);
    if (PyErr_Occurred()) goto done;
  }
  rc = 0;
done:
  Py_DECREF(shape);
  Py_XDECREF(stride);
  Py_XDECREF(dt);
  return rc;
}

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

/* flash_fwd_cpu(q, k, v, attn_mask, causal, scale, window_left, window_right, softcap, want_lse)
 *   -> (out, lse or None), or None when this call must take the op (a tensor is not on the CPU, the
 *   CUDA emulation is on, or set_tensor_api was never called).  q (B, Hq, Sq, D), k (B, Hkv, Sk, D),
 *   v (B, Hkv, Sk, Dv) and the mask are plain tensors (the caller checked); out (B, Hq, Sq, Dv) is stored (B, Sq, Hq, Dv) and
 *   lse (B, Hq, Sq) is float32, as the flash_fwd op returns them.  Without want_lse the kernel writes
 *   lse to a buffer of its own. */
static PyObject* ab_py_flash_fwd_cpu(PyObject* self, PyObject* args) {
  ab_state* st = state_of(self);
  PyObject *q, *k, *v, *mask;
  int causal, want_lse;
  double scale, softcap;
  long long wl, wr;
  if (!PyArg_ParseTuple(args, "OOOOidLLdp", &q, &k, &v, &mask, &causal, &scale, &wl, &wr, &softcap, &want_lse))
    return NULL;
  if (!st->empty_strided || ab_cuda_emulation()) Py_RETURN_NONE;
  PyObject* const tensors[4] = {q, k, v, mask};
  for (int i = 0; i < 4; ++i) {
    if (tensors[i] == Py_None) continue;
    const int cpu = is_cpu(st, tensors[i]);
    if (cpu < 0) return NULL;
    if (!cpu) Py_RETURN_NONE; /* another device: the op says what is wrong */
  }
  ab_attn_params p;
  memset(&p, 0, sizeof p);
  if (read_view(st, q, &p.q, "q", 1) < 0 || read_view(st, k, &p.k, "k", 1) < 0 ||
      read_view(st, v, &p.v, "v", 1) < 0)
    return NULL;
  if (p.q.ndim != 4 || p.k.ndim != 4 || p.v.ndim != 4)
    return direct_error("q, k and v must be 4-D: (B, Hq, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, Dv)");
  p.B = p.q.sizes[0];
  p.Hq = p.q.sizes[1];
  p.Sq = p.q.sizes[2];
  p.D = p.q.sizes[3];
  p.Hkv = p.k.sizes[1];
  p.Sk = p.k.sizes[2];
  p.Dv = p.v.sizes[3];
  if (mask != Py_None &&
      (read_view(st, mask, &p.mask, "attn_mask", 0) < 0 || broadcast_mask(&p.mask, p.B, p.Hq, p.Sq, p.Sk) < 0))
    return NULL;
  p.causal = (ab_causal)causal;
  p.scale = scale;
  p.window_left = wl;
  p.window_right = wr;
  p.softcap = softcap;
  const ab_dtype dt = p.q.dtype < AB_DTYPE_BOOL ? p.q.dtype : AB_DTYPE_F32;
  const ab_dtype lse_dt = dt == AB_DTYPE_F64 ? AB_DTYPE_F64 : AB_DTYPE_F32;
  /* out (B, Hq, Sq, Dv) laid out (B, Sq, Hq, Dv); lse (B, Hq, Sq) contiguous */
  const int64_t phys_sizes[4] = {p.B, p.Sq, p.Hq, p.Dv};
  int64_t phys[4];
  contiguous_strides(phys_sizes, 4, phys);
  p.out.ndim = 4;
  p.out.dtype = p.q.dtype;
  p.out.device = AB_DEVICE_CPU;
  p.out.device_index = -1;
  const int64_t out_sizes[4] = {p.B, p.Hq, p.Sq, p.Dv}, out_strides[4] = {phys[0], phys[2], phys[1], phys[3]};
  memcpy(p.out.sizes, out_sizes, sizeof out_sizes);
  memcpy(p.out.strides, out_strides, sizeof out_strides);
  p.lse = p.out;
  p.lse.ndim = 3;
  p.lse.dtype = lse_dt;
  const int64_t lse_sizes[3] = {p.B, p.Hq, p.Sq};
  memcpy(p.lse.sizes, lse_sizes, sizeof lse_sizes);
  contiguous_strides(lse_sizes, 3, p.lse.strides);
  /* out in q's dtype (a dtype the kernel rejects still gets an out: the kernel's check then fails) */
  PyObject* out = empty_strided(st, p.q.dtype < AB_DTYPE_BOOL ? q : NULL, p.out.sizes, p.out.strides, 4, dt);
  if (!out || set_data(st, out, &p.out) < 0) {
    Py_XDECREF(out);
    return NULL;
  }
  PyObject* lse = NULL;
  void* own_lse = NULL;
  if (want_lse) {
    lse = empty_strided(st, NULL, p.lse.sizes, p.lse.strides, 3, lse_dt);
    if (!lse || set_data(st, lse, &p.lse) < 0) {
      Py_DECREF(out);
      Py_XDECREF(lse);
      return NULL;
    }
  } else {
    const int64_t n = p.B * p.Hq * p.Sq;
    own_lse = n > 0 ? malloc((size_t)n * ab_dtype_size(lse_dt)) : NULL;
    if (n > 0 && !own_lse) {
      Py_DECREF(out);
      return PyErr_NoMemory();
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

/* *slot = value (a new reference), dropping the old one (Py_XSETREF is not in the limited API). */
static void replace_ref(PyObject** slot, PyObject* value) {
  PyObject* old = *slot;
  *slot = value;
  Py_XDECREF(old);
}

/* set_tensor_api(empty_strided, cpu_device, (float32, float16, bfloat16, float64, bool, int32, int64,
 * uint8)): what flash_fwd_cpu allocates with and the dtypes it recognises (ab_dtype's order). */
static PyObject* ab_py_set_tensor_api(PyObject* self, PyObject* args) {
  ab_state* st = state_of(self);
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

static PyMethodDef ab_methods[] = {
    {"flash_fwd_cpu", ab_py_flash_fwd_cpu, METH_VARARGS,
     "flash_fwd_cpu(q, k, v, attn_mask, causal, scale, window_left, window_right, softcap, want_lse) -> "
     "(out, lse or None), or None: the CPU flash forward without the dispatcher (checked CPU tensors, no autograd)."},
    {"set_tensor_api", ab_py_set_tensor_api, METH_VARARGS,
     "set_tensor_api(empty_strided, cpu_device, dtypes): what flash_fwd_cpu allocates outputs with."},
    {"_amx_emu_dot", ab_py_amx_emu_dot, METH_VARARGS,
     "_amx_emu_dot(op, a, b, c, shape) -> C after one emulated tile product (tests of the emulation)."},
    {"fma_peak", ab_py_fma_peak, METH_VARARGS,
     "fma_peak(seconds=0.3, threads=1) -> float32 flop/s of independent FMA chains on the CPU path."},
    {"cpu_isa", ab_py_cpu_isa, METH_NOARGS,
     "cpu_isa() -> the instruction-set path of the CPU kernels (ATTN_BACKENDS_CPU_ISA forces one)."},
    {"cpu_isa_index", ab_py_cpu_isa_index, METH_NOARGS,
     "cpu_isa_index() -> the CPU kernels' path as a number (0 generic, 1 avx2, 2 avx512, 3 amx, 4 amx_emu)."},
    {"cpu_isa_error", ab_py_cpu_isa_error, METH_NOARGS,
     "cpu_isa_error() -> why ATTN_BACKENDS_CPU_ISA cannot be honoured (CPU kernel calls fail with it), or None."},
    {"cpu_units", ab_py_cpu_units, METH_NOARGS,
     "cpu_units() -> bits of the CPU matrix units this process may use (1 AMX-BF16, 2 AMX-FP16, 4 AMX-INT8)."},
    {"cpu_isa_supported", ab_py_cpu_isa_supported, METH_O,
     "cpu_isa_supported(name) -> whether this CPU and OS can run that path."},
    {"set_cpu_isa", ab_py_set_cpu_isa, METH_O,
     "set_cpu_isa(name) -> switch the CPU kernels' path for this process; False if unsupported."},
    {"sage_cpu_isa", ab_py_sage_cpu_isa, METH_NOARGS,
     "sage_cpu_isa() -> the sage kernel's path: the CPU path, except AVX-512 without VNNI runs avx2."},
    {"cpu_features", ab_py_cpu_features, METH_NOARGS,
     "cpu_features() -> dict: x86 ISA extensions usable by this process (CPUID and XGETBV)."},
    {"build_info", ab_py_build_info, METH_NOARGS,
     "build_info() -> dict: version, torch ABI target, CUDA archs, compiler."},
    {"backend_table", ab_py_backend_table, METH_NOARGS,
     "backend_table() -> the registry: (name, aliases, kind, summary, lossy, provider, caps) rows."},
    {"enable_cuda_flash", ab_py_enable_cuda_flash, METH_O,
     "enable_cuda_flash(on): serve flash/flash_varlen (forward, backward) and math backward on CUDA from our (not yet verified) kernels."},
    {"enable_cuda_sage", ab_py_enable_cuda_sage, METH_O,
     "enable_cuda_sage(on): serve sage on CUDA (forward only) from our (not yet verified) kernel."},
    {"enable_cuda_decode", ab_py_enable_cuda_decode, METH_O,
     "enable_cuda_decode(on): serve paged_attention (attention_with_kvcache) on CUDA from our (not yet verified) kernel."},
    {"set_provider", ab_py_set_provider, METH_VARARGS,
     "set_provider(id, available, why_not): record whether a torch feature or package exists."},
    {"plan", ab_py_plan, METH_O,
     "plan(call) -> (chosen, order, reasons, path) for a described call (see ab_planner.h)."},
    {"set_cuda_emulation", ab_py_set_cuda_emulation, METH_O,
     "set_cuda_emulation(on): CPU tensors of flash, flash_varlen, sage and math run the CUDA kernels on the emulator."},
    {"cuda_emulation", ab_py_cuda_emulation, METH_NOARGS, "cuda_emulation() -> whether the CUDA emulation is on."},
    {"cuda_device", ab_py_cuda_device, METH_O,
     "cuda_device(index) -> (cc, supported, why_not): loads the CUDA library and asks the device."},
    {"lookup", ab_py_lookup, METH_O,
     "lookup(name) -> canonical backend name for any accepted name, or None."},
    {NULL, NULL, 0, NULL},
};

static int ab_exec(PyObject* module) {
  ab_state* st = state_of(module);
  if (!(st->s_shape = PyUnicode_InternFromString("shape")) || !(st->s_stride = PyUnicode_InternFromString("stride")) ||
      !(st->s_data_ptr = PyUnicode_InternFromString("data_ptr")) ||
      !(st->s_dtype = PyUnicode_InternFromString("dtype")) || !(st->s_is_cpu = PyUnicode_InternFromString("is_cpu")) ||
      !(st->s_new_empty_strided = PyUnicode_InternFromString("new_empty_strided")))
    return -1;
  return PyModule_AddStringConstant(module, "__version__", AB_VERSION);
}

static int ab_traverse(PyObject* module, visitproc visit, void* arg) {
  ab_state* st = state_of(module);
  if (!st) return 0;
  Py_VISIT(st->empty_strided);
  for (int i = 0; i < AB_DTYPE_OTHER; ++i) Py_VISIT(st->dtypes[i]);
  for (int i = 0; i < 4; ++i) Py_VISIT(st->alloc_kw[i]);
  return 0;
}

static int ab_clear(PyObject* module) {
  ab_state* st = state_of(module);
  if (!st) return 0;
  Py_CLEAR(st->s_shape);
  Py_CLEAR(st->s_stride);
  Py_CLEAR(st->s_data_ptr);
  Py_CLEAR(st->s_dtype);
  Py_CLEAR(st->s_is_cpu);
  Py_CLEAR(st->s_new_empty_strided);
  Py_CLEAR(st->empty_strided);
  for (int i = 0; i < AB_DTYPE_OTHER; ++i) Py_CLEAR(st->dtypes[i]);
  for (int i = 0; i < 4; ++i) Py_CLEAR(st->alloc_kw[i]);
  return 0;
}

static void ab_free(void* module) { ab_clear((PyObject*)module); }

static PyModuleDef_Slot ab_slots[] = {
    {Py_mod_exec, (void*)ab_exec},
    {0, NULL},
};

static struct PyModuleDef ab_module = {
    PyModuleDef_HEAD_INIT,
    "attn_backends._C",
    "C core of attn_backends: build facts, CPU features, backend names.  Importing it registers\n"
    "the attn_backends::* torch ops.",
    sizeof(ab_state),
    ab_methods,
    ab_slots,
    ab_traverse,
    ab_clear,
    ab_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&ab_module); }
