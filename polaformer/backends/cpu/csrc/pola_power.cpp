// PolaFormer's power map: the features [x⁺ᵖ ; x⁻ᵖ], their backward, the two streams' normalisation and its
// gradient, the streams' right-hand side, and the whole forward without gradients.
#include <ATen/ops/matmul.h>

#include "common.h"
#include "ops.h"

namespace polaformer::native {
namespace {

// [x⁺ᵖ ; x⁻ᵖ] with s = |x|ᵖ = exp(p·log|x|); log|x| is kept for the exponent's gradient when asked.
// NaN propagates to both halves, as in the torch-op version; x = 0 gives 0 in both.
// With Dots (queries of the no-gradient forward), each row's two normalisers are formed while the row is
// in registers: z = [φ·km + eps, φ·swap(km) + eps] with km (B, H, 2d), so that the product with the
// right-hand side needs only its dv numerator columns (a 66-wide product runs 15-25% slower than a
// 64-wide one).
template <typename T, bool Dots>
void power_features_kernel(const at::Tensor& x, const at::Tensor& power, at::Tensor& feat, at::Tensor* log_abs,
                           const T* km = nullptr, T eps = T(0), T* z = nullptr) {
  using V = Vectorized<T>;
  const Rows rows(x);
  const int64_t d = x.size(3), total = x.size(0) * x.size(1) * x.size(2);
  const T* xp = x.data_ptr<T>();
  const T* pp = power.data_ptr<T>();  // (B, H, 1, d) contiguous
  T* fp = feat.data_ptr<T>();
  T* lp = log_abs ? log_abs->data_ptr<T>() : nullptr;
  at::parallel_for(0, total, grain(3 * d), [&](int64_t begin, int64_t end) {
    const V zero(T(0));
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + rows.offset(r);
      const T* pr = pp + (r / rows.tokens) * d;
      const T* ka = Dots ? km + (r / rows.tokens) * 2 * d : nullptr;
      T* pos = fp + r * 2 * d;
      T* neg = pos + d;
      T* lr = lp ? lp + r * d : nullptr;
      V same(T(0)), opposite(T(0));
      int64_t c = 0;
      for (; c + V::size() <= d; c += V::size()) {
        const V xv = V::loadu(xr + c);
        const V lg = xv.abs().log();
        if (lr) lg.store(lr + c);
        const V s = (lg * V::loadu(pr + c)).exp();
        const V pv = V::blendv(s, zero, xv <= zero), nv = V::blendv(s, zero, xv >= zero);
        pv.store(pos + c);
        nv.store(neg + c);
        if constexpr (Dots) {
          const V a = V::loadu(ka + c), b = V::loadu(ka + d + c);
          same = at::vec::fmadd(pv, a, at::vec::fmadd(nv, b, same));
          opposite = at::vec::fmadd(pv, b, at::vec::fmadd(nv, a, opposite));
        }
      }
      T zs = T(0), zo = T(0);
      if constexpr (Dots) {
        zs = lane_sum(same);
        zo = lane_sum(opposite);
      }
      for (; c < d; ++c) {
        const T xv = xr[c];
        const T lg = std::log(std::abs(xv));
        if (lr) lr[c] = lg;
        const T s = std::exp(lg * pr[c]);
        pos[c] = xv <= T(0) ? T(0) : s;
        neg[c] = xv >= T(0) ? T(0) : s;
        if constexpr (Dots) {
          zs += pos[c] * ka[c] + neg[c] * ka[d + c];
          zo += pos[c] * ka[d + c] + neg[c] * ka[c];
        }
      }
      if constexpr (Dots) {
        z[2 * r] = zs + eps;
        z[2 * r + 1] = zo + eps;
      }
    }
  });
}

// out = res / z per stream: res (B, H, N, dv) contiguous numerators, z (B, H, N, 2) contiguous normalisers.
template <typename T>
void divide_streams_kernel(const at::Tensor& res, const at::Tensor& z, int64_t half, at::Tensor& out) {
  const Rows orows(out);
  const int64_t dv = out.size(3), total = res.size(0) * res.size(1) * res.size(2);
  const T* rp = res.data_ptr<T>();
  const T* zp = z.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, total, grain(dv), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* rr = rp + r * dv;
      T* o = op + orows.offset(r);
      divide_range(rr, 0, half, zp[2 * r], o);
      divide_range(rr, half, dv, zp[2 * r + 1], o);
    }
  });
}

