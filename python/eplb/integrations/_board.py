"""The progress board of eplb's vLLM communicator: how its ranks keep in step without a
collective.

Each rank owns a board, a few KiB of memory allocated by the transport that carries the
weights, and every peer reads it one-sided. Words, int64:

    0  progress  epoch * 65536 + phase (release-stored, only ever grows): PUBLISHED once the
                 rank's receives of this execute() are on its board, CHECKED once it has read
                 everyone's, 3 + k once it has finished round k, FENCED once it knows every
                 rank is done (it reads no board of this epoch any more)
    1  failure   epoch * 2**24 + kind * 65536 + culprit + 1, or 0: this rank gave up in that
                 epoch because of rank `culprit` (release-stored)
    2  layer     the layer of the epoch's execute(), -1 without set_transfer_context()
    3  old       crc32 of the layer's old placement, -1 without it
    4  count     how many experts the rank receives
    5  error     1 + index in ERRORS of a bad input found on this rank, 0 if none
    6  length    bytes of the error's text
    8  the experts received (`slots` words), then the error's text (TEXT bytes)

An epoch is one execute(); every rank counts them alike. A rank rewrites its board's fields
only after every peer has read them (the CHECKED fence of the previous epoch), so a reader
never sees them torn; and it closes its transport only once every peer is FENCED (settle), so
no peer still waiting on its board finds it gone.

Waiting for peers (wait_for) polls their first two words in one batch of reads, backing off
from 10 us to 200 us (a shorter poll takes the cores the copies need when ranks outnumber
them; a longer one adds its overshoot to every round). A peer whose board cannot be read (its process is gone) fails the wait with
IoError naming it; a peer that reports a failure makes the waiter give up too, naming the
culprit it reports; a peer that does not get there by the deadline fails it with Timeout naming
where the peer is. In each case the waiter writes its own failure word first, so the ranks that
wait on it learn at once and name the same culprit.
"""

import ctypes
import time

import numpy as np

import eplb
from eplb import _eplb

PUBLISHED, CHECKED = 1, 2
_PHASES = 65536
FENCED = _PHASES - 1
_EPOCH = 2 ** 24
TEXT = 2048
ERRORS = ("InvalidArgument", "NotSupported", "IoError", "Timeout", "Error")
# What a failure word says of its culprit, by kind.
_KINDS = {1: "could not read from", 2: "timed out waiting for", 3: "gave up because of"}
_CLASSES = {1: eplb.IoError, 2: eplb.Timeout, 3: eplb.IoError}


def round_done(k):
    """The phase of a rank that has finished round k (round -1: CHECKED)."""
    return 3 + k


def where(progress, epoch):
    """Where a peer whose progress word is `progress` is, seen from `epoch`."""
    e, phase = divmod(int(progress), _PHASES)
    if e < epoch:
        return "it is still in an earlier execute()" if e else "it has not begun an execute()"
    if phase == PUBLISHED:
        return "it has published its receives"
    if phase == CHECKED:
        return "it has checked every rank's receives"
    if phase == FENCED:
        return "it is done"
    return f"it has finished round {phase - 2}"


