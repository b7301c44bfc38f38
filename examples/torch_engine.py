#!/usr/bin/env python3
"""An expert-parallel PyTorch engine built the way vLLM's is, with eplb embedded through the
engine's own seams only:

- collectives: eplb's control plane is a gloo group the engine dedicates to it (as vLLM's
  get_eplb_group().cpu_group); eplb joins no rendezvous of its own;
- weights: each rank's experts live in the engine's tensors, in vLLM's FusedMoE layout
  (w13_weight [P_local, 2I, H], w2_weight [P_local, H, I] per layer), registered with eplb,
  which reads peers' in place and writes only the slots whose expert changes;
- maps: the router reads the engine's own map tensors (vLLM's logical_to_physical_map
  [L, E, R] padded with -1, logical_replica_count [L, E], physical_to_logical_map [L, P]),
  which eplb writes in place at the step each layer is installed on every rank;
- counters: the router counts tokens per physical slot into expert_load_pass [L, P] int32,
  which eplb reads once per step (record_pass).
The forward thread calls rb.step_end() once per pass, and nothing else of eplb's.

N rank processes (torch.multiprocessing, or under torchrun) run a small MoE decoder: random
expert weights from a seed, several MoE layers, top-k routing drawn from real expert loads
(DeepSeek-V3's published prefill statistics, folded onto --experts experts; or the FLAME-MoE
routing trace). Tokens go to the rank holding the replica the engine's maps name (all-to-all
on the engine's world group), are computed there, and come back. Weights and activations are
small dyadic fractions, so every sum is exact in float32: the outputs cannot depend on how the
ranks batch tokens, and every output is compared, bit for bit, with a single-process reference
of the same model. A mismatch can only be a wrong expert in a slot or a wrong map.

--propose: the engine keeps its own policy, as vLLM does (a vLLM EPLB policy class,
eplb.integrations.vllm's, over the engine's own all-reduced load window, every --interval
steps), and eplb's runtime only moves and installs what it decides (Rebalancer.propose).

--elastic: vLLM's elastic EP. The engine's groups are gloo ProcessGroups it builds itself on a
store of its own (stateless: outside torch's world map). When --kill-rank dies at --at-step, the
survivors' all-to-all fails; the launcher publishes the new membership, the survivors build new
groups, hand eplb theirs (rb.reconfigure(group=, members=)), re-slice their maps to the members'
slots as vLLM does (bind_maps again) and serve the step again. eplb restores the lost experts
from its backup copies; until a layer is repaired, a token's choice of an expert no slot serves
is left out of its sum (and of the reference's). --rejoin-at-step: a new process takes the seat
back at that step (Rebalancer.join, then the same reconfigure on every member).

    PYTHONPATH=<build>/python python3 examples/torch_engine.py [--ranks 4 --steps 64] [--json]
    PYTHONPATH=<build>/python python3 examples/torch_engine.py --compare       # off, sync, async
    PYTHONPATH=<build>/python python3 examples/torch_engine.py --propose
    PYTHONPATH=<build>/python python3 examples/torch_engine.py --kill-rank 1 --at-step 20
    PYTHONPATH=<build>/python python3 examples/torch_engine.py --kill-rank 1 --at-step 20 \
        --elastic --rejoin-at-step 60 --steps 96
    torchrun --nproc-per-node 4 examples/torch_engine.py --json

--json prints one JSON document on standard output and nothing else (logs go to standard
error).
"""

