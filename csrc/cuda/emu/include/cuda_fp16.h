// cuda_fp16.h -- the emulated build's stand-in: everything is in cuda_runtime.h (the emulator's host
// versions of the CUDA types and intrinsics the kernels use).
#include "cuda_runtime.h"
