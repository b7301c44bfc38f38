#!/usr/bin/env python3
"""A minimal expert-parallel PyTorch MoE loop on CPU, rebalanced live by eplb.

Every rank is a process started with torch.multiprocessing (spawn). eplb's control plane runs on
gloo (a FileStore in a temporary folder); the engine's own collectives (the token exchange and
the combine) run on torch.distributed's gloo group. By default the expert weights live in
eplb's arena: each rank computes with torch tensors that are views of it. With --own-weights the
model creates its experts as nn.Parameters the way an engine does at model load (per layer and
tensor, [local experts, ...]) and registers them with eplb, which reads its peers' in place and
writes into them only the slots whose expert changes. Either way eplb moves experts between the
ranks while the loop keeps running.

Per step and layer, each rank:
  1. routes its tokens (a synthetic router whose hot experts all start on rank 0 and move halfway
     through, or the bundled FLAME-MoE trace with --trace) and records the top-k ids in eplb;
  2. maps every (token, k) to a physical slot with eplb's dispatch tables (rb.route);
  3. exchanges tokens (all_gather stands in for the all-to-all), runs the experts of its own
     slots on the tokens sent to them, and combines the results (all_reduce);
  4. checks its output against a reference computed with freshly generated expert weights.
After every step it checks, bit for bit, that each of its slots holds the weights of the expert
eplb says is there, then calls rb.step_end() and fetches the weight views again.

    PYTHONPATH=<build>/python python3 examples/torch_moe.py [--ranks 2 --steps 120 ...]
    PYTHONPATH=<build>/python python3 examples/torch_moe.py --own-weights
    PYTHONPATH=<build>/python python3 examples/torch_moe.py --trace data/flame-moe-290m/routing_top6.csv
    PYTHONPATH=<build>/python python3 examples/torch_moe.py --json   # one JSON document on stdout
"""

import argparse
import csv
import json
import os
import sys
import tempfile
import time
import zlib

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import eplb


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--redundant", type=int, default=4, help="redundant slots per layer")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank per step")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--interval", type=int, default=20)
    p.add_argument("--window", type=int, default=20)
    p.add_argument("--lag", type=int, default=2)
    p.add_argument("--mode", choices=["async", "sync"], default="async")
    p.add_argument("--agreement", choices=["internal", "external"], default="internal",
                   help="external: carry eplb's per-step agreement on a torch.distributed "
                        "all-reduce instead of eplb's control plane")
    p.add_argument("--policy", choices=["sticky", "balanced", "deepseek"], default="sticky")
    p.add_argument("--trace", help="routing trace CSV (data/flame-moe-290m/routing_top6.csv): "
                                   "64 experts, top-6; overrides --experts and --top-k")
    p.add_argument("--control", default=None, help="eplb control backend (default gloo)")
    p.add_argument("--workdir", help="folder for the rendezvous files (default: a temp folder)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--own-weights", action="store_true",
                   help="the model allocates its experts as nn.Parameters and registers them")
    p.add_argument("--json", action="store_true",
                   help="print the summary as one JSON object (logs go to standard error)")
    args = p.parse_args(argv)
    if args.trace:
        args.experts, args.top_k = 64, 6
    return args


# ------------------------------------------------------------------------ the model's parts
def generator(*key):
    """A torch generator seeded from `key`, the same in every process (unlike hash())."""
    g = torch.Generator()
    g.manual_seed(zlib.crc32(repr(key).encode()))
    return g


def expert_weights(args, layer, expert):
    """The weights of one expert, generated from (seed, layer, expert): the reference and the
    arena's initial fill both come from here, so a slot is right iff it equals this."""
    g = generator(args.seed, "expert", layer, expert)
    w13 = torch.randn(2 * args.ffn, args.hidden, generator=g) / args.hidden ** 0.5
    w2 = torch.randn(args.hidden, args.ffn, generator=g) / args.ffn ** 0.5
    return w13, w2


def expert_ffn(x, w13, w2):
    """SwiGLU expert: x [n, hidden] -> [n, hidden]."""
    gate, up = (x @ w13.t()).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ w2.t()


