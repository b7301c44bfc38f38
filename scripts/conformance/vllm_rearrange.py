"""vLLM's real EplbState.rearrange on the CPU, in 4 processes over gloo, with eplb's EPLB
communicator and with vLLM's own torch_gloo one.

Each rank initializes vLLM's distributed state (init_distributed_environment and
ensure_model_parallel_initialized, gloo, tensor parallel 4 with expert parallelism: vLLM's EP
and EPLB groups), builds vLLM's EplbState and adds a model to it (EplbState.add_model: vLLM's
initial placement, its map tensors, its communicator from create_eplb_communicator), then calls
EplbState.rearrange (sync EPLB) several times. vLLM's default policy places; vLLM's
rearrange_expert_weights_inplace moves the weights through the communicator. After every
rearrangement each rank's weights are compared with the reference computed in this (the
parent) process from vLLM's new placement: slot p of layer l holds expert phy2log[l][p]'s bytes.
Then one more move through vLLM's batched path (transfer_layer with enable_migration_batching,
what async EPLB runs: one execute() per batch of vLLM's migration scheduler, or of the one
installed in its place), checked the same way.

Stand-ins, each forced by the absence of a GPU:
  1. the MoE model: FusedMoE layers need a GPU, so a model object holds the expert weights
     ([local slots, ...] CPU tensors per layer, as FusedMoE's get_expert_weights returns them)
     and takes vLLM's own MixtureOfExperts.set_eplb_state;
  2. the model's config: a real ModelConfig loads a Hugging Face model; a stand-in gives the
     model name and compile factors EplbState keys its models by;
  3. the loads: no forward pass records them, so each rank writes random counts into vLLM's
     own expert_load_window before each rearrangement;
  4. the timing events: rearrange() times itself with torch.Event, a device event; a CPU clock
     stands in for it (rearrange only logs the time);
  5. the device stream: vLLM's torch_gloo communicator waits on the accelerator's current
     stream before its gloo sends (torch.accelerator.current_stream().synchronize()); with no
     device there is nothing to wait for, and a stream whose synchronize() returns stands in;
  6. pinned memory: vLLM stages host copies in pinned memory when its platform says it can
     (PIN_MEMORY); pinning needs a device driver, so it is off, as vLLM's CPU platform has it.
eplb's communicator is switched on as a user does: EPLB_VLLM_COMMUNICATOR=eplb and vLLM's
load_general_plugins(), which runs the eplb package's vllm.general_plugins entry point.

Prints the wall time of every rearrangement for both communicators side by side (the slowest
rank's time of EplbState.rearrange; the two alternate, on the same loads), and
"vllm rearrange: ..." last; exits 1 on a mismatch. Timings on a machine with fewer cores than
ranks are the CPU's, not a network's: the copies of 4 ranks share the cores.

Usage: python vllm_rearrange.py [--layers 4] [--experts 32] [--redundant 8] [--hidden 1024]
                                [--intermediate 512] [--rearrangements 3]
"""

import argparse
import hashlib
import multiprocessing
import os
import sys
import time
import traceback

import numpy as np

WORLD = 4


def content(layer, expert, tensor, shape, dtype):
    """The bytes of `expert`'s weight `tensor` in `layer`: distinct everywhere."""
    import torch
    n = int(np.prod(shape))
    base = layer * 7919 + expert * 104729 + tensor * 31
    values = (torch.arange(n, dtype=torch.int64) * 2654435761 + base) % 65521
    return (values.to(torch.float32) / 65521.0).to(dtype).reshape(shape)


def tensor_shapes(args):
    import torch
    return [((2 * args.intermediate, args.hidden), torch.bfloat16),   # w13
            ((args.hidden, args.intermediate), torch.bfloat16)]       # w2


def digest(t):
    import torch
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def slot_digests(model):
    """[layers][tensors][local slots]: the digest of every slot's bytes on this rank."""
    return [[[digest(row) for row in w] for w in layer] for layer in model.expert_weights]


