// Fused CPU kernels of the polarity-aware attentions' elementwise stages (PolaFormer's power map, PaCS).
//
// Each function replaces a chain of 4-8 torch ops (one pass over memory each) by one pass that keeps a
// row in registers; the matrix products stay with torch. Built on first use by polaformer/ops/native.py
// with the vector width of the machine (ATen's Vectorized, whose log/exp are SLEEF's 1-ulp routines).
// Every kernel is checked against the torch-op version in float64 by tests/test_native.py.
//
// Tensors are (B, H, N, C) with unit stride along C and any strides elsewhere.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

namespace {

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

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4, name, " must be 4-D (B, H, N, C), got ", t.dim(), "-D");
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.size(3) <= 1 || t.stride(3) == 1, name, " must have unit stride along its last dimension");
}

// Rows per parallel task: about 16k elements, so that small calls stay on one thread.
int64_t grain(int64_t width) { return std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(width, 1)); }

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

// ---- PaCS (PolaFormer++) -------------------------------------------------------------------------------
// Features are [relu(x) ; relu(-x)], each half in "kernel order": with RoPE, channels [even | odd] so that
// the rotation works on whole blocks (see _pacs_indices in pola_attention.py).

// Source channel of kernel-order index i within a half of width d.
inline int64_t pacs_source(int64_t i, int64_t d, bool rope) {
  return rope ? (i < d / 2 ? 2 * i : 2 * (i - d / 2) + 1) : i;
}

// RoPE on one feature row in kernel order (see _rotate in pola_attention.py): per half, with E the first
// and O the second quarter-block, E' = E·c_E + O·s_E and O' = O·c_O + E·s_O (s holds -sin at E, +sin at O).
// Transposed (the rotation's backward): E' = E·c_E + O·s_O and O' = O·c_O + E·s_E.
template <typename T, bool Transposed = false>
inline void rotate_row(const T* f, const T* c, const T* s, int64_t d, T* out) {
  using V = Vectorized<T>;
  const int64_t p = d / 2;
  for (int64_t h = 0; h < 2; ++h) {
    const int64_t e = h * d, o = e + p;
    const T* s_e = s + (Transposed ? o : e);  // the sines that multiply O into E'
    const T* s_o = s + (Transposed ? e : o);  // and E into O'
    int64_t i = 0;
    for (; i + V::size() <= p; i += V::size()) {
      const V fe = V::loadu(f + e + i), fo = V::loadu(f + o + i);
      (fe * V::loadu(c + e + i) + fo * V::loadu(s_e + i)).store(out + e + i);
      (fo * V::loadu(c + o + i) + fe * V::loadu(s_o + i)).store(out + o + i);
    }
    for (; i < p; ++i) {
      const T fe = f[e + i], fo = f[o + i];
      out[e + i] = fe * c[e + i] + fo * s_e[i];
      out[o + i] = fo * c[o + i] + fe * s_o[i];
    }
  }
}

template <typename T>
inline void rotate_row_transposed(const T* f, const T* c, const T* s, int64_t d, T* out) {
  rotate_row<T, true>(f, c, s, d, out);
}

// RoPE tables (S, N, 2d) in kernel order with unit stride along channels and any stream/token strides.
struct Tables {
  const void* cos = nullptr;
  const void* cross = nullptr;
  int64_t ss = 0, sn = 0;
  Tables() = default;
  Tables(const at::Tensor& c, const at::Tensor& x) : cos(c.data_ptr()), cross(x.data_ptr()), ss(c.stride(0)), sn(c.stride(1)) {}
  template <typename T>
  const T* c(int64_t stream, int64_t n) const { return static_cast<const T*>(cos) + stream * ss + n * sn; }
  template <typename T>
  const T* s(int64_t stream, int64_t n) const { return static_cast<const T*>(cross) + stream * ss + n * sn; }
};

// out = [relu(x) ; relu(-x)] in kernel order, or exp of that minus 1 (the key features) when with_exp.
// With tables, num gets the rotated features as well (while the row is in cache).
template <typename T>
void pacs_halves_kernel(const at::Tensor& x, bool rope, bool with_exp, at::Tensor& out, const Tables* tables,
                        at::Tensor* num) {
  using V = Vectorized<T>;
  const Rows rows(x);
  const int64_t d = x.size(3), total = x.size(0) * x.size(1) * x.size(2);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* np = num ? num->data_ptr<T>() : nullptr;
  const int64_t tokens = x.size(2);
  at::parallel_for(0, total, grain(4 * d), [&](int64_t begin, int64_t end) {
    std::vector<T> ordered(rope ? d : 0);
    const V zero(T(0)), one(T(1));
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + rows.offset(r);
      if (rope) {
        for (int64_t i = 0; i < d; ++i) ordered[i] = xr[pacs_source(i, d, true)];
        xr = ordered.data();
      }
      T* pos = op + r * 2 * d;
      T* neg = pos + d;
      int64_t c = 0;
      for (; c + V::size() <= d; c += V::size()) {
        const V xv = V::loadu(xr + c);
        V pv = at::vec::maximum(xv, zero), nv = at::vec::maximum(zero - xv, zero);
        if (with_exp) {
          pv = pv.exp() - one;
          nv = nv.exp() - one;
        }
        pv.store(pos + c);
        nv.store(neg + c);
      }
      for (; c < d; ++c) {
        const T xv = xr[c];
        T pv = xv > T(0) || xv != xv ? xv : T(0), nv = xv < T(0) || xv != xv ? -xv : T(0);
        if (with_exp) {
          pv = std::exp(pv) - T(1);
          nv = std::exp(nv) - T(1);
        }
        pos[c] = pv;
        neg[c] = nv;
      }
      if (np) {
        const int64_t t = r % tokens;
        rotate_row<T>(pos, tables->c<T>(0, t), tables->s<T>(0, t), d, np + r * 2 * d);
      }
    }
  });
}

// phi[b, h, s, n] = exp(p[b, h, n] ⊙ t[b, h, s]) - 1 for both streams s: p (B, H, N, 2d) contiguous,
// t (B, H, 2, 1, 2d) contiguous, phi (B, H, 2, N, 2d).
// With tables (2, N, 2d), num gets each stream's rotated features too.
template <typename T>
void pacs_exp_kernel(const at::Tensor& p, const at::Tensor& temps, at::Tensor& phi, const Tables* tables,
                     at::Tensor* num, const T* key_means = nullptr, T eps = T(0), T* denom = nullptr) {
  using V = Vectorized<T>;
  const int64_t n = p.size(2), w = p.size(3), bh_count = p.size(0) * p.size(1);
  const T* pp = p.data_ptr<T>();
  const T* tp = temps.data_ptr<T>();
  T* fp = phi.data_ptr<T>();
  T* np = num ? num->data_ptr<T>() : nullptr;
  at::parallel_for(0, bh_count * n, grain(4 * w), [&](int64_t begin, int64_t end) {
    const V one(T(1));
    for (int64_t r = begin; r < end; ++r) {
      const int64_t bh = r / n, t = r % n;
      const T* pr = pp + r * w;
      for (int64_t s = 0; s < 2; ++s) {
        const T* tr = tp + (bh * 2 + s) * w;
        const T* km = key_means ? key_means + (bh * 2 + s) * w : nullptr;
        T* out = fp + ((bh * 2 + s) * n + t) * w;
        V dot(T(0));
        int64_t c = 0;
        for (; c + V::size() <= w; c += V::size()) {
          const V f = (V::loadu(pr + c) * V::loadu(tr + c)).exp() - one;
          f.store(out + c);
          if (km) dot = at::vec::fmadd(f, V::loadu(km + c), dot);
        }
        T sum = km ? lane_sum(dot) : T(0);
        for (; c < w; ++c) {
          out[c] = std::exp(pr[c] * tr[c]) - T(1);
          if (km) sum += out[c] * km[c];
        }
        if (km) denom[(bh * 2 + s) * n + t] = sum + eps;
        if (np) rotate_row<T>(out, tables->c<T>(s, t), tables->s<T>(s, t), w / 2, np + ((bh * 2 + s) * n + t) * w);
      }
    }
  });
}

// d/dx through the halves: sgn(x)·(grad⁺ where x > 0 else grad⁻), written in x's channel order. NaN in x
// gives NaN (the torch-op version's sign(NaN) = 0 would hide it).
template <typename T>
inline void pacs_unrelu_row(const T* xr, const T* gk, int64_t d, bool rope, T* out) {
  using V = Vectorized<T>;
  constexpr int64_t S = V::size();
  const V zero(T(0));
  auto pick = [&](const V& x, const V& pos, const V& neg) {
    const V chosen = V::blendv(V::blendv(zero, pos, x > zero), zero - neg, x < zero);
    return V::blendv(chosen, x, x != x);
  };
  int64_t i = 0;
  if (!rope) {
    for (; i + S <= d; i += S) pick(V::loadu(xr + i), V::loadu(gk + i), V::loadu(gk + d + i)).store(out + i);
  } else if (d % (2 * S) == 0) {
    const int64_t p = d / 2;
    for (int64_t c = 0; c < d; c += 2 * S) {  // kernel positions j and p + j hold channels 2j and 2j + 1
      const int64_t j = c / 2;
      const auto pos = at::vec::interleave2(V::loadu(gk + j), V::loadu(gk + p + j));
      const auto neg = at::vec::interleave2(V::loadu(gk + d + j), V::loadu(gk + d + p + j));
      pick(V::loadu(xr + c), pos.first, neg.first).store(out + c);
      pick(V::loadu(xr + c + S), pos.second, neg.second).store(out + c + S);
    }
    return;
  }
  for (; i < d; ++i) {
    const int64_t c = pacs_source(i, d, rope);
    const T xv = xr[c];
    out[c] = xv > T(0) ? gk[i] : (xv < T(0) ? -gk[d + i] : (xv == T(0) ? T(0) : xv));
  }
}

