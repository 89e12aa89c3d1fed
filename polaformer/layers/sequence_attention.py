"""Polarity-aware attention for token sequences that are not an image grid.

:class:`PolaSequenceAttention` (learnable power map, PolaFormer) and
:class:`PacsSequenceAttention` (PaCS map, PolaFormer++) take (B, N, C) tokens,
do self- or cross-attention and honour a key padding mask. The rank-restoring
depthwise conv runs along the token axis (a 1-D conv on v) in self-attention;
padded positions are zeroed before it, so padding never leaks into real tokens
and a right- or left-padded sequence gets exactly its unpadded output.
:class:`PolaMultiheadAttention` wraps either behind ``nn.MultiheadAttention``'s
call signature.

Masks follow ``nn.MultiheadAttention``: ``key_padding_mask`` is (B, M), True
(or ``-inf`` in a float mask) at padded keys.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import learnable_power, pacs_layer_attention, pola_layer_attention, power_linear_attention
from .deformable import DeformableDepthwiseConv1d
from .pola_attention import check_ablation_switches, check_alpha, check_heads

__all__ = ["PolaSequenceAttention", "PacsSequenceAttention", "PolaMultiheadAttention", "GATE_INITS"]

# Appendix A.4 of the paper: initialisations of the gate (polarity coefficient) projection.
GATE_INITS = {
    "kaiming_uniform": lambda w: nn.init.kaiming_uniform_(w, a=math.sqrt(5)),  # nn.Linear's default
    "zeros": nn.init.zeros_,
    "normal": nn.init.normal_,  # N(0, 1)
    "uniform": nn.init.uniform_,  # U(0, 1)
    "ones": nn.init.ones_,
}


def _as_bool_mask(mask: torch.Tensor | None, batch: int, length: int, name: str = "key_padding_mask"):
    """A (B, M) bool mask, True at padding; float masks must hold only 0 and -inf (as in MultiheadAttention),
    checked on the CPU only: elsewhere reading the check's result would wait for the device on every call."""
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        if not mask.is_floating_point():
            raise ValueError(f"{name} must be bool (True = padding) or float (-inf = padding), got {mask.dtype}")
        if mask.device.type == "cpu" and not ((mask == 0) | (mask == float("-inf"))).all():
            raise ValueError(
                f"a float {name} can only hold 0 and -inf here: linear attention cannot add an arbitrary bias "
                "to its scores"
            )
        mask = mask == float("-inf")
    if mask.shape != (batch, length):
        raise ValueError(f"{name} must be (batch, keys) = ({batch}, {length}), got {tuple(mask.shape)}")
    return mask