class CpuEvent:
    """Stand-in 4: torch.Event's timing interface on the CPU clock."""

    def __init__(self, *args, **kwargs):
        self.t = None

    def record(self, *args, **kwargs):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def wait(self, *args, **kwargs):
        pass

    def elapsed_time(self, end):
        return (end.t - self.t) * 1000.0


class NoStream:
    """Stand-in 5: the stream of a machine without a device."""

    def synchronize(self):
        pass


class ModelConfigStandIn:
    """Stand-in 2: what EplbState reads from a ModelConfig."""

    model = "eplb-conformance-moe"

    def compile_factors(self):
        return {"model": self.model}


class Layer:
    """Stand-in 1's layers: a FusedMoE's EPLB surface."""

    def __init__(self, weights):
        self.weights = weights

    def get_expert_weights(self):
        return self.weights

    def set_eplb_state(self, moe_layer_idx, expert_load_view, logical_to_physical_map,
                       logical_replica_count):
        self.maps = (expert_load_view, logical_to_physical_map, logical_replica_count)


def make_model(args, rank, phy2log):
    """Stand-in 1: the model, its weights those of vLLM's initial placement `phy2log`."""
    from vllm.model_executor.models.interfaces import MixtureOfExperts
    shapes = tensor_shapes(args)
    physical = args.experts + args.redundant
    local = physical // WORLD
    slots = phy2log[:, rank * local:(rank + 1) * local]
    import torch
    layers = [Layer([torch.stack([content(l, int(e), t, shape, dtype) for e in slots[l]])
                     for t, (shape, dtype) in enumerate(shapes)])
              for l in range(args.layers)]

    class Model:
        moe_layers = layers
        num_moe_layers = args.layers
        num_logical_experts = args.experts
        num_routed_experts = args.experts
        num_redundant_experts = args.redundant
        num_physical_experts = physical
        num_local_physical_experts = local
        num_expert_groups = 1
        num_shared_experts = 0
        set_eplb_state = MixtureOfExperts.set_eplb_state

    return Model()


