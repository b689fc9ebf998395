#include "common/tensor.h"

namespace sf {

std::string TensorView::shape_str() const {
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) {
    if (i) s += ',';  // (a ternary of literals here trips GCC 12's -Wrestrict)
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

}  // namespace sf
