#!/usr/bin/env python3
"""An expert-parallel PyTorch engine built the way vLLM's is, with eplb embedded through the
engine's own seams only:

- collectives: eplb's control plane is a torch.distributed gloo group the engine dedicates to
  it (as vLLM's get_eplb_group().cpu_group); eplb joins no rendezvous of its own;
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

    PYTHONPATH=<build>/python python3 examples/torch_engine.py [--ranks 4 --steps 64] [--json]
    PYTHONPATH=<build>/python python3 examples/torch_engine.py --compare       # off, sync, async
    PYTHONPATH=<build>/python python3 examples/torch_engine.py --kill-rank 1 --at-step 20
    torchrun --nproc-per-node 4 examples/torch_engine.py --json
"""

import argparse
import csv
import datetime
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_LOAD = os.path.join(ROOT, "data", "deepseek-v3-sglang", "prefill_in1024.json")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4, help="rank processes (not under torchrun)")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--layers", type=int, default=4, help="MoE layers")
    p.add_argument("--experts", type=int, default=64, help="logical experts per layer")
    p.add_argument("--redundant", type=int, default=16, help="redundant slots per layer")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--intermediate", type=int, default=16)
    p.add_argument("--tokens-per-rank", type=int, default=64)
    p.add_argument("--interval", type=int, default=16)
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--mode", choices=["async", "sync", "off"], default="async")
    p.add_argument("--policy", choices=["sticky", "balanced", "deepseek"], default="sticky")
    p.add_argument("--load", default=None,
                   help="SGLang statistics JSON (logical_count) to draw routes from "
                        f"(default {os.path.relpath(DEFAULT_LOAD, ROOT)})")
    p.add_argument("--trace", default=None, help="a routing trace CSV to draw routes from")
    p.add_argument("--compare", action="store_true", help="run off, sync and async in turn")
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--at-step", type=int, default=-1)
    p.add_argument("--timeout-ms", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    args = p.parse_args(argv)
    physical = args.experts + args.redundant
    if args.ranks < 1 or physical % args.ranks:
        p.error(f"--experts + --redundant = {physical} slots must split evenly over --ranks "
                f"{args.ranks}")
    if args.top_k > args.experts:
        p.error(f"--top-k {args.top_k} is more than --experts {args.experts}")
    if (args.kill_rank >= 0) != (args.at_step >= 0):
        p.error("--kill-rank and --at-step go together")
    if args.kill_rank >= args.ranks:
        p.error(f"--kill-rank {args.kill_rank} is not a rank of --ranks {args.ranks}")
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


def reference(args, x, topk, weights):
    """The same model in one process, every expert at hand."""
    for l in range(args.layers):
        outputs = [torch.stack([ffn(x[t:t + 1], *weights[l][int(topk[l, t, k])])[0]
                                for t in range(x.shape[0])]) for k in range(args.top_k)]
        x = combine(x, outputs)
    return x


# ---------------------------------------------------------------------------- one rank
class Engine:
    """One rank: its weights, maps and counters, the forward pass, and eplb beside them."""

    def __init__(self, args, rank, world, probabilities):
        self.args, self.rank, self.world = args, rank, world
        self.probabilities = probabilities
        E, L = args.experts, args.layers
        P = E + args.redundant
        self.P, self.spr = P, P // world
        # The engine's map tensors, vLLM's layout and sizes (R = num_redundant + 1), and its
        # initial placement (expert p % E in slot p, as vLLM starts).
        self.log2phy = torch.full((L, E, args.redundant + 1), -1, dtype=torch.int64)
        self.logcnt = torch.zeros((L, E), dtype=torch.int64)
        self.phy2log = torch.tensor([[p % E for p in range(P)]] * L, dtype=torch.int64)
        self.expert_load_pass = torch.zeros((L, P), dtype=torch.int32)
        # The engine's expert weights, FusedMoE's layout, loaded per its initial placement.
        self.all_weights = [[expert_weights(args, l, e) for e in range(E)] for l in range(L)]
        first = rank * self.spr
        self.w13 = [torch.stack([self.all_weights[l][int(self.phy2log[l, first + j])][0]
                                 for j in range(self.spr)]) for l in range(L)]
        self.w2 = [torch.stack([self.all_weights[l][int(self.phy2log[l, first + j])][1]
                                for j in range(self.spr)]) for l in range(L)]
        self.rb = None
        if args.mode != "off":
            # eplb's control plane: a gloo group the engine dedicates to it.
            self.eplb_group = dist.new_group(backend="gloo",
                                             timeout=datetime.timedelta(seconds=60))
            config = {"experts": E, "physical": P, "interval": args.interval,
                      "window": args.window, "mode": args.mode, "policy": args.policy,
                      "timeout_ms": args.timeout_ms, "on_error": "raise", "min_gain": 0.0}
            self.rb = eplb.Rebalancer(config, group=self.eplb_group, transport="shm",
                                      weights={"w13_weight": self.w13, "w2_weight": self.w2},
                                      initial=self.phy2log.numpy())
            self.rb.connect()
            self.rb.bind_maps(logical_to_physical_map=self.log2phy,
                              logical_replica_count=self.logcnt,
                              physical_to_logical_map=self.phy2log)
        else:  # no eplb: the engine's maps of its initial placement, filled by hand
            for l in range(L):
                for e in range(E):
                    slots = [p for p in range(P) if int(self.phy2log[l, p]) == e]
                    self.log2phy[l, e, :len(slots)] = torch.tensor(slots)
                    self.logcnt[l, e] = len(slots)

    def forward(self, step, x, topk):
        """One pass; returns (outputs [T, H], per-layer compute seconds, per-layer tokens)."""
        args, T, K = self.args, x.shape[0], self.args.top_k
        compute = torch.zeros(args.layers, dtype=torch.float64)
        tokens = torch.zeros(args.layers, dtype=torch.float64)
        token_ids = (torch.arange(T) + (step * self.world + self.rank) * T).unsqueeze(1)
        for l in range(args.layers):
            experts = topk[l]                                          # [T, K]
            # The router, from the engine's own maps: replica (token * K + k) mod count.
            replica = (token_ids * K + torch.arange(K)) % self.logcnt[l][experts]
            slots = self.log2phy[l][experts, replica]                  # [T, K]
            self.expert_load_pass[l].index_add_(0, slots.flatten(),
                                                torch.ones(T * K, dtype=torch.int32))
            owner = (slots // self.spr).flatten()
            order = torch.argsort(owner, stable=True)
            send_counts = torch.bincount(owner, minlength=self.world)
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts)
            rows = x.repeat_interleave(K, dim=0)[order]
            sent_slots = slots.flatten()[order].to(torch.float32).unsqueeze(1)
            payload = torch.cat([rows, sent_slots], dim=1)
            received = torch.empty(int(recv_counts.sum()), payload.shape[1])
            dist.all_to_all_single(received, payload, recv_counts.tolist(),
                                   send_counts.tolist())
            start = time.perf_counter()
            local = received[:, -1].long() - self.rank * self.spr
            result = torch.empty(received.shape[0], args.hidden)
            for j in torch.unique(local).tolist():
                mine = local == j
                result[mine] = ffn(received[mine, :-1], self.w13[l][j], self.w2[l][j])
            compute[l] = time.perf_counter() - start
            tokens[l] = received.shape[0]
            back = torch.empty(T * K, args.hidden)
            dist.all_to_all_single(back, result, send_counts.tolist(), recv_counts.tolist())
            outputs = torch.empty(T * K, args.hidden)
            outputs[order] = back
            outputs = outputs.view(T, K, args.hidden)
            x = combine(x, [outputs[:, k] for k in range(K)])
        return x, compute, tokens

    def run(self):
        args = self.args
        mismatches = checked = 0
        steps = []  # per step: (balancedness, moe_ms, stall_ms)
        for step in range(args.steps):
            if self.rank == args.kill_rank and step == args.at_step:
                sys.stdout.flush()
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            x, topk = draw_tokens(args, step, self.rank, self.probabilities)
            try:
                out, compute, tokens = self.forward(step, x, topk)
                figures = torch.cat([compute, tokens, -tokens])
                dist.all_reduce(figures, op=dist.ReduceOp.MAX)  # the busiest rank, per layer
                total_tokens = tokens.clone()
                dist.all_reduce(total_tokens)
            except RuntimeError as e:  # a collective of the engine's own: a peer is gone
                raise self.peer_failure(step, e) from e
            want = reference(args, x, topk, self.all_weights)
            wrong = int((out != want).any(dim=1).sum())
            mismatches += wrong
            checked += out.shape[0]
            L = args.layers
            balancedness = float(total_tokens.sum() / self.world / figures[L:2 * L].sum())
            stall = 0.0
            if self.rb is not None:
                self.rb.record_pass(self.expert_load_pass)
                self.expert_load_pass.zero_()
                start = time.perf_counter()
                self.rb.step_end()  # raises eplb's failure (on_error "raise")
                stall = (time.perf_counter() - start) * 1000
            steps.append((balancedness, float(figures[:L].sum()) * 1000, stall))
        history = self.rb.history() if self.rb is not None else []
        if self.rb is not None:
            self.rb.shutdown()
        return {"rank": self.rank, "mismatches": mismatches, "checked": checked,
                "steps": steps, "history": history}

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
    """The run's figures, from every rank's results (all ranks ran every step)."""
    steps = results[0]["steps"]
    histories = [r["history"] for r in results]
    completed = [h for h in histories[0] if h["outcome"] == "completed"]
    first = min((h["trigger_step"] for h in histories[0]), default=args.steps)
    after = completed[0]["end_step"] if completed else args.steps
    mean = lambda rows, i: float(np.mean([r[i] for r in rows])) if rows else None  # noqa: E731
    before_rows, after_rows = steps[:first], steps[after:]
    stalls = [max(h[i]["stall_total_ms"] for h in histories) for i in range(len(completed))] \
        if completed else []
    return {
        "control": "torch", "weights": "engine", "maps": "engine", "counters": "engine",
        "mode": args.mode, "ranks": len(results), "steps": args.steps,
        "rebalances": len(completed),
        "mismatches": sum(r["mismatches"] for r in results),
        "outputs_checked": sum(r["checked"] for r in results),
        "balancedness_before": mean(before_rows, 0), "balancedness_after": mean(after_rows, 0),
        "moe_ms_before": mean(before_rows, 1), "moe_ms_after": mean(after_rows, 1),
        "stall_ms_per_rebalance": stalls,
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
                            timeout=datetime.timedelta(seconds=60))
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


def main(argv=None):
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, "env://", None)
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