// Chain rule through the power features. With gs = Σ_halves grad_feat ⊙ feat (= dL/ds · s):
// dL/dx = p·gs/x, dL/dp = gs·log|x|; both are 0 at x = 0, where gs is 0 (p > 1). dL/dp is summed over
// the tokens of each (b, h) in fixed chunks, then over the chunks, so the result does not depend on
// the number of threads.
template <typename T>
void power_backward_kernel(const at::Tensor& x, const at::Tensor& feat, const at::Tensor& log_abs,
                           const at::Tensor& grad_feat, const at::Tensor& power, at::Tensor& grad_x,
                           at::Tensor* grad_p_chunks, int64_t chunk) {
  using V = Vectorized<T>;
  const Rows xrows(x), grows(grad_feat);
  const int64_t d = x.size(3), n = x.size(2), bh_count = x.size(0) * x.size(1);
  const int64_t chunks = (n + chunk - 1) / chunk;
  const T* xp = x.data_ptr<T>();
  const T* fp = feat.data_ptr<T>();  // contiguous (B, H, N, 2d)
  const T* lp = log_abs.data_ptr<T>();  // contiguous (B, H, N, d)
  const T* gp = grad_feat.data_ptr<T>();
  const T* pp = power.data_ptr<T>();
  T* gx = grad_x.data_ptr<T>();  // contiguous (B, H, N, d)
  T* gpc = grad_p_chunks ? grad_p_chunks->data_ptr<T>() : nullptr;  // (B·H, chunks, d)
  at::parallel_for(0, bh_count * chunks, std::max<int64_t>(1, grain(5 * d) / chunk), [&](int64_t begin, int64_t end) {
    const V zero(T(0));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / chunks, first = (task % chunks) * chunk, last = std::min(n, first + chunk);
      const T* pr = pp + bh * d;
      T* acc = gpc ? gpc + task * d : nullptr;
      if (acc) std::fill(acc, acc + d, T(0));
      for (int64_t t = first; t < last; ++t) {
        const int64_t r = bh * n + t;
        const T* xr = xp + xrows.offset(r);
        const T* fr = fp + r * 2 * d;
        const T* gr = gp + grows.offset(r);
        const T* lr = lp + r * d;
        T* out = gx + r * d;
        int64_t c = 0;
        for (; c + V::size() <= d; c += V::size()) {
          const V xv = V::loadu(xr + c);
          const V gs = V::loadu(gr + c) * V::loadu(fr + c) + V::loadu(gr + d + c) * V::loadu(fr + d + c);
          V::blendv(gs * V::loadu(pr + c) / xv, zero, xv == zero).store(out + c);
          if (acc) (V::loadu(acc + c) + V::blendv(gs * V::loadu(lr + c), zero, xv == zero)).store(acc + c);
        }
        for (; c < d; ++c) {
          const T xv = xr[c];
          const T gs = gr[c] * fr[c] + gr[d + c] * fr[d + c];
          out[c] = xv == T(0) ? T(0) : gs * pr[c] / xv;
          if (acc && xv != T(0)) acc[c] += gs * lr[c];
        }
      }
    }
  });
}

