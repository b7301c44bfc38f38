"""What the Python Rebalancer (runtime.py) reads from its arguments: the weight specs (an arena's
tensor shapes and dtypes, or the engine's own tensors), rendezvous names, token ids, and the
numpy/torch conversions of the views it hands out."""

import math
import operator
import os
import sys
import uuid

import numpy as np

from . import _eplb
from . import _as_int

InvalidArgument = _eplb.InvalidArgument

def _torch():
    import torch
    return torch


def _is_torch_tensor(x):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _is_torch_dtype(x):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.dtype)


def _itemsize(dtype):
    if _is_torch_dtype(dtype):
        return _torch().empty((), dtype=dtype).element_size()
    return np.dtype(dtype).itemsize


def _parse_tensor(name, spec):
    """(name, expert_bytes, shape or None, dtype or None) of one entry of `weights`."""
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"weights: tensor names must be non-empty strings, got {name!r}")
    if isinstance(spec, (int, np.integer)) and not isinstance(spec, bool):
        return name, _as_int(spec, f"weights: tensor '{name}' expert_bytes", 1), None, None
    try:
        shape, dtype = spec
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(
            operator.index(s) for s in shape)
        size = _itemsize(dtype)
    except (TypeError, ValueError) as e:
        raise InvalidArgument(
            f"weights: tensor '{name}' must be given as expert_bytes (an int) or "
            f"(shape, dtype), got {spec!r}: {e}") from None
    if any(s < 1 for s in shape):
        raise InvalidArgument(f"weights: tensor '{name}' has shape {shape}; every dimension "
                              "must be at least 1")
    nbytes = math.prod(shape) * size
    if nbytes > 2**63 - 1:
        raise InvalidArgument(f"weights: tensor '{name}' of shape {shape} holds {nbytes} bytes "
                              "per expert, more than a 64-bit count")
    return name, nbytes, shape, dtype


def _is_engine_tensors(spec):
    """A list (or tuple) of tensors or arrays, one per layer: the engine's own weights."""
    return (isinstance(spec, (list, tuple)) and len(spec) > 0 and
            all(_is_torch_tensor(t) or isinstance(t, np.ndarray) for t in spec))


