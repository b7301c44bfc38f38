"""The engine's seams of eplb.Rebalancer (docs/embedding.md): its process group as the control
plane, and its map and count tensors, read and written in place."""

import numpy as np

from . import _as_int, _eplb, MAX_RANKS
from ._weights import _is_torch_tensor

InvalidArgument = _eplb.InvalidArgument


# The map tensors bind_maps() takes, by the engines' names, and what each holds.
_MAP_KINDS = {
    "physical_to_logical_map": "physical_to_logical",
    "physical_to_logical_map_cpu": "physical_to_logical",
    "logical_to_physical_map": "logical_to_physical",
    "logical_to_all_physical_map": "logical_to_physical",
    "logical_to_all_physical_map_cpu": "logical_to_physical",
    "logical_replica_count": "replica_count",
    "logical_to_all_physical_map_num_valid": "replica_count",
    "logical_to_rank_dispatch_physical_map": "rank_dispatch",
}


def _host_ints(tensor, what):
    """(address, "int32"|"int64", shape, strides in elements) of an integer tensor in host
    memory; the caller keeps it alive. A CUDA tensor is refused with what to do instead."""
    if _is_torch_tensor(tensor):
        if tensor.device.type != "cpu":
            raise InvalidArgument(
                f"{what} is on {tensor.device}: eplb reads and writes the engine's counters and "
                f"maps in host memory in this build (the device path needs eplb built with CUDA "
                f"on a GPU machine); pass a CPU tensor: the engine's host copy (SGLang keeps "
                f"*_cpu maps), or a pinned host tensor it copies to with non_blocking=True")
        dtype = str(tensor.dtype).replace("torch.", "")
        if dtype not in ("int32", "int64"):
            raise InvalidArgument(f"{what} has dtype {tensor.dtype}: int32 or int64 expected")
        return (tensor.data_ptr(), dtype, list(tensor.shape), list(tensor.stride()))
    if not isinstance(tensor, np.ndarray):
        raise InvalidArgument(f"{what} must be a torch tensor or a numpy array (the engine's own "
                              f"memory, read and written in place), got "
                              f"{type(tensor).__name__}")
    if tensor.dtype not in (np.int32, np.int64):
        raise InvalidArgument(f"{what} has dtype {tensor.dtype}: int32 or int64 expected")
    if any(s % tensor.itemsize for s in tensor.strides) or any(s < 0 for s in tensor.strides):
        raise InvalidArgument(f"{what} has strides {tensor.strides} bytes: whole, positive "
                              f"elements expected")
    return (tensor.ctypes.data, str(tensor.dtype), list(tensor.shape),
            [s // tensor.itemsize for s in tensor.strides])


def _control_group(group, control, rendezvous, rank, world_size):
    """(the engine's group as collectives or None, group name, rank, world_size) for the
    constructor and reconfigure(): `group` is eplb's own group name (a string) or the engine's
    group (a torch.distributed gloo ProcessGroup, in the world map or not, vLLM's
    StatelessProcessGroup, or an object with eplb's collectives: _torch_group.py)."""
    from ._torch_group import collectives as engine_collectives
    if not isinstance(group, str):
        if control not in ("shm", "torch"):
            raise InvalidArgument(f"control={control!r} with group= the engine's group: that "
                                  f"group is the control plane, leave control out")
        if rendezvous is not None:
            raise InvalidArgument("rendezvous with group= the engine's group: its ranks have "
                                  "met already, leave rendezvous out")
        collectives = engine_collectives(group, rank, world_size)
        return collectives, "eplb", collectives.rank, collectives.size
    if world_size is None or rank is None:
        raise InvalidArgument("rank and world_size are needed unless group= is the engine's "
                              "group (a torch.distributed process group, vLLM's "
                              "StatelessProcessGroup, or an object with eplb's collectives)")
    world_size = _as_int(world_size, "world_size", 1, MAX_RANKS)
    rank = _as_int(rank, "rank", 0, world_size - 1)
    return None, group, rank, world_size
