// RoPE on adjacent channel pairs (rope.py's apply_rope) and its transpose.
#include "common.h"
#include "ops.h"

namespace polaformer::native {
namespace {

// RoPE on adjacent channel pairs (2i, 2i+1) of x (B, H, N, d) with the tables sin, cos (N, d) contiguous:
// out[2i] = x[2i]·c[2i] - x[2i+1]·s[2i], out[2i+1] = x[2i+1]·c[2i+1] + x[2i]·s[2i+1] (apply_rope in rope.py);
// inverse: the transposed map, the rotation's backward.
template <typename T>
void rope_pairs_kernel(const at::Tensor& x, const T* sp, const T* cp, bool inverse, T* out) {
  const Rows rows(x);
  const int64_t d = x.size(3), n = x.size(2), total = x.size(0) * x.size(1) * n;
  const T* xp = x.data_ptr<T>();
  at::parallel_for(0, total, grain(2 * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + rows.offset(r);
      const T* c = cp + (r % n) * d;
      const T* s = sp + (r % n) * d;
      T* o = out + r * d;
      if (inverse) {
        for (int64_t i = 0; i < d; i += 2) {
          const T a = xr[i], b = xr[i + 1];
          o[i] = a * c[i] + b * s[i + 1];
          o[i + 1] = b * c[i + 1] - a * s[i];
        }
      } else {
        for (int64_t i = 0; i < d; i += 2) {
          const T a = xr[i], b = xr[i + 1];
          o[i] = a * c[i] - b * s[i];
          o[i + 1] = b * c[i + 1] + a * s[i + 1];
        }
      }
    }
  });
}

}  // namespace

// See rope_pairs_kernel; returns a new contiguous (B, H, N, d) tensor.
at::Tensor rope_pairs(const at::Tensor& x, const at::Tensor& sin, const at::Tensor& cos, bool inverse) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(3) % 2 == 0, "RoPE rotates channel pairs: head_dim must be even, got ", x.size(3));
  for (const auto* t : {&sin, &cos}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == x.size(2) && t->size(1) == x.size(3) && t->is_contiguous(),
                "RoPE tables must be contiguous (N, d) = (", x.size(2), ", ", x.size(3), "), got ", t->sizes());
    TORCH_CHECK(t->scalar_type() == x.scalar_type(), "RoPE tables and x dtypes differ");
  }
  auto out = at::empty(x.sizes(), x.options());
  if (out.numel() == 0) return out;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rope_pairs", [&] {
    rope_pairs_kernel<scalar_t>(x, sin.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), inverse, out.data_ptr<scalar_t>());
  });
  return out;
}

}  // namespace polaformer::native