// out[..., :half] = res[..., :half] / (res[..., -2] + eps), out[..., half:] = res[..., half:-2] / (res[..., -1] + eps);
// the two normalisers (with eps) are written back into res[..., -2:].
template <typename T>
void normalise_kernel(at::Tensor& res, double eps, int64_t half, at::Tensor& out) {
  const Rows orows(out);
  const int64_t dv = out.size(3), width = dv + 2, total = res.size(0) * res.size(1) * res.size(2);
  T* rp = res.data_ptr<T>();  // contiguous (B, H, N, dv + 2)
  T* op = out.data_ptr<T>();
  const T e = static_cast<T>(eps);
  at::parallel_for(0, total, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* rr = rp + r * width;
      T* o = op + orows.offset(r);
      const T z[2] = {rr[dv] + e, rr[dv + 1] + e};
      rr[dv] = z[0];
      rr[dv + 1] = z[1];
      divide_range(rr, 0, half, z[0], o);
      divide_range(rr, half, dv, z[1], o);
    }
  });
}

// Gradient at the products' output: g[..., :dv] = dO / z per stream, g[..., dv + s] = -Σ_stream (dO / z)·O.
template <typename T>
void output_grad_kernel(const at::Tensor& grad_out, const at::Tensor& denom, const at::Tensor& out, int64_t half,
                        at::Tensor& g) {
  using V = Vectorized<T>;
  const Rows grows(grad_out), zrows(denom), orows(out);
  const int64_t dv = out.size(3), width = dv + 2, total = out.size(0) * out.size(1) * out.size(2);
  const T* gop = grad_out.data_ptr<T>();
  const T* zp = denom.data_ptr<T>();
  const T* op = out.data_ptr<T>();
  T* gp = g.data_ptr<T>();  // contiguous (B, H, N, dv + 2)
  const int64_t z_step = denom.stride(3);
  at::parallel_for(0, total, grain(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* go = gop + grows.offset(r);
      const T* zr = zp + zrows.offset(r);
      const T* o = op + orows.offset(r);
      T* gr = gp + r * width;
      for (int s = 0; s < 2; ++s) {
        const int64_t lo = s ? half : 0, hi = s ? dv : half;
        const T z = zr[s * z_step];
        const V zv(z);
        V dot_v(T(0));
        int64_t c = lo;
        for (; c + V::size() <= hi; c += V::size()) {
          const V gn = V::loadu(go + c) / zv;
          gn.store(gr + c);
          dot_v = dot_v + gn * V::loadu(o + c);
        }
        T dot = lane_sum(dot_v);
        for (; c < hi; ++c) {
          const T gn = go[c] / z;
          gr[c] = gn;
          dot += gn * o[c];
        }
        gr[dv + s] = -dot;
      }
    }
  });
}

// The one right-hand side of both streams from S = φkᵀv and Σφk, both divided by the key count m:
// row r of rhs is [S[r, :half] | S[r', half:] | Σφk[r] | Σφk[r']] / m with r' = (r + d) mod 2d.
template <typename T>
void stream_rhs_kernel(const at::Tensor& kv, const at::Tensor& k_sum, double m, int64_t half, at::Tensor& rhs) {
  const int64_t two_d = kv.size(2), d = two_d / 2, dv = kv.size(3), width = dv + 2;
  const T* kp = kv.data_ptr<T>();
  const T* sp = k_sum.data_ptr<T>();
  T* rp = rhs.data_ptr<T>();
  const T mm = static_cast<T>(m);
  at::parallel_for(0, kv.size(0) * kv.size(1), grain(two_d * width), [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const T* k = kp + bh * two_d * dv;
      const T* s = sp + bh * two_d;
      T* out = rp + bh * two_d * width;
      for (int64_t r = 0; r < two_d; ++r) {
        const int64_t swapped = r < d ? r + d : r - d;
        T* o = out + r * width;
        divide_range(k + r * dv, 0, half, mm, o);
        divide_range(k + swapped * dv, half, dv, mm, o);
        o[dv] = s[r] / mm;
        o[dv + 1] = s[swapped] / mm;
      }
    }
  });
}

