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
 * (remember) after the Python path planned the call once, logged it and did not fall back.  A process
 * with more kinds of calls than this replaces plans by a clock (second chance): the hand passes over a
 * plan used since it last came by, clearing its mark, and replaces the first one not used since. */
#define AB_REMEMBERED_MAX 64

typedef struct ab_remembered {
  ab_call call; /* memset to 0 before filling, so that whole structs compare with memcmp */
  int32_t chosen;
  int32_t used; /* looked up since the clock's hand last passed (ab_direct.c remembered) */
} ab_remembered;

/* Module state.  What the direct calls need from torch is handed over once by
 * attn_backends/_providers.py (set_tensor_api, set_fast_api); the interned names are the attributes
 * they read tensors' metadata through.  Every object the state owns is listed once here, X(field)
 * for one object and XN(field, count) for an array, and the struct, traverse and clear are generated
 * from the list. */
#define AB_STATE_OBJECTS(X, XN)                                                                            \
  X(s_shape)                /* "shape" */                                                                \
  X(s_stride)               /* "stride" */                                                               \
  X(s_data_ptr)             /* "data_ptr" */                                                             \
  X(s_dtype)                /* "dtype" */                                                                \
  X(s_is_cpu)               /* "is_cpu" */                                                               \
  X(s_is_neg)               /* "is_neg" */                                                               \
  X(s_requires_grad)        /* "requires_grad" */                                                        \
  X(s_new_empty_strided)    /* "new_empty_strided" */                                                    \
  X(s_mps_fix)              /* "mps_fix" */                                                              \
  X(call_type)              /* attn_backends._C.Call, the call descriptor's Python mirror */             \
  X(empty_strided)          /* torch.empty_strided; NULL until set_tensor_api */                         \
  XN(dtypes, AB_DTYPE_OTHER) /* torch.float32, float16, bfloat16, float64, bool, int32, int64, uint8:    \
                               indexed by ab_dtype */                                                    \
  XN(alloc_kw, 4)           /* {"dtype": torch.<float dtype>, "device": cpu} per floating ab_dtype */    \
  /* the fast path (set_fast_api); NULL until set */                                                     \
  X(tensor_type)            /* torch.Tensor: only tensors of exactly this type take the fast path */     \
  X(parameter_type)         /* torch.nn.Parameter: also taken for sinks and ALiBi slopes (module weights) */ \
  X(guards)                 /* tuple of callables; each returns something false when it may run */       \
  X(kv_guards)              /* the same for attention_with_kvcache's (inference mode allowed) */         \
  X(increment_version)      /* torch._C._increment_version: after a direct call wrote into a cache */   \
  X(grad_enabled)           /* torch.is_grad_enabled */                                                  \
  X(deterministic)          /* torch.are_deterministic_algorithms_enabled */                             \
  X(context_get)            /* the bound get() of ab.use()'s ContextVar (None outside any use()) */     \
  X(process_default)        /* a one-item list: the backend "auto" means outside any use() */            \
  X(settings)               /* attn_backends._planner.settings (a dict; "mps_fix") */                    \
  X(backend_ids)            /* dict: backend name as the caller spelt it -> ab_backend_id */

typedef struct ab_state {
#define AB_STATE_ONE(name) PyObject* name;
#define AB_STATE_MANY(name, count) PyObject* name[count];
  AB_STATE_OBJECTS(AB_STATE_ONE, AB_STATE_MANY)
#undef AB_STATE_ONE
#undef AB_STATE_MANY
  ab_remembered remembered[AB_REMEMBERED_MAX];
  int n_remembered;
  int next_evicted;              /* once the table is full, the clock's hand: where the search for a plan to
                                    replace starts */
  long long fast_calls;          /* calls the fast path served (tests) */
} ab_state;

/* Visits / clears every object of AB_STATE_OBJECTS (ab_module.c's module traverse and clear). */
static inline int ab_state_traverse(ab_state* st, visitproc visit, void* arg) {
#define AB_STATE_VISIT(name) Py_VISIT(st->name);
#define AB_STATE_VISIT_N(name, count) \
  for (int i = 0; i < (count); ++i) Py_VISIT(st->name[i]);
  AB_STATE_OBJECTS(AB_STATE_VISIT, AB_STATE_VISIT_N)
#undef AB_STATE_VISIT
#undef AB_STATE_VISIT_N
  return 0;
}

static inline void ab_state_clear(ab_state* st) {
#define AB_STATE_CLEAR(name) Py_CLEAR(st->name);
#define AB_STATE_CLEAR_N(name, count) \
  for (int i = 0; i < (count); ++i) Py_CLEAR(st->name[i]);
  AB_STATE_OBJECTS(AB_STATE_CLEAR, AB_STATE_CLEAR_N)
#undef AB_STATE_CLEAR
#undef AB_STATE_CLEAR_N
  st->n_remembered = 0;
}

/* ab_module.c */
ab_state* ab_module_state(PyObject* module);
/* Fills *c from a Call (or any tuple of AB_CALL_NFIELDS ints), range-checked; -1 with an exception. */
int ab_call_from_py(PyObject* obj, ab_call* c);

/* ab_direct.c */
extern PyMethodDef ab_direct_methods[];
int ab_direct_init(ab_state* st);     /* interns the names; -1 with an exception */
/* Drops every remembered plan (the registry changed: a provider, an opt-in kernel, the emulation). */
void ab_direct_forget(ab_state* st);

#endif /* AB_MODULE_H */