// Key backward: grad_k from grad_phi_k through phi = exp(halves) - 1 (d phi = (phi + 1) d halves).
template <typename T>
void pacs_key_backward_kernel(const at::Tensor& k, const at::Tensor& phi, const at::Tensor& grad_phi, bool rope,
                              at::Tensor& grad_k) {
  const Rows krows(k), grows(grad_phi);
  const int64_t d = k.size(3), total = k.size(0) * k.size(1) * k.size(2);
  const T* kp = k.data_ptr<T>();
  const T* fp = phi.data_ptr<T>();  // contiguous (B, H, M, 2d)
  const T* gp = grad_phi.data_ptr<T>();
  T* out = grad_k.data_ptr<T>();  // contiguous (B, H, M, d)
  at::parallel_for(0, total, grain(4 * d), [&](int64_t begin, int64_t end) {
    std::vector<T> g(2 * d);
    for (int64_t r = begin; r < end; ++r) {
      const T* gr = gp + grows.offset(r);
      const T* fr = fp + r * 2 * d;
      for (int64_t i = 0; i < 2 * d; ++i) g[i] = gr[i] * (fr[i] + T(1));
      pacs_unrelu_row<T>(kp + krows.offset(r), g.data(), d, rope, out + r * d);
    }
  });
}

// Query backward without row rescaling: with g_s = grad_phi_q[s] ⊙ (phi_q[s] + 1),
// grad_q = unrelu(Σ_s g_s ⊙ t_s) and grad_t[s] = Σ_tokens g_s ⊙ p_q (in fixed chunks of tokens, then
// over the chunks: independent of the thread count).
template <typename T>
void pacs_query_backward_kernel(const at::Tensor& q, const at::Tensor& p_q, const at::Tensor& phi,
                                const at::Tensor& grad_phi, const at::Tensor& temps, bool rope, at::Tensor& grad_q,
                                at::Tensor* grad_t_chunks, int64_t chunk) {
  using V = Vectorized<T>;
  const Rows qrows(q);
  const int64_t d = q.size(3), w = 2 * d, n = q.size(2), bh_count = q.size(0) * q.size(1);
  const int64_t chunks = (n + chunk - 1) / chunk;
  const T* qp = q.data_ptr<T>();
  const T* pp = p_q.data_ptr<T>();  // (B, H, N, 2d)
  const T* fp = phi.data_ptr<T>();  // (B, H, 2, N, 2d)
  const T* gp = grad_phi.data_ptr<T>();  // (B, H, 2, N, 2d)
  const T* tp = temps.data_ptr<T>();  // (B, H, 2, 1, 2d)
  T* out = grad_q.data_ptr<T>();
  T* acc_all = grad_t_chunks ? grad_t_chunks->data_ptr<T>() : nullptr;  // (B·H, chunks, 2, 2d)
  at::parallel_for(0, bh_count * chunks, std::max<int64_t>(1, grain(8 * w) / chunk), [&](int64_t begin, int64_t end) {
    std::vector<T> gsum(w);
    const V one(T(1));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / chunks, first = (task % chunks) * chunk, last = std::min(n, first + chunk);
      T* acc = acc_all ? acc_all + task * 2 * w : nullptr;
      if (acc) std::fill(acc, acc + 2 * w, T(0));
      for (int64_t t = first; t < last; ++t) {
        const T* pr = pp + (bh * n + t) * w;
        std::fill(gsum.begin(), gsum.end(), T(0));
        for (int64_t s = 0; s < 2; ++s) {
          const int64_t row = (bh * 2 + s) * n + t;
          const T* fr = fp + row * w;
          const T* gr = gp + row * w;
          const T* tr = tp + (bh * 2 + s) * w;
          T* as = acc ? acc + s * w : nullptr;
          int64_t c = 0;
          for (; c + V::size() <= w; c += V::size()) {
            const V g = V::loadu(gr + c) * (V::loadu(fr + c) + one);
            (V::loadu(gsum.data() + c) + g * V::loadu(tr + c)).store(gsum.data() + c);
            if (as) (V::loadu(as + c) + g * V::loadu(pr + c)).store(as + c);
          }
          for (; c < w; ++c) {
            const T g = gr[c] * (fr[c] + T(1));
            gsum[c] += g * tr[c];
            if (as) as[c] += g * pr[c];
          }
        }
        pacs_unrelu_row<T>(qp + qrows.offset(bh * n + t), gsum.data(), d, rope, out + (bh * n + t) * d);
      }
    }
  });
}

// ---- PaCS attention fused per row -----------------------------------------------------------------------
// The whole PaCS op without key padding, for any B, H, N, M: every feature row is made in registers where it
// is used and never written out. Forward: one pass over the keys forms S = φkᵀv (with RoPE: of the rotated
// keys) and Σφk, one pass over the queries forms both streams' features, normalisers, products with S and
// quotients. Backward: the same two passes, recomputing the features (cheaper than storing and re-reading
// them). Sums over tokens are kept per fixed chunk of tokens and added in chunk order, so results do not
// depend on the number of threads. Layouts as in _PacsAttention (pola_attention.py): features in kernel
// order, the opposite stream's S rows and key mean swapped.

constexpr int64_t kPacsChunk = 256;

// y[0:n] += a·x[0:n]
template <typename T>
inline void axpy(T a, const T* x, T* y, int64_t n) {
  using V = Vectorized<T>;
  const V av(a);
  int64_t i = 0;
  for (; i + V::size() <= n; i += V::size()) at::vec::fmadd(av, V::loadu(x + i), V::loadu(y + i)).store(y + i);
  for (; i < n; ++i) y[i] += a * x[i];
}