def _engine_tensor(name, layer, t, slots):
    """(address, slot stride in bytes, slot shape, dtype, expert bytes) of one engine tensor,
    after checking it can be registered: on the CPU, [slots, ...], each slot contiguous."""
    where = f"weights: tensor '{name}' of layer {layer}"
    if _is_torch_tensor(t):
        if t.layout != _torch().strided:
            raise InvalidArgument(f"{where} has layout {t.layout}: only dense (strided) tensors "
                                  "can be registered")
        if t.device.type != "cpu":
            raise InvalidArgument(
                f"{where} is on {t.device}: only CPU tensors can be registered with this "
                "build's transports (device memory goes through the cuda transport's arena)")
        shape, strides, size = tuple(t.shape), tuple(t.stride()), t.element_size()
        dtype, address = t.dtype, t.data_ptr()
    else:
        if t.dtype.hasobject:
            raise InvalidArgument(f"{where} holds Python objects (dtype {t.dtype}): weights must "
                                  "be plain numbers")
        if not t.flags.writeable:
            raise InvalidArgument(f"{where} is a read-only array: installs write into it")
        shape, size, dtype = t.shape, t.itemsize, t.dtype
        strides = tuple(s // size for s in t.strides)
        address = t.__array_interface__["data"][0]
        if any(s % size for s in t.strides):
            raise InvalidArgument(f"{where} has strides {t.strides} that are not whole elements")
    if len(shape) < 1 or shape[0] != slots:
        raise InvalidArgument(
            f"{where} has shape {shape}: its first dimension must be this rank's {slots} slots "
            "(physical // world_size)")
    # Every slot one contiguous run of bytes; the slots may be apart (a padded stride).
    expected = []
    step = 1
    for extent in reversed(shape[1:]):
        expected.append(step)
        step *= extent
    expected.reverse()
    if any(e > 1 and s != x for e, s, x in zip(shape[1:], strides[1:], expected)):
        raise InvalidArgument(
            f"{where} has strides {strides} (in elements): each slot [{', '.join(map(str, shape[1:]))}] "
            "must be contiguous (expert-major, as engines allocate them)")
    nbytes = math.prod(shape[1:]) * size
    stride = strides[0] * size if slots > 1 else nbytes
    if stride < nbytes:
        raise InvalidArgument(f"{where}: slots {stride} bytes apart overlap (each holds {nbytes})")
    return address, stride, tuple(shape[1:]), dtype, nbytes


def _parse_weights(weights):
    """(tensors, owned) of the `weights` argument: tensors [(name, expert_bytes, shape, dtype)]
    in arena order (engine tensors sized later, by _set_weights), owned [(name, [per layer])]
    for the engine's own tensors (all or none)."""
    items = weights.items() if isinstance(weights, dict) else weights
    try:
        items = list(items)
    except TypeError:
        raise InvalidArgument("weights must be a dict or a list of (name, spec) pairs, got "
                              f"{weights!r}") from None
    tensors = []
    owned = []  # the engine's tensors, per name: [layers]
    for item in items:
        try:
            name, spec = item
        except (TypeError, ValueError):
            raise InvalidArgument(
                f"weights: each entry must be a (name, spec) pair, got {item!r}") from None
        if _is_engine_tensors(spec):
            if not isinstance(name, str) or not name:
                raise InvalidArgument(
                    f"weights: tensor names must be non-empty strings, got {name!r}")
            owned.append((name, list(spec)))
            tensors.append((name, 0, None, None))  # sized by _set_weights
        else:
            tensors.append(_parse_tensor(name, spec))
    names = [t[0] for t in tensors]
    if len(set(names)) != len(names):
        raise InvalidArgument(f"weights: tensor names must be distinct, got {names}")
    if owned and len(owned) != len(tensors):
        raise InvalidArgument(
            "weights: give every tensor as the engine's own (a list of one tensor per layer) "
            f"or none; {[n for n, _ in owned]} are and the others are not")
    return tensors, owned


def _rendezvous(rendezvous, world_size):
    """The rendezvous as a string; a fresh name for a group of one, which meets no one."""
    if rendezvous is None:
        if world_size != 1:
            raise InvalidArgument(
                "rendezvous is required with more than one rank: a name shared by the ranks "
                "(inproc, shm), or a shared folder or redis://host:port (gloo)")
        return f"eplb-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    return os.fspath(rendezvous)


def _store(view, raw, value):
    """Copies one expert's `value` (array-like or torch tensor of the view's shape and dtype, or
    its bytes) into `view`, whose raw bytes are the uint8 array `raw`."""
    if _is_torch_tensor(view):
        torch = _torch()
        value = torch.as_tensor(value)
        if value.dtype == torch.uint8 and value.numel() == raw.size:
            raw[...] = value.reshape(raw.shape).numpy()
        else:
            view.copy_(value.reshape(view.shape))
        return
    if _is_torch_tensor(value):
        value = value.detach().cpu().contiguous().numpy()
    value = np.asarray(value)
    if value.dtype == np.uint8 and value.size == raw.size:
        raw[...] = value.reshape(raw.shape)
    else:
        view[...] = value


def _ids(topk_ids, name):
    """An integer numpy array for the C++ side; int32 C-contiguous input passes unchanged."""
    if _is_torch_tensor(topk_ids):
        topk_ids = topk_ids.detach()
        if topk_ids.device.type != "cpu":
            topk_ids = topk_ids.to("cpu")
        topk_ids = topk_ids.numpy()
    a = np.asarray(topk_ids)
    if a.dtype.kind not in "iu":
        raise InvalidArgument(f"{name} must hold integer expert ids, got dtype {a.dtype}")
    return a


def _to_torch(array):
    torch = _torch()
    if hasattr(array, "__dlpack__"):
        return torch.from_dlpack(array)
    return torch.from_numpy(array)


def _torch_dtype(dtype):
    """The torch dtype of a numpy dtype (via an empty array)."""
    return _torch().from_numpy(np.empty(0, dtype=dtype)).dtype
