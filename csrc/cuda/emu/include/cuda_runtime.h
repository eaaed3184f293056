// cuda_runtime.h -- the CUDA emulator's stand-in for the CUDA headers (docs/cuda.md, "The emulator").
//
// The emulated build compiles the unchanged kernel sources (csrc/cuda/*.cu, *.cuh) with g++ and this
// directory first on the include path, so <cuda_runtime.h>, <cuda_fp16.h> and <cuda_bf16.h> land here:
// the CUDA qualifiers become plain C++, the built-in variables (threadIdx, blockIdx, ...) and the
// intrinsics the kernels use (warp shuffles, __syncthreads, atomics, the 16-bit types) call into the
// emulator (emu_block.cpp, emu_device.cpp), and the runtime API is the emulator's host version.  The PTX wrappers
// (flash_common.cuh, sage_fwd_kernel.cuh) call ab_emu:: directly under AB_CUDA_EMULATE.
#ifndef AB_EMU_CUDA_RUNTIME_H
#define AB_EMU_CUDA_RUNTIME_H

#ifndef AB_CUDA_EMULATE
#error "csrc/cuda/emu/include is for the emulated build (AB_CUDA_EMULATE) only"
#endif

#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <tuple>
#include <type_traits>
#include <utility>

#include "../../../ab_half.h"

// ---- qualifiers -----------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n)
#define __restrict__ __restrict
// A block's threads are fibers of one OS thread, and blocks run one at a time per OS thread, so a
// static __shared__ variable is a thread_local (block scope: static is implied).
#define __shared__ thread_local

// The dynamic shared memory: every kernel declares it as `extern __shared__ ... smem_raw[]`.  The
// name becomes a pointer to the running block's buffer (placed by the emulator against a guard
// page); the block-scope extern declaration names the variable of the enclosing namespace, so
// each namespace that holds kernels has one, all pointing at the emulator's per-thread pointer.
extern thread_local unsigned char (*ab_emu_dyn_smem)[];
#define smem_raw (**ab_emu_smem_pp)
namespace ab_flash {
inline thread_local unsigned char (**ab_emu_smem_pp)[] = &ab_emu_dyn_smem;
}
namespace ab_sage {
inline thread_local unsigned char (**ab_emu_smem_pp)[] = &ab_emu_dyn_smem;
}
namespace {
[[maybe_unused]] thread_local unsigned char (**ab_emu_smem_pp)[] = &ab_emu_dyn_smem;
}

// ---- vector and 16-bit types ----------------------------------------------------------------------
struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
inline float2 make_float2(float x, float y) { return float2{x, y}; }

struct __half {
  uint16_t __x;
};
struct __nv_bfloat16 {
  uint16_t __x;
};
struct alignas(4) __half2 {
  __half x, y;
};
struct alignas(4) __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
inline float __half2float(__half h) { return ab_f16_to_f32(h.__x); }
inline __half __float2half_rn(float f) { return __half{ab_f32_to_f16(f)}; }
inline float __bfloat162float(__nv_bfloat16 h) { return ab_bf16_to_f32(h.__x); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{ab_f32_to_bf16(f)}; }
inline __half2 __floats2half2_rn(float lo, float hi) { return __half2{__float2half_rn(lo), __float2half_rn(hi)}; }
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
  return __nv_bfloat162{__float2bfloat16_rn(lo), __float2bfloat16_rn(hi)};
}

// ---- scalar intrinsics ----------------------------------------------------------------------------
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
// cvt.rni.s32.f32: round to nearest even, saturating, NaN -> 0
inline int __float2int_rn(float x) {
  if (x != x) return 0;
  if (x >= 2147483647.0f) return INT_MAX;
  if (x <= -2147483648.0f) return INT_MIN;
  return (int)nearbyintf(x);
}
// float arithmetic rounded once per operation, never contracted into an FMA (g++ without -mfma
// has none to contract into)
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
// the GPU's fast exponential (ex2.approx, a few ulp); emulated exactly
inline float __expf(float x) { return expf(x); }
// the high 32 bits of the 64-bit product
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline float __int_as_float(int i) {
  float f;
  memcpy(&f, &i, sizeof f);
  return f;
}

// ---- the runtime API --------------------------------------------------------------------------------
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevicePointer = 17,
  cudaErrorIllegalAddress = 700,
  cudaErrorLaunchFailure = 719,
};
enum cudaDeviceAttr {
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrMaxSharedMemoryPerMultiprocessor = 81,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
  cudaDevAttrReservedSharedMemoryPerBlock = 111,
};
enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
};
typedef struct CUstream_st* cudaStream_t;