// Its backward: the gradients of S and of Σφk from the gradient of rhs, both divided by m.
template <typename T>
void stream_rhs_backward_kernel(const at::Tensor& grad_rhs, double m, int64_t half, at::Tensor& grad_kv,
                                at::Tensor& grad_sum) {
  const int64_t two_d = grad_rhs.size(2), d = two_d / 2, width = grad_rhs.size(3), dv = width - 2;
  const T* gp = grad_rhs.data_ptr<T>();
  T* kp = grad_kv.data_ptr<T>();
  T* sp = grad_sum.data_ptr<T>();
  const T mm = static_cast<T>(m);
  at::parallel_for(0, grad_rhs.size(0) * grad_rhs.size(1), grain(two_d * width), [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const T* g = gp + bh * two_d * width;
      T* k = kp + bh * two_d * dv;
      T* s = sp + bh * two_d;
      for (int64_t r = 0; r < two_d; ++r) {
        const int64_t swapped = r < d ? r + d : r - d;
        T* o = k + r * dv;
        divide_range(g + r * width, 0, half, mm, o);
        divide_range(g + swapped * width, half, dv, mm, o);
        s[r] = (g[r * width + dv] + g[swapped * width + dv + 1]) / mm;
      }
    }
  });
}

at::Tensor expanded_power(const at::Tensor& power, const at::Tensor& x) {
  return power.expand({x.size(0), x.size(1), 1, x.size(3)}).contiguous();
}

// Tokens per block for x (B, H, N, ·) whose per-token work is `width` channels wide (as block_tokens in
// ops/_common.py: inputs of up to four blocks run as one).
int64_t block_tokens(const at::Tensor& x, int64_t width, int64_t block_elements, int64_t min_block_tokens) {
  const int64_t n = x.size(2), per_token = std::max<int64_t>(1, x.size(0) * x.size(1) * width);
  if (n * per_token <= 4 * block_elements) return std::max<int64_t>(n, 1);
  return std::max<int64_t>(min_block_tokens, block_elements / per_token);
}

}  // namespace

std::vector<at::Tensor> power_features(const at::Tensor& x, const at::Tensor& power, bool keep_log) {
  check_rows(x, "x");
  TORCH_CHECK(power.scalar_type() == x.scalar_type(), "power and x dtypes differ");
  const auto p = expanded_power(power, x);
  auto feat = at::empty({x.size(0), x.size(1), x.size(2), 2 * x.size(3)}, x.options());
  at::Tensor log_abs = keep_log ? at::empty(x.sizes(), x.options()) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "power_features", [&] {
    power_features_kernel<scalar_t, false>(x, p, feat, keep_log ? &log_abs : nullptr);
  });
  return {feat, log_abs};
}

std::vector<at::Tensor> power_backward(const at::Tensor& x, const at::Tensor& feat, const at::Tensor& log_abs,
                                       const at::Tensor& grad_feat, const at::Tensor& power, bool need_power_grad) {
  check_rows(x, "x");
  check_rows(grad_feat, "grad_feat");
  TORCH_CHECK(feat.is_contiguous() && log_abs.is_contiguous(), "feat and log_abs must be contiguous");
  const auto p = expanded_power(power, x);
  auto grad_x = at::empty(x.sizes(), x.options());
  const int64_t chunk = 256, chunks = (x.size(2) + chunk - 1) / chunk;
  at::Tensor partial = need_power_grad ? at::empty({x.size(0), x.size(1), chunks, x.size(3)}, x.options()) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "power_backward", [&] {
    power_backward_kernel<scalar_t>(x, feat, log_abs, grad_feat, p, grad_x, need_power_grad ? &partial : nullptr,
                                    chunk);
  });
  at::Tensor grad_p = need_power_grad ? partial.sum(2, /*keepdim=*/true) : at::Tensor();
  return {grad_x, grad_p};
}

