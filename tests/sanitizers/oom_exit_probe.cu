// Does compute-sanitizer itself crash a process whose CUDA context cannot be created because
// another process holds the device's memory? (test_cli_gpu's CPU-fallback case exits 139 under
// memcheck and 0 without it.) `fill` holds all but a few MiB until killed; `check` only asks for
// the device, as sparsefill-decode's fallback does, and exits 0.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "fill") == 0) {
    std::vector<void*> held;
    size_t free_b = 0, total_b = 0;
    for (size_t piece = size_t(1) << 30; piece >= (size_t(1) << 20); piece /= 4)
      while (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess && free_b > piece + (8u << 20)) {
        void* p = nullptr;
        if (cudaMalloc(&p, piece) != cudaSuccess) { (void)cudaGetLastError(); break; }
        held.push_back(p);
      }
    cudaMemGetInfo(&free_b, &total_b);
    std::printf("full: %zu MiB free of %zu\n", free_b >> 20, total_b >> 20);
    std::fflush(stdout);
    std::this_thread::sleep_for(std::chrono::seconds(600));
    return 0;
  }
  const cudaError_t e = cudaSetDevice(0);
  const cudaError_t f = e == cudaSuccess ? cudaFree(nullptr) : e;
  std::printf("check: cudaSetDevice %s, context %s\n", cudaGetErrorString(e), cudaGetErrorString(f));
  return 0;
}
