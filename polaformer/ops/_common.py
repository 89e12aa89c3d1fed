"""What the attention ops share: their input checks, key padding as a factor and a count, the compute dtype,
autocast turned off, whether autograd records a call, the swap of a feature vector's halves, the reduction of a
broadcast gradient, and the layer ops' checks and output epilogue ``(out + local) · gate``."""
from __future__ import annotations

import contextlib
import math

import torch

__all__ = [
    "BLOCK_ELEMENTS",
    "MIN_BLOCK_TOKENS",
    "block_tokens",
    "check_eps",
    "check_float",
    "check_broadcast",
    "check_key_padding_mask",
    "check_layer_tensors",
    "check_packed_batch",
    "check_qkv",
    "check_temperatures",
    "compute_dtype",
    "full_precision",
    "half_precision",
    "key_keep",
    "local_and_gate",
    "needs_grad",
    "sum_to",
    "swap_halves",
]


def check_float(**tensors) -> None:
    """Integer inputs would be computed in float and truncated back to integers: refuse them."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")


def check_qkv(q, k, v, *, split_values: bool = True, even_head_dim: bool = False, causal: bool = False) -> None:
    """Floating-point (B, H, ·, d) queries and keys and (B, H, ·, dv) values that fit together; ``split_values``:
    the values split into the two polarity streams (at least 2 channels, an even number with
    ``even_head_dim``); ``causal``: keys and values are the queries' own tokens (as many, and possibly none)."""
    check_float(q=q, k=k, v=v)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k and v must be 4-D (batch, heads, tokens, head_dim); "
                         f"got q{tuple(q.shape)}, k{tuple(k.shape)}, v{tuple(v.shape)}")
    if causal and not q.shape[:3] == k.shape[:3] == v.shape[:3]:
        raise ValueError(f"causal attention needs q, k and v with the same batch, heads and tokens; "
                         f"got q{tuple(q.shape)}, k{tuple(k.shape)}, v{tuple(v.shape)}")
    if q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"batch and head sizes differ: q{tuple(q.shape)}, k{tuple(k.shape)}, v{tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k head_dim differ: {q.shape[-1]} vs {k.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v token counts differ: {k.shape[-2]} vs {v.shape[-2]}")
    if not causal and k.shape[-2] == 0:
        raise ValueError("k and v need at least one token")
    if split_values and v.shape[-1] < 2:
        raise ValueError(f"value head_dim must be at least 2 to split into two polarity streams, got {v.shape[-1]}")
    if even_head_dim and v.shape[-1] % 2:
        raise ValueError(f"value head_dim must be even to split into same-sign and opposite-sign halves, "
                         f"got {v.shape[-1]}")


def check_eps(eps) -> None:
    """A NaN normaliser offset makes every output NaN, a negative one can divide by zero."""
    if isinstance(eps, (int, float)) and not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")


def check_key_padding_mask(key_padding_mask: torch.Tensor, k: torch.Tensor) -> None:
    if key_padding_mask.dtype != torch.bool:
        raise ValueError(f"key_padding_mask must be a bool tensor (True = padding), got {key_padding_mask.dtype}")
    if key_padding_mask.shape != (k.shape[0], k.shape[-2]):
        raise ValueError(f"key_padding_mask must be (batch, keys) = ({k.shape[0]}, {k.shape[-2]}), "
                         f"got {tuple(key_padding_mask.shape)}")


def check_packed_batch(q: torch.Tensor, key_padding_mask: torch.Tensor | None) -> None:
    """A packed batch is one row of sequences laid end to end, whose offsets say where each ends."""
    if key_padding_mask is not None:
        raise ValueError("pass key_padding_mask or cu_seqlens, not both: packed sequences have no padding")
    if q.shape[0] != 1:
        raise ValueError(f"packed q, k and v must have batch size 1 (1, heads, tokens, dim), got q{tuple(q.shape)}")


def check_temperatures(temp_same: torch.Tensor, temp_opposite: torch.Tensor, head_dim: int) -> None:
    """PaCS's temperatures weigh the 2d channels ``[x⁺ ; x⁻]`` of the query features."""
    for name, t in (("temp_same", temp_same), ("temp_opposite", temp_opposite)):
        if t.shape[-1] != 2 * head_dim:
            raise ValueError(f"{name} must have 2*head_dim = {2 * head_dim} channels, got {tuple(t.shape)}")


def check_broadcast(name: str, t: torch.Tensor, target: tuple[int, ...]) -> None:
    """``t`` a floating-point tensor that broadcasts to ``target`` (one-line error otherwise)."""
    check_float(**{name: t})
    if t.dim() > len(target) or any(n not in (1, m) for n, m in zip(reversed(t.shape), reversed(target))):
        raise ValueError(f"{name} must broadcast to {tuple(target)}, got {tuple(t.shape)}")