// Σ a[i]·b[i]
template <typename T>
inline T dot_row(const T* a, const T* b, int64_t n) {
  using V = Vectorized<T>;
  V acc(T(0));
  int64_t i = 0;
  for (; i + V::size() <= n; i += V::size()) acc = at::vec::fmadd(V::loadu(a + i), V::loadu(b + i), acc);
  T sum = tree_sum(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// out[0:n] = Σ_k x[k]·mat[k·ld + 0:n], the sums in registers (four partial sums per vector, so that the
// multiply-adds do not wait on each other).
template <typename T>
inline void vec_mat(const T* x, const T* mat, int64_t kdim, int64_t n, int64_t ld, T* out) {
  using V = Vectorized<T>;
  constexpr int64_t S = V::size();
  int64_t j = 0;
  for (; j + 2 * S <= n; j += 2 * S) {
    V a[4] = {V(T(0)), V(T(0)), V(T(0)), V(T(0))}, b[4] = {V(T(0)), V(T(0)), V(T(0)), V(T(0))};
    int64_t k = 0;
    for (; k + 4 <= kdim; k += 4) {
      for (int u = 0; u < 4; ++u) {
        const V xv(x[k + u]);
        const T* row = mat + (k + u) * ld + j;
        a[u] = at::vec::fmadd(xv, V::loadu(row), a[u]);
        b[u] = at::vec::fmadd(xv, V::loadu(row + S), b[u]);
      }
    }
    for (; k < kdim; ++k) {
      const V xv(x[k]);
      a[0] = at::vec::fmadd(xv, V::loadu(mat + k * ld + j), a[0]);
      b[0] = at::vec::fmadd(xv, V::loadu(mat + k * ld + j + S), b[0]);
    }
    ((a[0] + a[1]) + (a[2] + a[3])).store(out + j);
    ((b[0] + b[1]) + (b[2] + b[3])).store(out + j + S);
  }
  for (; j + S <= n; j += S) {
    V a[4] = {V(T(0)), V(T(0)), V(T(0)), V(T(0))};
    int64_t k = 0;
    for (; k + 4 <= kdim; k += 4)
      for (int u = 0; u < 4; ++u) a[u] = at::vec::fmadd(V(x[k + u]), V::loadu(mat + (k + u) * ld + j), a[u]);
    for (; k < kdim; ++k) a[0] = at::vec::fmadd(V(x[k]), V::loadu(mat + k * ld + j), a[0]);
    ((a[0] + a[1]) + (a[2] + a[3])).store(out + j);
  }
  for (; j < n; ++j) {
    T sum = T(0);
    for (int64_t k = 0; k < kdim; ++k) sum += x[k] * mat[k * ld + j];
    out[j] = sum;
  }
}

// out[r][0:n] = Σ_k x[r][k]·mat[k·ld + 0:n] for R rows at once: each row of mat, loaded once, serves all R.
template <typename T, int R>
inline void vec_mat_rows(const T* const* x, const T* mat, int64_t kdim, int64_t n, int64_t ld, T* const* out) {
  using V = Vectorized<T>;
  constexpr int64_t S = V::size();
  int64_t j = 0;
  for (; j + 2 * S <= n; j += 2 * S) {
    V a[R], b[R];
    for (int r = 0; r < R; ++r) a[r] = b[r] = V(T(0));
    for (int64_t k = 0; k < kdim; ++k) {
      const V m0 = V::loadu(mat + k * ld + j), m1 = V::loadu(mat + k * ld + j + S);
      for (int r = 0; r < R; ++r) {
        const V xv(x[r][k]);
        a[r] = at::vec::fmadd(xv, m0, a[r]);
        b[r] = at::vec::fmadd(xv, m1, b[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      a[r].store(out[r] + j);
      b[r].store(out[r] + j + S);
    }
  }
  for (; j + S <= n; j += S) {  // one vector wide: even and odd k in separate sums, 2R independent chains
    V a[R], b[R];
    for (int r = 0; r < R; ++r) a[r] = b[r] = V(T(0));
    int64_t k = 0;
    for (; k + 2 <= kdim; k += 2) {
      const V m0 = V::loadu(mat + k * ld + j), m1 = V::loadu(mat + (k + 1) * ld + j);
      for (int r = 0; r < R; ++r) {
        a[r] = at::vec::fmadd(V(x[r][k]), m0, a[r]);
        b[r] = at::vec::fmadd(V(x[r][k + 1]), m1, b[r]);
      }
    }
    if (k < kdim) {
      const V m0 = V::loadu(mat + k * ld + j);
      for (int r = 0; r < R; ++r) a[r] = at::vec::fmadd(V(x[r][k]), m0, a[r]);
    }
    for (int r = 0; r < R; ++r) (a[r] + b[r]).store(out[r] + j);
  }
  for (; j < n; ++j)
    for (int r = 0; r < R; ++r) {
      T sum = T(0);
      for (int64_t k = 0; k < kdim; ++k) sum += x[r][k] * mat[k * ld + j];
      out[r][j] = sum;
    }
}

// vec_mat for a group of 1-4 rows
template <typename T>
inline void vec_mat_group(int rows, const T* const* x, const T* mat, int64_t kdim, int64_t n, int64_t ld,
                          T* const* out) {
  switch (rows) {
    case 4: return vec_mat_rows<T, 4>(x, mat, kdim, n, ld, out);
    case 3: return vec_mat_rows<T, 3>(x, mat, kdim, n, ld, out);
    case 2: return vec_mat_rows<T, 2>(x, mat, kdim, n, ld, out);
    case 1: return vec_mat<T>(x[0], mat, kdim, n, ld, out[0]);
    default: return;
  }
}

// acc[k·n + 0:n] += Σ_{r < R} x[r][k]·y[r][0:n]: a rank-R update of a (kdim × n) sum. The rows of y stay in
// registers and each element of acc is loaded and stored once for the whole group.
template <typename T, int R>
inline void outer_acc_rows(const T* const* x, const T* const* y, int64_t kdim, int64_t n, T* acc) {
  using V = Vectorized<T>;
  constexpr int64_t S = V::size();
  int64_t j = 0;
  for (; j + 2 * S <= n; j += 2 * S) {
    V y0[R], y1[R];
    for (int r = 0; r < R; ++r) {
      y0[r] = V::loadu(y[r] + j);
      y1[r] = V::loadu(y[r] + j + S);
    }
    for (int64_t k = 0; k < kdim; ++k) {
      T* a = acc + k * n + j;
      V s0 = V::loadu(a), s1 = V::loadu(a + S);
      for (int r = 0; r < R; ++r) {
        const V xv(x[r][k]);
        s0 = at::vec::fmadd(xv, y0[r], s0);
        s1 = at::vec::fmadd(xv, y1[r], s1);
      }
      s0.store(a);
      s1.store(a + S);
    }
  }
  for (; j + S <= n; j += S) {
    V y0[R];
    for (int r = 0; r < R; ++r) y0[r] = V::loadu(y[r] + j);
    for (int64_t k = 0; k < kdim; ++k) {
      T* a = acc + k * n + j;
      V s0 = V::loadu(a);
      for (int r = 0; r < R; ++r) s0 = at::vec::fmadd(V(x[r][k]), y0[r], s0);
      s0.store(a);
    }
  }
  for (; j < n; ++j)
    for (int64_t k = 0; k < kdim; ++k)
      for (int r = 0; r < R; ++r) acc[k * n + j] += x[r][k] * y[r][j];
}

template <typename T>
inline void outer_acc(const T* const* x, const T* const* y, int rows, int64_t kdim, int64_t n, T* acc) {
  switch (rows) {
    case 4: return outer_acc_rows<T, 4>(x, y, kdim, n, acc);
    case 3: return outer_acc_rows<T, 3>(x, y, kdim, n, acc);
    case 2: return outer_acc_rows<T, 2>(x, y, kdim, n, acc);
    case 1: return outer_acc_rows<T, 1>(x, y, kdim, n, acc);
    default: return;
  }
}

// [relu(x) ; relu(-x)] of one row, in kernel order (pacs_halves_kernel without the exp); with RoPE the even and
// odd channels are split by whole vectors where the row allows it.
template <typename T>
inline void relu_halves_row(const T* xr, int64_t d, bool rope, T* out) {
  using V = Vectorized<T>;
  const V zero(T(0));
  int64_t i = 0;
  if (!rope) {
    for (; i + V::size() <= d; i += V::size()) {
      const V x = V::loadu(xr + i);
      at::vec::maximum(x, zero).store(out + i);
      at::vec::maximum(zero - x, zero).store(out + d + i);
    }
  } else if (d % (2 * V::size()) == 0) {
    const int64_t p = d / 2;
    for (int64_t c = 0; c < d; c += 2 * V::size()) {
      const auto parts = at::vec::deinterleave2(V::loadu(xr + c), V::loadu(xr + c + V::size()));
      const int64_t at_ = c / 2;  // channel 2j goes to j, channel 2j + 1 to p + j
      at::vec::maximum(parts.first, zero).store(out + at_);
      at::vec::maximum(parts.second, zero).store(out + p + at_);
      at::vec::maximum(zero - parts.first, zero).store(out + d + at_);
      at::vec::maximum(zero - parts.second, zero).store(out + d + p + at_);
    }
    return;
  }
  for (; i < d; ++i) {
    const T x = xr[pacs_source(i, d, rope)];
    out[i] = x > T(0) || x != x ? x : T(0);
    out[d + i] = x < T(0) || x != x ? -x : T(0);
  }
}

// phi = exp(p ⊙ t) - 1 (t = nullptr: exp(p) - 1), returning phi·km when km is given.
template <typename T>
inline T exp_row(const T* p, const T* t, int64_t w, T* phi, const T* km) {
  using V = Vectorized<T>;
  const V one(T(1));
  V dot(T(0));
  int64_t c = 0;
  for (; c + V::size() <= w; c += V::size()) {
    V x = V::loadu(p + c);
    if (t) x = x * V::loadu(t + c);
    const V f = x.exp() - one;
    f.store(phi + c);
    if (km) dot = at::vec::fmadd(f, V::loadu(km + c), dot);
  }
  T sum = km ? tree_sum(dot) : T(0);
  for (; c < w; ++c) {
    phi[c] = std::exp(t ? p[c] * t[c] : p[c]) - T(1);
    if (km) sum += phi[c] * km[c];
  }
  return sum;
}

// Per (b, h): S rows and key sums of a chunk of keys, added into kv (w × dv) and ks (w), four keys at a time.
// phi and num hold 4 rows of w each.
template <typename T>
void pacs_key_chunk(const T* kp, const Rows& krows, const T* vp, const Rows& vrows, int64_t bh, int64_t first,
                    int64_t last, int64_t d, int64_t dv, bool rope, const Tables* tables, T* kv, T* ks, T* phi,
                    T* num) {
  const int64_t w = 2 * d, m = krows.tokens;
  const T* kn[4];
  const T* vr[4];
  for (int64_t t0 = first; t0 < last; t0 += 4) {
    const int rows = static_cast<int>(std::min<int64_t>(4, last - t0));
    for (int r = 0; r < rows; ++r) {
      const int64_t t = t0 + r;
      T* f = phi + r * w;
      T* nr = num + r * w;
      relu_halves_row<T>(kp + krows.offset(bh * m + t), d, rope, nr);
      exp_row<T>(nr, nullptr, w, f, nullptr);
      kn[r] = f;
      if (tables) {
        rotate_row<T>(f, tables->c<T>(0, t), tables->s<T>(0, t), d, nr);
        kn[r] = nr;
      }
      axpy<T>(T(1), f, ks, w);
      vr[r] = vp + vrows.offset(bh * m + t);
    }
    outer_acc<T>(kn, vr, rows, w, dv, kv);
  }
}

// Sums chunks (bh, chunks, size) in chunk order into (bh, size), times scale.
template <typename T>
void sum_chunks(const T* partial, int64_t bh_count, int64_t chunks, int64_t size, T scale, T* out) {
  at::parallel_for(0, bh_count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      T* o = out + bh * size;
      std::fill(o, o + size, T(0));
      for (int64_t j = 0; j < chunks; ++j) {
        const T* src = partial + (bh * chunks + j) * size;
        for (int64_t i = 0; i < size; ++i) o[i] += src[i];
      }
      for (int64_t i = 0; i < size; ++i) o[i] /= scale;
    }
  });
}

template <typename T>
bool pacs_fused_forward_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const T* temps,
                               const Tables* tables, T eps, at::Tensor& out_tok, at::Tensor& denom, at::Tensor& kvs,
                               at::Tensor& k_means) {
  const Rows qrows(q), krows(k), vrows(v);
  const int64_t heads = q.size(1), n = q.size(2), m = k.size(2), d = q.size(3), w = 2 * d, dv = v.size(3),
                half = dv / 2, bh_count = q.size(0) * heads;
  const bool rope = tables != nullptr;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  // keys: S = φkᵀv / m and the key mean, per chunk then in chunk order
  const int64_t chunks = (m + kPacsChunk - 1) / kPacsChunk;
  auto partial = at::zeros({bh_count, chunks, w * dv + w}, q.options());
  T* pp = partial.data_ptr<T>();
  at::parallel_for(0, bh_count * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> phi(4 * w), num(4 * w);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / chunks, first = (task % chunks) * kPacsChunk;
      T* kv = pp + task * (w * dv + w);
      pacs_key_chunk<T>(kp, krows, vp, vrows, bh, first, std::min(m, first + kPacsChunk), d, dv, rope, tables, kv,
                        kv + w * dv, phi.data(), num.data());
    }
  });
  auto sums = at::empty({bh_count, w * dv + w}, q.options());
  sum_chunks<T>(pp, bh_count, chunks, w * dv + w, static_cast<T>(m), sums.data_ptr<T>());
  // both streams' right-hand sides: the opposite stream's rows swapped (kvs (BH, 2, w, half), km (BH, 2, w))
  T* sp = sums.data_ptr<T>();
  T* kvsp = kvs.data_ptr<T>();
  T* kmp = k_means.data_ptr<T>();
  for (int64_t bh = 0; bh < bh_count; ++bh) {
    const T* kv = sp + bh * (w * dv + w);
    const T* km = kv + w * dv;
    for (int64_t c = 0; c < w; ++c) {
      const int64_t swapped = (c + d) % w;
      std::copy(kv + c * dv, kv + c * dv + half, kvsp + (bh * 2 * w + c) * half);
      std::copy(kv + swapped * dv + half, kv + swapped * dv + dv, kvsp + (bh * 2 * w + w + c) * half);
      kmp[bh * 2 * w + c] = km[c];
      kmp[bh * 2 * w + w + c] = km[swapped];
    }
  }
  // queries: features, normalisers, numerators and quotients of both streams, four rows at a time
  T* op = out_tok.data_ptr<T>();  // (B, N, H, dv)
  T* zp = denom.data_ptr<T>();    // (B, H, 2, N)
  std::atomic<bool> finite{true};
  at::parallel_for(0, bh_count * n, grain(8 * w), [&](int64_t begin, int64_t end) {
    using V = Vectorized<T>;
    std::vector<T> p(4 * w), phi(4 * w), num(4 * w), acc(4 * half);
    // x - x is 0 for finite x and NaN otherwise: the sum of these over the thread's rows tells whether all were
    V probe(T(0));
    T probe_tail = T(0);
    for (int64_t r0 = begin; r0 < end;) {
      const int64_t bh = r0 / n, t0 = r0 % n;
      const int rows = static_cast<int>(std::min<int64_t>({4, end - r0, n - t0}));
      for (int i = 0; i < rows; ++i) relu_halves_row<T>(qp + qrows.offset(r0 + i), d, rope, p.data() + i * w);
      for (int64_t s = 0; s < 2; ++s) {
        const T* km = kmp + (bh * 2 + s) * w;
        const T* xs[4];
        T* sums[4];
        T z[4];
        for (int i = 0; i < rows; ++i) {
          T* f = phi.data() + i * w;
          z[i] = exp_row<T>(p.data() + i * w, temps + (bh * 2 + s) * w, w, f, km) + eps;
          xs[i] = f;
          if (rope) {
            rotate_row<T>(f, tables->c<T>(s, t0 + i), tables->s<T>(s, t0 + i), d, num.data() + i * w);
            xs[i] = num.data() + i * w;
          }
          sums[i] = acc.data() + i * half;
        }
        vec_mat_group<T>(rows, xs, kvsp + (bh * 2 + s) * w * half, w, half, half, sums);
        for (int i = 0; i < rows; ++i) {
          const int64_t t = t0 + i;
          zp[(bh * 2 + s) * n + t] = z[i];
          T* o = op + ((bh / heads) * n * heads + t * heads + bh % heads) * dv + s * half;
          divide_range<T>(sums[i], 0, half, z[i], o);
          probe_tail += z[i] - z[i];
          int64_t j = 0;
          for (; j + V::size() <= half; j += V::size()) {
            const V x = V::loadu(o + j);
            probe = probe + (x - x);
          }
          for (; j < half; ++j) probe_tail += o[j] - o[j];
        }
      }
      r0 += rows;
    }
    if (tree_sum(probe) + probe_tail != T(0)) finite = false;
  });
  return finite;
}