class Router:
    """Synthetic skewed top-k router, or top-k from a routing trace."""

    def __init__(self, args):
        self.args = args
        g = generator(args.seed, "router")
        self.weight = torch.randn(args.layers, args.hidden, args.experts, generator=g) * 0.1
        self.trace = load_trace(args.trace) if args.trace else None

    def __call__(self, layer, step, rank, h):
        a = self.args
        if self.trace is not None:
            ids, probs = self.trace
            tokens = (np.arange(a.tokens) + (step * a.ranks + rank) * a.tokens) % ids.shape[1]
            l = layer % ids.shape[0]
            topk_ids = torch.from_numpy(ids[l, tokens]).long()
            topk_w = torch.from_numpy(probs[l, tokens])
        else:
            # A quarter of the experts is hot. Under the trivial placement (slot p holds expert
            # p % experts) experts [redundant, slots_per_rank) live on rank 0 alone: the hot ones
            # start there, and move to the last experts (on the last rank) halfway through.
            hot = torch.zeros(a.experts)
            quarter = max(a.experts // 4, 1)
            if step < a.steps // 2:
                hot[a.redundant:a.redundant + quarter] = 3.0
            else:
                hot[-quarter:] = 3.0
            logits = h @ self.weight[layer] + hot
            topk_w, topk_ids = logits.softmax(dim=-1).topk(a.top_k, dim=-1)
        return topk_ids, topk_w / topk_w.sum(dim=-1, keepdim=True)


def load_trace(path):
    """ids int32 [layers, tokens, top_k], probs float32 [layers, tokens, top_k]."""
    rows = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            rows.setdefault(int(row["layer"]), []).append(
                (int(row["token"]), [int(e) for e in row["experts"].split()],
                 [float(w) for w in row["weights"].split()]))
    layers = sorted(rows)
    ids = np.array([[e for _, e, _ in sorted(rows[l])] for l in layers], dtype=np.int32)
    probs = np.array([[w for _, _, w in sorted(rows[l])] for l in layers], dtype=np.float32)
    return ids, probs


def step_tokens(args, step, rank):
    return torch.randn(args.tokens, args.hidden, generator=generator(args.seed, "x", step, rank))


# ------------------------------------------------------------------------------- one rank
def run_rank(rank, args, workdir):
    torch.set_num_threads(1)
    G, T, H = args.ranks, args.tokens, args.hidden
    dist.init_process_group("gloo", init_method="file://" + os.path.join(workdir, "torch-store"),
                            rank=rank, world_size=G)
    control = args.control or ("gloo" if "gloo" in eplb.control_backends() else "shm")
    rendezvous = (os.path.join(workdir, "eplb-store") if control == "gloo"
                  else "eplb-example-" + os.path.basename(workdir))
    config = {"experts": args.experts, "physical": args.experts + args.redundant,
              "interval": args.interval, "window": args.window, "lag": args.lag,
              "mode": args.mode, "policy": args.policy, "dispatch": "static",
              "agreement": args.agreement}
    # The expert weights: one gate_up and one down tensor per expert, float32.
    weights = {"gate_up": ((2 * args.ffn, H), torch.float32), "down": ((H, args.ffn), torch.float32)}
    params = None
    if args.own_weights:
        # As an engine's fused-MoE layer: its parameters, allocated at model load, never moved.
        spr = (args.experts + args.redundant) // G
        params = torch.nn.ParameterList()
        for _ in range(args.layers):
            params.append(torch.nn.Parameter(torch.zeros(spr, 2 * args.ffn, H), requires_grad=False))
            params.append(torch.nn.Parameter(torch.zeros(spr, H, args.ffn), requires_grad=False))
        weights = {"gate_up": [params[2 * l].data for l in range(args.layers)],
                   "down": [params[2 * l + 1].data for l in range(args.layers)]}
    reference = [[expert_weights(args, l, e) for e in range(args.experts)]
                 for l in range(args.layers)]
    router = Router(args)
    worst = 0.0
    balance = []  # per step: mean over layers of (mean rank load / max rank load)
    start = time.perf_counter()

    with eplb.Rebalancer(config, rank, G, control=control, rendezvous=rendezvous,
                         transport="shm", weights=weights, layers=args.layers) as rb:
        held = rb.connect()
        rb.fill_weights(lambda l, name, e: reference[l][e][0 if name == "gate_up" else 1])
        spr = rb.slots_per_rank
        if params is not None:
            pointers = [p.data_ptr() for p in params]

        for step in range(args.steps):
            h = step_tokens(args, step, rank)
            step_balance = []
            for layer in range(args.layers):
                # Views of the arena: fetched again every step (valid until step_end()).
                w13 = rb.weights(layer, "gate_up")  # [slots_per_rank, 2 * ffn, hidden]
                w2 = rb.weights(layer, "down")      # [slots_per_rank, hidden, ffn]
                topk_ids, topk_w = router(layer, step, rank, h)
                rb.record(layer, topk_ids)
                slots = rb.route(layer, topk_ids, first_token=(step * G + rank) * T)

                # Dispatch: every rank sees every rank's tokens and slots (an all-to-all would
                # send each only its own), and computes the (token, k) sent to its slots.
                all_h = [torch.empty_like(h) for _ in range(G)]
                all_slots = [torch.empty_like(slots) for _ in range(G)]
                all_w = [torch.empty_like(topk_w) for _ in range(G)]
                dist.all_gather(all_h, h)
                dist.all_gather(all_slots, slots)
                dist.all_gather(all_w, topk_w)
                partial = torch.zeros(G, T, H)
                for src in range(G):
                    owner, local = all_slots[src] // spr, all_slots[src] % spr
                    for j in range(spr):
                        tok, k = torch.nonzero((owner == rank) & (local == j), as_tuple=True)
                        if tok.numel() == 0:
                            continue
                        y = expert_ffn(all_h[src][tok], w13[j], w2[j]) * all_w[src][tok, k, None]
                        partial[src].index_add_(0, tok, y)
                dist.all_reduce(partial)  # combine: each rank keeps its own tokens' row
                out = partial[rank]

                # Reference: the same tokens through freshly generated weights of each expert.
                ref = torch.zeros(T, H)
                for k in range(topk_ids.shape[1]):
                    for e in topk_ids[:, k].unique().tolist():
                        tok = torch.nonzero(topk_ids[:, k] == e, as_tuple=True)[0]
                        w13_e, w2_e = reference[layer][e]
                        ref.index_add_(0, tok, expert_ffn(h[tok], w13_e, w2_e) * topk_w[tok, k, None])
                worst = max(worst, (out - ref).abs().max().item())
                if not torch.allclose(out, ref, rtol=1e-4, atol=1e-5):
                    raise AssertionError(f"rank {rank} step {step} layer {layer}: output differs "
                                         f"from the reference by {(out - ref).abs().max():.3g}")

                rank_load = torch.bincount(torch.cat(all_slots).flatten() // spr, minlength=G)
                step_balance.append((rank_load.float().mean() / rank_load.max()).item())
                h = h + out

            # Every slot holds its expert's weights, bit for bit.
            for layer in range(args.layers):
                w13, w2 = rb.weights(layer, "gate_up"), rb.weights(layer, "down")
                for j, e in enumerate(rb.local_experts(layer).tolist()):
                    if not (torch.equal(w13[j], reference[layer][e][0])
                            and torch.equal(w2[j], reference[layer][e][1])):
                        raise AssertionError(f"rank {rank} step {step}: layer {layer} slot {j} "
                                             f"does not hold expert {e}")
                if params is not None and (w13.data_ptr() != params[2 * layer].data_ptr() or
                                           w2.data_ptr() != params[2 * layer + 1].data_ptr()):
                    raise AssertionError(f"rank {rank} step {step}: layer {layer}'s weights are "
                                         "not the model's parameters")
            balance.append(sum(step_balance) / len(step_balance))
            rb.step_end()
            if params is not None and [p.data_ptr() for p in params] != pointers:
                raise AssertionError(f"rank {rank} step {step}: a parameter moved")
            if args.agreement == "external":
                # The engine carries eplb's agreement on a collective of its own (here a
                # one-value all-reduce; a real engine adds it to one it runs anyway).
                mine = torch.tensor([rb.agreement_contribution()], dtype=torch.int64)
                dist.all_reduce(mine, op=dist.ReduceOp.MIN)
                rb.agreement_result(rb.step, int(mine))

        history = rb.history()
        # Every rank saw the same rebalances end at the same steps with the same placement.
        mine = ([(r["trigger_step"], r["end_step"], r["outcome"], r["slots_moved"])
                 for r in history], rb.placement().tolist())
        everyone = [None] * G
        dist.all_gather_object(everyone, mine)
        if any(x != mine for x in everyone):
            raise AssertionError(f"rank {rank}: ranks disagree on the rebalances or placement")
    dist.barrier()
    dist.destroy_process_group()

    if rank == 0:
        seconds = time.perf_counter() - start
        done = [r for r in history if r["outcome"] == "completed"]
        kept = "the model's own parameters" if args.own_weights else "in its arena"
        first = balance[:args.interval]
        last = balance[-args.interval:]
        if args.json:
            print(json.dumps({
                "ranks": G, "layers": args.layers, "experts": args.experts,
                "physical": args.experts + args.redundant, "top_k": args.top_k,
                "steps": args.steps, "tokens_per_rank": T, "control": control,
                "agreement": args.agreement, "transport": "shm", "bytes_held": held,
                "weights": "engine" if args.own_weights else "arena",
                "rebalances": len(history), "completed": len(done),
                "skipped": sum(r["outcome"] == "skipped" for r in history),
                "slots_moved": sum(r["slots_moved"] for r in done),
                "bytes_read": sum(r["bytes_intra_node"] for r in done),
                "balancedness_first": sum(first) / len(first),
                "balancedness_last": sum(last) / len(last),
                "max_abs_difference": worst, "seconds": seconds}))
            return
        print(f"eplb torch_moe: {G} ranks, {args.layers} layers, {args.experts} experts in "
              f"{args.experts + args.redundant} slots, top-{args.top_k}, {args.steps} steps of "
              f"{T} tokens per rank, control {control} (agreement {args.agreement}), transport shm, "
              f"{held} bytes held per rank by eplb, weights {kept}")
        print(f"rebalances: {len(history)} ({len(done)} completed, "
              f"{sum(r['outcome'] == 'skipped' for r in history)} skipped), "
              f"{sum(r['slots_moved'] for r in done)} slots moved, "
              f"{sum(r['bytes_intra_node'] for r in done)} bytes read from peers")
        for r in done:
            print(f"  rebalance {r['index']}: steps {r['trigger_step']}-{r['end_step']}, "
                  f"{r['layers_installed']} layers, {r['slots_moved']} slots, predicted "
                  f"balancedness {r['balancedness_before']:.3f} -> {r['balancedness_after']:.3f}")
        print(f"measured balancedness (rank load mean/max): first {len(first)} steps "
              f"{sum(first) / len(first):.3f}, last {len(last)} steps {sum(last) / len(last):.3f}")
        print(f"outputs match the reference (max abs difference {worst:.2e}); every slot held "
              f"its expert's weights at every step; {seconds:.1f} s")


def main(argv=None):
    args = parse_args(argv)
    if (args.experts + args.redundant) % args.ranks:
        sys.exit(f"--experts + --redundant ({args.experts + args.redundant}) must be a multiple "
                 f"of --ranks ({args.ranks})")
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
        workdir = tempfile.mkdtemp(prefix="eplb-example-", dir=args.workdir)
        mp.spawn(run_rank, args=(args, workdir), nprocs=args.ranks, join=True)
    else:
        with tempfile.TemporaryDirectory(prefix="eplb-example-") as workdir:
            mp.spawn(run_rank, args=(args, workdir), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
