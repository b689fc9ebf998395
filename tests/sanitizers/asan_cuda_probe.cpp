// Negative control for asan_gpu.sh: with a CUDA context live and ASAN_OPTIONS as that script sets
// them, a one-byte heap overflow must still be reported (exit non-zero, "heap-buffer-overflow").
// Build: g++ -fsanitize=address -g asan_cuda_probe.cpp -I$CUDA/include -L$CUDA/lib64 -lcudart
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

int main(int argc, char**) {
  void* d = nullptr;
  if (cudaMalloc(&d, 1 << 20) != cudaSuccess) {
    std::puts("probe: no CUDA device");
    return 2;
  }
  char* h = static_cast<char*>(std::malloc(64));
  h[64 + argc - 1] = 1;  // one past the end (argc is 1): ASan must stop here
  std::printf("probe: overflow not reported\n");
  std::free(h);
  cudaFree(d);
  return 0;
}
