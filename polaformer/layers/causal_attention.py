"""Causal polarity-aware self-attention for autoregressive models, with incremental decoding.

:class:`PolaCausalSelfAttention` (learnable power map) and :class:`PacsCausalSelfAttention` (PaCS map, RoPE
over token positions) take (B, N, C) tokens; token ``t`` sees tokens ``0..t`` only, through both branches:
the causal attention op (:mod:`polaformer.ops.causal`, chunked-parallel) and a depthwise conv on v padded on
the left only. ``forward`` runs a whole sequence; ``step`` continues one from a :class:`CausalCache` (the
attention's recurrent state, the conv's last inputs and the position), so generation costs O(d²) per token
and layer whatever the context length. Output: ``proj((attention + conv(v)) * gate)``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import (
    CausalState,
    causal_linear_attention,
    causal_pacs_linear_attention,
    causal_pacs_step,
    causal_pola_linear_attention,
    causal_pola_step,
    elu_feature,
    learnable_power,
    pacs_temperature,
    rope_1d,
)
from .pola_attention import check_heads
from .sequence_attention import GATE_INITS

__all__ = ["CausalCache", "EluCausalSelfAttention", "PacsCausalSelfAttention", "PolaCausalSelfAttention",
           "SoftmaxCausalSelfAttention"]


class CausalCache(NamedTuple):
    """A sequence's past as :meth:`PolaCausalSelfAttention.step` needs it: the attention's state, the conv's
    last ``kernel_size − 1`` value tokens (B, kernel_size − 1, C), and the next token's position."""

    attention: CausalState
    conv_tail: torch.Tensor | None
    position: int