namespace ab_emu {

// ---- the emulator's entry points (emu_block.cpp, emu_device.cpp) ---------------------------------
extern thread_local const uint3* tls_thread_idx;
extern thread_local uint3 tls_block_idx;
extern thread_local dim3 tls_block_dim, tls_grid_dim;

cudaError_t get_device(int* device);
cudaError_t device_attribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t func_set_attribute(const void* fn, cudaFuncAttribute attr, int value);
cudaError_t occupancy(int* blocks, const void* fn, int threads, size_t smem);
cudaError_t memset_async(void* p, int value, size_t n);
cudaError_t get_last_error();
const char* error_name(cudaError_t e);
const char* error_string(cudaError_t e);

// warp collectives and the block barrier: the calling fiber parks until its warp (or block) is there
uint64_t shfl_xor(unsigned mask, uint64_t bits, int size, int lane_mask, int width);
int any_sync(unsigned mask, int pred);
void syncthreads();
float atomic_add(float* p, float v);

// the PTX wrappers' emulated instructions (fragment layouts: flash_common.cuh)
uint32_t cvta_shared(const void* p);
void ldmatrix_x4(uint32_t r[4], uint32_t addr, bool trans);
void cp_async(uint32_t dst, const void* src, int bytes, bool valid);
void cp_async_commit();
void cp_async_wait(int n);
void mma_m16n8k16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1, bool bf16);
void mma_m16n8k32_s8(int c[4], const uint32_t a[4], uint32_t b0, uint32_t b1);
float ex2_approx(float x);
float rcp_approx(float x);

// a kernel launch: the grid's blocks run one after another (or spread over the caller's threads)
struct KernelBody {
  void (*run)(void* ctx);  // one thread's kernel call with the launch's arguments
  void* ctx;
};
void launch(const void* fn, const char* name, const char* where, dim3 grid, dim3 block, size_t smem,
            cudaStream_t stream, KernelBody body);

template <typename... P> struct Launch {
  void (*fn)(P...);
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
  const char *name, *where;
  template <typename... A> void operator()(A&&... a) const {
    using Args = std::tuple<std::decay_t<P>...>;
    struct Ctx {
      void (*fn)(P...);
      Args args;
    } ctx{fn, Args(std::forward<A>(a)...)};
    KernelBody body{[](void* c) {
                      Ctx* x = static_cast<Ctx*>(c);
                      std::apply(x->fn, x->args);  // each thread gets its own copy of the parameters
                    },
                    &ctx};
    launch(reinterpret_cast<const void*>(fn), name, where, grid, block, smem, stream, body);
  }
};

template <typename... P>
Launch<P...> make_launch(void (*fn)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                         const char* name, const char* where) {
  return Launch<P...>{fn, grid, block, smem, stream, name, where};
}

}  // namespace ab_emu

// kernel<<<grid, block, smem, stream>>>(args) in the launchers is AB_LAUNCH(grid, block, smem,
// stream, kernel)(args) (ab_cuda_internal.h); here it is the emulator's launch
#define AB_LAUNCH(grid, block, smem, stream, ...) \
  ::ab_emu::make_launch(__VA_ARGS__, grid, block, smem, stream, #__VA_ARGS__, __PRETTY_FUNCTION__)

#define threadIdx (*::ab_emu::tls_thread_idx)
#define blockIdx (::ab_emu::tls_block_idx)
#define blockDim (::ab_emu::tls_block_dim)
#define gridDim (::ab_emu::tls_grid_dim)

inline cudaError_t cudaGetDevice(int* device) { return ab_emu::get_device(device); }
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  return ab_emu::device_attribute(value, attr, device);
}
template <typename F> cudaError_t cudaFuncSetAttribute(F* fn, cudaFuncAttribute attr, int value) {
  return ab_emu::func_set_attribute(reinterpret_cast<const void*>(fn), attr, value);
}
template <typename F>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, F* fn, int threads, size_t smem) {
  return ab_emu::occupancy(blocks, reinterpret_cast<const void*>(fn), threads, smem);
}
inline cudaError_t cudaMemsetAsync(void* p, int value, size_t n, cudaStream_t) {
  return ab_emu::memset_async(p, value, n);
}
inline cudaError_t cudaGetLastError() { return ab_emu::get_last_error(); }
inline const char* cudaGetErrorName(cudaError_t e) { return ab_emu::error_name(e); }
inline const char* cudaGetErrorString(cudaError_t e) { return ab_emu::error_string(e); }

template <typename T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8, "a shuffle moves up to 8 bytes");
  uint64_t bits = 0;
  memcpy(&bits, &v, sizeof v);
  bits = ab_emu::shfl_xor(mask, bits, (int)sizeof(T), lane_mask, width);
  memcpy(&v, &bits, sizeof v);
  return v;
}
inline int __any_sync(unsigned mask, int pred) { return ab_emu::any_sync(mask, pred); }
inline void __syncthreads() { ab_emu::syncthreads(); }
inline float atomicAdd(float* p, float v) { return ab_emu::atomic_add(p, v); }
inline size_t __cvta_generic_to_shared(const void* p) { return ab_emu::cvta_shared(p); }
// a read through the read-only cache is a read
template <typename T> inline T __ldg(const T* p) { return *p; }

#endif  // AB_EMU_CUDA_RUNTIME_H
