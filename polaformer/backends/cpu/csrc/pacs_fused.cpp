// The PaCS (PolaFormer++) attention fused per row.
//
// The whole PaCS op without key padding, for any B, H, N, M: every feature row is made in registers where it
// is used and never written out. Forward: one pass over the keys forms S = φkᵀv (with RoPE: of the rotated
// keys) and Σφk, one pass over the queries forms both streams' features, normalisers, products with S and
// quotients. Backward: the same two passes, recomputing the features (cheaper than storing and re-reading
// them). Sums over tokens are kept per fixed chunk of tokens and added in chunk order, so results do not
// depend on the number of threads. Layouts as in PacsAttention (ops/pacs/autograd.py): features in kernel
// order, the opposite stream's S rows and key mean swapped.
#include <atomic>

#include "common.h"
#include "ops.h"
#include "pacs.h"

namespace polaformer::native {
namespace {

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

// The shapes, dtypes and RoPE tables both fused entry points take.
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

}  // namespace

// The fused PaCS op (see pacs_fused_forward_kernel): q (B, H, N, d), k (B, H, M, d), v (B, H, M, dv) with unit
// channel stride, temps (…, 2, 1, 2d) stacked in kernel order, RoPE tables (2, N, 2d) or none. Returns
// ([out (B, N, H, dv), denom (B, H, 2, N), kvs (B, H, 2, 2d, dv/2), key means (B, H, 2, 2d)], all finite):
// where a value is not finite, the caller redoes the op with its rows rescaled.
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

}  // namespace polaformer::native
