"""The Long Range Arena model of the Skyformer code base, with a pluggable attention.

Token and learned position embeddings (normal, std 0.02), ``num_layers`` pre-LN
blocks (attention, then a GELU FFN), a final LayerNorm, mean pooling over the
valid tokens and an MLP head; the retrieval task encodes both documents with
the same encoder and classifies ``[a, b, a·b, a−b]``. Defaults are the paper's
LRA setting: dim 64, FFN 128, 2 heads × 32, 2 layers, dropout 0.1.

Padding: every attention receives the key padding mask and pooling averages the
valid tokens only (the Skyformer code divides by the padded length instead), so
with a padding-invariant attention a right-padded batch gives every sequence
exactly the logits it gets alone.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .attention import build_attention

__all__ = ["LRAModelConfig", "LRAClassifier"]


@dataclass
class LRAModelConfig:
    vocab_size: int
    num_classes: int
    max_len: int
    dual: bool = False  # two sequences per example (retrieval)
    dim: int = 64
    hidden_dim: int = 128
    num_heads: int = 2
    head_dim: int = 32
    num_layers: int = 2
    dropout: float = 0.1
    attention_dropout: float = 0.1
    attention: str = "softmax"
    attention_options: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


class _Block(nn.Module):
    def __init__(self, cfg: LRAModelConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.attn = build_attention(
            cfg.attention, cfg.dim, cfg.num_heads, cfg.head_dim, max_seq_len=cfg.max_len,
            dropout=cfg.attention_dropout, **cfg.attention_options,
        )
        self.drop = nn.Dropout(cfg.dropout)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, cfg.hidden_dim), nn.GELU(), nn.Dropout(cfg.dropout),
            nn.Linear(cfg.hidden_dim, cfg.dim), nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x), padding_mask))
        return x + self.mlp(self.norm2(x))


class LRAClassifier(nn.Module):
    """``forward(tokens, padding_mask, tokens_b=None, padding_mask_b=None) -> logits``.

    ``tokens``: (B, L) ids with ``L <= max_len``; ``padding_mask``: (B, L)
    bool, True at padding (or None: no padding).
    """

    def __init__(self, cfg: LRAModelConfig):
        super().__init__()
        self.cfg = cfg
        self.token_embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embed = nn.Embedding(cfg.max_len, cfg.dim)
        nn.init.normal_(self.token_embed.weight, std=0.02)
        nn.init.normal_(self.pos_embed.weight, std=0.02)
        self.embed_drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.num_layers))
        self.grad_checkpointing = False
        self.norm = nn.LayerNorm(cfg.dim)
        features = 4 * cfg.dim if cfg.dual else cfg.dim
        self.head = nn.Sequential(nn.Linear(features, cfg.hidden_dim), nn.ReLU(),
                                  nn.Linear(cfg.hidden_dim, cfg.num_classes))

    def set_grad_checkpointing(self, enable: bool = True):
        self.grad_checkpointing = enable

    def encode(self, tokens: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, dim): the mean of the final token features over each sequence's valid tokens."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (batch, length), got {tuple(tokens.shape)}")
        b, n = tokens.shape
        if n > self.cfg.max_len:
            raise ValueError(f"sequence length {n} exceeds the model's max_len {self.cfg.max_len}")
        if padding_mask is not None and padding_mask.shape != tokens.shape:
            raise ValueError(f"padding_mask must match tokens {tuple(tokens.shape)}, got {tuple(padding_mask.shape)}")
        x = self.embed_drop(self.token_embed(tokens) + self.pos_embed.weight[:n])
        for block in self.blocks:
            if self.grad_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, padding_mask, use_reentrant=False)
            else:
                x = block(x, padding_mask)
        x = self.norm(x)
        if padding_mask is None:
            return x.mean(dim=1)
        pads = padding_mask.unsqueeze(-1)
        counts = (~pads).sum(dim=1).clamp_min(1).to(x.dtype)
        return x.masked_fill(pads, 0.0).sum(dim=1) / counts

    def forward(
        self,
        tokens: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        tokens_b: torch.Tensor | None = None,
        padding_mask_b: torch.Tensor | None = None,
    ) -> torch.Tensor:
        a = self.encode(tokens, padding_mask)
        if not self.cfg.dual:
            if tokens_b is not None:
                raise ValueError("this model classifies single sequences; tokens_b is only for dual tasks (retrieval)")
            return self.head(a)
        if tokens_b is None:
            raise ValueError("a dual-task model (retrieval) needs tokens_b")
        b = self.encode(tokens_b, padding_mask_b)
        return self.head(torch.cat([a, b, a * b, a - b], dim=-1))
