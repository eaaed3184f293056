/* ab_module.h -- what the two files of the CPython module attn_backends._C share (limited API, abi3):
 * ab_module.c (build facts, CPU features, the registry, the planner and its call descriptor Call) and
 * ab_direct.c (the calls that skip the dispatcher: flash_fwd_cpu and the fast path of ab.attention).
 * These two are the only files that include Python.h. */
#ifndef AB_MODULE_H
#define AB_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "ab_core.h"
#include "ab_planner.h"

/* Plans the fast path may reuse: call descriptor -> chosen backend, filled by attn_backends/_dispatch.py
 * (remember) after the Python path planned the call once, logged it and did not fall back. */
#define AB_REMEMBERED_MAX 64

typedef struct ab_remembered {
  ab_call call; /* memset to 0 before filling, so that whole structs compare with memcmp */
  int32_t chosen;
} ab_remembered;

/* Module state.  What the direct calls need from torch is handed over once by
 * attn_backends/_providers.py (set_tensor_api, set_fast_api); the interned names are the attributes
 * they read tensors' metadata through. */
typedef struct ab_state {
  PyObject* s_shape;             /* "shape" */
  PyObject* s_stride;            /* "stride" */
  PyObject* s_data_ptr;          /* "data_ptr" */
  PyObject* s_dtype;             /* "dtype" */
  PyObject* s_is_cpu;            /* "is_cpu" */
  PyObject* s_requires_grad;     /* "requires_grad" */
  PyObject* s_new_empty_strided; /* "new_empty_strided" */
  PyObject* s_mps_fix;           /* "mps_fix" */
  PyObject* call_type;           /* attn_backends._C.Call, the call descriptor's Python mirror */
  PyObject* empty_strided;       /* torch.empty_strided; NULL until set_tensor_api */
  PyObject* dtypes[AB_DTYPE_OTHER]; /* torch.float32, float16, bfloat16, float64, bool, int32, int64, uint8:
                                       indexed by ab_dtype */
  PyObject* alloc_kw[4];         /* {"dtype": torch.<float dtype>, "device": cpu} per floating ab_dtype */
  /* the fast path (set_fast_api); NULL until set */
  PyObject* tensor_type;         /* torch.Tensor: only tensors of exactly this type take the fast path */
  PyObject* guards;              /* tuple of callables; each returns something false when the fast path may run */
  PyObject* grad_enabled;        /* torch.is_grad_enabled */
  PyObject* deterministic;       /* torch.are_deterministic_algorithms_enabled */
  PyObject* context_get;         /* the bound get() of ab.use()'s ContextVar (None outside any use()) */
  PyObject* process_default;     /* a one-item list: the backend "auto" means outside any use() */
  PyObject* settings;            /* attn_backends._planner.settings (a dict; "mps_fix") */
  PyObject* backend_ids;         /* dict: backend name as the caller spelt it -> ab_backend_id */
  ab_remembered remembered[AB_REMEMBERED_MAX];
  int n_remembered;
  long long fast_calls;          /* calls the fast path served (tests) */
} ab_state;

/* ab_module.c */
ab_state* ab_module_state(PyObject* module);
/* Fills *c from a Call (or any tuple of AB_CALL_NFIELDS ints), range-checked; -1 with an exception. */
int ab_call_from_py(PyObject* obj, ab_call* c);

/* ab_direct.c */
extern PyMethodDef ab_direct_methods[];
int ab_direct_init(ab_state* st);     /* interns the names; -1 with an exception */
int ab_direct_traverse(ab_state* st, visitproc visit, void* arg);
void ab_direct_clear(ab_state* st);
/* Drops every remembered plan (the registry changed: a provider, an opt-in kernel, the emulation). */
void ab_direct_forget(ab_state* st);

#endif /* AB_MODULE_H */