// Query features with both streams' normalisers z = [φ·km + eps, φ·swap(km) + eps] (B, H, N, 2) from
// key_means = km (B, H, 2d); see power_features_kernel.
std::vector<at::Tensor> power_features_dots(const at::Tensor& x, const at::Tensor& power,
                                            const at::Tensor& key_means, double eps, bool keep_log) {
  check_rows(x, "x");
  TORCH_CHECK(power.scalar_type() == x.scalar_type() && key_means.scalar_type() == x.scalar_type(),
              "power, key_means and x dtypes differ");
  TORCH_CHECK(key_means.dim() == 3 && key_means.size(0) == x.size(0) && key_means.size(1) == x.size(1) &&
                  key_means.size(2) == 2 * x.size(3),
              "key_means must be (B, H, 2d)");
  const auto p = expanded_power(power, x);
  const auto km = key_means.contiguous();
  auto feat = at::empty({x.size(0), x.size(1), x.size(2), 2 * x.size(3)}, x.options());
  auto z = at::empty({x.size(0), x.size(1), x.size(2), 2}, x.options());
  at::Tensor log_abs = keep_log ? at::empty(x.sizes(), x.options()) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "power_features_dots", [&] {
    power_features_kernel<scalar_t, true>(x, p, feat, keep_log ? &log_abs : nullptr, km.data_ptr<scalar_t>(),
                                          static_cast<scalar_t>(eps), z.data_ptr<scalar_t>());
  });
  return {feat, log_abs, z};
}

// out = numerators / z per stream (the same-sign stream has the first `half` channels).
void divide_streams(const at::Tensor& res, const at::Tensor& z, int64_t half, at::Tensor out) {
  check_rows(out, "out");
  TORCH_CHECK(res.is_contiguous() && z.is_contiguous() && res.sizes() == out.sizes() && z.size(3) == 2 &&
                  z.size(2) == res.size(2),
              "res must be contiguous (B, H, N, dv) and z contiguous (B, H, N, 2)");
  AT_DISPATCH_FLOATING_TYPES(res.scalar_type(), "divide_streams", [&] {
    divide_streams_kernel<scalar_t>(res, z, half, out);
  });
}

at::Tensor normalise(at::Tensor res, double eps, int64_t half, at::Tensor out) {
  check_rows(out, "out");
  TORCH_CHECK(res.is_contiguous() && res.size(3) == out.size(3) + 2, "res must be contiguous (B, H, N, dv + 2)");
  AT_DISPATCH_FLOATING_TYPES(res.scalar_type(), "normalise", [&] { normalise_kernel<scalar_t>(res, eps, half, out); });
  return res.narrow(3, out.size(3), 2);
}

at::Tensor output_grad(const at::Tensor& grad_out, const at::Tensor& denom, const at::Tensor& out, int64_t half) {
  check_rows(grad_out, "grad_out");
  check_rows(out, "out");
  auto g = at::empty({out.size(0), out.size(1), out.size(2), out.size(3) + 2}, out.options());
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "output_grad", [&] {
    output_grad_kernel<scalar_t>(grad_out, denom, out, half, g);
  });
  return g;
}

at::Tensor stream_rhs(const at::Tensor& kv, const at::Tensor& k_sum, double m, int64_t half) {
  TORCH_CHECK(kv.dim() == 4 && kv.size(2) % 2 == 0, "kv must be (B, H, 2d, dv)");
  TORCH_CHECK(k_sum.dim() == 3 && k_sum.size(2) == kv.size(2), "k_sum must be (B, H, 2d)");
  TORCH_CHECK(0 <= half && half <= kv.size(3), "half must lie in [0, dv]");
  const auto kv_c = kv.contiguous();
  const auto sum_c = k_sum.contiguous();
  auto rhs = at::empty({kv.size(0), kv.size(1), kv.size(2), kv.size(3) + 2}, kv.options());
  AT_DISPATCH_FLOATING_TYPES(kv.scalar_type(), "stream_rhs", [&] {
    stream_rhs_kernel<scalar_t>(kv_c, sum_c, m, half, rhs);
  });
  return rhs;
}