import argparse
import csv
import datetime
import glob
import json
import os
import signal
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import eplb
from eplb.integrations import vllm as eplb_vllm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_LOAD = os.path.join(ROOT, "data", "deepseek-v3-sglang", "prefill_in1024.json")
GROUP_TIMEOUT = datetime.timedelta(seconds=60)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4, help="rank processes (not under torchrun)")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--layers", type=int, default=4, help="MoE layers")
    p.add_argument("--experts", type=int, default=64, help="logical experts per layer")
    p.add_argument("--redundant", type=int, default=None,
                   help="redundant slots per layer (default 16; with --elastic at least the "
                        "fewest that leave every expert a slot on the ranks left)")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--intermediate", type=int, default=16)
    p.add_argument("--tokens-per-rank", type=int, default=64)
    p.add_argument("--interval", type=int, default=16)
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--mode", choices=["async", "sync", "off"], default="async")
    p.add_argument("--policy", choices=["sticky", "balanced", "deepseek"], default="sticky")
    p.add_argument("--propose", action="store_true",
                   help="the engine's own policy places (vLLM's policy interface), eplb's "
                        "runtime moves and installs (Rebalancer.propose)")
    p.add_argument("--load", default=None,
                   help="SGLang statistics JSON (logical_count) to draw routes from "
                        f"(default {os.path.relpath(DEFAULT_LOAD, ROOT)})")
    p.add_argument("--trace", default=None, help="a routing trace CSV to draw routes from")
    p.add_argument("--compare", action="store_true", help="run off, sync and async in turn")
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--at-step", type=int, default=-1)
    p.add_argument("--elastic", action="store_true",
                   help="with --kill-rank: the survivors rebuild their groups and keep serving")
    p.add_argument("--rejoin-at-step", type=int, default=-1,
                   help="with --elastic: a new process takes the killed rank's seat back")
    p.add_argument("--backup-copies", type=int, default=2,
                   help="with --elastic: host copies of every expert kept across the ranks")
    p.add_argument("--timeout-ms", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true",
                   help="print the summary as one JSON document (logs go to standard error)")
    args = p.parse_args(argv)
    if args.ranks < 1:
        p.error(f"--ranks {args.ranks} must be at least 1")
    if args.redundant is None:
        args.redundant = 16
        # Elastic: enough slots that the ranks left after one loss hold every expert.
        while args.elastic and ((args.experts + args.redundant) % args.ranks or
                                (args.ranks - 1) * ((args.experts + args.redundant) //
                                                    args.ranks) < args.experts):
            args.redundant += 1
    physical = args.experts + args.redundant
    if physical % args.ranks:
        p.error(f"--experts + --redundant = {physical} slots must split evenly over --ranks "
                f"{args.ranks}")
    if args.top_k > args.experts:
        p.error(f"--top-k {args.top_k} is more than --experts {args.experts}")
    if (args.kill_rank >= 0) != (args.at_step >= 0):
        p.error("--kill-rank and --at-step go together")
    if args.kill_rank >= args.ranks:
        p.error(f"--kill-rank {args.kill_rank} is not a rank of --ranks {args.ranks}")
    if args.elastic:
        if args.kill_rank < 0:
            p.error("--elastic needs --kill-rank R --at-step S (the rank it survives)")
        if args.mode == "off" or args.compare:
            p.error("--elastic needs eplb: --mode async or sync, without --compare")
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            p.error("--elastic runs under this example's own launcher, not torchrun (there "
                    "torchelastic restarts the whole job)")
        left = (args.ranks - 1) * (physical // args.ranks)
        if left < args.experts:
            p.error(f"--elastic: after a loss {args.ranks - 1} ranks x {physical // args.ranks} "
                    f"slots = {left} slots cannot hold {args.experts} experts: raise --redundant "
                    f"(or leave it out)")
        if not 1 <= args.backup_copies <= args.ranks:
            p.error(f"--backup-copies {args.backup_copies} is outside [1, {args.ranks}]")
    if args.rejoin_at_step >= 0 and (not args.elastic or args.rejoin_at_step <= args.at_step):
        p.error("--rejoin-at-step needs --elastic and a step after --at-step")
    if args.propose and args.mode == "off":
        p.error("--propose needs eplb: --mode async or sync")
    return args


# ---------------------------------------------------------------------------- the model
def route_probabilities(args):
    """[layers, experts] float64: the share of tokens each expert receives, from real loads."""
    if args.trace:  # layer,token,experts,weights: count each layer's routes
        layers = {}
        with open(args.trace) as f:
            for row in csv.DictReader(f):
                experts = [int(e) for e in row["experts"].split()]
                layers.setdefault(int(row["layer"]), []).extend(experts)
        width = 1 + max(max(v) for v in layers.values())
        counts = np.stack([np.bincount(layers[l], minlength=width) for l in sorted(layers)])
    else:
        from eplb.integrations import sglang
        counts = sglang.read_expert_distribution(args.load or DEFAULT_LOAD)[0]
        counts = counts[counts.sum(axis=1) > 0]  # DeepSeek-V3's dense layers have no load
    counts = counts[np.arange(args.layers) % counts.shape[0]]
    folded = np.zeros((args.layers, args.experts))
    for e in range(counts.shape[1]):  # fold the file's experts onto ours, keeping their skew
        folded[:, e % args.experts] += counts[:, e]
    return folded / folded.sum(axis=1, keepdims=True)


def dyadic(generator, shape, levels, scale):
    """Random values in {-levels..levels} / scale: exact in float32."""
    return (torch.randint(-levels, levels + 1, shape, generator=generator).float() / scale)


def expert_weights(args, layer, expert):
    """(w13 [2I, H], w2 [H, I]) of one expert, from the seed: every process makes the same."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + layer * 10_007 + expert)
    w13 = dyadic(g, (2 * args.intermediate, args.hidden), 2, 8)
    w2 = dyadic(g, (args.hidden, args.intermediate), 2, 8)
    return w13, w2


def ffn(x, w13, w2):
    """An expert: [n, H] -> [n, H], relu-gated. Products and sums stay exact in float32
    (x in [-2, 2] in steps of 1/4, weights in steps of 1/8), whatever the batch."""
    h = x @ w13.t()
    gate, up = h.chunk(2, dim=-1)
    return (torch.relu(gate) * up) @ w2.t()


def combine(x, outputs):
    """The layer's output: the residual plus each chosen expert's output rounded to 1/4, scaled
    back into [-2, 2] (every operation exact or element-wise, so the same on every rank)."""
    total = x + sum(torch.round(y * 4) / 4 for y in outputs)
    return torch.clamp(torch.round(total / 64 * 4) / 4, -2, 2)


def draw_tokens(args, step, rank, probabilities):
    """This rank's tokens of a step: inputs [T, H] and each layer's top-k experts [L, T, K]."""
    g = torch.Generator().manual_seed(args.seed * 7919 + step * 104_729 + rank * 1_299_709)
    x = torch.randint(-8, 9, (args.tokens_per_rank, args.hidden), generator=g).float() / 4
    p = torch.from_numpy(probabilities)
    topk = torch.stack([torch.multinomial(p[l].expand(args.tokens_per_rank, -1), args.top_k,
                                          replacement=False, generator=g)
                        for l in range(args.layers)])
    return x, topk


def reference(args, x, topk, weights, dropped=None):
    """The same model in one process, every expert at hand. `dropped`: per layer, the experts
    no slot served at that pass (after a lost rank, until the repair installs them): a token's
    choice of one of them is left out of its sum, as the engine leaves it out."""
    zero = torch.zeros(args.hidden)
    for l in range(args.layers):
        gone = dropped[l] if dropped else ()
        outputs = [torch.stack([zero if int(topk[l, t, k]) in gone else
                                ffn(x[t:t + 1], *weights[l][int(topk[l, t, k])])[0]
                                for t in range(x.shape[0])]) for k in range(args.top_k)]
        x = combine(x, outputs)
    return x


# ---------------------------------------------------------------------------- the groups
def all_to_all(pg, out, inp, out_splits, in_splits):
    """An all-to-all on `pg`, through the group's own methods (in torch's world map or not)."""
    pg.alltoall_base(out, inp, out_splits, in_splits, dist.AllToAllOptions()).wait()


def all_reduce(pg, t, op=dist.ReduceOp.SUM):
    options = dist.AllreduceOptions()
    options.reduceOp = op
    pg.allreduce([t], options).wait()


class Membership:
    """The membership board of an elastic run: members-<epoch>.json in the run's folder, the
    seats (ranks of the layout) of each group, by rank in it. The launcher writes the one
    after a loss; the members write the one that takes a seat back."""

    def __init__(self, folder):
        self.folder = folder

    def path(self, epoch):
        return os.path.join(self.folder, f"members-{epoch}.json")

    def write(self, epoch, seats):
        tmp = self.path(epoch) + f".{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump({"epoch": epoch, "seats": sorted(seats)}, f)
        os.replace(tmp, self.path(epoch))

    def wait(self, epoch, timeout=120, seat=None):
        """(epoch, seats) of `epoch`, once published; with `seat`, of the first epoch from
        `epoch` on that lists it. eplb.Timeout after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.path.exists(self.path(epoch)):
                with open(self.path(epoch)) as f:
                    seats = json.load(f)["seats"]
                if seat is None or seat in seats:
                    return epoch, seats
                epoch += 1
                continue
            time.sleep(0.02)
        raise eplb.Timeout(f"no membership of epoch {epoch}"
                           f"{'' if seat is None else f' listing seat {seat}'} within "
                           f"{timeout} s")


