// GELU and its slope in one pass.
#include "common.h"
#include "ops.h"

namespace polaformer::native {
namespace {

// GELU (erf form) of a dense buffer and its slope, in one pass: out = x·Φ(x), and x is overwritten by
// Φ(x) + x·φ(x), the factor its backward multiplies the incoming gradient by. Φ(x) = (1 + erf(x/√2))/2 as
// torch's gelu computes it: in float32 with the erf of its vectorised kernels (Abramowitz-Stegun 7.1.26,
// 1.5e-7 absolute), whose exp(-x²/2) is also φ's, so one exp serves both; in float64 with SLEEF's erf.
inline Vectorized<float> gelu_cdf_and_gauss(const Vectorized<float>& x, Vectorized<float>& gauss) {
  using V = Vectorized<float>;
  const V one(1.f), half(0.5f), minus_half(-0.5f), p(0.3275911f), p1(0.254829592f), p2(-0.284496736f),
      p3(1.421413741f), p4(-1.453152027f), p5(1.061405429f), inv_sqrt2(float(M_SQRT1_2));
  gauss = (minus_half * x * x).exp();  // exp(-z²) for z = x/√2
  const V t = one / at::vec::fmadd(p, x.abs() * inv_sqrt2, one);
  const V poly = at::vec::fmadd(at::vec::fmadd(at::vec::fmadd(at::vec::fmadd(p5, t, p4), t, p3), t, p2), t, p1);
  const V tail = half * poly * t * gauss;  // (1 - erf(|z|)) / 2
  return V::blendv(tail, one - tail, x >= V(0.f));
}

inline Vectorized<double> gelu_cdf_and_gauss(const Vectorized<double>& x, Vectorized<double>& gauss) {
  using V = Vectorized<double>;
  gauss = (V(-0.5) * x * x).exp();
  return V(0.5) * (V(1) + (x * V(M_SQRT1_2)).erf());
}

template <typename T>
void gelu_with_slope_kernel(const at::Tensor& x, at::Tensor& out, at::Tensor& slope) {
  using V = Vectorized<T>;
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* sp = slope.data_ptr<T>();  // may be x's memory
  at::parallel_for(0, x.numel(), int64_t{1} << 14, [&](int64_t begin, int64_t end) {
    const V pdf_scale(T(M_2_SQRTPI * M_SQRT1_2 * 0.5));
    for (int64_t i = begin; i < end; i += V::size()) {
      const int64_t count = std::min<int64_t>(V::size(), end - i);  // the tail as a partial vector: same math
      const V v = V::loadu(xp + i, count);
      V gauss;
      const V cdf = gelu_cdf_and_gauss(v, gauss);
      (v * cdf).store(op + i, count);
      at::vec::fmadd(v * pdf_scale, gauss, cdf).store(sp + i, count);
    }
  });
}

}  // namespace

// GELU of x and its slope at x; with in_place, the slope is written over x (dense) and only GELU returned.
// x may be in any dense layout (channels-last maps too): the outputs take x's strides.
std::vector<at::Tensor> gelu_with_slope(at::Tensor x, bool in_place) {
  TORCH_CHECK(x.device().is_cpu() && x.is_non_overlapping_and_dense(), "x must be a dense CPU tensor (any layout)");
  auto out = at::empty_like(x);
  auto slope = in_place ? x : at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "gelu_with_slope", [&] { gelu_with_slope_kernel<scalar_t>(x, out, slope); });
  if (in_place) return {out};
  return {out, slope};
}

}  // namespace polaformer::native
