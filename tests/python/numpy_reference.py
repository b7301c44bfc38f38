"""The public DeepSeek EPLB algorithm (deepseek-ai/EPLB `rebalance_experts`), restated in NumPy.

Used by the tests (eplb.rebalance_experts must give the same outputs) and by the benchmark (the
time of a vectorised Python implementation). Arithmetic as the reference: float32 loads, group
sums, w / count and pack sums; greedy choices take the lowest index on ties. Items are visited
by a stable descending sort, which is the reference's order whenever loads do not tie. The only
exact ties left in tie-free inputs are the replicas of one expert (equal w / count): the
reference visits them in the order of torch's (unstable) CPU sort, which shows in log2phy's
replica order only, never in phy2log or logcnt. Pass `order=` a function sorting like torch to
reproduce that order too.

Every step is vectorised over rows (layers, or layer x node), looping over items, as a careful
Python implementation would be.
"""

import numpy as np


def stable_descending(weight):
    """Indices sorting each row of weight by descending value, lowest index first on ties."""
    return np.argsort(-weight, axis=1, kind="stable")


def balanced_packing(weight, num_packs, order=stable_descending):
    """Pack the n items of each row into num_packs packs of n / num_packs items each.

    weight: float32 [rows, n]. Visits items in order(weight) (descending weight), each into the
    lightest pack with room (lowest pack on a tie). Returns pack [rows, n] and position in pack
    [rows, n].
    """
    rows, n = weight.shape
    per_pack = n // num_packs
    if per_pack == 1:
        return (np.broadcast_to(np.arange(n, dtype=np.int64), (rows, n)).copy(),
                np.zeros((rows, n), dtype=np.int64))
    visit = order(weight)
    pack = np.full((rows, n), -1, dtype=np.int64)
    position = np.full((rows, n), -1, dtype=np.int64)
    pack_weight = np.zeros((rows, num_packs), dtype=np.float32)
    pack_items = np.zeros((rows, num_packs), dtype=np.int64)
    r = np.arange(rows)
    for k in range(n):
        item = visit[:, k]
        best = np.where(pack_items < per_pack, pack_weight, np.inf).argmin(axis=1)
        pack[r, item] = best
        position[r, item] = pack_items[r, best]
        pack_items[r, best] += 1
        pack_weight[r, best] += weight[r, item]
    return pack, position


def replicate_experts(weight, num_slots):
    """Replicate each row's m experts into num_slots replicas, minimising the max w / count.

    weight: float32 [rows, m]. Slot j < m holds expert j; each further slot goes to the expert
    with the largest w / count (lowest expert on a tie). Returns phy2log [rows, num_slots],
    replica index of each slot [rows, num_slots], count [rows, m].
    """
    rows, m = weight.shape
    phy2log = np.zeros((rows, num_slots), dtype=np.int64)
    phy2log[:, :m] = np.arange(m)
    replica = np.zeros((rows, num_slots), dtype=np.int64)
    count = np.ones((rows, m), dtype=np.int64)
    r = np.arange(rows)
    for j in range(m, num_slots):
        best = (weight / count.astype(np.float32)).argmax(axis=1)
        phy2log[:, j] = best
        replica[:, j] = count[r, best]
        count[r, best] += 1
    return phy2log, replica, count


def rebalance_hierarchical(weight, num_physical, num_groups, num_nodes, num_gpus, order):
    """weight float32 [L, E] -> phy2log [L, P], replica index [L, P], logcnt [L, E]."""
    layers, experts = weight.shape
    assert experts % num_groups == 0 and num_groups % num_nodes == 0
    assert num_gpus % num_nodes == 0 and num_physical % num_gpus == 0
    group_size = experts // num_groups
    groups_per_node = num_groups // num_nodes
    local_experts = experts // num_nodes
    local_slots = num_physical // num_nodes
    local_ranks = num_gpus // num_nodes
    slots_per_rank = num_physical // num_gpus

    # Step 1: pack groups to nodes. Group sums accumulate in float32, in expert order.
    group_weight = np.zeros((layers, num_groups), dtype=np.float32)
    for i in range(group_size):
        group_weight += weight[:, i::group_size]
    group_pack, group_position = balanced_packing(group_weight, num_nodes, order)
    # mlog2log[l, m]: the logical expert at node-local order m (node n owns [n*E/N, (n+1)*E/N)).
    first = (group_pack * groups_per_node + group_position) * group_size  # [L, groups]
    mlog = (first[:, :, None] + np.arange(group_size)).reshape(layers, experts)
    mlog2log = np.empty_like(mlog)
    np.put_along_axis(mlog2log, mlog, np.arange(experts)[None, :].repeat(layers, 0), axis=1)

    # Step 2: replicate each node's experts into its slots. Rows are (layer, node).
    mlog_weight = np.take_along_axis(weight, mlog2log, axis=1).reshape(-1, local_experts)
    phy2mlog, replica, mlog_count = replicate_experts(mlog_weight, local_slots)

    # Step 3: pack each node's replicas (load w / count) into its ranks.
    phy_weight = np.take_along_axis(mlog_weight / mlog_count.astype(np.float32), phy2mlog, axis=1)
    pack, position = balanced_packing(phy_weight, local_ranks, order)
    local_slot = pack * slots_per_rank + position  # [L*N, P/N]
    node_offset = (np.arange(layers * num_nodes) % num_nodes * local_experts)[:, None]
    slot_mlog = np.empty_like(phy2mlog)
    slot_replica = np.empty_like(replica)
    np.put_along_axis(slot_mlog, local_slot, phy2mlog + node_offset, axis=1)
    np.put_along_axis(slot_replica, local_slot, replica, axis=1)
    phy2log = np.take_along_axis(mlog2log, slot_mlog.reshape(layers, num_physical), axis=1)
    logcnt = np.empty((layers, experts), dtype=np.int64)
    np.put_along_axis(logcnt, mlog2log, mlog_count.reshape(layers, experts), axis=1)
    return phy2log, slot_replica.reshape(layers, num_physical), logcnt


def rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus,
                      order=stable_descending):
    """The reference's entry point: (phy2log [L, P], log2phy [L, E, X] padded with -1,
    logcnt [L, E]), int64 numpy arrays."""
    weight = np.asarray(weight, dtype=np.float32)
    layers, experts = weight.shape
    if num_groups % num_nodes == 0:
        phy2log, replica, logcnt = rebalance_hierarchical(weight, num_replicas, num_groups,
                                                          num_nodes, num_gpus, order)
    else:
        phy2log, replica, logcnt = rebalance_hierarchical(weight, num_replicas, 1, 1, num_gpus,
                                                          order)
    most = int(logcnt.max())
    log2phy = np.full((layers, experts * most), -1, dtype=np.int64)
    np.put_along_axis(log2phy, phy2log * most + replica,
                      np.arange(num_replicas)[None, :].repeat(layers, 0), axis=1)
    return phy2log, log2phy.reshape(layers, experts, most), logcnt
