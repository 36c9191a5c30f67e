"""The low-latency ops of one epd group that were submitted without a CPU wait (CUDA
backend), kept so that each is waited for at most once, and only while its completion
record is still its own: an endpoint keeps the records of its latest
RECORD_WINDOW ops, so waiting an older one fails (FailedPreconditionError)."""

import collections
from typing import Callable, Optional

# Completion records an endpoint keeps (epd's abi::kCompletionCapacity).
RECORD_WINDOW = 64


class PendingOps:
    """Tracks the PendingOps of one endpoint, ascending by seq.

    add() takes each op right after its submission; every op is then waited exactly once:
    by the hook add() returned, by add() itself once the op is check_every ops old (its
    error, if any, raised by that add(), after every due op was waited), or by drain().
    An op waited through any path leaves the list, so no later path waits it again.
    Client-launched ops: one wait reports the device errors of every earlier op of the
    endpoint, so only the latest op is kept, and every check_every-th op is waited unless
    the caller waits it through its hook. Every op of the endpoint must go through add():
    the seq distance between tracked ops is what keeps them inside the window.
    """

    def __init__(self, client_launched: bool, check_every: int = 32):
        if not 0 < check_every < RECORD_WINDOW:
            raise ValueError(f"check_every {check_every} must be in (0, {RECORD_WINDOW})")
        self._ops = collections.OrderedDict()  # seq -> PendingOp, ascending
        self._client_launched = client_launched
        self._check_every = check_every
        self._count = 0

    def __len__(self) -> int:
        return len(self._ops)

    def add(self, op, hook_wanted: bool) -> Optional[Callable[[], None]]:
        """Tracks `op` (just submitted) and waits the ops now due; returns the op's hook
        (waits it unless some other path did; idempotent) when hook_wanted, else None.
        Raises the first error of the ops it waited."""
        seq = op.seq
        if self._client_launched:
            self._ops.clear()  # the wait of `op` reports theirs too
        self._ops[seq] = op
        self._count += 1
        due = [s for s in self._ops if s <= seq - self._check_every]
        if self._client_launched and not hook_wanted and self._count % self._check_every == 0:
            due.append(seq)
        self._wait(due)
        return (lambda: self._wait([seq])) if hook_wanted else None

    def drain(self) -> None:
        """Waits every tracked op; raises the first error among them (after all waits)."""
        self._wait(list(self._ops))

    def _wait(self, seqs) -> None:
        first_error = None
        for s in seqs:
            op = self._ops.pop(s, None)
            if op is None:
                continue
            try:
                op.wait()
            except Exception as e:  # noqa: BLE001 (re-raised below)
                first_error = first_error or e
        if first_error is not None:
            raise first_error