def check_layer_tensors(q, v, local, gate, packed: bool) -> None:
    """A layer op's epilogue tensors: ``local`` (B, H, N', dv) for the last N' ≤ N queries, ``gate`` (B, H, N, dv)."""
    out_shape = (*q.shape[:3], v.shape[-1])
    if gate is not None:
        check_float(gate=gate)
        if tuple(gate.shape) != out_shape:
            raise ValueError(f"gate must be (B, H, N, dv) = {out_shape}, got {tuple(gate.shape)}")
    if local is not None:
        check_float(local=local)
        rows = "N' = N (packed)" if packed else "N' <= N"
        if local.dim() != 4 or local.shape[:2] != q.shape[:2] or local.shape[-1] != v.shape[-1] \
                or local.shape[2] > q.shape[2] or (packed and local.shape[2] != q.shape[2]):
            raise ValueError(f"local must be (B, H, N', dv) with {rows} for outputs {out_shape}, "
                             f"got {tuple(local.shape)}")


def local_and_gate(out: torch.Tensor, local: torch.Tensor | None, gate: torch.Tensor | None) -> torch.Tensor:
    """``(out + local) · gate`` of (B, H, N, dv) outputs, ``local`` (B, H, N', dv) added to the last N' queries;
    either may be None. Computed token-major, as the layers lay their tokens out."""
    if local is None and gate is None:
        return out
    out = out.transpose(1, 2)
    if local is not None:
        prefix = out.shape[1] - local.shape[2]
        local = local.transpose(1, 2)
        out = torch.cat([out[:, :prefix], out[:, prefix:] + local], dim=1) if prefix else out + local
    if gate is not None:
        out = out * gate.transpose(1, 2)
    return out.transpose(1, 2)


def key_keep(key_padding_mask: torch.Tensor | None, k: torch.Tensor, dtype: torch.dtype):
    """``(keep, count)``: a (B, 1, M, 1) 0/1 factor for the key rows and the (B, 1, 1, 1) number of valid keys (at
    least 1, so an all-padding sequence gives zeros); ``(None, M)`` without a mask."""
    if key_padding_mask is None:
        return None, k.shape[-2]
    check_key_padding_mask(key_padding_mask, k)
    keep = (~key_padding_mask).to(device=k.device, dtype=dtype)[:, None, :, None]
    return keep, keep.sum(dim=-2, keepdim=True).clamp_min_(1.0)


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """At least float32: half-precision inputs are computed in float32 (``|x|ᵖ``, ``exp`` and their products
    overflow float16 long before the output does); float64 stays float64."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd records a call on these inputs."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def half_precision(*tensors: torch.Tensor) -> bool:
    """Whether every input is fp16/bf16: their products then lose nothing to TF32."""
    return all(t.dtype in (torch.float16, torch.bfloat16) for t in tensors)


def full_precision(device_type: str):
    """Autocast off for the block (meta tensors, used for FLOP counting, have no autocast)."""
    # dynamo before torch 2.14 cannot trace the availability query; a compiled call is on a real device
    if torch.compiler.is_compiling() or torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def swap_halves(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The two halves of ``dim`` swapped: ``[x⁺ ; x⁻]`` → ``[x⁻ ; x⁺]`` (the opposite-sign stream's order)."""
    first, second = x.chunk(2, dim=dim)
    return torch.cat([second, first], dim=dim)


def sum_to(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Reduce a broadcast gradient back to ``shape``, one dimension at a time, innermost first: a single
    multi-dimension ``sum`` over outer and middle dimensions of a large tensor runs much slower on the CPU."""
    lead = x.dim() - len(shape)
    for i in reversed(range(x.dim())):
        if i < lead or (shape[i - lead] == 1 and x.shape[i] != 1):
            x = x.sum(dim=i, keepdim=True)
    return x.reshape(shape)


# The forwards without gradients go through the tokens a block at a time, about this many elements of q (or k)
# per block, so that each block's features, products and division stay in the core's cache. Inputs of up to four
# blocks run as one: there the extra calls cost more than the cache saves.
BLOCK_ELEMENTS = 1 << 17
MIN_BLOCK_TOKENS = 64


def block_tokens(x: torch.Tensor, width: int) -> int:
    """Tokens per block for ``x`` (B, H, N, d) whose per-token work is ``width`` channels wide."""
    b, h, n, _ = x.shape
    per_token = max(1, b * h * width)
    if n * per_token <= 4 * BLOCK_ELEMENTS:
        return max(n, 1)
    return max(MIN_BLOCK_TOKENS, BLOCK_ELEMENTS // per_token)
