"""How the engine runs a task's model, one order for every task, and the sharded checkpoints of FSDP runs.

:func:`prepare_model` applies a run's settings in this order:

1. ``grad_checkpointing``: the model's ``set_grad_checkpointing(True)`` (timm's API), or that of each outermost
   submodule that has one (a detector's or segmenter's backbone);
2. ``parallel='fsdp'`` with more than one process: PyTorch's FSDP2 ``fully_shard`` on every block (:func:`blocks`),
   then on the root; rank 0's initial weights first, as DDP does. With ``amp`` the autocast becomes FSDP2's
   ``MixedPrecisionPolicy`` (parameters gathered in bfloat16/float16, gradients reduced in float32);
3. ``compile``: ``torch.compile`` of the model: ``True`` (inductor), one of inductor's modes (``'default'``,
   ``'reduce-overhead'``: the forward and backward graphs each replayed as one CUDA graph, ``'max-autotune'``,
   ``'max-autotune-no-cudagraphs'``), or a backend name such as ``'eager'``;
4. ``parallel='ddp'`` with more than one process: DistributedDataParallel.

With one process (no torchrun) ``fsdp`` trains the plain model but still writes sharded checkpoints, so a run moves
between 1 and N processes either way.

A run with ``parallel='fsdp'`` saves its model, EMA and optimizer with ``torch.distributed.checkpoint``: each
process writes its shards into a folder beside the checkpoint file (``state-<update>-<token>.dcp``, first written
under a hidden name and then renamed), and the file (``last.pth``, ``best.pth``) keeps the rest of the training
state and the folder's name under ``'sharded'``. Any run resumes from it, on any number of processes, sharded or
not; :func:`consolidate` turns it into one ordinary checkpoint file (``polaformer checkpoint consolidate``).
"""
from __future__ import annotations

import re
import shutil
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint import CorruptCheckpointError, read_checkpoint, with_checksum
from ..files import atomic_write
from .config import ConfigError
from .distributed import DistContext

__all__ = ["COMPILE_MODES", "PARALLEL", "SHARDED", "blocks", "check_execution", "compile_options", "consolidate",
           "enable_grad_checkpointing", "gathered", "load_sharded", "load_whole_into_sharded", "prepare_model",
           "remove_unused_folders", "save_sharded", "shard", "sync_from_rank0"]

PARALLEL = ("ddp", "fsdp")
SHARDED = "sharded"  # the checkpoint entry naming its shard folder
# timm's block containers, and the official PVT's ``block1`` ... ``block4``
_BLOCK_LISTS = re.compile(r"(blocks|layers|block\d+)")
_FOLDER = re.compile(r"state-\d+-[0-9a-f]{12}\.dcp")
_PARTIAL = re.compile(r"\.state-\d+-[0-9a-f]{12}\.dcp\.partial")


# inductor's modes (torch._inductor.list_mode_options(), without importing inductor to check a setting)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs", "lite")


def compile_options(value) -> dict | None:
    """``torch.compile``'s keyword arguments for a ``compile`` setting: None (False/None: off), inductor (True), a
    mode of inductor's (:data:`COMPILE_MODES`), or another backend by name."""
    if value is None or value is False:
        return None
    if value is True:
        return {"backend": "inductor"}
    return {"backend": "inductor", "mode": value} if value in COMPILE_MODES else {"backend": value}


def check_execution(parallel, compile, grad_checkpointing, keys: tuple[str, str, str]) -> None:
    """One-line errors for values no run can use; ``keys`` names the three settings as the task's config does."""
    parallel_key, compile_key, checkpointing_key = keys
    if parallel not in PARALLEL:
        raise ConfigError(f"{parallel_key} must be one of {', '.join(PARALLEL)}, got {parallel!r}")
    if not isinstance(grad_checkpointing, bool):
        raise ConfigError(f"{checkpointing_key} must be true or false, got {grad_checkpointing!r}")
    if compile is None or isinstance(compile, bool) or compile in COMPILE_MODES:
        return
    if not isinstance(compile, str):
        raise ConfigError(f"{compile_key} must be true, false, a torch.compile mode or backend name, got {compile!r}")
    import torch._dynamo  # only when a backend is named: a second to import

    known = sorted(set(torch._dynamo.list_backends(exclude_tags=())) | {"inductor"})
    if compile not in known:
        raise ConfigError(f"{compile_key}: unknown torch.compile mode or backend {compile!r} (modes: "
                          f"{', '.join(COMPILE_MODES)}; backends: {', '.join(known)})")