class _SequenceAttention(nn.Module):
    """Projections, gate, 1-D depthwise conv and output shared by the Pola and PaCS sequence layers.

    ``qg``: query + gate from the query input; ``kv``: key + value (one input,
    or the two weight halves applied to separate key and value inputs); with
    ``kdim != vdim``, separate ``k_proj`` / ``v_proj``. Output:
    ``proj((attention + dwc(v)) * g)``; ``g`` holds the polarity coefficients Gˢ/Gᵒ (its same-sign and
    opposite-sign channel halves of each head, as in :class:`~polaformer.layers.PolaLinearAttention`).
    Ablations: ``polarity_coefficients=False`` drops ``g`` (the projection becomes ``q``); ``local``
    ``"dcn"`` swaps ``dwc`` for a deformable ``dcn``, ``"none"`` (or ``kernel_size`` 0) removes it.
    """

    def __init__(self, dim, num_heads, *, kdim, vdim, qkv_bias, proj_drop, gate_init, dwc_channels, kernel_size,
                 polarity_coefficients=True, local="dwc"):
        super().__init__()
        check_ablation_switches(True, polarity_coefficients, local)
        check_heads(dim, num_heads)
        head_dim = dim // num_heads
        if head_dim % 2:
            raise ValueError(
                f"head_dim = dim / num_heads = {head_dim} must be even (values split into two polarity streams)"
            )
        if gate_init not in GATE_INITS:
            raise ValueError(f"unknown gate_init {gate_init!r} (known: {', '.join(GATE_INITS)})")
        if kernel_size and kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd so the conv keeps token positions, got {kernel_size}")
        self.dim, self.num_heads, self.head_dim = dim, num_heads, head_dim
        self.kdim, self.vdim = kdim or dim, vdim or dim
        self.polarity_coefficients = polarity_coefficients
        self.local = local if kernel_size else "none"
        if polarity_coefficients:
            self.qg = nn.Linear(dim, 2 * dim, bias=qkv_bias)
        else:
            self.q = nn.Linear(dim, dim, bias=qkv_bias)
        if self.kdim == self.vdim:
            self.kv = nn.Linear(self.kdim, 2 * dim, bias=qkv_bias)
        else:
            self.k_proj = nn.Linear(self.kdim, dim, bias=qkv_bias)
            self.v_proj = nn.Linear(self.vdim, dim, bias=qkv_bias)
        self.dwc = (
            nn.Conv1d(dwc_channels, dwc_channels, kernel_size, padding=kernel_size // 2, groups=dwc_channels)
            if self.local == "dwc" else None
        )
        if self.local == "dcn":
            self.dcn = DeformableDepthwiseConv1d(dwc_channels, kernel_size)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.gate_init = gate_init
        if polarity_coefficients:
            with torch.no_grad():
                GATE_INITS[gate_init](self.qg.weight[dim:])

    def _keys_values(self, key: torch.Tensor, value: torch.Tensor):
        if not hasattr(self, "kv"):
            return self.k_proj(key), self.v_proj(value)
        if key is value:
            return self.kv(key).chunk(2, dim=-1)
        w_k, w_v = self.kv.weight.chunk(2)
        b_k, b_v = self.kv.bias.chunk(2) if self.kv.bias is not None else (None, None)
        return F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, n, _ = t.shape
        return t.reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2)

    def _attend(self, q, k, v, key_padding_mask, causal=False):  # (B, H, N, d) each -> (B, H, N, d)
        raise NotImplementedError

    def _local(self, v: torch.Tensor) -> torch.Tensor:
        """Depthwise conv of (B, N, C) values along tokens."""
        raise NotImplementedError

    def _local_conv(self) -> nn.Module:
        return self.dcn if self.local == "dcn" else self.dwc

    def forward(self, query: torch.Tensor, key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
        """Self-attention when ``key`` is None, else cross-attention to ``key`` / ``value``.

        ``query``: (B, N, dim); ``key``: (B, M, kdim), ``value``: (B, M, vdim),
        ``value`` defaulting to ``key``. ``key_padding_mask``: (B, M) (N in
        self-attention), True at padding. The depthwise conv branch needs tokens
        aligned with the queries and runs in self-attention only. ``causal``
        (self-attention only): token t sees tokens 0..t, the conv padded on the left.
        """
        if query.dim() != 3 or query.shape[-1] != self.dim:
            raise ValueError(f"query must be (batch, tokens, {self.dim}), got {tuple(query.shape)}")
        self_attention = key is None
        key = query if self_attention else key
        value = key if value is None else value
        if key.dim() != 3 or key.shape[-1] != self.kdim or key.shape[0] != query.shape[0]:
            raise ValueError(f"key must be (batch={query.shape[0]}, keys, {self.kdim}), got {tuple(key.shape)}")
        if value.shape[:2] != key.shape[:2] or value.shape[-1] != self.vdim:
            raise ValueError(
                f"value must be (batch, keys, {self.vdim}) = ({key.shape[0]}, {key.shape[1]}, {self.vdim}), "
                f"got {tuple(value.shape)}"
            )
        if key.shape[1] == 0:
            raise ValueError("key and value need at least one token")
        mask = _as_bool_mask(key_padding_mask, key.shape[0], key.shape[1])
        if causal and not self_attention:
            raise ValueError("causal attention is self-attention: pass no key/value")

        q, g = self.qg(query).chunk(2, dim=-1) if self.polarity_coefficients else (self.q(query), None)
        k, v = self._keys_values(key, value)
        if mask is not None:
            v = v.masked_fill(mask[..., None], 0.0)  # padding stays out of the conv branch
        out = self._attend(self._heads(q), self._heads(k), self._heads(v), mask, causal)
        out = out.transpose(1, 2).reshape(query.shape)
        if self_attention and self.local != "none":
            if causal and self.local != "dwc":
                raise ValueError(
                    f"causal attention needs local='dwc' or 'none': a {self.local} branch sees later tokens")
            # causal: the same kernel shifted to end at each token (its left half-width of extra zeros)
            shift = self.dwc.kernel_size[0] // 2 if causal else 0
            out = out + self._local(F.pad(v, (0, 0, shift, 0)))[:, :v.shape[1]]
        return self.proj_drop(self.proj(out if g is None else out * g))


class PolaSequenceAttention(_SequenceAttention):
    """PolaFormer's polarity-aware linear attention for (B, N, C) sequences.

    As the vision layer (:class:`~polaformer.layers.PolaLinearAttention`):
    learnable softplus ``scale`` dividing q and k, per-head power
    ``p = 1 + alpha·sigmoid(power)``, output gate, depthwise conv on v shared
    by all heads (``head_dim`` channels), here a 1-D conv along tokens.

    Args:
        dim: query (and output) channels; ``dim / num_heads`` must be even.
        num_heads: attention heads.
        kdim, vdim: key / value input channels for cross-attention (default ``dim``).
        qkv_bias: bias in the q/g/k/v projections.
        proj_drop: dropout after the output projection.
        kernel_size: odd width of the 1-D depthwise conv on v, 0 for none.
        polarity: the two polarity streams (official); False: one stream of
            ``relu(x)ᵖ`` features over the whole value (paper Table 3).
        polarity_coefficients: the gate holding Gˢ/Gᵒ; False removes it.
        local: ``"dwc"``, ``"dcn"`` (deformable) or ``"none"``, the branch on v.
        alpha: the power map's range, ``p ∈ (1, 1 + alpha)`` (the paper's LRA
            rows use 3, 5 and 7).
        gate_init: initialisation of the gate projection's weight, one of
            :data:`GATE_INITS` (paper appendix A.4; default: nn.Linear's).
        eps: added to each stream's normaliser.
    """

    def __init__(self, dim: int, num_heads: int = 8, *, kdim: int | None = None, vdim: int | None = None,
                 qkv_bias: bool = True, proj_drop: float = 0.0, kernel_size: int = 5, alpha: float = 4.0,
                 gate_init: str = "kaiming_uniform", eps: float = 1e-6, polarity: bool = True,
                 polarity_coefficients: bool = True, local: str = "dwc"):
        check_ablation_switches(polarity, polarity_coefficients, local)
        check_heads(dim, num_heads)  # before dim // num_heads below
        super().__init__(dim, num_heads, kdim=kdim, vdim=vdim, qkv_bias=qkv_bias, proj_drop=proj_drop,
                         gate_init=gate_init, dwc_channels=dim // num_heads, kernel_size=kernel_size,
                         polarity_coefficients=polarity_coefficients, local=local)
        check_alpha(alpha)
        self.alpha, self.eps, self.polarity = alpha, eps, polarity
        self.power = nn.Parameter(torch.zeros(1, num_heads, 1, self.head_dim))
        self.scale = nn.Parameter(torch.zeros(1, 1, dim))

    def _attend(self, q, k, v, key_padding_mask, causal=False):
        b, h, _, d = q.shape
        if self.polarity:
            return pola_layer_attention(q, k, v, self.scale.reshape(1, h, 1, d), self.power, self.alpha, None,
                                        self.eps, key_padding_mask, causal=causal)
        if causal:
            raise ValueError("causal attention needs polarity=True (the one-stream ablation has no causal form)")
        scale = F.softplus(self.scale).reshape(1, h, 1, d)
        return power_linear_attention(q / scale, k / scale, v, learnable_power(self.power, self.alpha), self.eps,
                                      key_padding_mask)

    def _local(self, v):
        b, n, c = v.shape
        per_head = v.reshape(b, n, self.num_heads, self.head_dim).permute(0, 2, 3, 1)
        local = self._local_conv()(per_head.reshape(b * self.num_heads, self.head_dim, n))
        return local.reshape(b, self.num_heads, self.head_dim, n).permute(0, 3, 1, 2).reshape(b, n, c)


class PacsSequenceAttention(_SequenceAttention):
    """PolaFormer++'s PaCS attention for (B, N, C) sequences.

    Queries ``exp(s·x) − 1`` with a channel-wise temperature per stream
    (``s = sigmoid(s1)`` same-sign, ``sigmoid(s2)`` opposite-sign), keys
    ``exp(x) − 1``; a depthwise conv on v over all channels (LePE), as in the
    vision layer, here 1-D. No RoPE: sequence models bring their own positions.
    Arguments as :class:`PolaSequenceAttention` (without ``alpha`` and ``polarity``).
    """

    def __init__(self, dim: int, num_heads: int = 8, *, kdim: int | None = None, vdim: int | None = None,
                 qkv_bias: bool = True, proj_drop: float = 0.0, kernel_size: int = 5,
                 gate_init: str = "kaiming_uniform", eps: float = 1e-6, polarity_coefficients: bool = True,
                 local: str = "dwc"):
        super().__init__(dim, num_heads, kdim=kdim, vdim=vdim, qkv_bias=qkv_bias, proj_drop=proj_drop,
                         gate_init=gate_init, dwc_channels=dim, kernel_size=kernel_size,
                         polarity_coefficients=polarity_coefficients, local=local)
        self.eps = eps
        self.s1 = nn.Parameter(torch.zeros(1, num_heads, 1, 2 * self.head_dim))
        self.s2 = nn.Parameter(torch.zeros(1, num_heads, 1, 2 * self.head_dim))

    def _attend(self, q, k, v, key_padding_mask, causal=False):
        return pacs_layer_attention(q, k, v, self.s1, self.s2, eps=self.eps, key_padding_mask=key_padding_mask,
                                    causal=causal)

    def _local(self, v):
        return self._local_conv()(v.transpose(1, 2)).transpose(1, 2)


def _same_data(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``b`` is ``a`` or a view of exactly the same elements (``x[0]`` taken twice)."""
    return a is b or (
        a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
        and a.device == b.device
    )


class PolaMultiheadAttention(nn.Module):
    """A drop-in for ``nn.MultiheadAttention`` with polarity-aware linear attention.

    Same constructor and call as ``nn.MultiheadAttention`` (``batch_first``,
    ``kdim``/``vdim``, ``key_padding_mask``); returns ``(output, None)``: the
    (N, M) weight matrix is exactly what linear attention never forms. It also
    works inside ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer``.

    ``is_causal=True`` (self-attention) runs the causal op
    (:mod:`polaformer.ops.causal`) and a left-padded conv; ``attn_mask`` is then
    taken as the causal mask it must be (as ``nn.TransformerDecoderLayer`` passes it).
    Differences, each refused with a clear error rather than silently ignored:
    any other ``attn_mask`` (use ``key_padding_mask`` for padding), causal
    cross-attention, ``add_bias_kv``, ``add_zero_attn``.
    ``dropout`` drops output activations (there are no weights to drop).
    Self-attention (query, key and value are the same data, as in
    ``mha(x, x, x)``) adds the 1-D depthwise conv branch; any other call is
    cross-attention without it.

    Extra keyword arguments: ``feature_map`` (``"pola"`` or ``"pacs"``),
    ``alpha``, ``kernel_size``, ``gate_init`` and the ablation switches
    (``polarity``, ``polarity_coefficients``, ``local``), passed to the sequence layer.
    """

    # Read by nn.TransformerEncoder(Layer) to decide on its fused fast path; these values
    # send it down the path that calls our forward.
    in_proj_weight = None
    in_proj_bias = None
    _qkv_same_embed_dim = False

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device=None,
        dtype=None,
        *,
        feature_map: str = "pola",
        **layer_kwargs,
    ):
        super().__init__()
        check_heads(embed_dim, num_heads)
        if add_bias_kv or add_zero_attn:
            raise ValueError("add_bias_kv and add_zero_attn are not supported by PolaMultiheadAttention")
        layers = {"pola": PolaSequenceAttention, "pacs": PacsSequenceAttention}
        if feature_map not in layers:
            raise ValueError(f"unknown feature_map {feature_map!r} (known: {', '.join(layers)})")
        self.embed_dim, self.num_heads, self.batch_first = embed_dim, num_heads, batch_first
        self.kdim, self.vdim = kdim or embed_dim, vdim or embed_dim
        self.attn = layers[feature_map](
            embed_dim, num_heads, kdim=kdim, vdim=vdim, qkv_bias=bias, proj_drop=dropout, **layer_kwargs
        )
        self.to(device=device, dtype=dtype)

    @property
    def out_proj(self) -> nn.Linear:
        return self.attn.proj

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, None]:
        if attn_mask is not None and not is_causal:
            raise ValueError(
                "attn_mask is not supported: linear attention takes key_padding_mask for padding, or is_causal=True"
            )
        self_attention = _same_data(query, key) and _same_data(query, value)
        if is_causal and not self_attention:
            raise ValueError("is_causal=True needs self-attention (query, key and value the same tensor)")
        unbatched = query.dim() == 2  # (L, E), as nn.MultiheadAttention accepts
        if unbatched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        if self_attention:
            out = self.attn(query, key_padding_mask=key_padding_mask, causal=is_causal)
        else:
            out = self.attn(query, key, value, key_padding_mask=key_padding_mask)
        if unbatched:
            return out.squeeze(0), None
        return (out if self.batch_first else out.transpose(0, 1)), None