def stateless_groups(folder, epoch, rank, size):
    """The engine's two gloo groups of one membership epoch, built on a store of its own, not in
    torch's world map (as vLLM's elastic EP builds them): the world (all-to-alls, figures) and
    the one it dedicates to eplb."""
    store = dist.FileStore(os.path.join(folder, f"store-{epoch}"), size)
    world = dist.ProcessGroupGloo(dist.PrefixStore("world", store), rank, size, GROUP_TIMEOUT)
    eplb_group = dist.ProcessGroupGloo(dist.PrefixStore("eplb", store), rank, size,
                                       GROUP_TIMEOUT)
    return world, eplb_group


# ---------------------------------------------------------------------------- one rank
class Engine:
    """One rank: its weights, maps and counters, the forward pass, and eplb beside them.

    `seat` is the rank's place in the layout (its slots [seat * P_local, ...)); `board` the
    membership board of an elastic run (None: a fixed world); `joining`: for a new process taking
    a lost seat back, the first epoch that may list it (None otherwise)."""

    def __init__(self, args, seat, world, probabilities, board=None, joining=None):
        self.args, self.seat, self.world = args, seat, world
        self.probabilities = probabilities
        self.board = board
        E, L = args.experts, args.layers
        P = E + args.redundant
        self.P, self.spr = P, P // world
        # The engine's map tensors, vLLM's layout and sizes (R = num_redundant + 1), its initial
        # placement (expert p % E in slot p, as vLLM starts) and its per-pass counters. The
        # slot-indexed ones are buffers of the layout's width, of which the engine uses the
        # members' slots (vLLM re-slices them under elastic EP): views [:, :members * P_local].
        self.log2phy = torch.full((L, E, args.redundant + 1), -1, dtype=torch.int64)
        self.logcnt = torch.zeros((L, E), dtype=torch.int64)
        self.phy2log_buffer = torch.tensor([[p % E for p in range(P)]] * L, dtype=torch.int64)
        self.load_pass_buffer = torch.zeros((L, P), dtype=torch.int32)
        self.use_slots(P)
        # The engine's expert weights, FusedMoE's layout, loaded per its initial placement (a
        # process taking a seat back loads nothing: eplb fills its slots).
        self.all_weights = [[expert_weights(args, l, e) for e in range(E)] for l in range(L)]
        first = seat * self.spr
        if joining is not None:
            self.w13 = [torch.zeros(self.spr, 2 * args.intermediate, args.hidden)
                        for _ in range(L)]
            self.w2 = [torch.zeros(self.spr, args.hidden, args.intermediate) for _ in range(L)]
        else:
            self.w13 = [torch.stack([self.all_weights[l][int(self.phy2log[l, first + j])][0]
                                     for j in range(self.spr)]) for l in range(L)]
            self.w2 = [torch.stack([self.all_weights[l][int(self.phy2log[l, first + j])][1]
                                    for j in range(self.spr)]) for l in range(L)]
        self.window = []  # --propose: the engine's own load window, [L, E] per step
        self.rb = None
        self.epoch, self.members = 0, list(range(world))
        self.rank = seat
        if args.mode == "off":  # no eplb: the engine's maps of its initial placement, by hand
            self.world_group = dist.group.WORLD
            for l in range(L):
                for e in range(E):
                    slots = [p for p in range(P) if int(self.phy2log[l, p]) == e]
                    self.log2phy[l, e, :len(slots)] = torch.tensor(slots)
                    self.logcnt[l, e] = len(slots)
            return
        config = {"experts": E, "physical": P, "interval": 0 if args.propose else args.interval,
                  "window": args.window, "mode": args.mode, "policy": args.policy,
                  "timeout_ms": args.timeout_ms, "on_error": "raise", "min_gain": 0.0}
        weights = {"w13_weight": self.w13, "w2_weight": self.w2}
        if board is None:
            # eplb's control plane: a gloo group of torch's world map the engine dedicates to it.
            self.world_group = dist.group.WORLD
            self.eplb_group = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)
            self.rb = eplb.Rebalancer(config, group=self.eplb_group, transport="shm",
                                      weights=weights, initial=self.phy2log.numpy())
            self.rb.connect()
            self.bind_maps()
            return
        config["backup_copies"] = args.backup_copies
        if joining is not None:
            # A new process for a lost seat: no group yet; it enters with the members'
            # reconfigure() once a membership lists its seat.
            self.rb = eplb.Rebalancer.join(config, seat, world, weights=weights)
            self.join_group(board.wait(joining, seat=seat))
            self.rb.fill_backup(self.backup_of)
            return
        self.epoch, self.members = board.wait(0)
        self.world_group, self.eplb_group = stateless_groups(board.folder, 0,
                                                             self.members.index(seat),
                                                             len(self.members))
        self.rank = self.members.index(seat)
        self.rb = eplb.Rebalancer(config, group=self.eplb_group, transport="shm",
                                  weights=weights, initial=self.phy2log.numpy())
        self.rb.connect()
        self.rb.fill_backup(self.backup_of)
        self.bind_maps()

    def backup_of(self, layer, tensor, expert, view):
        """eplb's backup copy of an expert: the engine's checkpoint (here, the seed)."""
        return self.all_weights[layer][expert][0 if tensor == "w13_weight" else 1]

    def use_slots(self, width):
        """The engine's views of its slot-indexed buffers at `width` slots (vLLM's
        reconfigure_physical_expert_slots): the members' slots, renumbered from 0."""
        self.phy2log = self.phy2log_buffer[:, :width]
        self.expert_load_pass = self.load_pass_buffer[:, :width]
        self.expert_load_pass.zero_()

    def bind_maps(self):
        self.rb.bind_maps(logical_to_physical_map=self.log2phy,
                          logical_replica_count=self.logcnt,
                          physical_to_logical_map=self.phy2log)

    # ------------------------------------------------------------------ elastic EP
    def join_group(self, membership):
        """Onto the group of `membership` (epoch, seats): the engine's new groups, eplb moved
        onto its own (reconfigure), and the maps re-sliced to the members' slots."""
        self.epoch, self.members = membership
        self.rank = self.members.index(self.seat)
        self.world_group, self.eplb_group = stateless_groups(self.board.folder, self.epoch,
                                                             self.rank, len(self.members))
        self.rb.reconfigure(group=self.eplb_group, members=self.members)
        self.use_slots(len(self.members) * self.spr)
        self.bind_maps()

    def shrink(self, step, error):
        """A peer is gone (an all-to-all failed): the next membership, from the launcher."""
        sys.stderr.write(f"torch_engine: seat {self.seat}: step {step}: a peer is gone "
                         f"({str(error).strip()[:120]}); waiting for the new group\n")
        self.join_group(self.board.wait(self.epoch + 1))

    def grow(self, seat):
        """--rejoin-at-step: the members take `seat` back (the lowest member publishes it)."""
        members = sorted(self.members + [seat])
        if self.rank == 0:
            self.board.write(self.epoch + 1, members)
        self.join_group((self.epoch + 1, members))

    # ------------------------------------------------------------------ serving
    def forward(self, step, x, topk):
        """One pass; returns (outputs [T, H], per-layer compute seconds, per-layer tokens,
        per-layer experts no slot served)."""
        args, T, K = self.args, x.shape[0], self.args.top_k
        G = len(self.members)
        compute = torch.zeros(args.layers, dtype=torch.float64)
        tokens = torch.zeros(args.layers, dtype=torch.float64)
        dropped = []
        token_ids = (torch.arange(T) + (step * self.world + self.seat) * T).unsqueeze(1)
        for l in range(args.layers):
            experts = topk[l]                                          # [T, K]
            # The router, from the engine's own maps: replica (token * K + k) mod count. An
            # expert no slot serves (count 0, after a lost rank) is left out of the sum.
            count = self.logcnt[l][experts]
            served = (count > 0).flatten().nonzero().flatten()         # (t, k) served
            dropped.append(set(torch.nonzero(self.logcnt[l] == 0).flatten().tolist()))
            replica = (token_ids * K + torch.arange(K)) % count.clamp(min=1)
            slots = self.log2phy[l][experts, replica].flatten()[served]
            self.expert_load_pass[l].index_add_(0, slots,
                                                torch.ones(slots.numel(), dtype=torch.int32))
            owner = slots // self.spr  # the rank in the group: the maps number its slots
            order = torch.argsort(owner, stable=True)
            send_counts = torch.bincount(owner, minlength=G)
            recv_counts = torch.empty_like(send_counts)
            all_to_all(self.world_group, recv_counts, send_counts, [], [])
            rows = x.repeat_interleave(K, dim=0)[served][order]
            sent_slots = slots[order].to(torch.float32).unsqueeze(1)
            payload = torch.cat([rows, sent_slots], dim=1)
            received = torch.empty(int(recv_counts.sum()), payload.shape[1])
            all_to_all(self.world_group, received, payload, recv_counts.tolist(),
                       send_counts.tolist())
            start = time.perf_counter()
            local = received[:, -1].long() % self.spr
            result = torch.empty(received.shape[0], args.hidden)
            for j in torch.unique(local).tolist():
                mine = local == j
                result[mine] = ffn(received[mine, :-1], self.w13[l][j], self.w2[l][j])
            compute[l] = time.perf_counter() - start
            tokens[l] = received.shape[0]
            back = torch.empty(served.numel(), args.hidden)
            all_to_all(self.world_group, back, result, send_counts.tolist(),
                       recv_counts.tolist())
            outputs = torch.zeros(T * K, args.hidden)
            outputs[served[order]] = back
            outputs = outputs.view(T, K, args.hidden)
            x = combine(x, [outputs[:, k] for k in range(K)])
        return x, compute, tokens, dropped

    def propose(self, step):
        """--propose: the engine's own policy every --interval steps, over its window's load
        all-reduced on its world group (vLLM's rearrange); eplb moves and installs it."""
        counts = eplb_vllm.logical_load(self.expert_load_pass, self.phy2log, self.args.experts)
        self.window = (self.window + [counts])[-self.args.window:]
        if step == 0 or step % self.args.interval or self.rb.rebalancing:
            return
        load = torch.stack(self.window).sum(0)
        all_reduce(self.world_group, load)
        eplb_vllm.propose(self.rb, load, policy=eplb_vllm.make_policy(self.args.policy))

    def run(self):
        args = self.args
        mismatches = checked = dropped_choices = unavailable_steps = 0
        steps = []  # per step: (balancedness, moe_ms, stall_ms)
        step = self.rb.step if self.rb is not None else 0
        while step < args.steps:
            if self.seat == args.kill_rank and step == args.at_step and self.epoch == 0:
                if self.board is not None:  # what it checked, for the run's figures
                    self.report({"seat": self.seat, "mismatches": mismatches,
                                 "checked": checked, "killed_at": step})
                sys.stdout.flush()
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            if step == args.rejoin_at_step and args.kill_rank not in self.members:
                self.grow(args.kill_rank)
            x, topk = draw_tokens(args, step, self.seat, self.probabilities)
            try:
                out, compute, tokens, dropped = self.forward(step, x, topk)
                figures = torch.cat([compute, tokens, -tokens])
                all_reduce(self.world_group, figures, dist.ReduceOp.MAX)  # the busiest rank
                total_tokens = tokens.clone()
                all_reduce(self.world_group, total_tokens)
            except RuntimeError as e:  # a collective of the engine's own: a peer is gone
                if self.board is None:
                    raise self.peer_failure(step, e) from e
                self.shrink(step, e)
                self.expert_load_pass.zero_()
                continue  # the step again, on the new group
            want = reference(args, x, topk, self.all_weights, dropped)
            mismatches += int((out != want).any(dim=1).sum())
            checked += out.shape[0]
            gone = sum(len(d) for d in dropped)
            if gone:
                unavailable_steps += 1
                dropped_choices += sum(int(sum((topk[l] == e).sum() for e in dropped[l]))
                                       for l in range(args.layers) if dropped[l])
            L = args.layers
            balancedness = float(total_tokens.sum() / len(self.members) / figures[L:2 * L].sum())
            stall = 0.0
            if self.rb is not None:
                if args.propose:
                    self.propose(step)
                self.rb.record_pass(self.expert_load_pass, per="slot")
                self.expert_load_pass.zero_()
                start = time.perf_counter()
                self.rb.step_end()  # raises eplb's failure (on_error "raise")
                stall = (time.perf_counter() - start) * 1000
            steps.append((step, balancedness, float(figures[:L].sum()) * 1000, stall))
            step += 1
        history = self.rb.history() if self.rb is not None else []
        if self.rb is not None:
            self.rb.shutdown()
        return {"seat": self.seat, "mismatches": mismatches, "checked": checked,
                "steps": steps, "history": history, "dropped_choices": dropped_choices,
                "unavailable_steps": unavailable_steps, "reconfigures": self.epoch}

    def report(self, result):
        """An elastic run's rank leaves its figures in the run's folder (the killed one too,
        for the steps it served, before it dies)."""
        path = os.path.join(self.board.folder, f"result-{self.seat}-{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(path + ".tmp", path)

    def peer_failure(self, step, error):
        """eplb's failure for a collective of the engine's that failed: eplb's group names the
        ranks whose process exited; eplb abandons any rebalance in flight (shutdown drains its
        control thread, each collective failing at once or at its timeout)."""
        gone = self.rb.exited_ranks() if self.rb is not None else []
        who = ("rank " + " and rank ".join(map(str, gone)) + (" is" if len(gone) == 1 else
                                                               " are")) if gone else "a peer is"
        if self.rb is not None:
            self.rb.shutdown()
        return eplb.IoError(f"rank {self.rank}: step {step}: {who} gone (the engine's "
                            f"all-to-all failed: {str(error).strip()[:160]}); the rebalance in "
                            f"flight is abandoned, no rank waits for it")


def summarize(args, results):
    """The run's figures, from the results of the ranks that served to the end (results[0]
    served every step)."""
    steps = [s[1:] for s in results[0]["steps"]]
    history = results[0]["history"]
    completed = [h for h in history if h["outcome"] == "completed" and not h.get("repair")]
    first = min((h["trigger_step"] for h in history), default=args.steps)
    after = completed[0]["end_step"] if completed else args.steps
    mean = lambda rows, i: float(np.mean([r[i] for r in rows])) if rows else None  # noqa: E731
    before_rows, after_rows = steps[:first], steps[after:]
    stall = {}  # by rebalance: the slowest rank's stall
    for r in results:
        for h in r.get("history", []):
            if h["outcome"] == "completed" and not h.get("repair"):
                stall[h["index"]] = max(stall.get(h["index"], 0.0), h["stall_total_ms"])
    return {
        "control": "torch", "weights": "engine", "maps": "engine", "counters": "engine",
        "policy": "engine" if args.propose else "eplb",
        "mode": args.mode, "ranks": args.ranks, "steps": len(steps),
        "rebalances": len(completed),
        "proposed": sum(1 for h in completed if h.get("proposed")),  # installed
        "proposals": sum(1 for h in history if h.get("proposed")),   # made, any outcome
        "mismatches": sum(r["mismatches"] for r in results),
        "outputs_checked": sum(r["checked"] for r in results),
        "balancedness_before": mean(before_rows, 0), "balancedness_after": mean(after_rows, 0),
        "moe_ms_before": mean(before_rows, 1), "moe_ms_after": mean(after_rows, 1),
        "stall_ms_per_rebalance": [stall[i] for i in sorted(stall)],
        "steps_before": [0, first], "steps_after": [after, args.steps],
        "per_step": {"balancedness": [r[0] for r in steps], "moe_ms": [r[1] for r in steps]},
    }


def same_steps(summary, reference):
    """`summary`'s before and after figures over `reference`'s step ranges (EPLB off beside a
    mode that rebalanced: the same steps, the same tokens)."""
    out = dict(summary)
    per = summary["per_step"]
    for name, key in (("balancedness", "balancedness"), ("moe_ms", "moe_ms")):
        for when in ("before", "after"):
            lo, hi = reference[f"steps_{when}"]
            rows = per[key][lo:hi]
            out[f"{name}_{when}"] = float(np.mean(rows)) if rows else None
    out["steps_before"], out["steps_after"] = reference["steps_before"], reference["steps_after"]
    return out


def rank_main(rank, world, args, init, out_dir):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=GROUP_TIMEOUT)
    torch.set_num_threads(1)
    engine = Engine(args, rank, world, route_probabilities(args))
    try:
        result = engine.run()
    except (eplb.Error, RuntimeError) as e:
        sys.stderr.write(f"torch_engine: {e}\n")  # one write: the ranks share the stream
        sys.stderr.flush()
        # A dead peer: leave without waiting on anyone, a moment after the other survivors saw
        # the failure too (so that each names the rank that died, not this one).
        time.sleep(1)
        os._exit(3)
    gathered = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        summary = summarize(args, gathered)
        if out_dir:
            with open(os.path.join(out_dir, "summary.json"), "w") as f:
                json.dump(summary, f)
        else:
            print_summary(args, [summary])
    dist.barrier()


