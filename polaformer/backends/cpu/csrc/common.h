// Shared by every kernel family of the native CPU module (one .cpp per family, bindings.cpp binds them all).
//
// Each kernel replaces a chain of 4-8 torch ops (one pass over memory each) by one pass that keeps a
// row in registers; the matrix products stay with torch. Built on first use by native.py (torch's
// cpp_extension) with the vector width of the machine (ATen's Vectorized, whose log/exp are SLEEF's
// 1-ulp routines).
// Every kernel is checked against the torch-op version in float64 by tests/test_native.py.
//
// Tensors are (B, H, N, C) with unit stride along C and any strides elsewhere. Everything here is inline or
// a template: several translation units include it. It includes the few ATen headers used rather than
// ATen.h, whose parsing would dominate the compile time of every translation unit.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace polaformer::native {

using at::vec::Vectorized;

// Rows of (B, H, N, ·) addressed through their strides.
struct Rows {
  int64_t heads, tokens, sb, sh, sn;
  Rows(const at::Tensor& t) : heads(t.size(1)), tokens(t.size(2)), sb(t.stride(0)), sh(t.stride(1)), sn(t.stride(2)) {}
  int64_t offset(int64_t row) const {
    const int64_t n = row % tokens, bh = row / tokens;
    return (bh / heads) * sb + (bh % heads) * sh + n * sn;
  }
};

inline void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4, name, " must be 4-D (B, H, N, C), got ", t.dim(), "-D");
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.size(3) <= 1 || t.stride(3) == 1, name, " must have unit stride along its last dimension");
}

// Rows per parallel task: about 16k elements, so that small calls stay on one thread.
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(width, 1)); }

// The sum of a vector's lanes by halving shuffles (a fixed order, not the lanes').
template <typename T>
inline T tree_sum(const Vectorized<T>& v) {
  return at::vec::vec_reduce_all<T>([](const Vectorized<T>& a, const Vectorized<T>& b) { return a + b; }, v);
}

// The sum of a vector's lanes, in lane order.
template <typename T>
inline T lane_sum(const Vectorized<T>& v) {
  T lanes[Vectorized<T>::size()];
  v.store(lanes);
  T sum = T(0);
  for (int64_t i = 0; i < Vectorized<T>::size(); ++i) sum += lanes[i];
  return sum;
}

// out[c] = src[c] / z for c in [lo, hi): a division, not a reciprocal multiply, as the torch ops round.
template <typename T>
inline void divide_range(const T* src, int64_t lo, int64_t hi, T z, T* out) {
  using V = Vectorized<T>;
  const V zv(z);
  int64_t c = lo;
  for (; c + V::size() <= hi; c += V::size()) (V::loadu(src + c) / zv).store(out + c);
  for (; c < hi; ++c) out[c] = src[c] / z;
}

}  // namespace polaformer::native
