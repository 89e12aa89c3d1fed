// Depthwise convolution on channels-last maps: the weight gradient, and Pola's local branch fused with its
// gate.
#include "common.h"
#include "ops.h"

namespace polaformer::native {
namespace {

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

// (N, H, W, C) memory of an (N, C, H, W) tensor: channels-last and dense.
void check_channels_last(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4 && t.device().is_cpu(), name, " must be a 4-D CPU tensor");
  const int64_t c = t.size(1), h = t.size(2), w = t.size(3);
  const bool dense = (t.size(1) == 1 || t.stride(1) == 1) && (w == 1 || t.stride(3) == c) &&
                     (h == 1 || t.stride(2) == w * c) && (t.size(0) == 1 || t.stride(0) == h * w * c);
  TORCH_CHECK(dense, name, " must be a dense channels-last map");
}

}  // namespace

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

}  // namespace polaformer::native