class _CausalSelfAttention(nn.Module):
    def __init__(self, dim, num_heads, *, qkv_bias, proj_drop, kernel_size, gate_init, eps, chunk_size,
                 conv_channels):
        super().__init__()
        check_heads(dim, num_heads)
        self.head_dim = dim // num_heads
        if self.head_dim % 2:
            raise ValueError(f"head_dim = dim / num_heads = {self.head_dim} must be even (two polarity streams)")
        if gate_init not in GATE_INITS:
            raise ValueError(f"unknown gate_init {gate_init!r} (known: {', '.join(GATE_INITS)})")
        if kernel_size < 0:
            raise ValueError(f"kernel_size must be >= 0 (0: no conv branch), got {kernel_size}")
        self.dim, self.num_heads, self.eps, self.chunk_size = dim, num_heads, eps, chunk_size
        self.qg = nn.Linear(dim, 2 * dim, bias=qkv_bias)
        self.kv = nn.Linear(dim, 2 * dim, bias=qkv_bias)
        # no padding here: the inputs get kernel_size - 1 earlier tokens (zeros or the cache) on the left
        self.dwc = nn.Conv1d(conv_channels, conv_channels, kernel_size, groups=conv_channels) if kernel_size else None
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        with torch.no_grad():
            GATE_INITS[gate_init](self.qg.weight[dim:])

    def _heads(self, t):
        b, n, _ = t.shape
        return t.reshape(b, n, self.num_heads, self.head_dim).transpose(1, 2)

    def _conv(self, v, tail):
        """Causal depthwise conv of (B, T, C) values after ``tail`` (earlier values, None: zeros); returns the
        output and the new tail."""
        if self.dwc is None:
            return 0.0, None
        b, t, c = v.shape
        width = self.dwc.kernel_size[0] - 1
        if tail is None:
            tail = v.new_zeros(b, width, c)
        seq = torch.cat([tail.to(v.dtype), v], dim=1)
        channels = self.dwc.in_channels
        per_group = seq.reshape(b, t + width, c // channels, channels).permute(0, 2, 3, 1)
        out = self.dwc(per_group.reshape(-1, channels, t + width))
        out = out.reshape(b, c // channels, channels, t).permute(0, 3, 1, 2).reshape(b, t, c)
        return out, seq[:, seq.shape[1] - width:]

    def _attention(self, q, k, v, key_padding_mask, cache, return_state):
        raise NotImplementedError

    def _run(self, x, key_padding_mask, cache):
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ValueError(f"x must be (batch, tokens, {self.dim}), got {tuple(x.shape)}")
        if key_padding_mask is not None and (key_padding_mask.dtype != torch.bool
                                             or key_padding_mask.shape != x.shape[:2]):
            raise ValueError(f"key_padding_mask must be a bool (batch, tokens) = {tuple(x.shape[:2])} tensor")
        if x.shape[1] == 0:  # no token: nothing to attend, the cache unchanged (the ops' chunking divides by N)
            return x.new_zeros(x.shape), cache and cache.attention, cache and cache.conv_tail
        q, g = self.qg(x).chunk(2, dim=-1)
        k, v = self.kv(x).chunk(2, dim=-1)
        if key_padding_mask is not None:
            v = v.masked_fill(key_padding_mask[..., None], 0.0)
        out, state = self._attention(self._heads(q), self._heads(k), self._heads(v), key_padding_mask, cache,
                                     cache is not None)
        local, tail = self._conv(v, None if cache is None else cache.conv_tail)
        out = out.transpose(1, 2).reshape(x.shape) + local
        return self.proj_drop(self.proj(out * g)), state, tail

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, N, C) -> (B, N, C), token ``t`` from tokens ``0..t``; ``key_padding_mask`` (B, N), True at
        padding (those tokens are seen by no other)."""
        return self._run(x, key_padding_mask, None)[0]

    def empty_cache(self, batch: int, device=None, dtype=torch.float32) -> CausalCache:
        """The cache before the first token."""
        f = self._features
        d, h = self.head_dim, self.num_heads
        kv = (torch.zeros(batch, h, f, d // 2 + d % 2, device=device, dtype=dtype),
              torch.zeros(batch, h, f, d // 2, device=device, dtype=dtype))
        state = CausalState(kv, torch.zeros(batch, h, f, device=device, dtype=dtype),
                            torch.zeros(batch, 1, 1, device=device, dtype=dtype))
        tail = None if self.dwc is None else torch.zeros(batch, self.dwc.kernel_size[0] - 1, self.dim,
                                                         device=device, dtype=dtype)
        return CausalCache(state, tail, 0)

    def step(self, x: torch.Tensor, cache: CausalCache | None = None) -> tuple[torch.Tensor, CausalCache]:
        """Continue the sequence behind ``cache`` (None: a new one) with tokens ``x`` (B, T, C): one token runs
        the recurrent form, several (a prompt) the chunked one. Returns the output and the updated cache;
        ``forward`` of the whole sequence gives the same outputs."""
        if cache is None:
            cache = self.empty_cache(x.shape[0], x.device)
        self._check_cache(cache, x)
        out, state, tail = self._run(x, None, cache)
        return out, CausalCache(state, tail, cache.position + x.shape[1])

    def _check_cache(self, cache, x: torch.Tensor) -> None:
        """A cache of these sequences (its attention state is checked by the op): one error naming what is not."""
        if not isinstance(cache, CausalCache):
            raise TypeError(f"cache must be the CausalCache a previous step returned (or None), got "
                            f"{type(cache).__name__}")
        if isinstance(cache.position, bool) or not isinstance(cache.position, int) or cache.position < 0:
            raise ValueError(f"cache.position must be an integer >= 0, got {cache.position!r}")
        if self.dwc is not None:
            shape = (x.shape[0], self.dwc.kernel_size[0] - 1, self.dim)
            tail = cache.conv_tail
            if not isinstance(tail, torch.Tensor) or tuple(tail.shape) != shape:
                got = tuple(tail.shape) if isinstance(tail, torch.Tensor) else type(tail).__name__
                raise ValueError(f"cache.conv_tail is {got}, these tokens (batch {x.shape[0]}) continue from "
                                 f"{shape}: pass the cache of these sequences, or None to start new ones")

    @property
    def _features(self) -> int:
        return 2 * self.head_dim


class PolaCausalSelfAttention(_CausalSelfAttention):
    """Causal PolaFormer attention: softplus ``scale`` dividing q and k, per-head power
    ``p = 1 + alpha·sigmoid(w)``, gate, causal depthwise conv on v shared by the heads (``head_dim`` channels).

    Args:
        dim, num_heads: channels and heads (``dim / num_heads`` even).
        qkv_bias, proj_drop: as :class:`~polaformer.layers.PolaSequenceAttention`.
        kernel_size: width of the causal conv on v (any width; 0 for none).
        alpha: the power map's range ``p ∈ (1, 1 + alpha)``.
        gate_init: one of :data:`~polaformer.layers.GATE_INITS`.
        eps: the normaliser's eps; chunk_size: tokens per chunk of the training form.
    """

    def __init__(self, dim: int, num_heads: int = 8, *, qkv_bias: bool = True, proj_drop: float = 0.0,
                 kernel_size: int = 4, alpha: float = 4.0, gate_init: str = "kaiming_uniform", eps: float = 1e-6,
                 chunk_size: int = 64):
        check_heads(dim, num_heads)  # before dim // num_heads below
        super().__init__(dim, num_heads, qkv_bias=qkv_bias, proj_drop=proj_drop, kernel_size=kernel_size,
                         gate_init=gate_init, eps=eps, chunk_size=chunk_size, conv_channels=dim // num_heads)
        self.alpha = alpha
        self.power = nn.Parameter(torch.zeros(1, num_heads, 1, self.head_dim))
        self.scale = nn.Parameter(torch.zeros(1, num_heads, 1, self.head_dim))

    def _attention(self, q, k, v, key_padding_mask, cache, return_state):
        scale = F.softplus(self.scale).to(q.dtype)  # half-precision q and k stay half (the kernels' inputs)
        q, k, power = q / scale, k / scale, learnable_power(self.power, self.alpha)
        if cache is not None and q.shape[-2] == 1:
            return causal_pola_step(q, k, v, power, cache.attention, self.eps)
        out = causal_pola_linear_attention(q, k, v, power, self.eps, self.chunk_size, key_padding_mask,
                                           initial_state=None if cache is None else cache.attention,
                                           return_state=return_state)
        return out if return_state else (out, None)


class PacsCausalSelfAttention(_CausalSelfAttention):
    """Causal PolaFormer++ attention: PaCS features with a learnable channel-wise temperature per stream, RoPE
    over token positions on the numerator (``rope=True``), gate, causal depthwise conv on v over all channels.
    Arguments as :class:`PolaCausalSelfAttention` without ``alpha``, plus ``rope`` and ``rope_base``."""

    def __init__(self, dim: int, num_heads: int = 8, *, qkv_bias: bool = True, proj_drop: float = 0.0,
                 kernel_size: int = 4, gate_init: str = "kaiming_uniform", eps: float = 1e-6, chunk_size: int = 64,
                 rope: bool = True, rope_base: float = 10000.0):
        super().__init__(dim, num_heads, qkv_bias=qkv_bias, proj_drop=proj_drop, kernel_size=kernel_size,
                         gate_init=gate_init, eps=eps, chunk_size=chunk_size, conv_channels=dim)
        self.s1 = nn.Parameter(torch.zeros(1, num_heads, 1, 2 * self.head_dim))
        self.s2 = nn.Parameter(torch.zeros(1, num_heads, 1, 2 * self.head_dim))
        # one frequency per channel pair of the 2·head_dim features
        angles = 1.0 / rope_base ** (torch.arange(self.head_dim, dtype=torch.float32) / self.head_dim)
        self.register_buffer("rope_angles", angles.repeat_interleave(2) if rope else None, persistent=False)

    def _attention(self, q, k, v, key_padding_mask, cache, return_state):
        temps = pacs_temperature(self.s1), pacs_temperature(self.s2)
        start = 0 if cache is None else cache.position
        tables = (None, None)
        if self.rope_angles is not None:
            tables = rope_1d(self.rope_angles.to(torch.float64), q.shape[-2], start)
        if cache is not None and q.shape[-2] == 1:
            return causal_pacs_step(q, k, v, *temps, *tables, cache.attention, self.eps)
        out = causal_pacs_linear_attention(q, k, v, *temps, *tables, self.eps, self.chunk_size, key_padding_mask,
                                           initial_state=None if cache is None else cache.attention,
                                           return_state=return_state)
        return out if return_state else (out, None)


class _PlainCausalSelfAttention(nn.Module):
    """The baselines' shared projections: q, k, v in one linear, an output linear, and a ``step`` API."""

    def __init__(self, dim: int, num_heads: int = 8, *, qkv_bias: bool = True, proj_drop: float = 0.0):
        super().__init__()
        check_heads(dim, num_heads)
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def _qkv(self, x):
        b, n, _ = x.shape
        return self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)

    def _out(self, out):
        b, h, n, d = out.shape
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(b, n, h * d)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.step(x)[0]


