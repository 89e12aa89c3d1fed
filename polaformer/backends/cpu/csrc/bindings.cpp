// The one Python module of the native kernels: every entry point of ops.h, with its docstring.
#include <torch/extension.h>

#include "ops.h"

using namespace polaformer::native;

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
