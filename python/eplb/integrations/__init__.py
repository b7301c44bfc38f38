"""eplb inside the serving engines: each engine's own interface, with eplb's placements behind it.

- ``eplb.integrations.vllm``: ``EplbPolicy``, a policy for vLLM's EPLB policy registry
  (``vllm.distributed.eplb.policy``), ``make_policy`` / ``register`` to configure and install it,
  and the maps and load files around it (``compute_logical_maps``, ``preserve_intragpu_slots``,
  ``logical_load``, ``save_load_window``).
- ``eplb.integrations.vllm_communicator``: ``TransportCommunicator``, vLLM's
  ``EplbCommunicator`` over eplb's transports (one-sided reads of the peers' live expert
  weights, in eplb's half-duplex rounds), and ``install`` / ``install_from_env`` to put it in
  vLLM's communicator factory (``EPLB_VLLM_COMMUNICATOR=eplb``).
- ``eplb.integrations.sglang``: ``rebalance_experts`` in the argument order of SGLang's
  ``eplb_algorithms.rebalance_experts``, what ``ExpertLocationMetadata`` is built from, and the
  files of ``--init-expert-location`` and of SGLang's expert-distribution recorder.
- ``eplb.integrations.prometheus``: the placement metrics for a Prometheus exporter (imported on
  its own; nothing here imports it).

Neither engine is imported by these modules (``vllm.register`` imports vLLM when called), and
torch only when a torch tensor is passed in: every function also takes numpy arrays and nested
lists, and returns numpy arrays for them. docs/integrations.md has the engines' side.
"""

import contextlib
import sys

import numpy as np

import eplb

__all__ = []


def _is_torch(x):
    # A tensor can only exist if torch is already imported: never import it for other inputs.
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


@contextlib.contextmanager
def _file_errors(path, doing):
    """Turns an OSError of the file `path` (missing, a folder, no permission) into eplb.IoError
    naming the file and what was being done with it ("read", "write")."""
    try:
        yield
    except OSError as e:
        raise eplb.IoError(f"{path}: cannot {doing} it: {e.strerror or e}") from e


def _check_step_sum(steps, total, name):
    """Raises InvalidArgument where `total`, the sum over axis 0 of `steps` (finite,
    non-negative loads, float64 or int64 [steps, layers, experts]), overflowed: each step is
    fine, their sum is not."""
    if total.dtype.kind == "f":
        bad = ~np.isfinite(total)
    else:  # int64 wraps silently: the same sum in float64 tells
        bad = np.add.reduce(steps, axis=0, dtype=np.float64) >= 2.0**63
    if bad.any():
        layer, expert = (int(i) for i in np.argwhere(bad)[0])
        raise eplb.InvalidArgument(f"{name}: the loads of layer {layer} expert {expert} sum over "
                                   f"the steps past what a {total.dtype} holds (each step is "
                                   f"finite): scale the counts down")


def _numpy(x):
    """A numpy array of `x` (a torch tensor on any device is copied to host memory)."""
    if _is_torch(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _integers(x, name):
    """An int64 numpy copy or view of `x`, which must hold integers (expert or slot ids)."""
    if _is_torch(x) and x.is_floating_point():
        raise eplb.InvalidArgument(f"{name} must hold integer expert ids, got dtype {x.dtype}")
    a = _numpy(x)
    if a.dtype.kind not in "iu" and not (a.size == 0 and a.dtype.kind == "f"):
        raise eplb.InvalidArgument(f"{name} must hold integer expert ids, got dtype {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.int64)


def _loads(x, name):
    """A float64 numpy copy of the loads `x` (torch of any real dtype and device, numpy, lists)."""
    if _is_torch(x):
        return eplb._torch_load_numpy(x, name)
    try:
        a = np.asarray(x)
    except (TypeError, ValueError) as e:
        raise eplb.InvalidArgument(f"{name} must be a numeric array of loads: {e}") from e
    if a.dtype.kind not in "iuf":
        raise eplb.InvalidArgument(f"{name} must hold real-valued loads (integers or floats), "
                                   f"got dtype {a.dtype}")
    eplb._check_exact(a, name)
    return a.astype(np.float64)


def _like(a, template):
    """`a` (numpy) as the caller gave `template`: a torch tensor on the template's device for a
    tensor, the numpy array itself otherwise."""
    if _is_torch(template):
        import torch
        return torch.from_numpy(np.ascontiguousarray(a)).to(template.device)
    return a


def _logical_maps(phy2log, experts, width=None):
    """The slots of each logical expert, from phy2log int64 [L, P]: (log2phy [L, E, X] padded
    with -1, the slots of each expert in ascending physical index, and count [L, E]). Negative
    entries are empty slots and are left out. X is `width`, or the largest count over all layers
    and experts when None."""
    layers, physical = phy2log.shape
    valid = phy2log >= 0
    if np.any(phy2log[valid] >= experts):
        bad = np.argwhere(valid & (phy2log >= experts))[0]
        raise eplb.InvalidArgument(
            f"layer {bad[0]} slot {bad[1]} holds expert {phy2log[bad[0], bad[1]]}, outside "
            f"[0, {experts}) (num_logical_experts is {experts})")
    row, slot = np.nonzero(valid)  # row-major: each layer's slots in ascending order
    key = row * experts + phy2log[row, slot]
    count = np.bincount(key, minlength=layers * experts).reshape(layers, experts)
    most = int(count.max()) if count.size else 0
    width = most if width is None else width
    if most > width:
        raise eplb.InvalidArgument(f"an expert holds {most} slots, more than the {width} columns "
                                   f"of the map")
    # The rank of each slot among its expert's: its position in a stable sort by expert.
    order = np.argsort(key, kind="stable")
    first = np.concatenate(([0], np.cumsum(count.ravel())[:-1]))
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size) - first[key[order]]
    log2phy = np.full((layers * experts, width), -1, dtype=np.int64)
    log2phy[key, rank] = slot
    return log2phy.reshape(layers, experts, width), count.astype(np.int64)


def _policy_env(environ, policy_var, tolerance_var, choices, keeps_own):
    """(policy, tolerance) an engine's environment asks for, or None when ``policy_var`` is
    unset, empty or "off" (the engine keeps ``keeps_own``). ``policy`` is lower-cased and one
    of ``choices``; ``tolerance_var`` is sticky's tolerance in [0, 1) (default 0.01). Raises
    eplb.InvalidArgument naming the variable and its value otherwise."""
    value = environ.get(policy_var, "").strip().lower()
    if value in ("", "off", "0", "none"):
        return None
    if value not in choices:
        raise eplb.InvalidArgument(f"{policy_var}={environ[policy_var]!r} is not one of "
                                   f"{', '.join(choices)} (or off / unset: {keeps_own})")
    raw = environ.get(tolerance_var, "").strip()
    try:
        tolerance = float(raw) if raw else 0.01
    except ValueError:
        raise eplb.InvalidArgument(f"{tolerance_var}={raw!r} is not a number (sticky's "
                                   f"tolerance, in [0, 1))") from None
    if not 0 <= tolerance < 1:
        raise eplb.InvalidArgument(f"{tolerance_var}={raw} must be in [0, 1) (the balancedness "
                                   f"sticky may give up)")
    return value, tolerance
