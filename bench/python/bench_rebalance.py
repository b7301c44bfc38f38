#!/usr/bin/env python3
"""Times eplb.rebalance_experts against the NumPy re-statement of the reference algorithm
(tests/python/numpy_reference.py) on DeepSeek-V3's shape, and prints the ratio.

    PYTHONPATH=<build>/python python3 bench/python/bench_rebalance.py [--layers 58] ...

Both run in this process on the same load; the outputs are checked equal before timing.
"""

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "tests", "python"))
import numpy_reference  # noqa: E402

import eplb  # noqa: E402


def best_of(fn, repeat):
    """Median and minimum wall time of `repeat` calls, in seconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=58)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--physical", type=int, default=288)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--gpus", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5, help="runs of the NumPy version")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    weight = (np.round(rng.lognormal(0.0, 1.0, (args.layers, args.experts)) * 1000)
              + rng.random((args.layers, args.experts))).astype(np.float32)
    call = (weight, args.physical, args.groups, args.nodes, args.gpus)

    ours = eplb.rebalance_experts(*call)
    ref = numpy_reference.rebalance_experts(*call)
    if not (np.array_equal(ours[0], ref[0]) and np.array_equal(ours[2], ref[2])):
        sys.exit("eplb and the NumPy re-statement disagree on this load")

    numpy_median, numpy_min = best_of(lambda: numpy_reference.rebalance_experts(*call),
                                      args.repeat)
    eplb_median, eplb_min = best_of(lambda: eplb.rebalance_experts(*call),
                                    max(20, args.repeat))
    shape = f"{args.layers}x{args.experts}->{args.physical}"
    print(f"rebalance_experts {shape} (groups {args.groups}, nodes {args.nodes}, "
          f"gpus {args.gpus}): numpy {numpy_median * 1e3:.1f} ms (min {numpy_min * 1e3:.1f}), "
          f"eplb {eplb_median * 1e3:.3f} ms (min {eplb_min * 1e3:.3f}): "
          f"{numpy_median / eplb_median:.0f}x")


if __name__ == "__main__":
    main()
