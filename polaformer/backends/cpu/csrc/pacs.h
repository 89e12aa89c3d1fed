// Row helpers of the PaCS (PolaFormer++) features, shared by pacs.cpp and pacs_fused.cpp.
#pragma once

#include "common.h"

namespace polaformer::native {

// Features are [relu(x) ; relu(-x)], each half in "kernel order": with RoPE, channels [even | odd] so that
// the rotation works on whole blocks (see _pacs_indices in ops/pacs/autograd.py).

// Source channel of kernel-order index i within a half of width d.
inline int64_t pacs_source(int64_t i, int64_t d, bool rope) {
  return rope ? (i < d / 2 ? 2 * i : 2 * (i - d / 2) + 1) : i;
}

// RoPE on one feature row in kernel order (see _rotate in ops/pacs/autograd.py): per half, with E the first
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

// Checks RoPE tables (streams, n, w): both or neither, unit channel stride, x's dtype, equal strides.
inline void check_tables(const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& cross, int64_t streams,
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

}  // namespace polaformer::native
