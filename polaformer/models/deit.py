"""Pola-DeiT: DeiT with PolaFormer attention (paper Table 1; no official code exists).

Layout decisions, where the paper is silent:

- The attention runs over all tokens, class token included (as DeiT's
  softmax attention did), so the class token still reads the whole image.
- The depthwise conv on v needs a 2-D grid, so it runs over the patch tokens
  only and adds to them; the class token gets no conv term.
- No learnable key positional encoding. DeiT already adds an absolute
  position embedding to every token, so the official PVT/Swin key table would
  duplicate it, and it would tie the model to one input size. This choice
  lands on the paper's count: DeiT-T-PolaFormer has 6.19M parameters (DeiT-T
  5.72M plus, per block, the gate projection, scale, power and a 5×5 depthwise
  conv), against 6.1M in Table 1. Keeping the key table as well would give
  6.64M (+9%).

State-dict names follow timm's VisionTransformer (``patch_embed``,
``cls_token``, ``pos_embed``, ``blocks.i.{norm1,attn,norm2,mlp}``, ``norm``,
``head``), with the attention's own names from the official code.
"""
from __future__ import annotations

from functools import partial

import torch
from timm.layers import DropPath, Mlp, PatchEmbed, trunc_normal_
from timm.models import generate_default_cfgs
from timm.models._features import feature_take_indices
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..layers import PolaLinearAttention
from ..ops import tokens_to_map
from ._helpers import (
    ClassifierMixin,
    build_image_model,
    check_architecture,
    check_global_pool,
    check_grid,
    check_image,
    empty_batch,
    factory_kwargs,
    image_cfg,
    pos_table_for_grid,
    register_variants,
    trunc_normal_init,
)

__all__ = ["PolaDeiT"]


