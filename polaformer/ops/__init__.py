"""Attention math as tensor functions. One folder per op holds all its forms (:mod:`.pola`, :mod:`.pacs`,
:mod:`.causal`: the entry and the order of its paths, the Triton kernels, the CPU autograd, the torch formulation,
packed sequences, the float64 reference); the modules beside them are what several ops share: feature maps,
input checks (``_common``), the references' weights, RoPE, position tables, token/map layout, packed-sequence
helpers, windowed softmax attention, and which kernels may run (:mod:`.dispatch`)."""
from ._common import full_precision
from .causal import (
    CausalState,
    causal_linear_attention,
    causal_pacs_linear_attention,
    causal_pacs_step,
    causal_pola_linear_attention,
    causal_pola_step,
    naive_causal_linear_attention,
)
from .feature_maps import (
    elu_feature,
    focused_feature,
    learnable_power,
    pacs_key_features,
    pacs_query_features,
    pacs_temperature,
    polarity_split,
    power_feature,
    relu_feature,
)
from .layout import tokens_to_map
from .pacs import (
    naive_pacs_layer_attention,
    naive_pacs_linear_attention,
    pacs_attention_weights,
    pacs_layer_attention,
    pacs_linear_attention,
)
from .pola import (
    linear_attention,
    naive_pola_layer_attention,
    naive_pola_linear_attention,
    naive_power_linear_attention,
    official_pola_linear_attention,
    pola_attention_weights,
    pola_layer_attention,
    pola_linear_attention,
    power_attention_weights,
    power_linear_attention,
)
from .positions import resample_grid_table
from .reference import linear_attention_weights, softmax_attention_weights
from .rope import apply_rope, apply_rope_export, rope_1d, rope_2d, rope_angles, rotate_pairs
from .window_softmax import window_softmax_attention

__all__ = [
    "CausalState",
    "apply_rope",
    "apply_rope_export",
    "causal_linear_attention",
    "causal_pacs_linear_attention",
    "causal_pacs_step",
    "causal_pola_linear_attention",
    "causal_pola_step",
    "elu_feature",
    "focused_feature",
    "full_precision",
    "learnable_power",
    "linear_attention",
    "linear_attention_weights",
    "naive_causal_linear_attention",
    "naive_pacs_layer_attention",
    "naive_pacs_linear_attention",
    "naive_pola_layer_attention",
    "naive_pola_linear_attention",
    "naive_power_linear_attention",
    "official_pola_linear_attention",
    "pacs_attention_weights",
    "pacs_key_features",
    "pacs_layer_attention",
    "pacs_linear_attention",
    "pacs_query_features",
    "pacs_temperature",
    "pola_attention_weights",
    "pola_layer_attention",
    "pola_linear_attention",
    "power_attention_weights",
    "power_linear_attention",
    "polarity_split",
    "power_feature",
    "relu_feature",
    "resample_grid_table",
    "rope_1d",
    "rope_2d",
    "rope_angles",
    "rotate_pairs",
    "softmax_attention_weights",
    "tokens_to_map",
    "window_softmax_attention",
]
