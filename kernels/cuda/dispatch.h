// Runtime values -> compile-time constants for the CUDA kernels, in one place. A selector calls
// f(std::integral_constant<...>) for a supported value and returns false otherwise, so the same
// switch that instantiates a kernel also answers "is this supported?". Adding a head dim means a
// case here plus an instantiation file (attention_dense_hd<D>.cu) and its extern declaration.
#pragma once
#include <type_traits>

namespace sf::kernels::cuda {

template <typename F>
bool dispatch_head_dim(int head_dim, F&& f) {
  switch (head_dim) {
    case 64:
      f(std::integral_constant<int, 64>{});
      return true;
    case 128:
      f(std::integral_constant<int, 128>{});
      return true;
    default:
      return false;
  }
}

}  // namespace sf::kernels::cuda