def elastic_main(seat, world, args, folder, joining):
    """One process of an elastic run: seat `seat`, or (`joining`: the first epoch that may
    list it) the process that takes it back. Its figures go to the run's folder."""
    torch.set_num_threads(1)
    board = Membership(folder)
    try:
        engine = Engine(args, seat, world, route_probabilities(args), board, joining)
        engine.report(engine.run())
    except (eplb.Error, RuntimeError) as e:
        sys.stderr.write(f"torch_engine: seat {seat}: {e}\n")
        sys.stderr.flush()
        os._exit(3)


def print_summary(args, summaries):
    if args.json:
        print(json.dumps(summaries[0] if len(summaries) == 1 else
                         {"modes": {s["mode"]: s for s in summaries}}))
        return
    fmt = lambda v, d=3: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    print("mode    rebalances  mismatches  balancedness before -> after   MoE ms/step before "
          "-> after   stall ms/rebalance")
    for s in summaries:
        print(f"{s['mode']:<7} {s['rebalances']:>10}  {s['mismatches']:>10}  "
              f"{fmt(s['balancedness_before']):>19} -> {fmt(s['balancedness_after']):<6}  "
              f"{fmt(s['moe_ms_before'], 2):>18} -> {fmt(s['moe_ms_after'], 2):<8}  "
              f"{', '.join(f'{x:.2f}' for x in s['stall_ms_per_rebalance']) or '-'}")
    for s in summaries:
        if "elastic" in s:
            e = s["elastic"]
            print(f"elastic: {len(e['lost'])} lost ({', '.join(e['lost'])}), {e['rejoins']} "
                  f"rejoined, {e['unavailable_steps']} steps with an expert unavailable, "
                  f"{e['dropped_choices']} top-k choices dropped, {s['steps']} steps served, "
                  f"{s['mismatches']} mismatches in {s['outputs_checked']} outputs")