std::vector<at::Tensor> stream_rhs_backward(const at::Tensor& grad_rhs, double m, int64_t half) {
  TORCH_CHECK(grad_rhs.dim() == 4 && grad_rhs.size(2) % 2 == 0 && grad_rhs.size(3) >= 2,
              "grad_rhs must be (B, H, 2d, dv + 2)");
  TORCH_CHECK(0 <= half && half <= grad_rhs.size(3) - 2, "half must lie in [0, dv]");
  const auto g = grad_rhs.contiguous();
  auto grad_kv = at::empty({g.size(0), g.size(1), g.size(2), g.size(3) - 2}, g.options());
  auto grad_sum = at::empty({g.size(0), g.size(1), g.size(2)}, g.options());
  AT_DISPATCH_FLOATING_TYPES(g.scalar_type(), "stream_rhs_backward", [&] {
    stream_rhs_backward_kernel<scalar_t>(g, m, half, grad_kv, grad_sum);
  });
  return {grad_kv, grad_sum};
}

// The whole forward of the power-map attention without gradients and without key padding, as
// pola_attention_no_grad in ops/pola/autograd.py does it (the same blocks), in one call: at small sizes
// the Python around two dozen tensor calls costs as much as the elementwise kernels. Checks p >= 1.
at::Tensor pola_forward_no_grad(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& power, double eps, int64_t block_elements,
                                int64_t min_block_tokens) {
  check_rows(q, "q");
  check_rows(k, "k");
  TORCH_CHECK(v.dim() == 4 && v.size(2) == k.size(2) && v.size(3) >= 2, "v must be (B, H, M, dv) with dv >= 2");
  if (power.numel()) {
    const double lowest = power.min().item<double>();
    TORCH_CHECK_VALUE(!(lowest < 1), "power must be >= 1 everywhere (the map |x|^p needs p >= 1), got a minimum of ",
                      lowest);
  }
  const int64_t d = q.size(3), dv = v.size(3), half = (dv + 1) / 2, n = q.size(2), m = k.size(2);
  at::Tensor kv, k_sum;
  const int64_t key_step = block_tokens(k, d, block_elements, min_block_tokens);
  for (int64_t i = 0; i < m; i += key_step) {
    const int64_t len = std::min(key_step, m - i);
    const auto phi_k = power_features(k.narrow(2, i, len), power, false)[0];
    auto part_kv = at::matmul(phi_k.transpose(-2, -1), v.narrow(2, i, len));
    auto part_sum = phi_k.sum(-2);
    if (i == 0) {
      kv = std::move(part_kv);
      k_sum = std::move(part_sum);
    } else {
      kv.add_(part_kv);
      k_sum.add_(part_sum);
    }
  }
  const auto rhs = stream_rhs(kv, k_sum, static_cast<double>(m), half);
  // (B, H, N, dv) view of (B, N, H, dv) memory, so that merging the heads afterwards is a view
  auto out = at::empty({q.size(0), n, q.size(1), dv}, v.options()).transpose(1, 2);
  const int64_t query_step = block_tokens(q, d, block_elements, min_block_tokens);
  // The normalisers come from the query feature pass (see power_features_kernel), the numerators from a
  // product with the first dv columns of rhs only.
  const auto numerators = rhs.narrow(3, 0, dv);
  const auto key_means = rhs.select(3, dv).contiguous();  // km (B, H, 2d), the first normaliser column
  for (int64_t i = 0; i < n; i += query_step) {
    const int64_t len = std::min(query_step, n - i);
    const auto features = power_features_dots(q.narrow(2, i, len), power, key_means, eps, false);
    divide_streams(at::matmul(features[0], numerators).contiguous(), features[2], half, out.narrow(2, i, len));
  }
  return out;
}

}  // namespace polaformer::native