def enable_grad_checkpointing(model: nn.Module) -> None:
    """Turn on the model's gradient checkpointing, or that of its outermost submodules that have it."""
    if hasattr(model, "set_grad_checkpointing"):
        model.set_grad_checkpointing(True)
        return
    found: list[str] = []
    for name, module in model.named_modules():
        if hasattr(module, "set_grad_checkpointing") and not any(name.startswith(f"{f}.") for f in found):
            module.set_grad_checkpointing(True)
            found.append(name)
    if not found:
        raise ConfigError(f"grad_checkpointing: the model ({type(model).__name__}) has no set_grad_checkpointing()")


def blocks(model: nn.Module) -> list[nn.Module]:
    """The units FSDP shards one by one: the children of every ``nn.ModuleList``/``nn.Sequential`` attribute named
    ``blocks``, ``layers`` or ``block<N>``, innermost first-level only (a Swin stage in ``layers`` holds ``blocks``:
    its blocks are the units, the stage is not)."""
    found = [child for name, module in model.named_modules()
             if isinstance(module, (nn.ModuleList, nn.Sequential)) and _BLOCK_LISTS.fullmatch(name.rpartition(".")[2])
             for child in module]
    ids = {id(m) for m in found}
    return [m for m in found if not any(id(inner) in ids for inner in m.modules() if inner is not m)]


def sync_from_rank0(model: nn.Module) -> None:
    """Rank 0's weights and buffers to every process (each built its model from its own seed)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        dist.broadcast(tensor.data, src=0)


def shard(model: nn.Module, param_dtype: torch.dtype | None) -> None:
    """FSDP2 in place: ``fully_shard`` each block, then the root (each process keeps its part of the weights)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for block in blocks(model):
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def prepare_model(model: nn.Module, *, ctx: DistContext, device: torch.device, parallel: str, compile,
                  grad_checkpointing: bool, amp_dtype: torch.dtype | None, find_unused_parameters: bool = False,
                  ema: nn.Module | None = None) -> nn.Module:
    """``model`` as the loop runs it (see the module docstring); ``ema`` (a copy of the model) is sharded like it.
    Under FSDP every process must hold rank 0's weights already (:func:`sync_from_rank0`, before the EMA copy);
    the optimizer is then built on ``model``'s parameters (its shards)."""
    if grad_checkpointing:
        enable_grad_checkpointing(model)
    if parallel == "fsdp" and ctx.is_distributed:
        shard(model, amp_dtype)
        if ema is not None:
            shard(ema, amp_dtype)
    options = compile_options(compile)
    runner = torch.compile(model, **options) if options else model
    if parallel == "ddp" and ctx.is_distributed:  # rank 0's weights go to every process here
        runner = nn.parallel.DistributedDataParallel(
            runner, device_ids=[ctx.local_rank] if device.type == "cuda" else None,
            find_unused_parameters=find_unused_parameters)
    return runner


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextmanager
def gathered(model: nn.Module):
    """Under FSDP: every process holds the whole model inside (one all-gather), so that evaluation may run a
    different number of batches on each process; nothing otherwise."""
    if not is_sharded(model):
        yield model
        return
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield model
    finally:
        for unit in units:
            unit.set_reshard_after_forward(True, recurse=False)
            unit.reshard()


# --- sharded checkpoints ------------------------------------------------------------------------

def _states(model: nn.Module, optimizer, ema: nn.Module | None) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    states = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    if ema is not None:
        states["model_ema"] = get_model_state_dict(ema)
    return states


def save_sharded(output: Path, name: str, model: nn.Module, optimizer, ema: nn.Module | None, ctx: DistContext) -> None:
    """Every process writes its shards of model, optimizer (and EMA) into ``output/name`` (all processes call).
    Written under a hidden name first: a folder with the final name is complete."""
    import torch.distributed.checkpoint as dcp

    partial = output / f".{name}.partial"
    if ctx.is_main and partial.exists():
        shutil.rmtree(partial)
    if ctx.is_distributed:
        dist.barrier()
    with warnings.catch_warnings():  # one process saves alone by design
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(_states(model, optimizer, ema), checkpoint_id=str(partial), no_dist=not ctx.is_distributed)
    if ctx.is_distributed:
        dist.barrier()
    if ctx.is_main:
        partial.rename(output / name)