template <typename T>
void pacs_fused_backward_kernel(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                const at::Tensor& v, const T* temps, const Tables* tables, const T* kvs,
                                const T* k_means, const T* denom, const at::Tensor& out, T m, at::Tensor& grad_q,
                                at::Tensor& grad_k, at::Tensor& grad_v, T* grad_temps) {
  const Rows qrows(q), krows(k), vrows(v), grows(grad_out), orows(out);
  const int64_t n = q.size(2), mk = k.size(2), d = q.size(3), w = 2 * d, dv = v.size(3), half = dv / 2,
                bh_count = q.size(0) * q.size(1);
  const bool rope = tables != nullptr;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const T* gp = grad_out.data_ptr<T>();
  const T* outp = out.data_ptr<T>();
  // kvsᵀ per stream, (BH, 2, half, w): the numerators' gradient is then a sum of whole feature-wide rows
  auto kvs_t = at::empty({bh_count, 2, half, w}, q.options());
  T* kvtp = kvs_t.data_ptr<T>();
  for (int64_t i = 0; i < bh_count * 2; ++i)
    for (int64_t c = 0; c < w; ++c)
      for (int64_t j = 0; j < half; ++j) kvtp[(i * half + j) * w + c] = kvs[(i * w + c) * half + j];
  // queries: per chunk, the gradients of S (both streams), of the key means and of the temperatures
  const int64_t chunks = (n + kPacsChunk - 1) / kPacsChunk, size = 2 * w * half + 2 * w + 2 * w;
  auto partial = at::zeros({bh_count, chunks, size}, q.options());
  T* pp = partial.data_ptr<T>();
  T* gq = grad_q.data_ptr<T>();
  at::parallel_for(0, bh_count * chunks, 1, [&](int64_t begin, int64_t end) {
    using V = Vectorized<T>;
    std::vector<T> p(4 * w), phi(4 * w), num(4 * w), grad_num(4 * w), grad_phi(w), gsum(4 * w), g_num(4 * half);
    const V one(T(1));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / chunks, first = (task % chunks) * kPacsChunk, last = std::min(n, first + kPacsChunk);
      T* g_kvs = pp + task * size;       // (2, w, half)
      T* g_km = g_kvs + 2 * w * half;    // (2, w)
      T* g_t = g_km + 2 * w;             // (2, w)
      for (int64_t t0 = first; t0 < last; t0 += 4) {
        const int rows = static_cast<int>(std::min<int64_t>(4, last - t0));
        for (int i = 0; i < rows; ++i) relu_halves_row<T>(qp + qrows.offset(bh * n + t0 + i), d, rope, p.data() + i * w);
        std::fill(gsum.begin(), gsum.end(), T(0));
        for (int64_t s = 0; s < 2; ++s) {
          const T* ts = temps + (bh * 2 + s) * w;
          const T* km = k_means + (bh * 2 + s) * w;
          const T* qn[4];
          const T* gn[4];
          T* grads[4];
          T g_den[4];
          for (int i = 0; i < rows; ++i) {
            const int64_t t = t0 + i, r = bh * n + t;
            T* f = phi.data() + i * w;
            exp_row<T>(p.data() + i * w, ts, w, f, nullptr);
            qn[i] = f;
            if (rope) {
              rotate_row<T>(f, tables->c<T>(s, t), tables->s<T>(s, t), d, num.data() + i * w);
              qn[i] = num.data() + i * w;
            }
            T* g = g_num.data() + i * half;
            divide_range<T>(gp + grows.offset(r) + s * half, 0, half, denom[(bh * 2 + s) * n + t], g);
            g_den[i] = -dot_row<T>(g, outp + orows.offset(r) + s * half, half);
            gn[i] = g;
            grads[i] = grad_num.data() + i * w;
          }
          // dL/d(rotated features) = kvs · g_num; dL/dS += q_numᵀ g_num
          vec_mat_group<T>(rows, gn, kvtp + (bh * 2 + s) * half * w, half, w, w, grads);
          outer_acc<T>(qn, gn, rows, w, half, g_kvs + s * w * half);
          T* gkm = g_km + s * w;
          T* gts = g_t + s * w;
          for (int i = 0; i < rows; ++i) {
            const T* gphi = grads[i];
            if (rope) {
              rotate_row_transposed<T>(grads[i], tables->c<T>(s, t0 + i), tables->s<T>(s, t0 + i), d, grad_phi.data());
              gphi = grad_phi.data();
            }
            const T* f = phi.data() + i * w;
            const T* pr = p.data() + i * w;
            T* gs = gsum.data() + i * w;
            const V den(g_den[i]);
            int64_t c = 0;
            for (; c + V::size() <= w; c += V::size()) {
              const V fv = V::loadu(f + c);
              at::vec::fmadd(den, fv, V::loadu(gkm + c)).store(gkm + c);
              const V g = at::vec::fmadd(den, V::loadu(km + c), V::loadu(gphi + c)) * (fv + one);
              (V::loadu(gs + c) + g * V::loadu(ts + c)).store(gs + c);
              (V::loadu(gts + c) + g * V::loadu(pr + c)).store(gts + c);
            }
            for (; c < w; ++c) {
              gkm[c] = g_den[i] * f[c] + gkm[c];
              const T g = (g_den[i] * km[c] + gphi[c]) * (f[c] + T(1));
              gs[c] += g * ts[c];
              gts[c] += g * pr[c];
            }
          }
        }
        for (int i = 0; i < rows; ++i) {
          const int64_t r = bh * n + t0 + i;
          pacs_unrelu_row<T>(qp + qrows.offset(r), gsum.data() + i * w, d, rope, gq + r * d);
        }
      }
    }
  });
  auto sums = at::empty({bh_count, size}, q.options());
  sum_chunks<T>(pp, bh_count, chunks, size, T(1), sums.data_ptr<T>());
  T* sp = sums.data_ptr<T>();
  // back to the key layout: grad S (BH, w, dv) = [S_same | swapped S_opp] / m, the key mean's likewise; and
  // grad Sᵀ (BH, dv, w) for the keys' gradient
  auto gkv = at::empty({bh_count, w, dv}, q.options()), gkv_t = at::empty({bh_count, dv, w}, q.options()),
       gkm = at::empty({bh_count, w}, q.options());
  T* gkvp = gkv.data_ptr<T>();
  T* gkvtp = gkv_t.data_ptr<T>();
  T* gkmp = gkm.data_ptr<T>();
  for (int64_t bh = 0; bh < bh_count; ++bh) {
    const T* g_kvs = sp + bh * size;
    const T* g_km = g_kvs + 2 * w * half;
    const T* g_t = g_km + 2 * w;
    for (int64_t c = 0; c < w; ++c) {
      const int64_t swapped = (c + d) % w;  // row c of the key layout is row (c + d) mod w of the opposite stream
      for (int64_t j = 0; j < half; ++j) {
        const T same = g_kvs[c * half + j] / m, opposite = g_kvs[(w + swapped) * half + j] / m;
        gkvp[(bh * w + c) * dv + j] = same;
        gkvp[(bh * w + c) * dv + half + j] = opposite;
        gkvtp[(bh * dv + j) * w + c] = same;
        gkvtp[(bh * dv + half + j) * w + c] = opposite;
      }
      gkmp[bh * w + c] = (g_km[c] + g_km[w + swapped]) / m;
    }
    if (grad_temps) std::copy(g_t, g_t + 2 * w, grad_temps + bh * 2 * w);
  }
  // keys and values, four rows at a time (no sums over tokens)
  T* gk = grad_k.data_ptr<T>();
  T* gv = grad_v.data_ptr<T>();
  at::parallel_for(0, bh_count * mk, grain(8 * w), [&](int64_t begin, int64_t end) {
    using V = Vectorized<T>;
    std::vector<T> p(w), phi(4 * w), num(4 * w), grad_num(4 * w), grad_phi(w);
    const V one(T(1));
    for (int64_t r0 = begin; r0 < end;) {
      const int64_t bh = r0 / mk, t0 = r0 % mk;
      const int rows = static_cast<int>(std::min<int64_t>({4, end - r0, mk - t0}));
      const T* kn[4];
      const T* vr[4];
      T* gvr[4];
      T* grads[4];
      for (int i = 0; i < rows; ++i) {
        const int64_t r = r0 + i;
        T* f = phi.data() + i * w;
        relu_halves_row<T>(kp + krows.offset(r), d, rope, p.data());
        exp_row<T>(p.data(), nullptr, w, f, nullptr);
        kn[i] = f;
        if (rope) {
          rotate_row<T>(f, tables->c<T>(0, t0 + i), tables->s<T>(0, t0 + i), d, num.data() + i * w);
          kn[i] = num.data() + i * w;
        }
        vr[i] = vp + vrows.offset(r);
        gvr[i] = gv + r * dv;
        grads[i] = grad_num.data() + i * w;
      }
      // dL/dv = k_numᵀ grad S; dL/d(rotated features) = grad S · v
      vec_mat_group<T>(rows, kn, gkvp + bh * w * dv, w, dv, dv, gvr);
      vec_mat_group<T>(rows, vr, gkvtp + bh * dv * w, dv, w, w, grads);
      const T* mg = gkmp + bh * w;
      for (int i = 0; i < rows; ++i) {
        const T* gphi = grads[i];
        if (rope) {
          rotate_row_transposed<T>(grads[i], tables->c<T>(0, t0 + i), tables->s<T>(0, t0 + i), d, grad_phi.data());
          gphi = grad_phi.data();
        }
        const T* f = phi.data() + i * w;
        T* g = num.data() + i * w;  // the rotated features are no longer needed
        int64_t c = 0;
        for (; c + V::size() <= w; c += V::size())
          ((V::loadu(gphi + c) + V::loadu(mg + c)) * (V::loadu(f + c) + one)).store(g + c);
        for (; c < w; ++c) g[c] = (gphi[c] + mg[c]) * (f[c] + T(1));
        pacs_unrelu_row<T>(kp + krows.offset(r0 + i), g, d, rope, gk + (r0 + i) * d);
      }
      r0 += rows;
    }
  });
}

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

