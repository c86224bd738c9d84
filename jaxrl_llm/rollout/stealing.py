"""Work stealing between data-parallel paged engines: those of one process, and across processes.

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

Across processes (:class:`Lending`, a ``jax.distributed`` job of several processes): each
process runs its own rows, and a process cannot reach another's queues, so prompts move
through the key-value store of JAX's coordination service (where ``distributed.
host_allgather`` exchanges host values). When an engine's queue opens, the process *lends*
every prompt of that queue but its head: it publishes them (their tokens, budgets,
sequence ids and token offsets; one blob per lending) under the call's namespace, in order.
Within a process the open queues' heads are taken first, then the lent prompts. Any engine of any
process with nothing of its own left to run and room for a lent prompt may take it, the
lending process's own engines from the front (the order they would have run them in),
the other processes' from the back; a prompt is taken by an atomic insert of its claim key
(the store refuses a second one), so it runs once. The process that ran another's prompt
publishes the prompt's outputs, and the lending process reads them back into its rows
(:meth:`Lending.publish_results`, :meth:`Lending.collect_results`). A process is done with a
call when every process has emptied its queues and every lent prompt has been taken; the
engines see the other processes' state through a snapshot of the store read at most every
``refresh_s`` (two reads: the processes' states, the claims). Each move costs a few store
round trips (~0.3 ms each on one host), a prompt's tokens and its outputs: prompts, not KV.
The outputs of another process's prompt are published as soon as its last sample finishes
(``paged.run`` calls :meth:`EngineQueue.send_back`), so the lending process waits for them
only as long as they decode, not for the rest of the thief's call.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from jaxrl_llm.distributed import npz_arrays, npz_bytes


class Rows:
    """The prompts of a call as the engines of one process read them, by row: the process's
    own ``local`` rows, then prompts lent by other processes, appended as they are taken
    (:meth:`add`; a row's index never changes). ``budgets``, ``seq_ids`` and ``offsets`` hold
    each row's ``[G]`` int32 budgets, global sequence ids and token offsets
    (``paged.run``'s ``budgets_bg``, ``seq_ids_bg``, ``token_offsets_bg``; defaults
    ``b·G + g`` and 0). ``longest``: the longest prompt an engine must be ready to take (its
    page tables' width): its own rows' at first; across processes, every process's (set by
    ``paged_dp``), so that any lent prompt fits the tables of any engine."""

    def __init__(
        self,
        prompts: Sequence[np.ndarray],
        budgets_bg: np.ndarray,
        seq_ids_bg: np.ndarray | None = None,
        token_offsets_bg: np.ndarray | None = None,
    ):
        budgets_bg = np.asarray(budgets_bg, np.int32)
        b, g = budgets_bg.shape
        if seq_ids_bg is None:
            seq_ids_bg = np.arange(b * g, dtype=np.int32).reshape(b, g)
        if token_offsets_bg is None:
            token_offsets_bg = np.zeros((b, g), np.int32)
        self.num_samples = g
        self.local = b
        self.prompts = [np.asarray(p, np.int32) for p in prompts]
        self.budgets = list(budgets_bg)
        self.seq_ids = list(np.asarray(seq_ids_bg, np.int32))
        self.offsets = list(np.asarray(token_offsets_bg, np.int32))
        self.origin: dict[int, tuple[int, int]] = {}  # row -> (process, lent index)
        self.longest = max((len(p) for p in self.prompts), default=0)

    def add(self, prompt: np.ndarray, budgets: np.ndarray, seq_ids: np.ndarray,
            offsets: np.ndarray, origin: tuple[int, int]) -> int:  # fmt: skip
        """Appends another process's lent prompt ``origin`` = (process, index); its row."""
        self.prompts.append(np.asarray(prompt, np.int32))
        self.budgets.append(np.asarray(budgets, np.int32))
        self.seq_ids.append(np.asarray(seq_ids, np.int32))
        self.offsets.append(np.asarray(offsets, np.int32))
        self.origin[len(self.prompts) - 1] = origin
        return len(self.prompts) - 1


class Lending:
    """The prompts the processes of one call lend each other (module docstring), seen from
    process ``process`` of ``processes``. ``client``: the coordination service's client
    (``distributed._kv_client()``, or a stand-in with its ``key_value_*`` methods);
    ``namespace``: the call's key prefix, the same on every process and new for every call.

    Keys under the namespace: ``prompt/P/J`` (process P's J-th lending: one blob of its
    prompts, in order), ``state/lent/P`` (where P's lendings end: ``"5,12"`` for prompts
    0-4 in lending 0 and 5-11 in lending 1), ``state/started/P`` (P has reached the call),
    ``state/drained/P`` (P's queues are empty: it lends no more), ``state/failed/P`` (an
    engine of P failed: every process stops), ``claim/P/K`` (the process that took P's
    prompt K), ``result/P/K`` (its outputs, from the process that ran it).

    ``refresh_s``: the most often the store is read (default 20 ms, more with over 8
    processes: 2.5 ms per process, so the coordinator serves ~800 reads a second whatever
    the job's size). ``timeout_s``: how long to wait for every process to reach the call.
    Results are waited for as long as their process runs (a process that dies is JAX's
    coordination service's to detect: it ends the job)."""

    def __init__(self, client: Any, namespace: str, process: int, processes: int,
                 rows: Rows, *, refresh_s: float | None = None,
                 timeout_s: float = 1800.0):  # fmt: skip
        self._kv, self._ns = client, namespace.rstrip("/")
        self.me, self.count, self.rows = process, processes, rows
        self.refresh_s = max(0.02, 0.0025 * processes) if refresh_s is None else refresh_s
        self.timeout_s = timeout_s
        self.lent: list[tuple[int, int]] = []  # K -> (row, the engine whose queue it left)
        self._ends: list[list[int]] = [[] for _ in range(processes)]  # each P's lendings' ends
        self._blobs: dict[tuple[int, int], dict[str, np.ndarray]] = {}  # (P, J) -> lending J
        self._fetched: dict[tuple[int, int], int] = {}  # another process's prompt -> its row
        self.claims: dict[tuple[int, int], int] = {}  # (P, K) -> the process that took it
        self.published: set[int] = set()  # rows of other processes' prompts whose outputs went
        self._started = [False] * processes
        self._drained = [False] * processes
        self.failed: tuple[int, str] | None = None
        self._seen = -float("inf")  # when the store was last read
        self._deadline = time.monotonic() + timeout_s
        self._said_drained = False
        self._started[process] = True
        self._kv.key_value_set(self._key("state", "started", process), "1")

    def _key(self, *parts: Any) -> str:
        return "/".join([self._ns, *map(str, parts)])

    def _lent_n(self, p: int) -> int:
        return self._ends[p][-1] if self._ends[p] else 0

    def lend(self, rows: Sequence[int], engine: int) -> None:
        """Publishes this process's ``rows`` (in order; one blob, two store writes), which
        leave ``engine``'s queue."""
        if not rows:
            return
        r = self.rows
        blob = npz_bytes(
            lengths=np.asarray([len(r.prompts[b]) for b in rows], np.int32),
            tokens=np.concatenate([r.prompts[b] for b in rows]),
            budgets=np.stack([r.budgets[b] for b in rows]),
            seq_ids=np.stack([r.seq_ids[b] for b in rows]),
            offsets=np.stack([r.offsets[b] for b in rows]),
        )
        self._kv.key_value_set_bytes(self._key("prompt", self.me, len(self._ends[self.me])), blob)
        self.lent += [(b, engine) for b in rows]
        self._ends[self.me].append(len(self.lent))
        self._kv.key_value_set(
            self._key("state", "lent", self.me),
            ",".join(map(str, self._ends[self.me])),
            allow_overwrite=True,
        )

    def drained(self) -> None:
        """This process's queues are empty: it lends nothing more in this call."""
        if not self._said_drained:
            self._said_drained = True
            self._drained[self.me] = True
            self._kv.key_value_set(self._key("state", "drained", self.me), "1")

    def fail(self, message: str) -> None:
        """An engine of this process failed: the other processes stop taking and waiting."""
        self.failed = self.failed or (self.me, message)
        with contextlib.suppress(Exception):  # already failing; the store may be gone too
            self._kv.key_value_set(self._key("state", "failed", self.me), message[:2000])

    def refresh(self, *, force: bool = False) -> None:
        """Reads the processes' states and the claims from the store (at most every
        ``refresh_s`` unless ``force``)."""
        now = time.monotonic()
        if not force and now - self._seen < self.refresh_s:
            return
        self._seen = now
        for key, value in self._kv.key_value_dir_get(self._key("state") + "/"):
            kind, p = key.rsplit("/", 2)[-2:]
            if kind == "lent" and int(p) != self.me:
                ends = [int(x) for x in value.split(",")]
                if len(ends) > len(self._ends[int(p)]):
                    self._ends[int(p)] = ends
            elif kind == "started":
                self._started[int(p)] = True
            elif kind == "drained":
                self._drained[int(p)] = True
            elif kind == "failed" and self.failed is None:
                self.failed = (int(p), value)
        for key, value in self._kv.key_value_dir_get(self._key("claim") + "/"):
            p, k = key.rsplit("/", 2)[-2:]
            self.claims[int(p), int(k)] = int(value)

    def _unclaimed(self, p: int) -> list[int]:
        return [k for k in range(self._lent_n(p)) if (p, k) not in self.claims]

    def available(self) -> bool:
        """Whether a lent prompt may still be taken (from the last :meth:`refresh`)."""
        return self.failed is None and any(self._unclaimed(p) for p in range(self.count))

    def finished(self) -> bool:
        """Whether no process will lend more and every lent prompt is taken (or one failed):
        refreshes first.

        Raises:
          TimeoutError: a process has not reached the call within ``timeout_s``."""
        self.refresh()
        done = self.failed is not None or (
            all(self._drained) and not any(self._unclaimed(p) for p in range(self.count))
        )
        if not done and not all(self._started) and time.monotonic() > self._deadline:
            absent = [p for p in range(self.count) if not self._started[p]]
            raise TimeoutError(
                f"work stealing: processes {absent} did not reach this generate call within "
                f"{self.timeout_s:.0f} s (did one fail before it, or take another path?)"
            )
        return done

    def _row(self, p: int, k: int) -> int:
        """The row of lent prompt ``(p, k)`` here: its own row in the lending process, else
        a row appended to :attr:`rows` with the prompt read from the store (its lending's
        blob, once)."""
        if p == self.me:
            return self.lent[k][0]
        if (p, k) not in self._fetched:
            j = bisect.bisect_right(self._ends[p], k)
            if (p, j) not in self._blobs:
                self._blobs[p, j] = npz_arrays(
                    self._kv.key_value_try_get_bytes(self._key("prompt", p, j))
                )
            got, i = self._blobs[p, j], k - (self._ends[p][j - 1] if j else 0)
            start = int(got["lengths"][:i].sum())
            prompt = got["tokens"][start : start + int(got["lengths"][i])]
            self._fetched[p, k] = self.rows.add(
                prompt, got["budgets"][i], got["seq_ids"][i], got["offsets"][i], (p, k)
            )
        return self._fetched[p, k]

    def take(
        self, claim: Callable[[int], Any], engine: int, tries: int = 4
    ) -> tuple[int, Any, bool] | None:
        """``(row, claim(row), moved)`` for a lent prompt that ``claim`` (the engine's room
        check) accepts and this process then claims in the store; ``moved``: it left another
        engine's queue (not ``engine``'s own). This process's own lent prompts first, from the
        front; then the process with the most untaken, from the back. At most ``tries``
        candidates; None when none fits or the store refused each claim."""
        self.refresh()
        if self.failed is not None:
            return None
        order = [(self.me, k) for k in self._unclaimed(self.me)]
        others = sorted((p for p in range(self.count) if p != self.me),
                        key=lambda p: -len(self._unclaimed(p)))  # fmt: skip
        order += [(p, k) for p in others for k in reversed(self._unclaimed(p))]
        for p, k in order[:tries]:
            b = self._row(p, k)
            room = claim(b)
            if not room:
                continue
            try:
                self._kv.key_value_set(self._key("claim", p, k), str(self.me))
            except Exception as e:  # the store's ALREADY_EXISTS: another process took it
                if "ALREADY_EXISTS" not in str(e) and "already exists" not in str(e):
                    raise
                self.claims.setdefault((p, k), -1)
                continue
            self.claims[p, k] = self.me
            return b, room, not (p == self.me and self.lent[k][1] == engine)
        return None

    def publish_results(self, outputs: dict[int, tuple[np.ndarray, ...]]) -> None:
        """Publishes the outputs (each array's row) of the other processes' prompts that this
        process ran, by row (once each: :attr:`published`)."""
        for b, arrays in outputs.items():
            if b in self.published:
                continue
            p, k = self.rows.origin[b]
            blob = npz_bytes(**{f"a{i}": x for i, x in enumerate(arrays)})
            self._kv.key_value_set_bytes(self._key("result", p, k), blob)
            self.published.add(b)

    def collect_results(self) -> dict[int, tuple[np.ndarray, ...]]:
        """The outputs of this process's lent prompts that other processes ran, by this
        process's row: waits for them as long as no process has failed. Reads every result
        already published at once (one read of the call's result folder), then waits on the
        first missing one and reads the folder again: a few store round trips however many
        prompts moved, not one per prompt.

        Raises:
          RuntimeError: a process failed (or a lent prompt ran nowhere: a bug)."""
        self.refresh(force=True)
        out: dict[int, tuple[np.ndarray, ...]] = {}
        waiting: dict[int, int] = {}  # lent prompt k -> its row here, run by another process
        if self.lent:
            self._check_failed()
        for k, (b, _) in enumerate(self.lent):
            p = self.claims.get((self.me, k))
            if p is None:  # every engine here has stopped: a prompt is lost
                raise RuntimeError(f"work stealing: lent prompt {k} (row {b}) ran nowhere")
            if p != self.me:
                waiting[k] = b
        folder = self._key("result", self.me) + "/"
        while waiting:
            for key, blob in self._kv.key_value_dir_get_bytes(folder):
                k = int(key.rsplit("/", 1)[-1])
                if k in waiting:
                    got = npz_arrays(blob)
                    out[waiting.pop(k)] = tuple(got[f"a{i}"] for i in range(len(got)))
            if not waiting:
                break
            self._check_failed()
            try:  # until the first missing result is published (or a second passes)
                self._kv.blocking_key_value_get_bytes(folder + str(min(waiting)), 1000)
            except Exception as e:  # the store's DEADLINE_EXCEEDED: not yet
                if "DEADLINE_EXCEEDED" not in str(e) and "timed out" not in str(e):
                    raise
                self.refresh(force=True)  # a failure ends the wait
        return out

    def _check_failed(self) -> None:
        if self.failed is not None:
            raise RuntimeError(f"work stealing: process {self.failed[0]} failed: {self.failed[1]}")


class PromptQueues:
    """The waiting prompts of one call's engines in a process (rows of ``rows``), engine
    ``e`` starting with ``shares[e]``; :meth:`engine` is engine ``e``'s view. With
    ``lending`` (several processes), an opened queue lends all but its head to the other
    processes (and its own engines), and the engines take lent prompts once the process's
    queues have none left for them."""

    def __init__(self, shares: Sequence[Iterable[int]], rows: Rows | None = None,
                 lending: Lending | None = None):  # fmt: skip
        self._queues = [deque(s) for s in shares]
        self._open = [False] * len(self._queues)
        self._cond = threading.Condition()
        self._aborted = False
        self.rows, self.lending = rows, lending
        self.ran: list[list[int] | None] = [None] * len(self._queues)
        self._check_drained()

    def _check_drained(self) -> None:
        if self.lending is not None and not any(self._queues):
            self.lending.drained()

    def engine(self, e: int) -> EngineQueue:
        return EngineQueue(self, e)

    def abort(self, message: str = "an engine failed") -> None:
        """An engine failed: every waiting engine stops waiting (and steals nothing more);
        with lending, the other processes too."""
        with self._cond:
            self._aborted = True
            if self.lending is not None:
                self.lending.fail(message)
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

    @property
    def rows(self) -> Rows | None:
        """The rows the queues' prompts index (None: the engine's own arguments)."""
        return self._all.rows

    def popleft(self) -> int:
        with self.lock:
            b = self._own.popleft()
            if not self._own:  # an engine waiting for this queue may stop waiting
                self.lock.notify_all()
                self._all._check_drained()
            return b

    def extendleft(self, prompts: Iterable[int]) -> None:
        with self.lock:
            self._own.extendleft(prompts)

    def open(self) -> None:
        """The head prompt waits for room: the other engines may take from the tail (with
        lending, every prompt but the head is lent, to every engine of every process)."""
        with self.lock:
            if not self._all._open[self._e]:
                self._all._open[self._e] = True
                lending = self._all.lending
                if lending is not None and len(self._own) > 1:
                    tail = [self._own.pop() for _ in range(len(self._own) - 1)][::-1]
                    lending.lend(tail, self._e)
                self.lock.notify_all()

    def _victim(self) -> deque | None:
        qs, e = self._all, self._e
        if qs._aborted:
            return None
        waiting = [(len(q), i) for i, q in enumerate(qs._queues) if i != e and qs._open[i] and q]
        return qs._queues[max(waiting)[1]] if waiting else None

    def _lending(self) -> Lending | None:
        lending = self._all.lending
        return None if lending is None or self._all._aborted else lending

    def stealable(self) -> bool:
        """Whether another engine has opened a queue with prompts in it (or a lent prompt
        is untaken, as of the last look at the store)."""
        with self.lock:
            lending = self._lending()
            return self._victim() is not None or (lending is not None and lending.available())

    def steal(self, claim: Callable[[int], Any]) -> tuple[int, Any] | None:
        """``(b, claim(b))`` for ``b`` the last prompt of the open queue with the most prompts,
        taken when ``claim`` (this engine's room check, run holding :attr:`lock`) returns a
        true value; with lending and no such queue, a lent prompt (:meth:`Lending.take`);
        else None."""
        with self.lock:
            q = self._victim()
            if q is None:
                lending = self._lending()
                taken = None if lending is None else lending.take(claim, self._e)
                if taken is None:
                    return None
                b, room, moved = taken
                self.stolen += moved
                return b, room
            room = claim(q[-1])
            if not room:
                return None
            b = q.pop()
            if not q:
                self.lock.notify_all()
                self._all._check_drained()
            self.stolen += 1
            return b, room

    def others_waiting(self) -> bool:
        """Whether another engine still has prompts queued (it may open its queue later), or
        with lending, whether any process may still lend or has lent prompts untaken; and no
        engine failed."""
        qs = self._all
        with self.lock:
            if qs._aborted:
                return False
            if any(q for i, q in enumerate(qs._queues) if i != self._e):
                return True
            return qs.lending is not None and not qs.lending.finished()

    def wait(self) -> None:
        """Blocks until another engine opens a queue with prompts in it, or no other queue
        has prompts left (or an engine failed). With lending, at most one look at the store
        (``refresh_s``) at a time: the caller tries the lent prompts again after it."""
        with self.lock:
            lending = self._lending()
            if lending is not None:
                if self._victim() is None and self.others_waiting():
                    self.lock.wait(lending.refresh_s)
                return
            while self._victim() is None and self.others_waiting():
                self.lock.wait()

    def send_back(self, b: int, outputs: tuple[np.ndarray, ...]) -> None:
        """Row ``b`` is another process's prompt, finished here: its ``outputs`` (each
        array's row) go to that process now, not at the end of this engine's run."""
        with self.lock:
            self._all.lending.publish_results({b: outputs})

    def done(self, ran: Sequence[int]) -> None:
        """Records the prompts this engine ran (their outputs' rows, in this order)."""
        with self.lock:
            self._all.ran[self._e] = list(ran)
            self.lock.notify_all()


__all__ = ["EngineQueue", "Lending", "PromptQueues", "Rows"]
