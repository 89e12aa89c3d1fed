"""Distributed data parallel training: the process group, samplers, and cross-process reductions.

``torchrun --nproc_per_node=K -m polaformer train ...`` starts K processes with ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` in their environment;
:func:`init_distributed` joins them (NCCL on CUDA, Gloo on the CPU). Without those variables
(or with ``WORLD_SIZE=1``) everything here works for a single process.

Data order: every process draws the same permutation of the training set for an epoch (seeded
with ``SEED + epoch``) and takes every K-th index, so that step ``s`` of K processes with batch
B covers exactly the images of step ``s`` of one process with batch K*B. A data set's own random draws (crops,
flips, noise) come from :class:`SampleDraws`, a generator per sample, so they too are the same for any process
count. Evaluation takes every K-th example (:func:`shard`) and sums over the processes.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler, Sampler, Subset


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    owns_group: bool = False  # this module created the process group, and destroys it

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str) -> DistContext:
    """Join the process group torchrun describes in the environment, if any."""
    if dist.is_available() and dist.is_initialized():  # a caller set it up
        return DistContext(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistContext()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(
        backend="nccl" if device_type == "cuda" else "gloo", init_method="env://", world_size=world_size, rank=rank
    )
    return DistContext(rank, world_size, local_rank, owns_group=True)


def shutdown(ctx: DistContext) -> None:
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(values: Sequence[float], ctx: DistContext, device: torch.device) -> list[float]:
    """Element-wise sums over the processes (in float64), or ``values`` themselves."""
    if not ctx.is_distributed:
        return [float(v) for v in values]
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def all_gather_object(obj: Any, ctx: DistContext) -> list:
    """``[obj of rank 0, obj of rank 1, ...]`` on every process."""
    if not ctx.is_distributed:
        return [obj]
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def barrier(ctx: DistContext) -> None:
    if ctx.is_distributed:
        dist.barrier()


class TrainSampler(DistributedSampler):
    """``DistributedSampler`` (shuffled per ``set_epoch``) that can start part-way into an epoch.

    ``set_start(n)`` skips this process's first ``n`` indices of the epoch: a run resumed from a
    checkpoint written after ``n`` samples continues with exactly the samples that followed.
    """

    def __init__(self, dataset: Dataset, ctx: DistContext, seed: int):
        super().__init__(dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=seed)
        self.start = 0

    def set_start(self, start: int) -> None:
        self.start = start

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.start, None)

    def __len__(self) -> int:
        return max(0, self.num_samples - self.start)


class ShardSampler(Sampler):
    """Every K-th index from ``rank``, in order, without padding: each image is evaluated once."""

    def __init__(self, dataset: Dataset, ctx: DistContext):
        self.indices = range(ctx.rank, len(dataset), ctx.world_size)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def shard(dataset: Dataset, ctx: DistContext, limit: int = 0) -> Subset:
    """This process's part of an evaluation set: every K-th of its first ``limit`` examples (0: all) from ``rank``,
    so that the processes together see each of them once, whatever their number."""
    end = min(limit, len(dataset)) if limit else len(dataset)
    return Subset(dataset, range(ctx.rank, end, ctx.world_size))


class SampleDraws:
    """What a training set draws at random for one sample (a crop, a flip, noise) comes from
    :meth:`generator`, seeded by (seed, epoch, index): the same sample gets the same draws whatever the number of
    processes, the batch size, the loader worker or the update a run resumed from. The engine calls
    :meth:`set_epoch` at each epoch's start."""

    def __init__(self, seed: int = 0):
        self.draw_seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def generator(self, index: int) -> torch.Generator:
        # SeedSequence mixes the three into one well-spread 64-bit seed, the same on every platform and version
        seed = np.random.SeedSequence([self.draw_seed, self.epoch, index]).generate_state(1, np.uint64)[0]
        return torch.Generator().manual_seed(int(seed))
