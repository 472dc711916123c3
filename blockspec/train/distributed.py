"""Data parallel training over `torchrun` processes: ranks, collectives, and FSDP2 sharding."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from blockspec.dflash.drafter import DFlashDrafter

GLOO_GRACE_S = 0.1  # see DistInfo.close


class DistInfo:
    """Rank/world from torchrun's environment; a no-op single process otherwise."""

    def __init__(self) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.active = self.world > 1
        if self.active and not dist.is_initialized():
            gpu = torch.cuda.is_available() and os.environ.get("BLOCKSPEC_BACKEND") != "gloo"
            # CUDA tensors (gradients, FSDP shards) over nccl; the small CPU tensors (weight sums,
            # stats, flags) need gloo beside it: a plain "nccl" group has no CPU backend
            dist.init_process_group("cpu:gloo,cuda:nccl" if gpu else "gloo")

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        if self.active:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        if self.active:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def close(self) -> None:
        """Tears the process group down; call once at the end of the program."""
        if not (self.active and dist.is_initialized()):
            return
        dist.barrier()  # no rank leaves while another still talks to it
        dist.destroy_process_group()
        # A gloo worker thread frees a finished collective's tensors after its waiter moved on,
        # and needs the GIL when Python created them; a finalizing interpreter refuses it and the
        # process aborts ("terminate called without an active exception": 1 FSDP run in ~35 did).
        # The group outlives this call (DTensor's caches hold FSDP's mesh, and so the group, till
        # exit), so its threads get the GIL for a moment now, while the interpreter still runs.
        time.sleep(GLOO_GRACE_S)

    @property
    def main(self) -> bool:
        return self.rank == 0


def shard_drafter(drafter: DFlashDrafter, device: torch.device | str) -> DFlashDrafter:
    """Shards the drafter in place with FSDP2 over all ranks: one group per draft layer, then the
    rest (fc, norms) at the root. Gradients are SUMMED across ranks, not averaged: the trainer
    already normalises the loss by the global weight sum."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    for layer in drafter.layers:
        # DFlashDrafter.forward calls a layer's parts, never the layer itself, and FSDP gathers on
        # forward calls: so the layer's group is the list of its parts
        fully_shard(list(layer.children()), mesh=mesh)
    fully_shard(drafter, mesh=mesh)
    for m in drafter.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            # plain SUM collectives: gloo cannot run the PREMUL_SUM a custom factor would use
            m.set_force_sum_reduction_for_comms(True)
    return drafter
