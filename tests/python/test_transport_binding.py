"""The transport layer as Python sees it (eplb._eplb._Transport, the data plane of eplb's vLLM
communicator): a rank's reads of registered and allocated memory land byte for byte, a word
written with _store_release is read back, and bad arguments raise eplb.InvalidArgument naming
the value. One process: every backend serves a rank's reads of its own regions."""

import numpy as np
import pytest

import eplb
from eplb import _eplb


@pytest.mark.parametrize("backend", _eplb.transport_backends())
def test_reads_of_registered_and_allocated_memory(backend):
    t = _eplb._Transport(backend, 0, "node-0")
    assert (t.backend, t.rank) == (backend, 0)
    assert set(t.capabilities()) == {"device_memory", "one_sided", "register_memory", "cross_node"}
    src = np.arange(16, dtype=np.int64)
    dst = np.zeros(16, dtype=np.int64)
    region = t.register_memory(src.ctypes.data, src.nbytes)
    board, address = t.allocate(32)
    assert (region, board) == (0, 1)
    _eplb._store_release(address + 8, 77)
    # rows: (peer, region, offset, destination address, bytes)
    t.read(np.array([[0, region, 16, dst.ctypes.data, 32],
                     [0, board, 8, dst.ctypes.data + 64, 8]], dtype=np.int64), 5.0)
    assert dst.tolist() == [2, 3, 4, 5, 0, 0, 0, 0, 77] + [0] * 7
    t.read(np.zeros((0, 5), dtype=np.int64), 1e300)  # an endless wait is clamped, not undefined
    t.close()
    t.close()  # harmless
    with pytest.raises(eplb.Error, match="closed"):
        t.read(np.zeros((0, 5), dtype=np.int64), 1.0)


def test_bad_arguments_name_the_value():
    t = _eplb._Transport("shm", 0)
    _, address = t.allocate(16)
    cases = [
        (lambda: t.read(np.zeros((1, 4), dtype=np.int64), 1.0), r"an \[n, 5\] array"),
        (lambda: t.read(np.zeros((0, 5), dtype=np.int64), float("nan")), "timeout nan s"),
        (lambda: t.read(np.array([[0, 0, -1, address, 8]]), 1.0), "offset -1 and bytes 8"),
        (lambda: t.read(np.array([[1, 0, 0, address, 8]]), 1.0), "peer 1 whose descriptor"),
        (lambda: t.read(np.array([[0, 5, 0, address, 8]]), 1.0), "region 5 of rank 0"),
        (lambda: t.allocate(0), "allocate: 0 bytes"),
        (lambda: t.register_memory(0, 8), "a null address"),
        (lambda: _eplb._store_release(address + 1, 3), f"address {address + 1} is not an "
                                                        f"aligned 64-bit word"),
        (lambda: _eplb._Transport("nope", 0), "unknown transport backend 'nope'"),
        (lambda: _eplb._Transport("shm", -1), "transport rank -1"),
    ]
    for call, message in cases:
        with pytest.raises(eplb.InvalidArgument, match=message):
            call()
    t.close()
