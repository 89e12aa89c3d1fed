// PaCS (PolaFormer++) features as separate stages: the halves, exp(p·t) - 1 for both streams, and the
// keys' and queries' backward.
#include "common.h"
#include "ops.h"
#include "pacs.h"

namespace polaformer::native {
namespace {

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

}  // namespace

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

}  // namespace polaformer::native