// The sums of one block of rows for one vector of channels. K > 0: the kernel size known at compile time,
// so that the K² accumulators stay in registers; K = 0: any odd size. Positions whose whole K×K window
// lies inside the map (all but a border of K/2) take a loop without bound checks.
template <typename T, int K>
inline void depthwise_weight_grad_block(const T* in, const T* g, int64_t row_begin, int64_t row_end, int64_t height,
                                        int64_t width, int64_t channels, int64_t k_dyn, int64_t count,
                                        Vectorized<T>* acc, Vectorized<T>& acc_bias) {
  using V = Vectorized<T>;
  const int64_t k = K > 0 ? K : k_dyn, pad = k / 2;
  auto checked = [&](const T* g_row, int64_t image, int64_t y, int64_t x) {
    const V gv = V::loadu(g_row + x * channels, count);
    acc_bias = acc_bias + gv;
    for (int64_t i = 0; i < k; ++i) {
      const int64_t yy = y + i - pad;
      if (yy < 0 || yy >= height) continue;
      const T* in_row = in + ((image * height + yy) * width) * channels;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t xx = x + j - pad;
        if (xx < 0 || xx >= width) continue;
        acc[i * k + j] = at::vec::fmadd(gv, V::loadu(in_row + xx * channels, count), acc[i * k + j]);
      }
    }
  };
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t image = row / height, y = row % height;
    const T* g_row = g + row * width * channels;
    if (y < pad || y >= height - pad || width < k) {
      for (int64_t x = 0; x < width; ++x) checked(g_row, image, y, x);
      continue;
    }
    for (int64_t x = 0; x < pad; ++x) checked(g_row, image, y, x);
    const T* window = in + ((image * height + y - pad) * width - pad) * channels;  // top-left tap of x = 0
    const int64_t row_stride = width * channels;
    for (int64_t x = pad; x < width - pad; ++x) {
      const V gv = V::loadu(g_row + x * channels, count);
      acc_bias = acc_bias + gv;
      const T* w0 = window + x * channels;
      for (int64_t i = 0; i < k; ++i) {
        for (int64_t j = 0; j < k; ++j) {
          acc[i * k + j] = at::vec::fmadd(gv, V::loadu(w0 + i * row_stride + j * channels, count), acc[i * k + j]);
        }
      }
    }
    for (int64_t x = std::max(pad, width - pad); x < width; ++x) checked(g_row, image, y, x);
  }
}

