"""A small GPT-style language model family with causal polarity-aware attention (``pola_lm_*``).

Token embedding plus a learned position table, pre-norm blocks (causal attention, GELU MLP), a final norm and a
head tied to the embedding. ``attention`` picks the token mixer: ``pola`` / ``pacs``
(:mod:`polaformer.layers.causal_attention`), ``elu`` (ELU+1 causal linear attention) or ``softmax`` (SDPA,
causal), so the four compare at one parameter budget. :meth:`PolaLM.generate` runs each layer's ``step``: the
recurrent form for the linear attentions, a KV cache for softmax.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from timm.layers import Mlp
from timm.models import generate_default_cfgs
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..capture import capturing
from ..layers.registry import sequence_attentions
from ._helpers import check_architecture, refuse_unknown_kwargs, register_variants

__all__ = ["ATTENTIONS", "PolaLM"]

# the causal token mixers of polaformer.layers.registry.SEQUENCE_ATTENTIONS, by name
ATTENTIONS = sequence_attentions("causal")


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio, drop, attention, attention_kwargs):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = ATTENTIONS[attention](dim, num_heads, proj_drop=drop, **attention_kwargs)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))

    def step(self, x, cache):
        out, cache = self.attn.step(self.norm1(x), cache)
        x = x + out
        return x + self.mlp(self.norm2(x)), cache


class PolaLM(nn.Module):
    """Byte- (or token-) level causal language model.

    Args:
        vocab_size: tokens (256 for bytes).
        context: longest sequence (the position table's length).
        dim, depth, num_heads, mlp_ratio: sizes.
        attention: ``pola``, ``pacs``, ``elu`` or ``softmax``.
        drop_rate: dropout after attention and MLP outputs and on the embeddings.
        attention_kwargs: further arguments of the attention layer (``kernel_size``, ``chunk_size``, ...).
    """

    def __init__(self, vocab_size: int = 256, context: int = 256, dim: int = 128, depth: int = 4,
                 num_heads: int = 4, mlp_ratio: float = 4.0, attention: str = "pola", drop_rate: float = 0.0,
                 attention_kwargs: dict | None = None, **kwargs):
        super().__init__()
        refuse_unknown_kwargs(kwargs, "PolaLM")
        check_architecture(drop_rate, vocab_size=vocab_size, context=context, dim=dim, depth=depth,
                           num_heads=num_heads, rate_name="drop_rate", ratios={"mlp_ratio": mlp_ratio})
        if attention not in ATTENTIONS:
            raise ValueError(f"unknown attention {attention!r} (known: {', '.join(ATTENTIONS)})")
        self.vocab_size, self.context, self.attention = vocab_size, context, attention
        self.tok_embed = nn.Embedding(vocab_size, dim)
        self.pos_embed = nn.Parameter(torch.zeros(context, dim))
        self.drop = nn.Dropout(drop_rate)
        self.blocks = nn.ModuleList(
            Block(dim, num_heads, mlp_ratio, drop_rate, attention, dict(attention_kwargs or {})) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.apply(self._init_weights)
        nn.init.normal_(self.pos_embed, std=0.02)
        self.head.weight = self.tok_embed.weight  # tied
        self.grad_checkpointing = False

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True):
        self.grad_checkpointing = enable

    @staticmethod
    def _init_weights(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def _check_tokens(self, tokens):
        # an id past the vocabulary would fail deep in the embedding; checked where it costs no device sync
        if tokens.device.type == "cpu" and not capturing() and tokens.numel():
            low, high = int(tokens.min()), int(tokens.max())
            if low < 0 or high >= self.vocab_size:
                raise ValueError(f"token ids must be in [0, {self.vocab_size}), got {low if low < 0 else high}")

    def _embed(self, tokens, start):
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (batch, length), got {tuple(tokens.shape)}")
        if tokens.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise ValueError(f"tokens must be integer ids, got {tokens.dtype}")
        self._check_tokens(tokens)
        end = start + tokens.shape[1]
        if end > self.context:
            raise ValueError(f"sequence of {end} tokens is longer than the model's context {self.context}")
        return self.drop(self.tok_embed(tokens) + self.pos_embed[start:end])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, N) token ids -> (B, N, vocab) next-token logits."""
        x = self._embed(tokens, 0)
        for block in self.blocks:
            if self.grad_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.norm(x))

    def step(self, tokens: torch.Tensor, caches: list | None = None, start: int = 0):
        """Logits of ``tokens`` (B, T) continuing the sequence behind ``caches`` (None: a new one) whose
        length is ``start``; returns ``(logits, caches)``."""
        x = self._embed(tokens, start)
        caches = caches or [None] * len(self.blocks)
        new = []
        for block, cache in zip(self.blocks, caches):
            x, cache = block.step(x, cache)
            new.append(cache)
        return self.head(self.norm(x)), new

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, new_tokens: int, temperature: float = 1.0, top_k: int = 0,
                 generator: torch.Generator | None = None, on_token: Callable[[], None] | None = None) -> torch.Tensor:
        """Continue ``prompt`` (B, T) by ``new_tokens`` sampled tokens (greedy at ``temperature`` 0); one
        layer ``step`` per token (``on_token`` is called after each: a progress bar). The model sees a window of
        at most ``context`` tokens (its positions): a longer prompt is read from its last ``context`` tokens, and
        when the window is full it restarts from its newest half (one parallel pass), so any length can be
        generated. Returns (B, T + new_tokens)."""
        if prompt.dim() != 2 or prompt.shape[1] == 0:
            raise ValueError(f"the prompt must be (batch, tokens) with at least one token, got {tuple(prompt.shape)}")
        if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 0:
            raise ValueError(f"new_tokens must be an integer >= 0, got {new_tokens!r}")
        number = isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
        if not number or not 0 <= temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: all), got {top_k!r}")
        self._check_tokens(prompt)
        window = prompt[:, -self.context:]
        logits, caches = self.step(window)
        out = [prompt]
        position = window.shape[1]
        for i in range(new_tokens):
            last = logits[:, -1].float()
            if temperature <= 0:
                token = last.argmax(dim=-1, keepdim=True)
            else:
                last = last / temperature
                if top_k:
                    kth = last.topk(min(top_k, last.shape[-1]), dim=-1).values[:, -1:]
                    last = last.masked_fill(last < kth, float("-inf"))
                token = torch.multinomial(F.softmax(last, dim=-1), 1, generator=generator)
            out.append(token)
            if on_token is not None:
                on_token()
            if i + 1 == new_tokens:
                break
            if position == self.context:  # no position left: restart the window from its newest half
                window = torch.cat(out, dim=1)[:, -max(1, self.context // 2):]
                logits, caches = self.step(window)
                position = window.shape[1]
            else:
                logits, caches = self.step(token, caches, position)
                position += 1
        return torch.cat(out, dim=1)


def _cfg(**kwargs):
    return {"num_classes": 256, "input_size": (256,), "first_conv": "tok_embed", "classifier": "head",
            "license": "apache-2.0", **kwargs}


SIZES = {"tiny": dict(dim=64, depth=2, num_heads=2), "small": dict(dim=128, depth=4, num_heads=4),
         "base": dict(dim=256, depth=6, num_heads=4)}

default_cfgs = generate_default_cfgs({f"pola_lm_{size}": _cfg() for size in SIZES})


def _create(variant, pretrained=False, **kwargs) -> PolaLM:
    if pretrained:
        raise ValueError(f"{variant} has no pretrained weights; train one with 'polaformer lm train'")
    return PolaLM(**{**SIZES[variant.removeprefix("pola_lm_")], **kwargs})


register_variants(__name__, {f"pola_lm_{size}": sizes for size, sizes in SIZES.items()}, _create)