class PolaDeiTBlock(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0, qkv_bias=True, drop=0.0, drop_path=0.0,
                 alpha=4.0, kernel_size=5, key_pos_tokens=None, norm_layer=nn.LayerNorm, attn_switches=None):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = PolaLinearAttention(
            dim, num_heads, qkv_bias=qkv_bias, proj_drop=drop, kernel_size=kernel_size, alpha=alpha,
            key_pos_tokens=key_pos_tokens, fused_qkvg=True, num_prefix_tokens=1, **(attn_switches or {}),
        )
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=drop)

    def forward(self, x, height: int, width: int):
        x = x + self.drop_path(self.attn(self.norm1(x), height, width))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class PolaDeiT(ClassifierMixin, nn.Module):
    """Vision Transformer (DeiT recipe) whose attention is PolaFormer's.

    Args:
        img_size, patch_size, in_chans, num_classes, embed_dim, depth,
        num_heads, mlp_ratio, qkv_bias: as in timm's VisionTransformer.
        global_pool: ``'token'`` (class token, DeiT's choice), ``'avg'`` (patch-token mean) or ``''``
            (no pooling: the head sees every token, as timm's ViT).
        drop_rate, drop_path_rate: head dropout and stochastic depth.
        alpha: range of the learnable power, ``p ∈ (1, 1 + alpha)``.
        kernel_size: depthwise conv on v.
        key_pos_encoding: also learn the official key positional table (adds
            ``(1 + grid²)·dim`` parameters per block and fixes the input size).
        polarity, polarity_coefficients, local: the attention's ablation switches (paper Table 3; see
            :class:`~polaformer.layers.PolaLinearAttention`); the defaults are the official model.
        device, dtype: where and in which dtype to build the parameters (timm's factory arguments).
    """

    global_pools = ("token", "avg", "")

    @factory_kwargs
    def __init__(self, img_size=224, patch_size=16, in_chans=3, num_classes=1000, global_pool="token",
                 embed_dim=192, depth=12, num_heads=3, mlp_ratio=4.0, qkv_bias=True, drop_rate=0.0,
                 drop_path_rate=0.0, alpha=4.0, kernel_size=5, key_pos_encoding=False,
                 norm_layer=partial(nn.LayerNorm, eps=1e-6), polarity=True, polarity_coefficients=True, local="dwc"):
        super().__init__()
        check_architecture(drop_path_rate, depth=depth, num_heads=num_heads, embed_dim=embed_dim, in_chans=in_chans,
                           patch_size=patch_size, num_classes=num_classes, ratios={"mlp_ratio": mlp_ratio})
        check_architecture(drop_rate, rate_name="drop_rate")
        check_grid(img_size, patch_size)
        check_global_pool(global_pool, self.global_pools)
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.global_pool = global_pool
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.num_prefix_tokens = 1
        self.grad_checkpointing = False
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim, strict_img_size=False)
        num_patches = self.patch_embed.num_patches
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + num_patches, embed_dim))
        dpr = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
        self.blocks = nn.ModuleList(
            PolaDeiTBlock(embed_dim, num_heads, mlp_ratio, qkv_bias, drop_rate, dpr[i], alpha, kernel_size,
                          1 + num_patches if key_pos_encoding else None, norm_layer,
                          dict(polarity=polarity, polarity_coefficients=polarity_coefficients, local=local))
            for i in range(depth)
        )
        self.norm = norm_layer(embed_dim)
        reduction = self.patch_embed.patch_size[0]
        self.feature_info = [dict(num_chs=embed_dim, reduction=reduction, module=f"blocks.{i}") for i in range(depth)]
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self._init_weights()

    def _init_weights(self):
        trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        for m in self.modules():
            trunc_normal_init(m)

    @torch.jit.ignore
    def no_weight_decay(self):
        """Position tables and the attention's temperature/exponent parameters."""
        skip = ("pos_embed", "cls_token", ".scale", ".power", ".positional_encoding")
        return {name for name, _ in self.named_parameters() if name.endswith(skip)}

    @torch.jit.ignore
    def group_matcher(self, coarse=False):
        return dict(stem=r"^cls_token|pos_embed|patch_embed", blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))])

    def _embed(self, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        ph, pw = self.patch_embed.patch_size
        x = check_image(x, self.in_chans, (ph, pw), f"the patch size {ph}x{pw}")
        height, width = x.shape[-2] // ph, x.shape[-1] // pw
        x = self.patch_embed(x)
        pos_embed = pos_table_for_grid(self.pos_embed, (height, width), self.patch_embed.grid_size,
                                       num_prefix_tokens=1)
        return torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + pos_embed, height, width

    def _block(self, blk, x, height, width):
        if self.grad_checkpointing and torch.is_grad_enabled():
            return checkpoint(blk, x, height, width, use_reentrant=False)
        return blk(x, height, width)

    @empty_batch
    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x, height, width = self._embed(x)
        for blk in self.blocks:
            x = self._block(blk, x, height, width)
        return self.norm(x)

    @empty_batch
    def forward_intermediates(self, x, indices=None, norm=False, stop_early=False, output_fmt="NCHW",
                              intermediates_only=False):
        """Block outputs (patch tokens only) as NCHW maps at the patch stride, or NLC with the class token."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        take, max_index = feature_take_indices(len(self.blocks), indices)
        x, height, width = self._embed(x)
        intermediates = []
        blocks = self.blocks[: max_index + 1] if stop_early else self.blocks
        for i, blk in enumerate(blocks):
            x = self._block(blk, x, height, width)
            if i in take:
                y = self.norm(x) if norm else x
                if output_fmt == "NCHW":
                    y = tokens_to_map(y[:, 1:], height, width)
                intermediates.append(y)
        if intermediates_only:
            return intermediates
        return self.norm(x), intermediates

    def prune_intermediate_layers(self, indices=1, prune_norm=False, prune_head=True):
        take, max_index = feature_take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[: max_index + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0)
        return take

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.global_pool == "token":
            x = x[:, 0]
        elif self.global_pool == "avg":
            x = x[:, self.num_prefix_tokens:].mean(dim=1)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


_SIZES = {
    "pola_deit_tiny_patch16_224": dict(embed_dim=192, depth=12, num_heads=3),  # paper Table 1: 6.1M, 74.6% top-1
    "pola_deit_small_patch16_224": dict(embed_dim=384, depth=12, num_heads=6),
    "pola_deit_base_patch16_224": dict(embed_dim=768, depth=12, num_heads=12),
    # A small Pola-DeiT for 8×8 single-channel digits: 2×2 patches (16 tokens + class token).
    "pola_deit_digits": dict(img_size=8, patch_size=2, in_chans=1, num_classes=10, embed_dim=64, depth=4,
                             num_heads=2, mlp_ratio=2.0, kernel_size=3),
}

_cfg = partial(image_cfg, pool_size=None, first_conv="patch_embed.proj", license="apache-2.0")
default_cfgs = generate_default_cfgs({
    **{name: _cfg() for name in _SIZES},
    # 8×8 grey digits (scikit-learn), the embedded default data of `polaformer train`.
    "pola_deit_digits": _cfg(num_classes=10, input_size=(1, 8, 8), crop_pct=1.0, mean=(0.0,), std=(1.0,)),
})


def _create(variant, pretrained=False, **kwargs) -> PolaDeiT:
    """Build a variant; the caller's keyword arguments override the variant's sizes.

    ``features_only`` returns the last three blocks by default, as timm's ViT.
    """
    return build_image_model(PolaDeiT, variant, pretrained, default_out_indices=3, **{**_SIZES[variant], **kwargs})


register_variants(__name__, _SIZES, _create)