// Weight and bias gradients of a depthwise convolution (stride 1, odd K×K kernel, "same" zero padding)
// on channels-last maps: gw[c, i, j] = Σ g[n, y, x, c] · in[n, y + i - K/2, x + j - K/2, c], gb[c] = Σ g.
// oneDNN's backward-weights pass for these shapes runs 10-20x slower than its forward. Here each task
// holds the K² sums of one channel vector over a fixed block of rows; the blocks' partial sums are added
// in block order, so the result does not depend on the number of threads.
template <typename T, int K>
void depthwise_weight_grad_kernel(const T* in, const T* g, int64_t n_rows, int64_t height, int64_t width,
                                  int64_t channels, int64_t k, int64_t rows_per_block, T* partial) {
  using V = Vectorized<T>;
  const int64_t taps = k * k, c_blocks = (channels + V::size() - 1) / V::size();
  const int64_t blocks = (n_rows + rows_per_block - 1) / rows_per_block;
  at::parallel_for(0, blocks * c_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<V> acc_dyn(K > 0 ? 0 : taps);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block = task / c_blocks, c0 = (task % c_blocks) * V::size();
      const int64_t count = std::min<int64_t>(V::size(), channels - c0);
      const int64_t r0 = block * rows_per_block, r1 = std::min(n_rows, r0 + rows_per_block);
      T* out = partial + block * (taps + 1) * channels + c0;
      V acc_bias(T(0));
      if constexpr (K > 0) {
        V acc[K * K];
        for (int t = 0; t < K * K; ++t) acc[t] = V(T(0));
        depthwise_weight_grad_block<T, K>(in + c0, g + c0, r0, r1, height, width, channels, k, count, acc, acc_bias);
        for (int t = 0; t < K * K; ++t) acc[t].store(out + t * channels, count);
      } else {
        std::fill(acc_dyn.begin(), acc_dyn.end(), V(T(0)));
        depthwise_weight_grad_block<T, 0>(in + c0, g + c0, r0, r1, height, width, channels, k, count,
                                          acc_dyn.data(), acc_bias);
        for (int64_t t = 0; t < taps; ++t) acc_dyn[t].store(out + t * channels, count);
      }
      acc_bias.store(out + taps * channels, count);
    }
  });
}


// out[b, p + t] = (out[b, p + t] + bias + Σ_taps w_tap · v[b, p + t + offset(tap)]) · g[b, p + t] over the H·W
// grid tokens t (zero padding), and out[b, t] *= g[b, t] for the p prefix tokens: Pola's local branch
// and gate, reading v and g where the projection wrote them (token rows, unit channel stride) instead of
// a channels-last copy, a conv output, an add and a multiply. wt is (K·K, C): each tap's weights over
// the channels, contiguous. Rows of the grid are split between the threads.
template <typename T>
void dwconv_add_gate_kernel(T* out, const T* v, int64_t v_b, int64_t v_t, const T* g, int64_t g_b, int64_t g_t,
                            const T* wt, const T* bias, int64_t batch, int64_t prefix, int64_t h, int64_t w,
                            int64_t c, int64_t k) {
  using V = Vectorized<T>;
  const int64_t pad = k / 2, n = prefix + h * w;
  at::parallel_for(0, batch * (h + (prefix ? 1 : 0)), 1, [&](int64_t begin, int64_t end) {
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / (h + (prefix ? 1 : 0)), y = job % (h + (prefix ? 1 : 0)) - (prefix ? 1 : 0);
      T* ob = out + b * n * c;
      const T* vb = v + b * v_b;
      const T* gb = g + b * g_b;
      if (y < 0) {  // the prefix tokens: gate only
        for (int64_t t = 0; t < prefix; ++t) {
          int64_t ch = 0;
          for (; ch + V::size() <= c; ch += V::size())
            (V::loadu(ob + t * c + ch) * V::loadu(gb + t * g_t + ch)).store(ob + t * c + ch);
          for (; ch < c; ++ch) ob[t * c + ch] *= gb[t * g_t + ch];
        }
        continue;
      }
      const int64_t y0 = std::max<int64_t>(0, y - pad), y1 = std::min<int64_t>(h, y + pad + 1);
      // Interior runs of four pixels: each tap's weights are loaded once for the four (loads, not FMAs,
      // bound this loop). The other pixels and channels take the general loop below.
      constexpr int64_t run = 4;
      const int64_t c_vec = c - c % V::size();
      int64_t x_done = pad;  // pixels [pad, x_done) were written by the runs
      if (c_vec > 0) {
        for (; x_done + run + pad <= w; x_done += run) {
          const int64_t token = prefix + y * w + x_done;
          for (int64_t ch = 0; ch < c_vec; ch += V::size()) {
            V acc[run];
            for (int64_t u = 0; u < run; ++u) acc[u] = V::loadu(bias + ch);
            for (int64_t yy = y0; yy < y1; ++yy) {
              const T* vrow = vb + (prefix + yy * w + x_done - pad) * v_t + ch;
              const T* wrow = wt + (yy - y + pad) * k * c + ch;
              for (int64_t dx = 0; dx < k; ++dx) {
                const V wv = V::loadu(wrow + dx * c);
                for (int64_t u = 0; u < run; ++u) acc[u] = at::vec::fmadd(wv, V::loadu(vrow + (u + dx) * v_t), acc[u]);
              }
            }
            for (int64_t u = 0; u < run; ++u) {
              T* o = ob + (token + u) * c + ch;
              ((V::loadu(o) + acc[u]) * V::loadu(gb + (token + u) * g_t + ch)).store(o);
            }
          }
        }
      }
      for (int64_t x = 0; x < w; ++x) {
        const bool by_runs = c_vec > 0 && x >= pad && x < x_done;
        if (by_runs && c_vec == c) continue;
        const int64_t x0 = std::max<int64_t>(0, x - pad), x1 = std::min<int64_t>(w, x + pad + 1);
        const int64_t token = prefix + y * w + x;
        T* o = ob + token * c;
        const T* gr = gb + token * g_t;
        int64_t ch = by_runs ? c_vec : 0;
        for (; ch + V::size() <= c; ch += V::size()) {
          V acc = V::loadu(bias + ch);
          for (int64_t yy = y0; yy < y1; ++yy) {
            const T* vrow = vb + (prefix + yy * w + x0) * v_t + ch;
            const T* wrow = wt + ((yy - y + pad) * k + x0 - x + pad) * c + ch;
            for (int64_t i = 0; i < x1 - x0; ++i)
              acc = at::vec::fmadd(V::loadu(wrow + i * c), V::loadu(vrow + i * v_t), acc);
          }
          ((V::loadu(o + ch) + acc) * V::loadu(gr + ch)).store(o + ch);
        }
        for (; ch < c; ++ch) {
          T acc = bias[ch];
          for (int64_t yy = y0; yy < y1; ++yy) {
            const T* vrow = vb + (prefix + yy * w + x0) * v_t + ch;
            const T* wrow = wt + ((yy - y + pad) * k + x0 - x + pad) * c + ch;
            for (int64_t i = 0; i < x1 - x0; ++i) acc += wrow[i * c] * vrow[i * v_t];
          }
          o[ch] = (o[ch] + acc) * gr[ch];
        }
      }
    }
  });
}

at::Tensor expanded_power(const at::Tensor& power, const at::Tensor& x) {
  return power.expand({x.size(0), x.size(1), 1, x.size(3)}).contiguous();
}

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

// Tokens per block for x (B, H, N, ·) whose per-token work is `width` channels wide (as _block_tokens in
// pola_attention.py: inputs of up to four blocks run as one).
int64_t block_tokens(const at::Tensor& x, int64_t width, int64_t block_elements, int64_t min_block_tokens) {
  const int64_t n = x.size(2), per_token = std::max<int64_t>(1, x.size(0) * x.size(1) * width);
  if (n * per_token <= 4 * block_elements) return std::max<int64_t>(n, 1);
  return std::max<int64_t>(min_block_tokens, block_elements / per_token);
}

// The whole forward of the power-map attention without gradients and without key padding, as
// _pola_attention_no_grad in pola_attention.py does it (the same blocks), in one call: at small sizes
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

void check_tables(const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& cross, int64_t streams,
                  int64_t n, int64_t w, const at::Tensor& like) {
  TORCH_CHECK(cos.has_value() == cross.has_value(), "pass both RoPE tables or neither");
  if (!cos) return;
  for (const auto* t : {&*cos, &*cross}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == streams && t->size(1) == n && t->size(2) == w,
                "RoPE tables must be (", streams, ", ", n, ", ", w, "), got ", t->sizes());
    TORCH_CHECK(t->stride(2) == 1 && t->scalar_type() == like.scalar_type(), "RoPE tables: unit channel stride, same dtype");
  }
  TORCH_CHECK(cos->strides() == cross->strides(), "RoPE tables must have the same strides");
}

