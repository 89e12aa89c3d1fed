"""Sizes checked before anything is allocated: a request that cannot fit fails in one line.

Without these checks ``eval --img-size 100000`` grows until the kernel kills it, and a
checkpoint whose ``model_kwargs`` say ``depth=1e9`` hangs, then aborts in C++. The estimates are
lower bounds (the input batch alone; the weights of the transformer blocks alone; the batch and the
input and output of its largest layer), so a request
is refused only when it certainly cannot fit in the memory available now.

Every family's timm entry point checks its sizes here (:func:`polaformer.models._helpers.register_variants`),
as do the engine's model factory, the tasks and ``analyze``.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping

import torch
from torch import nn

# Keyword arguments that size a model: each must be a positive number (or a list of them).
SIZE_KWARGS = (
    "img_size", "patch_size", "in_chans", "embed_dim", "embed_dims", "dim", "hidden_size", "depth", "depths",
    "num_heads", "mlp_ratio", "mlp_ratios", "window_size", "sr_ratios", "head_dim",
)
# the names of a transformer's width, in timm's families (embed_dim/embed_dims) and ours (PolaLM, PolaDiT)
_WIDTH_KWARGS = ("embed_dims", "embed_dim", "dim", "hidden_size")


def available_memory(device: torch.device | str = "cpu") -> int:
    """Bytes that can be allocated now on ``device`` (free GPU memory, or the host's MemAvailable)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _gib(count: float) -> str:
    return f"{count / 2**30:.3g} GiB"


def _values(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def check_model_kwargs(arch: str, kwargs: Mapping, error: type[Exception] = ValueError) -> None:
    """Refuse non-positive sizes (:data:`SIZE_KWARGS`), and models whose blocks alone exceed the memory available
    (:func:`check_model_memory`)."""
    for key in SIZE_KWARGS:
        if key not in kwargs or kwargs[key] is None:
            continue
        for value in _values(kwargs[key]):
            if not _positive(value):
                raise error(f"model {arch!r}: {key} must be positive, got {kwargs[key]!r}")
    check_model_memory(arch, kwargs, error)


def _positive(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0


def check_model_memory(arch: str, kwargs: Mapping, error: type[Exception] = ValueError) -> None:
    """Refuse a model whose blocks alone exceed the memory available, before anything is allocated.

    The estimate counts 12·dim² weights per transformer block (attention 4·dim², MLP 8·dim² at
    the usual ratio 4) for the depths and widths given (32 where no width is given, no more than any
    of the zoo's), plus a position table of (img_size / patch_size)² tokens. Sizes that are not positive numbers
    are left to the model's constructor, which names them.
    """
    given = [kwargs[key] for key in SIZE_KWARGS if kwargs.get(key) is not None]
    if not all(_values(value) and all(_positive(v) for v in _values(value)) for value in given):
        return
    depths = [int(d) for d in _values(kwargs.get("depths", kwargs.get("depth", 1)))]
    width = next((kwargs[key] for key in _WIDTH_KWARGS if kwargs.get(key) is not None), 32)
    widths = [int(w) for w in _values(width)]
    widths = (widths * len(depths))[: len(depths)] if len(widths) < len(depths) else widths[: len(depths)]
    weights = sum(12 * depth * width**2 for depth, width in zip(depths, widths))
    if "img_size" in kwargs:
        size = max(int(v) for v in _values(kwargs["img_size"]))
        patch = min(int(v) for v in _values(kwargs.get("patch_size", 16)))
        weights += (size // patch) ** 2 * widths[0]
    needed, free = 4 * weights, available_memory("cpu")
    if needed > free:
        raise error(
            f"model {arch!r} with {dict(kwargs)} needs at least {_gib(needed)} for its weights "
            f"({weights:.3g} parameters), more than the {_gib(free)} of memory available"
        )


def check_allocation(what: str, needed: int, device: torch.device | str = "cpu", error: type[Exception] = ValueError,
                     hint: str = "use a smaller size or batch") -> None:
    """Refuse, before allocating, ``needed`` bytes (a lower bound of what ``what`` takes) beyond the memory
    available on ``device``."""
    free = available_memory(device)
    if needed > free:
        raise error(f"{what} needs {_gib(needed)}, more than the {_gib(free)} of memory available on "
                    f"{torch.device(device)}; {hint}")


def check_batch_memory(batch_size: int, channels: int, height: int, width: int, device: torch.device | str,
                       error: type[Exception] = ValueError, what: str = "the input batch") -> None:
    """Refuse a float32 ``batch_size x channels x height x width`` batch larger than the memory available."""
    check_allocation(f"{what} ({batch_size} x {channels} x {height} x {width})",
                     4 * batch_size * channels * height * width, device, error)


def largest_layer_bytes(model: nn.Module, input_size: tuple[int, ...]) -> int:
    """Bytes of the largest input plus output of any one leaf module, for one float32 image.

    Runs ``model`` once on a blank image of ``input_size``. Without gradients a layer's input and
    output are both alive while it runs, so a batch needs at least this much per image on top of
    the batch itself; the attention's own intermediates and the allocator's slack come on top.
    """
    largest = 0

    def measure(module, inputs, output):
        nonlocal largest
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        # by address: an identity or in-place layer's output is its input, held once
        held = {t.data_ptr(): t.numel() * t.element_size() for t in (*inputs, *outputs) if torch.is_tensor(t)}
        largest = max(largest, sum(held.values()))

    leaves = [m for m in model.modules() if not any(True for _ in m.children())]
    handles = [m.register_forward_hook(measure) for m in leaves]
    try:
        with torch.no_grad():
            model.eval()(torch.zeros(1, *input_size))
    finally:
        for handle in handles:
            handle.remove()
    return largest


def check_forward_memory(model: nn.Module, batch_size: int, input_size: tuple[int, int, int],
                         device: torch.device | str, error: type[Exception] = ValueError, *,
                         half: bool = False) -> None:
    """Refuse a forward pass of ``batch_size`` images whose batch plus largest layer (see
    :func:`largest_layer_bytes`; halved for 16-bit ``half`` precision) exceed the memory available."""
    per_image = 4 * math.prod(input_size) + largest_layer_bytes(model, input_size) // (2 if half else 1)
    needed, free = batch_size * per_image, available_memory(device)
    if needed > free:
        raise error(
            f"a forward pass of {batch_size} x {' x '.join(map(str, input_size))} images needs at least "
            f"{_gib(needed)} (the batch and its largest layer's input and output), more than the {_gib(free)} "
            f"of memory available on {torch.device(device)}; use a smaller batch"
        )