class Board:
    """This rank's board and its views of the peers' (see the module's text). One thread."""

    def __init__(self, transport, rank, world, slots, stopped=None):
        self.rank, self.world = rank, world
        self.words = 8 + slots + TEXT // 8
        self._text = 8 + slots  # the word the error's text starts at
        self._transport = transport
        self.region, address = transport.allocate(self.words * 8)
        self._mine = np.ctypeslib.as_array((ctypes.c_int64 * self.words).from_address(address))
        self._address = address
        self._heads = np.zeros((world, 2), dtype=np.int64)
        self._boards = np.zeros((world, self.words), dtype=np.int64)
        self._stopped = stopped  # () -> a sentence naming stopped peers of this machine, or ""

    # ------------------------------------------------------------ this rank's words
    def publish(self, epoch, layer, old, experts, error):
        """This epoch's receives (and a bad input, (kind, text) or None), then PUBLISHED."""
        words = self._mine
        words[2] = -1 if layer is None else layer
        words[3] = -1 if old is None else old
        words[4] = len(experts)
        words[8:8 + len(experts)] = experts
        if error is None:
            words[5] = words[6] = 0
        else:
            text = error[1].encode()[:TEXT]
            words[5] = 1 + ERRORS.index(error[0] if error[0] in ERRORS else "Error")
            words[6] = len(text)
            raw = words[self._text:].view(np.uint8)
            raw[:len(text)] = np.frombuffer(text, dtype=np.uint8)
        self.progress(epoch, PUBLISHED)

    def progress(self, epoch, phase):
        _eplb._store_release(self._address, epoch * _PHASES + phase)

    def fail(self, epoch, kind, culprit):
        _eplb._store_release(self._address + 8, epoch * _EPOCH + kind * 65536 + culprit + 1)

    # ------------------------------------------------------------ the peers'
    def read(self, epoch, deadline, what):
        """Every rank's board as a dict (layer, old, experts, error), after PUBLISHED."""
        peers = [p for p in range(self.world) if p != self.rank]
        reads = [(p, self.region, 0, self._boards[p].ctypes.data, self.words * 8)
                 for p in peers]
        if reads:
            self._read(reads, peers, epoch, deadline, what)
        self._boards[self.rank] = self._mine
        out = []
        for words in self._boards:
            error = None
            if words[5]:
                text = words[self._text:].view(np.uint8)[:int(words[6])]
                error = (ERRORS[int(words[5]) - 1], bytes(text).decode(errors="replace"))
            out.append({"layer": None if words[2] < 0 else int(words[2]),
                        "old": None if words[3] < 0 else int(words[3]),
                        "recv": words[8:8 + int(words[4])].tolist(), "error": error})
        return out

    def wait_for(self, peers, epoch, phase, deadline, what):
        """Returns once every rank in `peers` has reached `phase` of `epoch`; raises (after
        writing this rank's failure word) when one is gone, gave up, or is late."""
        target = epoch * _PHASES + phase
        pending = sorted({int(p) for p in peers} - {self.rank})
        pause = 1e-5
        while pending:
            self._read_heads(pending, epoch, deadline, what)
            pending = [p for p in pending if self._heads[p, 0] < target]
            for p in pending:  # a peer that is not there yet and gave up
                failure = int(self._heads[p, 1])
                if failure >= epoch * _EPOCH:
                    kind, culprit = divmod(failure % _EPOCH, 65536)
                    culprit -= 1
                    self.fail(epoch, 3, culprit)
                    raise _CLASSES.get(kind, eplb.IoError)(
                        f"eplb communicator, {what}: rank {p} {_KINDS.get(kind, 'failed on')} "
                        f"rank {culprit}" + ("" if kind == 3 else
                                             f"; rank {self.rank} gives up too"))
            if not pending:
                return
            now = time.monotonic()
            if now >= deadline:
                self.fail(epoch, 2, pending[0])
                late = ", ".join(f"rank {p} ({where(self._heads[p, 0], epoch)})"
                                 for p in pending)
                stopped = self._stopped() if self._stopped else ""
                raise eplb.Timeout(f"eplb communicator, {what}: rank {self.rank} timed out "
                                   f"waiting for {late}" + (f"; {stopped}" if stopped else ""))
            time.sleep(min(pause, max(deadline - now, 0.0)))
            pause = min(pause * 2, 2e-4)

    def settle(self, epoch, seconds):
        """Waits up to `seconds` until no peer reads this board any more: every one is FENCED
        in `epoch`, gave up, or is gone. Never raises."""
        deadline = time.monotonic() + seconds
        pending = [p for p in range(self.world) if p != self.rank]
        pause = 1e-4
        while pending and time.monotonic() < deadline:
            still = []
            for p in pending:
                try:
                    self._transport.read(np.array([[p, self.region, 0, self._heads[p].ctypes.data,
                                                    16]], dtype=np.int64), 0.5)
                except eplb.Error:
                    continue  # gone: it reads nothing
                if self._heads[p, 0] < epoch * _PHASES + FENCED and \
                        self._heads[p, 1] < epoch * _EPOCH:
                    still.append(p)
            pending = still
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    def _read_heads(self, peers, epoch, deadline, what):
        reads = [(p, self.region, 0, self._heads[p].ctypes.data, 16) for p in peers]
        self._read(reads, peers, epoch, deadline, what)

    def _read(self, reads, peers, epoch, deadline, what):
        try:
            self._transport.read(np.array(reads, dtype=np.int64),
                                 max(deadline - time.monotonic(), 0.0))
        except eplb.Error as e:
            late = isinstance(e, eplb.Timeout)
            gone = self.unreachable(peers) or list(peers)  # else: one of them, which is unknown
            self.fail(epoch, 2 if late else 1, gone[0])
            raise (eplb.Timeout if late else eplb.IoError)(
                f"eplb communicator, {what}: rank {self.rank} could not read from "
                + ", ".join(f"rank {p}" for p in gone) + f": {e}") from e

    def unreachable(self, peers, seconds=0.5):
        """The `peers` whose board a read fails from within `seconds` each."""
        gone = []
        probe = np.zeros(2, dtype=np.int64)
        for p in peers:
            if p == self.rank:
                continue
            try:
                self._transport.read(np.array([[p, self.region, 0, probe.ctypes.data, 16]],
                                              dtype=np.int64), seconds)
            except eplb.Error:
                gone.append(p)
        return gone