std::vector<at::Tensor> pacs_halves(const at::Tensor& x, bool rope, bool with_exp, const c10::optional<at::Tensor>& cos,
                                    const c10::optional<at::Tensor>& cross) {
  check_rows(x, "x");
  TORCH_CHECK(!rope || x.size(3) % 2 == 0, "RoPE order needs an even head_dim");
  check_tables(cos, cross, 1, x.size(2), 2 * x.size(3), x);
  auto out = at::empty({x.size(0), x.size(1), x.size(2), 2 * x.size(3)}, x.options());
  at::Tensor num = cos ? at::empty_like(out) : out;
  const Tables tables = cos ? Tables(*cos, *cross) : Tables();
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "pacs_halves", [&] {
    pacs_halves_kernel<scalar_t>(x, rope, with_exp, out, cos ? &tables : nullptr, cos ? &num : nullptr);
  });
  return {out, num};
}

// With key_means (B, H, 2, 2d, 1), also each stream's normaliser φ·key_mean + eps, (B, H, 2, N, 1), formed
// from the feature row while it is in registers: as a product it is a matrix-vector one, which costs twice
// the numerators' product.
std::vector<at::Tensor> pacs_exp_features(const at::Tensor& p, const at::Tensor& temps,
                                          const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& cross,
                                          const c10::optional<at::Tensor>& key_means, double eps) {
  TORCH_CHECK(p.dim() == 4 && p.is_contiguous(), "p must be contiguous (B, H, N, 2d)");
  check_tables(cos, cross, 2, p.size(2), p.size(3), p);
  const auto t = temps.expand({p.size(0), p.size(1), 2, 1, p.size(3)}).contiguous();
  auto phi = at::empty({p.size(0), p.size(1), 2, p.size(2), p.size(3)}, p.options());
  at::Tensor num = cos ? at::empty_like(phi) : phi;
  const Tables tables = cos ? Tables(*cos, *cross) : Tables();
  at::Tensor km, denom;
  if (key_means) {
    TORCH_CHECK(key_means->scalar_type() == p.scalar_type(), "key_means and p dtypes differ");
    km = key_means->expand({p.size(0), p.size(1), 2, p.size(3), 1}).contiguous();
    denom = at::empty({p.size(0), p.size(1), 2, p.size(2), 1}, p.options());
  }
  AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "pacs_exp_features", [&] {
    pacs_exp_kernel<scalar_t>(p, t, phi, cos ? &tables : nullptr, cos ? &num : nullptr,
                              key_means ? km.data_ptr<scalar_t>() : nullptr, static_cast<scalar_t>(eps),
                              key_means ? denom.data_ptr<scalar_t>() : nullptr);
  });
  if (key_means) return {phi, num, denom};
  return {phi, num};
}

at::Tensor pacs_key_backward(const at::Tensor& k, const at::Tensor& phi, const at::Tensor& grad_phi, bool rope) {
  check_rows(k, "k");
  check_rows(grad_phi, "grad_phi");
  TORCH_CHECK(phi.is_contiguous(), "phi must be contiguous");
  auto grad_k = at::empty(k.sizes(), k.options());
  AT_DISPATCH_FLOATING_TYPES(k.scalar_type(), "pacs_key_backward", [&] {
    pacs_key_backward_kernel<scalar_t>(k, phi, grad_phi, rope, grad_k);
  });
  return grad_k;
}

std::vector<at::Tensor> pacs_query_backward(const at::Tensor& q, const at::Tensor& p_q, const at::Tensor& phi,
                                            const at::Tensor& grad_phi, const at::Tensor& temps, bool rope,
                                            bool need_temp_grad) {
  check_rows(q, "q");
  TORCH_CHECK(p_q.is_contiguous() && phi.is_contiguous() && grad_phi.is_contiguous(),
              "p_q, phi and grad_phi must be contiguous");
  const auto t = temps.expand({q.size(0), q.size(1), 2, 1, 2 * q.size(3)}).contiguous();
  auto grad_q = at::empty(q.sizes(), q.options());
  const int64_t chunk = 256, chunks = (q.size(2) + chunk - 1) / chunk;
  at::Tensor partial =
      need_temp_grad ? at::empty({q.size(0), q.size(1), chunks, 2, 2 * q.size(3)}, q.options()) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "pacs_query_backward", [&] {
    pacs_query_backward_kernel<scalar_t>(q, p_q, phi, grad_phi, t, rope, grad_q, need_temp_grad ? &partial : nullptr,
                                         chunk);
  });
  // (B, H, chunks, 2, 2d) -> (B, H, 2, 1, 2d), the temperatures' layout
  at::Tensor grad_t = need_temp_grad ? partial.sum(2).unsqueeze(3) : at::Tensor();
  return {grad_q, grad_t};
}

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

// The fused PaCS op (see pacs_fused_forward_kernel): q (B, H, N, d), k (B, H, M, d), v (B, H, M, dv) with unit
// channel stride, temps (…, 2, 1, 2d) stacked in kernel order, RoPE tables (2, N, 2d) or none. Returns
// ([out (B, N, H, dv), denom (B, H, 2, N), kvs (B, H, 2, 2d, dv/2), key means (B, H, 2, 2d)], all finite):
// where a value is not finite, the caller redoes the op with its rows rescaled.
void check_pacs_fused(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& cross) {
  check_rows(q, "q");
  check_rows(k, "k");
  check_rows(v, "v");
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(1) == q.size(1) && v.size(1) == q.size(1),
              "q, k and v must share batch and heads");
  TORCH_CHECK(k.size(3) == q.size(3) && v.size(2) == k.size(2) && v.size(3) % 2 == 0 && k.size(2) > 0,
              "k must match q's head_dim, v k's tokens, with an even value width");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "q, k and v dtypes differ");
  check_tables(cos, cross, 2, q.size(2), 2 * q.size(3), q);
  TORCH_CHECK(!cos || (q.size(3) % 2 == 0 && k.size(2) == q.size(2)), "RoPE needs an even head_dim and M == N");
}

std::tuple<std::vector<at::Tensor>, bool> pacs_fused_forward(const at::Tensor& q, const at::Tensor& k,
                                                             const at::Tensor& v, const at::Tensor& temps,
                                                             const c10::optional<at::Tensor>& cos,
                                                             const c10::optional<at::Tensor>& cross, double eps) {
  check_pacs_fused(q, k, v, cos, cross);
  const int64_t b = q.size(0), h = q.size(1), n = q.size(2), w = 2 * q.size(3), dv = v.size(3);
  TORCH_CHECK(temps.scalar_type() == q.scalar_type(), "temps and q dtypes differ");
  const auto t = temps.expand({b, h, 2, 1, w}).contiguous();
  auto out = at::empty({b, n, h, dv}, q.options());
  auto denom = at::empty({b, h, 2, n}, q.options());
  auto kvs = at::empty({b, h, 2, w, dv / 2}, q.options());
  auto k_means = at::empty({b, h, 2, w}, q.options());
  const Tables tables = cos ? Tables(*cos, *cross) : Tables();
  bool finite = true;
  if (q.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "pacs_fused_forward", [&] {
      finite = pacs_fused_forward_kernel<scalar_t>(q, k, v, t.data_ptr<scalar_t>(), cos ? &tables : nullptr,
                                                   static_cast<scalar_t>(eps), out, denom, kvs, k_means);
    });
  }
  return {{out, denom, kvs, k_means}, finite};
}

// Gradients of q, k, v (contiguous) and, if asked, of the stacked temperatures (B, H, 2, 1, 2d), from the
// output's gradient and what pacs_fused_forward returned (out as (B, H, N, dv) rows); m: the number of keys.
std::vector<at::Tensor> pacs_fused_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                            const at::Tensor& v, const at::Tensor& temps,
                                            const c10::optional<at::Tensor>& cos,
                                            const c10::optional<at::Tensor>& cross, const at::Tensor& kvs,
                                            const at::Tensor& k_means, const at::Tensor& denom, const at::Tensor& out,
                                            bool need_temp_grad) {
  check_pacs_fused(q, k, v, cos, cross);
  check_rows(grad_out, "grad_out");
  check_rows(out, "out");
  const int64_t b = q.size(0), h = q.size(1), n = q.size(2), w = 2 * q.size(3), dv = v.size(3);
  TORCH_CHECK(grad_out.sizes() == out.sizes() && out.size(0) == b && out.size(1) == h && out.size(2) == n &&
                  out.size(3) == dv, "grad_out and out must be (B, H, N, dv)");
  TORCH_CHECK(kvs.is_contiguous() && kvs.numel() == b * h * w * dv && k_means.is_contiguous() &&
                  k_means.numel() == 2 * b * h * w && denom.is_contiguous() && denom.numel() == 2 * b * h * n,
              "kvs, k_means and denom must be pacs_fused_forward's");
  for (const auto* x : {&grad_out, &temps, &kvs, &k_means, &denom, &out})
    TORCH_CHECK(x->scalar_type() == q.scalar_type(), "all tensors must have q's dtype");
  const auto t = temps.expand({b, h, 2, 1, w}).contiguous();
  auto grad_q = at::empty(q.sizes(), q.options());
  auto grad_k = at::empty(k.sizes(), k.options());
  auto grad_v = at::empty(v.sizes(), v.options());
  at::Tensor grad_t = need_temp_grad ? at::empty({b, h, 2, 1, w}, q.options()) : at::Tensor();
  const Tables tables = cos ? Tables(*cos, *cross) : Tables();
  if (q.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "pacs_fused_backward", [&] {
      pacs_fused_backward_kernel<scalar_t>(grad_out, q, k, v, t.data_ptr<scalar_t>(), cos ? &tables : nullptr,
                                           kvs.data_ptr<scalar_t>(), k_means.data_ptr<scalar_t>(),
                                           denom.data_ptr<scalar_t>(), out, static_cast<scalar_t>(k.size(2)), grad_q,
                                           grad_k, grad_v, need_temp_grad ? grad_t.data_ptr<scalar_t>() : nullptr);
    });
  }
  return {grad_q, grad_k, grad_v, grad_t};
}

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