def launch(args):
    """Starts --ranks processes and waits for all of them; returns the summary (or None when a
    rank failed) and an exit code. A rank that fails makes the others fail within the timeout;
    any process still there after that is killed: none is left behind."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="eplb-torch-engine-") as folder:
        init = f"file://{folder}/store"
        procs = [ctx.Process(target=rank_main, args=(r, args.ranks, args, init, folder))
                 for r in range(args.ranks)]
        for p in procs:
            p.start()
        deadline = None
        while any(p.is_alive() for p in procs):
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed and deadline is None:
                deadline = time.time() + 2 * args.timeout_ms / 1000 + 10
            if deadline is not None and time.time() > deadline:
                for p in procs:
                    if p.is_alive():
                        p.kill()
            time.sleep(0.05)
        codes = [p.exitcode for p in procs]
        if any(codes):
            for r, c in enumerate(codes):
                if c and c < 0:
                    print(f"torch_engine: rank {r} died (signal {-c})", file=sys.stderr)
            return None, 1
        with open(os.path.join(folder, "summary.json")) as f:
            return json.load(f), 0


def launch_elastic(args):
    """An elastic run: one process per seat and a membership board. A process ended by a signal
    is lost: the board's next epoch leaves its seat out (the survivors wait for it, then build
    their new groups), and with --rejoin-at-step a new process is started for the seat at once
    (it waits for the epoch that lists it). A process that fails with an error ends the run."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="eplb-torch-engine-") as folder:
        board = Membership(folder)
        seats = list(range(args.ranks))
        epoch = 0
        board.write(epoch, seats)
        procs = [(s, ctx.Process(target=elastic_main, args=(s, args.ranks, args, folder, None)))
                 for s in seats]
        for _, p in procs:
            p.start()
        lost, rejoins, failed, deadline = [], 0, [], None
        handled = set()
        while any(p.is_alive() for _, p in procs):
            for i, (s, p) in enumerate(procs):
                if p.exitcode is None or i in handled:
                    continue
                handled.add(i)
                if p.exitcode < 0:  # a signal: the seat is lost, the others go on
                    lost.append(f"rank {s} (pid {p.pid}): signal {-p.exitcode}")
                    seats.remove(s)
                    epoch += 1
                    board.write(epoch, seats)
                    if args.rejoin_at_step >= 0 and rejoins == 0:
                        rejoins += 1
                        q = ctx.Process(target=elastic_main,
                                        args=(s, args.ranks, args, folder, epoch + 1))
                        q.start()
                        procs.append((s, q))
                elif p.exitcode > 0:
                    failed.append(f"rank {s} exited with {p.exitcode}")
                    if deadline is None:
                        deadline = time.time() + 2 * args.timeout_ms / 1000 + 10
            if deadline is not None and time.time() > deadline:
                for _, p in procs:
                    if p.is_alive():
                        p.kill()
            time.sleep(0.05)
        for i, (s, p) in enumerate(procs):  # ended in the last pass
            if i not in handled and p.exitcode and p.exitcode > 0:
                failed.append(f"rank {s} exited with {p.exitcode}")
        results = []
        for path in sorted(glob.glob(os.path.join(folder, "result-*.json"))):
            with open(path) as f:
                results.append(json.load(f))
    for f in failed:
        print(f"torch_engine: {f}", file=sys.stderr)
    served = [r for r in results if "steps" in r and len(r["steps"]) == args.steps]
    if failed or not served:
        return None, 1
    served.sort(key=lambda r: r["seat"])
    summary = summarize(args, served + [r for r in results if r not in served])
    summary["elastic"] = {
        "lost": lost, "rejoins": rejoins,
        "reconfigures": max(r.get("reconfigures", 0) for r in results),
        "unavailable_steps": max(r.get("unavailable_steps", 0) for r in results),
        "dropped_choices": sum(r.get("dropped_choices", 0) for r in results),
        "repairs": sum(1 for h in served[0]["history"] if h.get("repair")
                       and h["outcome"] == "completed"),
    }
    return summary, 0


def main(argv=None):
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, "env://", None)
        return 0
    if args.elastic:
        summary, code = launch_elastic(args)
        if code:
            return code
        print_summary(args, [summary])
        return 0
    modes = ["off", "sync", "async"] if args.compare else [args.mode]
    summaries = []
    for mode in modes:
        args.mode = mode
        summary, code = launch(args)
        if code:
            return code
        summaries.append(summary)
    if args.compare:  # EPLB off over the steps async rebalanced around
        summaries[0] = same_steps(summaries[0], summaries[-1])
    print_summary(args, summaries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
