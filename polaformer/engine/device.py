"""Where a run computes and in which precision: device names and autocast, for every task and command."""
from __future__ import annotations

from contextlib import nullcontext

import torch

from .config import ConfigError

AMP_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str | torch.device, error: type[Exception] = ConfigError) -> torch.device:
    """``'auto'`` (CUDA when available) or a torch device name that can run models here."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as e:
        raise error(f"unknown device {str(device)!r}: {e}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise error(f"device {str(device)!r} requested but CUDA is not available")
    if resolved.type == "mps" and not torch.backends.mps.is_available():
        raise error(f"device {str(device)!r} requested but MPS is not available")
    if resolved.type not in ("cpu", "cuda", "mps"):
        raise error(f"device {str(device)!r} cannot run models: use 'cpu' or 'cuda'")
    count = torch.cuda.device_count() if resolved.type == "cuda" else 1  # one CPU, one MPS device
    if resolved.index is not None and resolved.index >= count:
        known = ", ".join(f"'{resolved.type}:{i}'" for i in range(count))
        raise error(f"device {str(device)!r}: there is no {resolved.type} device {resolved.index} (use {known} or "
                    f"'{resolved.type}')")
    return resolved


def amp_dtype(device: torch.device, enabled: bool, cuda_dtype: str = "float16") -> torch.dtype | None:
    """The autocast dtype of mixed precision: bfloat16 on the CPU (no float16 kernels), ``cuda_dtype`` on CUDA."""
    if not enabled:
        return None
    if device.type != "cuda":
        return torch.bfloat16
    return AMP_DTYPES[cuda_dtype]


def autocast(device: torch.device | str, dtype: torch.dtype | None):
    """Autocast to ``dtype`` on ``device``'s kind, or nothing when ``dtype`` is None."""
    if dtype is None:
        return nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def place_model(model: torch.nn.Module, device: torch.device, *, inference: bool = False,
                fused: bool = True) -> torch.nn.Module:
    """``model`` moved to ``device``; on the CPU also with :func:`polaformer.accelerate`'s fused modules unless
    ``fused`` is false (the same function and state_dict keys; with ``inference`` the model is put in eval mode and
    its BatchNorms are folded into their convs, so it is for evaluation only). Returns the model."""
    from ..acceleration import accelerate

    model = model.to(device)
    if device.type == "cpu" and fused:
        accelerate(model.eval() if inference else model, inference=inference)
    return model
