"""Work stealing between the data-parallel paged engines of one process.

``paged_dp`` cuts a call's prompts into one contiguous share per engine. With heavy-tailed
completions and more sequences than an engine's slots or pool hold at once, a share of long
budgets keeps its engine busy while the others sit idle with their shares done: the call
lasts as long as its busiest engine. Here each engine keeps its share in a queue of its own,
in prompt order, and takes from its head as before; an engine that has run out of prompts
and has room takes the *last* prompt of the engine with the most prompts waiting (Blumofe &
Leiserson's work stealing; as vLLM's data-parallel router sends a request to the least-loaded
engine), one prompt (its G samples together) at a time.

Only prompts that wait *for room* may be taken: an engine opens its queue to the others the
first time its head prompt finds no free slots or pages (or a preempted sequence of its own
waits), never when it merely has not reached its prompts yet. So a call whose every share
fits its engine at once runs exactly the contiguous split, as before; only a call that
queues rebalances, and then which engine runs a prompt depends on timing. A sample's keys do
not (they come from its global sequence id, whatever engine or slot it gets), so neither do
its tokens, up to float rounding: decoded beside other rows its logits may differ in the
last bits, and a near-tie then samples another token (as between any two batch layouts;
BENCHMARKS.md, "Work stealing").

Threads: one lock (a :class:`threading.Condition`) guards every queue. An owner holds it
while it looks at and pops its head (``paged.run``'s admission), a thief while it checks
that a candidate fits its own engine and pops it, so a prompt is taken once. An engine with
nothing left to run waits on the condition until another engine opens a queue with prompts
in it, or every other queue is empty.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any


class PromptQueues:
    """The waiting prompts of one call's engines (prompt indices into the call's batch),
    engine ``e`` starting with ``shares[e]``; :meth:`engine` is engine ``e``'s view."""

    def __init__(self, shares: Sequence[Iterable[int]]):
        self._queues = [deque(s) for s in shares]
        self._open = [False] * len(self._queues)
        self._cond = threading.Condition()
        self._aborted = False
        self.ran: list[list[int] | None] = [None] * len(self._queues)

    def engine(self, e: int) -> EngineQueue:
        return EngineQueue(self, e)

    def abort(self) -> None:
        """An engine failed: every waiting engine stops waiting (and steals nothing more)."""
        with self._cond:
            self._aborted = True
            self._cond.notify_all()


class EngineQueue:
    """Engine ``e``'s queue, with the deque operations ``paged.run`` uses on its own prompts
    (``bool``, ``len``, ``[0]``, ``popleft``, ``extendleft``), and the stealing ones. Each
    takes :attr:`lock` (reentrant); the owner holds it across a look at its head and the pop
    that follows, so that no thief takes the head in between."""

    def __init__(self, queues: PromptQueues, e: int):
        self._all, self._e = queues, e
        self._own = queues._queues[e]
        self.lock = queues._cond
        self.share = len(self._own)  # the prompts it starts with: what its sizes are fitted for
        self.stolen = 0  # prompts it took from other engines' queues

    def __bool__(self) -> bool:
        return bool(self._own)

    def __len__(self) -> int:
        return len(self._own)

    def __getitem__(self, i: int) -> int:
        return self._own[i]

    def popleft(self) -> int:
        with self.lock:
            b = self._own.popleft()
            if not self._own:  # an engine waiting for this queue may stop waiting
                self.lock.notify_all()
            return b

    def extendleft(self, prompts: Iterable[int]) -> None:
        with self.lock:
            self._own.extendleft(prompts)

    def open(self) -> None:
        """The head prompt waits for room: the other engines may take from the tail."""
        with self.lock:
            if not self._all._open[self._e]:
                self._all._open[self._e] = True
                self.lock.notify_all()

    def _victim(self) -> deque | None:
        qs, e = self._all, self._e
        if qs._aborted:
            return None
        waiting = [(len(q), i) for i, q in enumerate(qs._queues) if i != e and qs._open[i] and q]
        return qs._queues[max(waiting)[1]] if waiting else None

    def stealable(self) -> bool:
        """Whether another engine has opened a queue with prompts in it."""
        with self.lock:
            return self._victim() is not None

    def steal(self, claim: Callable[[int], Any]) -> tuple[int, Any] | None:
        """``(b, claim(b))`` for ``b`` the last prompt of the open queue with the most prompts,
        taken when ``claim`` (this engine's room check, run holding :attr:`lock`) returns a
        true value; else None."""
        with self.lock:
            q = self._victim()
            room = None if q is None else claim(q[-1])
            if not room:
                return None
            b = q.pop()
            if not q:
                self.lock.notify_all()
            self.stolen += 1
            return b, room

    def others_waiting(self) -> bool:
        """Whether another engine still has prompts queued (it may open its queue later), and
        no engine failed."""
        qs = self._all
        with self.lock:
            return not qs._aborted and any(q for i, q in enumerate(qs._queues) if i != self._e)

    def wait(self) -> None:
        """Blocks until another engine opens a queue with prompts in it, or no other queue
        has prompts left (or an engine failed)."""
        with self.lock:
            while self._victim() is None and self.others_waiting():
                self.lock.wait()

    def done(self, ran: Sequence[int]) -> None:
        """Records the prompts this engine ran (their outputs' rows, in this order)."""
        with self.lock:
            self._all.ran[self._e] = list(ran)
            self.lock.notify_all()


__all__ = ["EngineQueue", "PromptQueues"]
