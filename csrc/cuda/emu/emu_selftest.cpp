// emu_selftest.cpp -- small kernels with the bugs the emulator exists to catch, for its own tests
// (tests/test_cuda_emu.py): an out-of-range global store, a misaligned vector store, an
// out-of-range ldmatrix, a missing
// __syncthreads, a read of cp.async'd shared memory before the wait.  They go through the same
// launch, device memory and checks as the real kernels.
#include <stdio.h>
#include <string.h>

#include <string>

#include "../flash_common.cuh"
#include "emu_runtime.h"

namespace {

// n + 1 threads store into n floats
__global__ void oob_store(float* out) { out[blockIdx.x * blockDim.x + threadIdx.x] = 1.0f; }

// a 16-byte vector store 4 bytes past a 16-byte boundary
__global__ void misaligned_store(uint32_t* out) {
  *reinterpret_cast<uint4*>(out + 1 + 4 * threadIdx.x) = uint4{1, 2, 3, 4};
}

// each thread reads another warp's slot, with or without the barrier between write and read
__global__ void exchange(int* out, int sync) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  int* s = reinterpret_cast<int*>(smem_raw);
  s[threadIdx.x] = (int)threadIdx.x;
  if (sync) __syncthreads();
  out[threadIdx.x] = s[(threadIdx.x + 32) % blockDim.x];
}

// lane l reads the 16 bytes at offset 16 (l + 1): the last lane's row is past the 512 bytes
__global__ void ldmatrix_past_end(uint32_t* out) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint32_t r[4];
  ab_flash::ldmatrix_x4(r, ab_flash::smem_u32(smem_raw) + 16 * (threadIdx.x + 1));
  out[threadIdx.x] = r[0];
}

// copies 16 bytes per thread to shared memory and reads them back, with or without the wait
__global__ void copy_then_read(const uint32_t* in, uint32_t* out, int wait) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint32_t* s = reinterpret_cast<uint32_t*>(smem_raw);
  ab_flash::cp_async_16(ab_flash::smem_u32(s + 4 * threadIdx.x), in + 4 * threadIdx.x, true);
  ab_flash::cp_async_commit();
  if (wait) ab_flash::cp_async_wait<0>();
  out[threadIdx.x] = s[4 * threadIdx.x];
}

}  // namespace

// Runs self-test `which` ("oob_store", "misaligned_store", "exchange", "exchange_synced",
// "smem_over_48k_unset", "ldmatrix_past_end", "copy_then_read", "copy_wait_read"): the number of
// threads that read a wrong value, or -1 when the launch failed, with the emulator's message in msg.
extern "C" AB_EXPORT int ab_cuda_emu_selftest(const char* which, char* msg, int msg_len) {
  ab_emu::session_begin(nullptr);
  const std::string w = which;
  constexpr int n = 128;
  int wrong = 0;
  uint32_t* out = reinterpret_cast<uint32_t*>(ab_emu::device_alloc("out", n * 4, 16, 0, true, 4));
  if (w == "oob_store") {
    AB_LAUNCH(1, n + 1, 0, nullptr, oob_store)(reinterpret_cast<float*>(out));
  } else if (w == "misaligned_store") {
    AB_LAUNCH(1, 8, 0, nullptr, misaligned_store)(out);
  } else if (w == "exchange" || w == "exchange_synced") {
    AB_LAUNCH(1, n, n * 4, nullptr, exchange)(reinterpret_cast<int*>(out), w == "exchange_synced");
    for (int i = 0; i < n; ++i) wrong += out[i] != (uint32_t)((i + 32) % n);
  } else if (w == "smem_over_48k_unset") {  // no cudaFuncSetAttribute: a device refuses the launch
    AB_LAUNCH(1, n, 64 * 1024, nullptr, exchange)(reinterpret_cast<int*>(out), 1);
  } else if (w == "ldmatrix_past_end") {
    AB_LAUNCH(1, 32, 512, nullptr, ldmatrix_past_end)(out);
  } else if (w == "copy_then_read" || w == "copy_wait_read") {
    uint32_t* in = reinterpret_cast<uint32_t*>(ab_emu::device_alloc("in", n * 16, 16, 0, false, 4));
    for (int i = 0; i < 4 * n; ++i) in[i] = (uint32_t)i;
    AB_LAUNCH(1, n, n * 16, nullptr, copy_then_read)(in, out, w == "copy_wait_read");
    for (int i = 0; i < n; ++i) wrong += out[i] != (uint32_t)(4 * i);
  } else {
    wrong = -1;
    snprintf(msg, (size_t)msg_len, "unknown self-test %s", which);
  }
  const std::string failure = ab_emu::session_failure();
  if (!failure.empty()) {
    snprintf(msg, (size_t)msg_len, "%s", failure.c_str());
    wrong = -1;
  }
  ab_emu::session_end();
  return wrong;
}
