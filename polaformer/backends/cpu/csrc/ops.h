// The entry points that bindings.cpp exposes to Python, by the file that defines (and documents) them.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>
#include <vector>

namespace polaformer::native {

// pola_power.cpp
std::vector<at::Tensor> power_features(const at::Tensor& x, const at::Tensor& power, bool keep_log);
std::vector<at::Tensor> power_backward(const at::Tensor& x, const at::Tensor& feat, const at::Tensor& log_abs,
                                       const at::Tensor& grad_feat, const at::Tensor& power, bool need_power_grad);
std::vector<at::Tensor> power_features_dots(const at::Tensor& x, const at::Tensor& power,
                                            const at::Tensor& key_means, double eps, bool keep_log);
void divide_streams(const at::Tensor& res, const at::Tensor& z, int64_t half, at::Tensor out);
at::Tensor normalise(at::Tensor res, double eps, int64_t half, at::Tensor out);
at::Tensor output_grad(const at::Tensor& grad_out, const at::Tensor& denom, const at::Tensor& out, int64_t half);
at::Tensor stream_rhs(const at::Tensor& kv, const at::Tensor& k_sum, double m, int64_t half);
std::vector<at::Tensor> stream_rhs_backward(const at::Tensor& grad_rhs, double m, int64_t half);
at::Tensor pola_forward_no_grad(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& power, double eps, int64_t block_elements,
                                int64_t min_block_tokens);

// pacs.cpp
std::vector<at::Tensor> pacs_halves(const at::Tensor& x, bool rope, bool with_exp, const c10::optional<at::Tensor>& cos,
                                    const c10::optional<at::Tensor>& cross);
std::vector<at::Tensor> pacs_exp_features(const at::Tensor& p, const at::Tensor& temps,
                                          const c10::optional<at::Tensor>& cos, const c10::optional<at::Tensor>& cross,
                                          const c10::optional<at::Tensor>& key_means, double eps);
at::Tensor pacs_key_backward(const at::Tensor& k, const at::Tensor& phi, const at::Tensor& grad_phi, bool rope);
std::vector<at::Tensor> pacs_query_backward(const at::Tensor& q, const at::Tensor& p_q, const at::Tensor& phi,
                                            const at::Tensor& grad_phi, const at::Tensor& temps, bool rope,
                                            bool need_temp_grad);

// pacs_fused.cpp
std::tuple<std::vector<at::Tensor>, bool> pacs_fused_forward(const at::Tensor& q, const at::Tensor& k,
                                                             const at::Tensor& v, const at::Tensor& temps,
                                                             const c10::optional<at::Tensor>& cos,
                                                             const c10::optional<at::Tensor>& cross, double eps);
std::vector<at::Tensor> pacs_fused_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                            const at::Tensor& v, const at::Tensor& temps,
                                            const c10::optional<at::Tensor>& cos,
                                            const c10::optional<at::Tensor>& cross, const at::Tensor& kvs,
                                            const at::Tensor& k_means, const at::Tensor& denom, const at::Tensor& out,
                                            bool need_temp_grad);

// rope.cpp
at::Tensor rope_pairs(const at::Tensor& x, const at::Tensor& sin, const at::Tensor& cos, bool inverse);

// gelu.cpp
std::vector<at::Tensor> gelu_with_slope(at::Tensor x, bool in_place);

// depthwise.cpp
std::vector<at::Tensor> depthwise_weight_grad(const at::Tensor& input, const at::Tensor& grad_out, int64_t k);
void dwconv_add_gate(at::Tensor out, const at::Tensor& v, const at::Tensor& g, const at::Tensor& wt,
                     const at::Tensor& bias, int64_t prefix, int64_t h, int64_t w, int64_t k);

}  // namespace polaformer::native