// (N, H, W, C) memory of an (N, C, H, W) tensor: channels-last and dense.
void check_channels_last(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4 && t.device().is_cpu(), name, " must be a 4-D CPU tensor");
  const int64_t c = t.size(1), h = t.size(2), w = t.size(3);
  const bool dense = (t.size(1) == 1 || t.stride(1) == 1) && (w == 1 || t.stride(3) == c) &&
                     (h == 1 || t.stride(2) == w * c) && (t.size(0) == 1 || t.stride(0) == h * w * c);
  TORCH_CHECK(dense, name, " must be a dense channels-last map");
}

// gradients of a depthwise conv's weight (C, 1, K, K) and bias (C) from its input and output gradient
std::vector<at::Tensor> depthwise_weight_grad(const at::Tensor& input, const at::Tensor& grad_out, int64_t k) {
  check_channels_last(input, "input");
  check_channels_last(grad_out, "grad_out");
  TORCH_CHECK(input.sizes() == grad_out.sizes(), "input and grad_out shapes differ");
  TORCH_CHECK(input.scalar_type() == grad_out.scalar_type(), "input and grad_out dtypes differ");
  TORCH_CHECK(k >= 1 && k % 2 == 1, "the kernel size must be odd, got ", k);
  const int64_t n = input.size(0), c = input.size(1), h = input.size(2), w = input.size(3), taps = k * k;
  // blocks of about 64k elements: each reads K - 1 rows of halo again, which costs memory traffic
  const int64_t rows = n * h, rows_per_block = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(w * c, 1));
  const int64_t blocks = std::max<int64_t>(1, (rows + rows_per_block - 1) / rows_per_block);
  auto partial = at::zeros({blocks, taps + 1, c}, input.options());  // zero where there are no rows
  AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "depthwise_weight_grad", [&] {
    const scalar_t* in = input.data_ptr<scalar_t>();
    const scalar_t* g = grad_out.data_ptr<scalar_t>();
    scalar_t* out = partial.data_ptr<scalar_t>();
    if (rows == 0 || c == 0) return;
    if (k == 3) depthwise_weight_grad_kernel<scalar_t, 3>(in, g, rows, h, w, c, k, rows_per_block, out);
    else if (k == 5) depthwise_weight_grad_kernel<scalar_t, 5>(in, g, rows, h, w, c, k, rows_per_block, out);
    else if (k == 7) depthwise_weight_grad_kernel<scalar_t, 7>(in, g, rows, h, w, c, k, rows_per_block, out);
    else depthwise_weight_grad_kernel<scalar_t, 0>(in, g, rows, h, w, c, k, rows_per_block, out);
  });
  // (taps + 1, C): each entry is the sum of its blocks in block order, whatever the threads
  auto sums = at::empty({taps + 1, c}, input.options());
  AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "depthwise_weight_grad_sum", [&] {
    const scalar_t* src = partial.data_ptr<scalar_t>();
    scalar_t* dst = sums.data_ptr<scalar_t>();
    const int64_t entries = (taps + 1) * c;
    at::parallel_for(0, entries, 1024, [&](int64_t begin, int64_t end) {
      for (int64_t e = begin; e < end; ++e) {
        scalar_t total = scalar_t(0);
        for (int64_t b = 0; b < blocks; ++b) total += src[b * entries + e];
        dst[e] = total;
      }
    });
  });
  auto grad_weight = sums.narrow(0, 0, taps).t().reshape({c, 1, k, k});
  return {grad_weight, sums[taps].clone()};
}


// See dwconv_add_gate_kernel. out (B, N, C) contiguous, updated in place; v and g (B, N, C) with unit
// channel stride; wt (K·K, C) contiguous; bias (C).
void dwconv_add_gate(at::Tensor out, const at::Tensor& v, const at::Tensor& g, const at::Tensor& wt,
                     const at::Tensor& bias, int64_t prefix, int64_t h, int64_t w, int64_t k) {
  TORCH_CHECK(out.dim() == 3 && out.is_contiguous(), "out must be contiguous (B, N, C)");
  TORCH_CHECK(v.sizes() == out.sizes() && g.sizes() == out.sizes(), "v and g must have out's shape ", out.sizes());
  TORCH_CHECK(v.stride(2) == 1 && g.stride(2) == 1, "v and g need a unit channel stride");
  TORCH_CHECK(k >= 1 && k % 2 == 1, "the kernel size must be odd, got ", k);
  TORCH_CHECK(prefix >= 0 && out.size(1) == prefix + h * w, "token count ", out.size(1), " != ", prefix, " + ", h,
              "*", w);
  const int64_t c = out.size(2);
  TORCH_CHECK(wt.is_contiguous() && wt.dim() == 2 && wt.size(0) == k * k && wt.size(1) == c,
              "wt must be contiguous (K*K, C)");
  TORCH_CHECK(bias.is_contiguous() && bias.numel() == c, "bias must be contiguous (C)");
  for (const auto* t : {&v, &g, &wt, &bias})
    TORCH_CHECK(t->scalar_type() == out.scalar_type(), "all tensors must have out's dtype");
  if (out.numel() == 0) return;
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "dwconv_add_gate", [&] {
    dwconv_add_gate_kernel<scalar_t>(out.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), v.stride(0), v.stride(1),
                                     g.data_ptr<scalar_t>(), g.stride(0), g.stride(1), wt.data_ptr<scalar_t>(),
                                     bias.data_ptr<scalar_t>(), out.size(0), prefix, h, w, c, k);
  });
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("power_features", &power_features, "[x⁺ᵖ ; x⁻ᵖ] and log|x|");
  m.def("power_backward", &power_backward, "gradients of x and p through the power features");
  m.def("normalise", &normalise, "both streams' numerators over their normalisers");
  m.def("output_grad", &output_grad, "gradient at the products' output");
  m.def("pola_forward_no_grad", &pola_forward_no_grad, "the power-map attention's forward without gradients");
  m.def("power_features_dots", &power_features_dots, "query features, log|x| and both normalisers");
  m.def("divide_streams", &divide_streams, "numerators over both streams' normalisers");
  m.def("stream_rhs", &stream_rhs, "both streams' right-hand side [S_same | swapped S_opp | sums] / m");
  m.def("stream_rhs_backward", &stream_rhs_backward, "gradients of S and of the key sums from that of rhs");
  m.def("pacs_halves", &pacs_halves, "[relu(x) ; relu(-x)] in kernel order, optionally exp(.) - 1, and rotated",
        py::arg("x"), py::arg("rope"), py::arg("with_exp"), py::arg("cos") = py::none(), py::arg("cross") = py::none());
  m.def("pacs_exp_features", &pacs_exp_features, "exp(p * t) - 1 for both streams, rotated, and normalisers",
        py::arg("p"), py::arg("temps"), py::arg("cos") = py::none(), py::arg("cross") = py::none(),
        py::arg("key_means") = py::none(), py::arg("eps") = 0.0);
  m.def("pacs_key_backward", &pacs_key_backward, "gradient of the keys through exp(halves) - 1");
  m.def("pacs_query_backward", &pacs_query_backward, "gradients of the queries and temperatures");
  m.def("pacs_fused_forward", &pacs_fused_forward, "the PaCS op without key padding, features made per row",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("temps"), py::arg("cos") = py::none(),
        py::arg("cross") = py::none(), py::arg("eps") = 1e-6);
  m.def("pacs_fused_backward", &pacs_fused_backward, "its backward, the features recomputed per row");
  m.def("gelu_with_slope", &gelu_with_slope, "GELU of x and its slope at x (written over x if in_place)",
        py::arg("x"), py::arg("in_place"));
  m.def("rope_pairs", &rope_pairs, "RoPE on adjacent channel pairs (or its transpose, inverse=True)", py::arg("x"),
        py::arg("sin"), py::arg("cos"), py::arg("inverse") = false);
  m.def("depthwise_weight_grad", &depthwise_weight_grad, "weight and bias gradients of a depthwise conv");
  m.def("dwconv_add_gate", &dwconv_add_gate, "(out + depthwise conv of v) * g in place, prefix tokens gated only");
}