def run_rank(rank, args, store, queue):
    try:
        queue.put((rank, "ok", rank_main(rank, args, store)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def rank_main(rank, args, store):
    import torch
    torch.set_num_threads(1)
    import vllm.distributed.eplb.eplb_state as eplb_state_module
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (ensure_model_parallel_initialized,
                                                 get_eplb_group, init_distributed_environment)
    import vllm.distributed.eplb.eplb_communicator as communicator_module
    eplb_state_module.torch.Event = CpuEvent  # stand-in 4
    torch.accelerator.current_stream = lambda *a, **k: NoStream()  # stand-in 5
    communicator_module.PIN_MEMORY = eplb_state_module.PIN_MEMORY = False  # stand-in 6

    # vLLM's state twice over one distributed setup: first with vLLM's torch_gloo, then, once
    # the plugin has put eplb's communicator in vLLM's factory, with eplb's. Their
    # rearrangements alternate, on the same loads, so both see the same machine.
    states = {}
    for backend in ("torch_gloo", "eplb"):
        config = VllmConfig(device_config=DeviceConfig(device="cpu"))
        parallel = config.parallel_config
        parallel.tensor_parallel_size = WORLD
        parallel.enable_expert_parallel = True
        parallel.enable_eplb = True
        parallel.eplb_config.use_async = False
        parallel.eplb_config.num_redundant_experts = args.redundant
        # vLLM's config admits only its own communicator names; eplb's replaces them all.
        parallel.eplb_config.communicator = "torch_gloo"
        with set_current_vllm_config(config):
            if backend == "torch_gloo":
                init_distributed_environment(world_size=WORLD, rank=rank,
                                             distributed_init_method=f"file://{store}",
                                             local_rank=rank, backend="gloo")
                ensure_model_parallel_initialized(WORLD, 1)
            else:
                os.environ["EPLB_VLLM_COMMUNICATOR"] = "eplb"
                from vllm.plugins import load_general_plugins
                load_general_plugins()
                from vllm.distributed.eplb import eplb_communicator as ec
                if getattr(ec.create_eplb_communicator, "_eplb_original", None) is None:
                    raise RuntimeError("eplb's vllm.general_plugins entry point did not install "
                                       "its communicator (is eplb installed in this "
                                       "environment, and VLLM_PLUGINS unset?)")
            state = eplb_state_module.EplbState(parallel, torch.device("cpu"))
            initial = np.array(eplb_state_module.EplbState
                               .build_initial_global_physical_to_logical_map(
                                   args.experts, args.redundant))
            model = make_model(args, rank, np.tile(initial, (args.layers, 1)))
            state.add_model(model, ModelConfigStandIn())
            states[backend] = (config, state, model, next(iter(state.model_states.values())))

    results = {b: (type(s[3].communicator).__name__, []) for b, s in states.items()}
    rng = np.random.default_rng(1000 + rank)
    for i in range(args.rearrangements):
        # Stand-in 3: the window's counts, skewed differently each time, alike for both.
        shape = states["eplb"][3].expert_load_window.shape
        counts = torch.from_numpy(rng.poisson(rng.pareto(1.2, size=shape[1:]) * 100,
                                              size=shape).astype(np.int32))
        for backend, (config, state, model, model_state) in states.items():
            model_state.expert_load_window.copy_(counts)
            with set_current_vllm_config(config):
                get_eplb_group().barrier()
                start = time.perf_counter()
                state.rearrange()
                seconds = time.perf_counter() - start
            phy2log = model_state.physical_to_logical_map.clone().numpy()
            results[backend][1].append((seconds, phy2log, slot_digests(model)))

    # vLLM's batched path (async EPLB with enable_migration_batching): transfer_layer runs the
    # communicator once per batch of vLLM's migration scheduler (or of the one installed in its
    # place), then move_from_buffer; one more move, to a placement of vLLM's policy.
    from vllm.distributed.eplb.rebalance_execute import move_from_buffer, transfer_layer
    from vllm.distributed.parallel_state import get_ep_group
    load = torch.from_numpy(np.random.default_rng(77).integers(
        1, 1000, size=(args.layers, args.experts)))
    batched = {}
    for backend, (config, state, model, model_state) in states.items():
        old = model_state.physical_to_logical_map.clone()
        new = state.policy.rebalance_experts(load, args.experts + args.redundant, 1, 1, WORLD,
                                             old)
        with set_current_vllm_config(config):
            get_eplb_group().barrier()
            start = time.perf_counter()
            for layer in range(args.layers):
                metadata = transfer_layer(old[layer], new[layer], model.expert_weights[layer],
                                          model_state.expert_buffer, get_ep_group().device_group,
                                          model_state.communicator, layer_idx=layer,
                                          enable_migration_batching=True)
                move_from_buffer(model.expert_weights[layer], model_state.expert_buffer,
                                 metadata, new[layer].numpy(), rank)
            seconds = time.perf_counter() - start
        batched[backend] = (seconds, new.numpy(), slot_digests(model))
    states["eplb"][3].communicator.close()
    return {"runs": results, "batched": batched}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--redundant", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--rearrangements", type=int, default=3)
    args = parser.parse_args()
    if (args.experts + args.redundant) % WORLD:
        parser.error(f"--experts + --redundant must be a multiple of {WORLD}")

    import tempfile
    folder = tempfile.mkdtemp(prefix="vllm-rearrange-")
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=run_rank, args=(r, args, f"{folder}/store", queue))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in procs:
            rank, status, value = queue.get(timeout=1800)
            out[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    failed = [f"rank {r}: {v}" for r, (s, v) in sorted(out.items()) if s != "ok"]
    if failed:
        print("\n".join(failed), file=sys.stderr)
        print("vllm rearrange: FAILED (a rank raised)")
        return 1

    # The reference, in this process: every slot holds its expert's bytes under the new map.
    shapes = tensor_shapes(args)
    local = (args.experts + args.redundant) // WORLD
    import torch

    reference = {}  # (layer, expert, tensor) -> the digest of its bytes

    def matches(backend, what, phy2log, rank, hashes):
        good = True
        for l in range(args.layers):
            for t, (shape, dtype) in enumerate(shapes):
                for row, e in enumerate(phy2log[l, rank * local:(rank + 1) * local].tolist()):
                    if (l, e, t) not in reference:
                        reference[(l, e, t)] = digest(content(l, e, t, shape, dtype))
                    if hashes[l][t][row] != reference[(l, e, t)]:
                        good = False
                        print(f"{backend}: {what}: rank {rank} layer {l} tensor {t} slot "
                              f"{rank * local + row} differs from the reference (expert {e})")
        return good

    ok = True
    names, times, maps = {}, {}, {}
    for backend in ("torch_gloo", "eplb"):
        runs = [out[r][1]["runs"][backend][1] for r in range(WORLD)]
        names[backend] = out[0][1]["runs"][backend][0]
        maps[backend] = [runs[0][i][1] for i in range(args.rearrangements)]
        times[backend] = [max(runs[r][i][0] for r in range(WORLD))
                          for i in range(args.rearrangements)]
        for i in range(args.rearrangements):
            for r in range(WORLD):
                _, phy2log, hashes = runs[r][i]
                if not np.array_equal(phy2log, maps[backend][i]):
                    ok = False
                    print(f"{backend}: rearrangement {i + 1}: rank {r}'s map differs from "
                          f"rank 0's")
                ok &= matches(backend, f"rearrangement {i + 1}", phy2log, r, hashes)
        for r in range(WORLD):
            _, phy2log, hashes = out[r][1]["batched"][backend]
            ok &= matches(backend, "batched move", phy2log, r, hashes)
    same_maps = all(np.array_equal(a, b) for a, b in zip(maps["torch_gloo"], maps["eplb"]))
    expert_mib = sum(int(np.prod(s)) * 2 for s, _ in shapes) / 2**20
    print(f"vllm rearrange: {WORLD} ranks, {args.layers} layers, "
          f"{args.experts}+{args.redundant} experts, {expert_mib:.1f} MiB per expert; "
          f"communicators: torch_gloo = {names['torch_gloo']}, eplb = {names['eplb']}")
    print(f"wall time of EplbState.rearrange (slowest rank), alternating, on {os.cpu_count()} "
          f"cores at load average {os.getloadavg()[0]:.1f}:")
    print(f"{'rearrangement':>14} {'torch_gloo s':>13} {'eplb s':>9} {'ratio':>7}")
    for i in range(args.rearrangements):
        g, e = times["torch_gloo"][i], times["eplb"][i]
        print(f"{i + 1:>14} {g:>13.3f} {e:>9.3f} {g / e:>6.2f}x")
    print(f"{'total':>14} {sum(times['torch_gloo']):>13.3f} {sum(times['eplb']):>9.3f} "
          f"{sum(times['torch_gloo']) / sum(times['eplb']):>6.2f}x")
    g = max(out[r][1]["batched"]["torch_gloo"][0] for r in range(WORLD))
    e = max(out[r][1]["batched"]["eplb"][0] for r in range(WORLD))
    print(f"{'batched move':>14} {g:>13.3f} {e:>9.3f} {g / e:>6.2f}x   (transfer_layer with "
          f"enable_migration_batching: one execute() per batch of vLLM's scheduler)")
    if not same_maps:
        ok = False
        print("the two runs placed differently (vLLM's policy on the same loads)")
    print(f"vllm rearrange: {'every' if ok else 'NOT every'} rank's weights equal the "
          f"reference after each of {args.rearrangements} rearrangements and the batched move, "
          f"with both communicators" + ("" if ok else ": FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
