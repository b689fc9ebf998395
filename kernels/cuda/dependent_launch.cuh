// Programmatic dependent launch (Hopper): a kernel launched by launch_dependent() may be put on
// the SMs while the kernel before it in the stream is still finishing, so the gap between two
// short kernels (the launch, the CTA rasterization, the previous grid's drain) overlaps instead of
// adding up. The decode step is ~10 such kernels a layer; prefill's elementwise ops and the
// verification pass launch through it too.
//
// The rule that keeps it correct: a kernel launched this way calls grid_dep_enter() before any
// global load, store or atomic (a prefetch, or a thread exiting without touching memory, may come
// first), and at least one thread of the grid reaches it. The wait returns once the grid before
// it in the stream has completed and its writes are visible, so read-after-write and
// write-after-read both hold; since that grid waited for its own predecessor the same way (or
// was launched the ordinary way), every earlier grid has completed too. Launched without the
// attribute (SF_PDL=0, or another caller), the wait returns at once and the kernel behaves as
// any other; its trigger only lets a following dependent launch start early.
#pragma once
#include <cuda_runtime.h>

#include <utility>

#include "kernels/cuda/cuda_ops.h"

namespace sf::kernels::cuda {

__device__ __forceinline__ void grid_dep_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  // After the wait, not before: the next grid then runs at most one kernel ahead of its inputs,
  // and only in SM room this grid's last wave leaves.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#elif defined(__CUDA_ARCH__)
#error "dependent launch needs sm_90: an older target would launch dependents that never wait"
#endif
}

// kernel<<<grid, block, smem, st>>>(args...), with the programmatic-serialization attribute
// when dependent_launch() is on. The kernel must keep the rule above.
template <typename... KArgs, typename... Args>
cudaError_t launch_dependent(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                             cudaStream_t st, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = dependent_launch() ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace sf::kernels::cuda
