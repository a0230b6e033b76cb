"""DTensor inputs (FSDP2's ``fully_shard``, tensor parallelism): local shards and global norms.

The kernels take plain tensors. A ``DTensor`` holds, on each rank, a local piece of a larger
tensor, placed on a device mesh: ``Shard(d)`` on a mesh dimension splits it between the ranks of
that dimension, ``Replicate()`` gives every rank the whole, ``Partial()`` holds summands.

- Elementwise work (scaling, optimizer updates) runs on each rank's local tensor as it is: that
  is exactly the elementwise work on the whole.
- A norm is computed locally per group of tensors sharded over the same mesh dimensions, then
  the per-rank norms are gathered over each of those dimensions and combined; replicated
  dimensions are not reduced (their ranks hold the same elements). ``Partial`` tensors are
  first made replicated (a collective). Every rank must pass the same list of tensors in the
  same order (as every rank of an SPMD program does), since the collectives follow that order.

The result is a plain tensor on each rank, the same value everywhere.
"""
from __future__ import annotations

import sys
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist  # loaded with torch; DTensor itself is not imported here

from ._reference import combine_norms

# Nothing is imported from torch.distributed here (importing DTensor costs about a second):
# while the module that defines a class is not loaded, no object of that class exists.
_DTENSOR_MODULES = ("torch.distributed.tensor", "torch.distributed._tensor")  # torch >= 2.5, older
_FSDP_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")  # >= 2.6, older

__all__ = ["any_dtensor", "locals_", "global_norm", "mask_problem", "sharded_by_fsdp"]


def _loaded(modules: tuple, name: str):
    for module in modules:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None:
            return cls
    return None


def _dtensor_type():
    return _loaded(_DTENSOR_MODULES, "DTensor")


def sharded_by_fsdp(model: torch.nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``model`` or one of its submodules."""
    fsdp_module = _loaded(_FSDP_MODULES, "FSDPModule")
    return fsdp_module is not None and any(isinstance(m, fsdp_module) for m in model.modules())


def any_dtensor(tensors: Sequence[Optional[torch.Tensor]]) -> bool:
    """Whether any of ``tensors`` is a DTensor."""
    cls = _dtensor_type()
    return cls is not None and any(isinstance(t, cls) for t in tensors)


def locals_(tensors: Sequence[Optional[torch.Tensor]]) -> list:
    """This rank's local tensor (sharing its storage) of each DTensor; anything else as it is."""
    cls = _dtensor_type()
    return [t.to_local() if isinstance(t, cls) else t for t in tensors] if cls else list(tensors)


def _without_partial(t):
    if not any(pl.is_partial() for pl in t.placements):
        return t
    replicate = _loaded(_DTENSOR_MODULES, "Replicate")
    placements = [replicate() if pl.is_partial() else pl for pl in t.placements]
    return t.redistribute(t.device_mesh, placements)


def global_norm(
    tensors: Sequence[torch.Tensor], p: float, local_norm: Callable[[List[torch.Tensor]], torch.Tensor]
) -> torch.Tensor:
    """The ``p``-norm of all elements of ``tensors`` (DTensors and plain tensors, the plain
    ones taken as the same on every rank); ``local_norm(list)`` is the norm of plain tensors."""
    dtensor = _dtensor_type()
    groups: Dict[object, List[torch.Tensor]] = {}
    for t in tensors:
        key = None
        if isinstance(t, dtensor):
            t = _without_partial(t)
            dims = tuple(i for i, pl in enumerate(t.placements) if pl.is_shard())
            key = (t.device_mesh, dims) if dims else None
            t = t.to_local()
        groups.setdefault(key, []).append(t)
    device = locals_(tensors[:1])[0].device
    norms = []
    for key, part in groups.items():
        norm = local_norm(part)
        if key is not None:
            mesh, dims = key
            for dim in dims:
                norm = _gather_and_combine(norm, p, mesh.get_group(dim))
        norms.append(norm)
    return norms[0] if len(norms) == 1 else combine_norms(norms, p, device)


def _gather_and_combine(norm: torch.Tensor, p: float, group) -> torch.Tensor:
    """The norm over the ranks of ``group``, each holding the norm of its own elements."""
    mine = norm.reshape(1).contiguous()
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    return combine_norms([n[0] for n in everyone], p, norm.device).to(norm.dtype)


def mask_problem(param: torch.Tensor, mask: torch.Tensor) -> Optional[str]:
    """Why ``mask`` cannot mask ``param`` elementwise when either is a DTensor, or None."""
    dtensor = _dtensor_type()
    if dtensor is None or not (isinstance(param, dtensor) or isinstance(mask, dtensor)):
        return None
    if not isinstance(param, dtensor):
        return "is a DTensor but the parameter is not"
    if not isinstance(mask, dtensor):
        return ("is a plain tensor but the parameter is a DTensor: shard the mask like it, "
                "torch.distributed.tensor.distribute_tensor(mask, p.device_mesh, p.placements)")
    if mask.device_mesh != param.device_mesh or tuple(mask.placements) != tuple(param.placements):
        return (f"is placed {tuple(mask.placements)} on {mask.device_mesh} but the parameter "
                f"{tuple(param.placements)} on {param.device_mesh}: shard the mask like it")
    return None