def load_sharded(folder: Path, model: nn.Module, optimizer, ema: nn.Module | None, has_ema: bool) -> None:
    """Restore model, optimizer (and the EMA where the folder has one) from a shard folder written by any number of
    processes, into a model sharded or not."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    if not folder.is_dir():
        raise FileNotFoundError(f"its shard folder {folder} is missing")
    ema = ema if has_ema else None
    states = _states(model, optimizer, ema)
    try:
        with warnings.catch_warnings():  # one process loads alone by design
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(states, checkpoint_id=str(folder), no_dist=not (dist.is_available() and dist.is_initialized()))
    except Exception as e:  # CheckpointException gathers every process's failure: its first line says enough
        first_line = str(e).strip().splitlines()[0]
        raise ValueError(f"the shard folder {folder.name} does not fit this run: {first_line}") from e
    set_model_state_dict(model, states["model"])
    set_optimizer_state_dict(model, optimizer, states["optimizer"])
    if ema is not None:
        set_model_state_dict(ema, states["model_ema"])


def load_whole_into_sharded(checkpoint: dict, model: nn.Module, optimizer, ema: nn.Module | None) -> None:
    """A single-file training state (weights already loaded before sharding) into a sharded run: its optimizer
    state (numbered parameters) and EMA."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    whole = StateDictOptions(full_state_dict=True)
    names = {param: name for name, param in model.named_parameters()}
    saved = checkpoint["optimizer"]
    order = [names[param] for group in optimizer.param_groups for param in group["params"]]
    by_name = {"state": {order[int(i)]: value for i, value in saved["state"].items()},
               "param_groups": [{**group, "params": [order[int(i)] for i in group["params"]]}
                                for group in saved["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=whole)
    if ema is not None and checkpoint.get("model_ema") is not None:
        set_model_state_dict(ema, checkpoint["model_ema"], options=whole)


def remove_unused_folders(output: Path, keep: set[str]) -> None:
    """Remove the shard folders in ``output`` no checkpoint file names (``keep``), and unfinished ones."""
    for path in output.iterdir():
        if (_FOLDER.fullmatch(path.name) and path.name not in keep) or _PARTIAL.fullmatch(path.name):
            shutil.rmtree(path, ignore_errors=True)


def new_folder_name(num_updates: int, token: str) -> str:
    return f"state-{num_updates}-{token}.dcp"


def optimizer_by_index(state: dict) -> dict:
    """An optimizer state keyed by parameter names (the state-dict API's) as ``Optimizer.state_dict()`` keys it:
    the parameters numbered in the order of their groups."""
    index: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        ids = [index.setdefault(name, len(index)) for name in group["params"]]
        groups.append({**group, "params": ids})
    return {"state": {index[name]: value for name, value in state["state"].items()}, "param_groups": groups}


def consolidate(source, target) -> Path:
    """One checkpoint file at ``target`` from the sharded checkpoint ``source`` (a ``last.pth``/``best.pth`` of a
    ``parallel: fsdp`` run): its training state with the whole model, EMA and optimizer in place of the shard
    folder. Every command and loader takes the result; a run resumes from it as from its source."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    source, target = Path(source), Path(target)
    checkpoint = read_checkpoint(source)
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get(SHARDED), str):
        raise CorruptCheckpointError(source, "not a sharded checkpoint (no 'sharded' entry naming its shard folder)")
    folder = source.parent / checkpoint.pop(SHARDED)
    checkpoint.pop("ema_saved", None)
    if not folder.is_dir():
        raise CorruptCheckpointError(source, f"its shard folder {folder} is missing")
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        whole = Path(scratch) / "whole.pt"
        dcp_to_torch_save(str(folder), str(whole))
        states = torch.load(whole, map_location="cpu", weights_only=True)
    checkpoint.update(model=states["model"], optimizer=optimizer_by_index(states["optimizer"]))
    if "model_ema" in states:
        checkpoint["model_ema"] = states["model_ema"]
    checkpoint.pop("tensor_sha256", None)
    return atomic_write(target, lambda f: torch.save(with_checksum(checkpoint), f))