class EluCausalSelfAttention(_PlainCausalSelfAttention):
    """Causal linear attention with the ``ELU(x) + 1`` map (Katharopoulos et al., 2020), the plain baseline of
    the causal Pola/PaCS layers; its cache is the recurrent state."""

    def __init__(self, dim: int, num_heads: int = 8, *, eps: float = 1e-6, chunk_size: int = 64, **kwargs):
        super().__init__(dim, num_heads, **kwargs)
        self.eps, self.chunk_size = eps, chunk_size

    def step(self, x, cache=None):
        if x.shape[1] == 0:  # no token: the cache unchanged (the op's chunking divides by N)
            return x.new_zeros(x.shape), cache
        q, k, v = self._qkv(x)
        out, state = causal_linear_attention(elu_feature(q), elu_feature(k), v, self.eps, self.chunk_size,
                                             initial_state=cache, recurrent=x.shape[1] == 1 and cache is not None)
        return self._out(out), state


class SoftmaxCausalSelfAttention(_PlainCausalSelfAttention):
    """Causal softmax attention through ``scaled_dot_product_attention``; its cache holds every key and value
    (the KV cache), so a generated token costs O(context)."""

    def step(self, x, cache=None):
        q, k, v = self._qkv(x)
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        if cache is None or q.shape[2] == k.shape[2]:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif q.shape[2] == 1:
            out = F.scaled_dot_product_attention(q, k, v)
        else:  # several new tokens after a cache: each sees the cache and the new ones up to itself
            n, m = q.shape[2], k.shape[2]
            seen = torch.ones(n, m, dtype=torch.bool, device=x.device).tril(m - n)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=seen)
        return self._out(out), (k, v)
