"""A run put together before its first update: output folder, the checkpoint it continues, model, optimizer, EMA,
loader and schedule, in one order for every task.

:func:`build_run` sets the :class:`~.loop.Engine`'s parts: ``folder`` (locked first, so that a busy or unwritable
folder fails before anything is built), ``resume_path``, ``model`` (placed on the device and wrapped as
:func:`~.parallel.prepare_model` says: gradient checkpointing, FSDP2, ``torch.compile``, DDP), ``model_ema``,
``optimizer``, ``sampler`` and ``train_loader``, ``scheduler`` and ``scaler``, and the run's position (``epoch``,
``batches``, ``num_updates``, ``history``, ``best``...), restored from the checkpoint when resuming (:mod:`.resume`).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, IterableDataset

from .checkpoint import read_training_state
from .config import ConfigError
from .device import amp_dtype, place_model
from .distributed import TrainSampler
from .folder import RunFolder
from .parallel import SHARDED, compile_options, prepare_model, sync_from_rank0
from .resume import check_same_settings, check_updates_left, find_resume, restore
from .state import Window, seed_everything

__all__ = ["build_run"]


def build_run(engine) -> None:
    """Put ``engine``'s run together (see the module docstring)."""
    s, ctx, task = engine.settings, engine.ctx, engine.task
    if engine.device.type == "cuda" and ctx.is_distributed:
        engine.device = torch.device("cuda", ctx.local_rank)
    seed_everything(s.seed + ctx.rank)
    engine.output = Path(s.output)
    engine.folder = RunFolder(engine.output, s.last_name, task.best_files, lock=ctx.is_main)
    engine.resume_path = find_resume(s, engine.last_path, ctx.is_main)
    resume = read_training_state(engine.resume_path, task.name, task.resume_hint) if engine.resume_path else None
    model = task.build(engine, resuming=resume is not None)
    engine.folder.check_start(continuing=engine.resume_path is not None or s.resume == "auto" or s.overwrite,
                              writable=ctx.is_main)
    if resume is not None:
        task.check_resume(resume, engine.resume_path)
        check_same_settings(task, resume, s.allow_changed, engine.resume_path)
        if SHARDED not in resume:  # a sharded state is loaded once the model is sharded
            task.load_weights(model, resume, engine.resume_path)
    # the compiler traces the plain modules, not the CPU backend's fused ones
    place_model(model, engine.device, fused=compile_options(s.compile) is None)
    engine.amp_dtype = amp_dtype(engine.device, s.amp, s.amp_cuda_dtype)
    engine.sharded = s.parallel == "fsdp" and ctx.is_distributed  # the model's parameters are shards
    # under FSDP mixed precision is its policy, not autocast
    engine.autocast_dtype = None if engine.sharded else engine.amp_dtype
    _build_model(engine, model)
    engine.optimizer = task.build_optimizer(model)
    if s.ema_decay is not None and not engine.sharded:  # after DDP: a copy of the weights all processes share
        from timm.utils import ModelEmaV3

        engine.model_ema = ModelEmaV3(model, decay=s.ema_decay)

    engine.accumulation_steps = max(1, s.accumulation_steps)
    _build_loader(engine)
    engine.updates_per_epoch = engine.batches_per_epoch // engine.accumulation_steps
    if engine.updates_per_epoch == 0:
        raise ConfigError(
            f"the training set ({len(task.train_set)} examples) is smaller than one optimizer update "
            f"(batch {s.batch_size} x {ctx.world_size} processes x {engine.accumulation_steps} accumulation steps)"
        )
    engine.total_updates = s.steps if s.steps is not None else s.epochs * engine.updates_per_epoch
    engine.scheduler = task.build_scheduler(engine.optimizer, engine.updates_per_epoch, engine.total_updates)
    engine.scaler = torch.amp.GradScaler(engine.device.type, enabled=engine.amp_dtype == torch.float16)

    engine.epoch = s.start_epoch if s.epochs is not None else 0  # epochs of data completed
    engine.batches = 0  # batches of this process done in the current epoch
    engine.num_updates = engine.epoch * engine.updates_per_epoch
    engine.window = Window()
    engine.pending = []  # (update count, output) of the batches not yet read
    engine.last_loss = None  # the loss of the last batch read
    engine.history = []
    engine.best = {}  # record key -> best value so far
    engine.best_at = {}  # record key -> update count of that value
    engine.lr = engine.optimizer.param_groups[0]["lr"]  # the rate of the last update
    engine.elapsed_before = 0.0  # seconds the runs this one continues took
    engine.started = time.perf_counter()
    if resume is not None:
        restore(engine, resume)
        check_updates_left(engine)
    if hasattr(engine.scheduler, "step_update"):
        engine.scheduler.step_update(num_updates=engine.num_updates)


def _build_model(engine, model) -> None:
    """``engine.model``: ``model`` as the loop runs it; under FSDP also the EMA, sharded like it."""
    from timm.utils import ModelEmaV3

    s, ctx = engine.settings, engine.ctx
    engine.model_ema = None
    if engine.sharded:  # rank 0's weights (and the EMA's copy of them), sharded by prepare_model
        sync_from_rank0(model)
    if s.ema_decay is not None and engine.sharded:
        engine.model_ema = ModelEmaV3(model, decay=s.ema_decay)
    engine.model = prepare_model(
        model, ctx=ctx, device=engine.device, parallel=s.parallel, compile=s.compile,
        grad_checkpointing=s.grad_checkpointing, amp_dtype=engine.amp_dtype,
        find_unused_parameters=s.find_unused_parameters,
        ema=engine.model_ema.module if engine.model_ema is not None else None)


def _build_loader(engine) -> None:
    s, ctx, train_set = engine.settings, engine.ctx, engine.task.train_set
    sampler = None
    if isinstance(train_set, IterableDataset):
        # A streamed set (polaformer.data.shards) orders its own samples per epoch, process and loader
        # worker, and takes the sampler's part (set_epoch, set_start); len() is its samples per process.
        train_set.set_layout(ctx.rank, ctx.world_size, num_workers=s.num_workers, batch_size=s.batch_size,
                             seed=s.seed)
        engine.sampler = train_set
    else:
        engine.sampler = sampler = TrainSampler(train_set, ctx, seed=s.seed)
    # Its own generator: creating an iterator must not draw from the global RNG (resuming
    # restores that), and it seeds the workers per epoch and process (see Engine._train_epoch).
    engine.loader_generator = torch.Generator()
    engine.train_loader = DataLoader(
        train_set, batch_size=s.batch_size, sampler=sampler, drop_last=True,
        num_workers=s.num_workers, pin_memory=engine.device.type == "cuda" and s.pin_memory,
        collate_fn=engine.task.train_collate, generator=engine.loader_generator,
    )
    engine.batches_per_epoch = len(engine.train_loader) // engine.accumulation_steps * engine.accumulation_steps
