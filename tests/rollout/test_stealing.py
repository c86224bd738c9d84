"""The prompt queues of work stealing (rollout/stealing.py), without an engine: who may take
what, and when a waiting engine wakes; across processes, what is lent, who takes it and how
the outputs go back, on a stand-in for the coordination service's store. The engines' side is
in test_paged_dp.py."""

import threading
import time

import numpy as np
import pytest

from jaxrl_llm.rollout import stealing


def test_only_open_queues_are_taken_from_their_tail_most_waiting_first():
    qs = stealing.PromptQueues([range(0, 3), range(3, 8), range(8, 10), []])
    a, b, c, idle = (qs.engine(e) for e in range(4))
    assert [a.share, b.share, c.share, idle.share] == [3, 5, 2, 0]
    with idle.lock:
        assert idle.steal(lambda _: True) is None  # nobody waits for room yet
        c.open()
        assert idle.steal(lambda _: True) == (9, True)  # c's last prompt, with the claim
        b.open()
        assert idle.steal(lambda _: False) is None  # b's last does not fit the thief
        assert idle.steal(lambda _: True) == (7, True)  # b now has the most waiting
        assert [b.popleft(), len(b)] == [3, 3]  # the owner keeps its head
    assert idle.stolen == 2 and a.stolen == 0
    assert not a.stealable() or a.steal(lambda _: True) is not None
    idle.done([7, 9])
    assert qs.ran[3] == [7, 9]


def test_a_waiting_engine_wakes_when_a_queue_opens_or_every_other_is_empty():
    qs = stealing.PromptQueues([[0, 1], []])
    owner, thief = qs.engine(0), qs.engine(1)
    assert thief.others_waiting() and not thief.stealable()
    woke = []

    def waiter():
        thief.wait()
        woke.append(thief.stealable())

    t = threading.Thread(target=waiter)
    t.start()
    t.join(0.2)
    assert t.is_alive()  # the owner's prompts do not wait for room: nothing to take
    with owner.lock:
        owner.open()
    t.join(5)
    assert woke == [True]
    with owner.lock:
        assert [owner.popleft(), owner.popleft()] == [0, 1]
    t = threading.Thread(target=waiter)
    t.start()
    t.join(5)  # every other queue is empty: nothing will come
    assert woke == [True, False] and not thief.others_waiting()


def test_an_abort_releases_waiting_engines_and_stops_the_taking():
    qs = stealing.PromptQueues([[0, 1, 2], []])
    thief = qs.engine(1)
    t = threading.Thread(target=thief.wait)
    t.start()
    qs.abort()
    t.join(5)
    assert not t.is_alive()
    qs.engine(0).open()
    assert not thief.stealable() and not thief.others_waiting()


# ---------------------------------------------------------------------------------------------
# Across processes (stealing.Lending): two "processes" in one, sharing a stand-in for the
# coordination service's key-value store with its semantics (an insert of an existing key is
# refused; blocking reads time out; directories by prefix).


class FakeStore:
    def __init__(self):
        self.kv: dict[str, object] = {}
        self.cond = threading.Condition()
        self.calls = 0
        self.calls_by_thread: dict[int, int] = {}

    def _count(self):
        self.calls += 1
        me = threading.get_ident()
        self.calls_by_thread[me] = self.calls_by_thread.get(me, 0) + 1

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.cond:
            self._count()
            if key in self.kv and not allow_overwrite:
                raise RuntimeError(f"ALREADY_EXISTS: key {key} already exists.")
            self.kv[key] = value
            self.cond.notify_all()

    key_value_set_bytes = key_value_set

    def key_value_try_get_bytes(self, key):
        with self.cond:
            self._count()
            if key not in self.kv:
                raise RuntimeError(f"NOT_FOUND: Config key {key} not found.")
            return self.kv[key]

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        with self.cond:
            self._count()
            if not self.cond.wait_for(lambda: key in self.kv, timeout_ms / 1e3):
                raise RuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
            return self.kv[key]

    def key_value_dir_get(self, prefix):
        with self.cond:
            self._count()
            return [(k, v) for k, v in sorted(self.kv.items()) if k.startswith(prefix)]

    key_value_dir_get_bytes = key_value_dir_get

    def key_value_delete(self, prefix):
        with self.cond:
            for k in [k for k in self.kv if k.startswith(prefix)]:
                del self.kv[k]


def _process(store, p, n_rows, first_id, shares=None, **kw):
    """Process ``p`` of 2: ``n_rows`` prompts (prompt b: b + 2 tokens of value 100·p + b),
    G = 2, budgets 8, global sequence ids from ``first_id``; its engines' queues."""
    prompts = [np.full(b + 2, 100 * p + b, np.int32) for b in range(n_rows)]
    ids = (first_id + np.arange(2 * n_rows, dtype=np.int32)).reshape(n_rows, 2)
    rows = stealing.Rows(prompts, np.full((n_rows, 2), 8, np.int32), ids)
    lending = stealing.Lending(store, "call7", p, 2, rows, refresh_s=0.0, **kw)
    return rows, lending, stealing.PromptQueues(shares or [range(n_rows)], rows, lending)


def test_an_opened_queue_lends_all_but_its_head_and_each_lent_prompt_runs_once():
    store = FakeStore()
    _, lend0, qs0 = _process(store, 0, 6, 0)
    rows1, lend1, qs1 = _process(store, 1, 2, 12)
    e0, e1 = qs0.engine(0), qs1.engine(0)
    assert e1.others_waiting()  # process 0 has not emptied its queues
    with e0.lock:
        e0.open()  # its head waits for room: rows 1..5 are lent, in order
    assert [len(e0), e0[0]] == [1, 0] and [b for b, _ in lend0.lent] == [1, 2, 3, 4, 5]
    assert [k for k in store.kv if "/prompt/" in k] == ["call7/prompt/0/0"]  # one blob
    assert store.kv["call7/state/lent/0"] == "5"
    with e1.lock:
        assert [e1.popleft(), e1.popleft()] == [0, 1]  # its own first
        assert store.kv["call7/state/drained/1"] == "1"
        assert e1.steal(lambda b: False) is None  # nothing fits the thief: nothing is claimed
        assert not any(k.startswith("call7/claim/") for k in store.kv)
        b, room = e1.steal(lambda b: "room")  # process 0's last lent prompt (its row 5)
    assert (b, room, rows1.origin[b]) == (2, "room", (0, 4))
    assert rows1.prompts[b].tolist() == [5] * 7 and rows1.seq_ids[b].tolist() == [10, 11]
    assert rows1.budgets[b].tolist() == [8, 8] and e1.stolen == 1
    # The owner takes its lent prompts back from the front, unmoved (its own queue's).
    with e0.lock:
        assert e0.popleft() == 0
        taken = [e0.steal(lambda b: True) for _ in range(4)]
    assert [t[0] for t in taken] == [1, 2, 3, 4] and e0.stolen == 0
    assert e0.steal(lambda b: True) is None and e1.steal(lambda b: True) is None
    assert not e0.others_waiting() and not e1.others_waiting()  # all drained, all taken
    claims = {k: v for k, v in store.kv.items() if k.startswith("call7/claim/")}
    assert claims == {f"call7/claim/0/{k}": "0" for k in range(4)} | {"call7/claim/0/4": "1"}
    # Outputs: process 1 publishes its row of process 0's prompt, process 0 reads it back.
    e1.send_back(2, (np.full((2, 3), 7), np.array([True, False])))  # as the prompt finishes
    assert "call7/result/0/4" in store.kv
    lend1.publish_results({2: (np.full((2, 3), 8), np.array([False, False]))})  # once only
    assert lend1.published == {2}
    back = lend0.collect_results()
    assert list(back) == [5] and back[5][0].tolist() == [[7] * 3] * 2
    assert back[5][1].tolist() == [True, False]
    assert lend1.collect_results() == {}  # it lent nothing


def test_the_outputs_of_many_moved_prompts_come_back_in_a_few_store_reads():
    store, lend0, rows1, qs1, _, e1 = _opened_pair(6, 0)  # process 0 lends rows 1..5
    with e1.lock:
        taken = [e1.steal(lambda b: True)[0] for _ in range(5)]  # process 1 takes them all
    assert [rows1.origin[b] for b in taken] == [(0, k) for k in (4, 3, 2, 1, 0)]
    e1.send_back(taken[0], (np.full((2, 3), 4), np.array([True, True])))
    lend1 = qs1.lending
    lend1.publish_results({b: (np.full((2, 3), rows1.origin[b][1]),) for b in taken[1:3]})
    late = {b: (np.full((2, 3), rows1.origin[b][1]),) for b in taken[3:]}
    publisher = threading.Timer(0.3, lend1.publish_results, (late,))
    publisher.start()  # two outputs come later: the lending process waits for them
    store.calls_by_thread.clear()
    back = lend0.collect_results()
    publisher.join()
    assert sorted(back) == [1, 2, 3, 4, 5]
    assert all(back[b][0].tolist() == [[b - 1] * 3] * 2 for b in back)
    assert back[5][1].tolist() == [True, True]
    # Two reads to refresh, one of the result folder (3 outputs there), one wait for the
    # late ones, one more folder read: 5 requests (a read per prompt made 7; a hundred
    # prompts would make no more), and 4 more for each second the late ones took (a wait that
    # timed out, a refresh, a folder read).
    calls = store.calls_by_thread[threading.get_ident()]
    assert calls >= 5 and (calls - 5) % 4 == 0, calls


def _opened_pair(n0: int, n1: int):
    """Process 0 with ``n0`` prompts, its queue opened (all but its head lent), and process 1
    with ``n1``: ``(store, process 0's lending, process 1's rows and queues, the two engines)``."""
    store = FakeStore()
    _, lend0, qs0 = _process(store, 0, n0, 0)
    rows1, _, qs1 = _process(store, 1, n1, 2 * n0)
    e0, e1 = qs0.engine(0), qs1.engine(0)
    with e0.lock:
        e0.open()
    return store, lend0, rows1, qs1, e0, e1


def test_a_prompt_another_process_claimed_first_is_skipped_and_others_lend_in_turn():
    store, lend0, rows1, _, _, e1 = _opened_pair(4, 0)
    store.key_value_set("call7/claim/0/2", "0")  # the owner took its last one meanwhile
    with e1.lock:
        b, _ = e1.steal(lambda b: True)
    assert rows1.origin[b] == (0, 1) and lend0.claims.get((0, 2)) is None
    lend0.refresh(force=True)
    assert lend0.claims[(0, 2)] == 0 and lend0.claims[(0, 1)] == 1


def test_a_process_with_two_engines_takes_from_its_own_queues_before_lent_prompts():
    store = FakeStore()
    _, _, qs0 = _process(store, 0, 6, 0, shares=[range(0, 4), range(4, 6)])
    a, b = qs0.engine(0), qs0.engine(1)
    with a.lock:
        a.open()  # lends rows 1..3; its head stays
        assert [b.popleft(), b.popleft()] == [4, 5]
        assert b.steal(lambda _: True) == (0, True)  # a's open queue: its head, in-process
        assert b.steal(lambda _: True) == (1, True)  # then a's lent prompts, from the front
    assert b.stolen == 2 and store.kv["call7/state/drained/0"] == "1"


def test_a_thief_reads_each_prompt_from_its_lending():
    store = FakeStore()
    _, lend0, qs0 = _process(store, 0, 6, 0, shares=[range(0, 3), range(3, 6)])
    rows1, _, qs1 = _process(store, 1, 0, 12)
    a, b = qs0.engine(0), qs0.engine(1)
    with a.lock:
        a.open()  # lending 0: rows 1, 2
        b.open()  # lending 1: rows 4, 5
    assert store.kv["call7/state/lent/0"] == "2,4"
    thief = qs1.engine(0)
    with thief.lock:
        got = [thief.steal(lambda _: True)[0] for _ in range(3)]
    assert [rows1.origin[r] for r in got] == [(0, 3), (0, 2), (0, 1)]  # from the back
    assert [rows1.prompts[r].tolist() for r in got] == [[5] * 7, [4] * 6, [2] * 4]
    assert [rows1.seq_ids[r].tolist() for r in got] == [[10, 11], [8, 9], [4, 5]]
    assert thief.stolen == 3 and lend0.claims == {}  # process 0 has not looked yet


def test_a_failed_process_stops_the_others_and_its_outputs_are_not_waited_for():
    _, lend0, _, qs1, e0, e1 = _opened_pair(3, 1)
    with e1.lock:
        assert e1.popleft() == 0 and e1.steal(lambda b: True) is not None
    qs1.abort("data shard 1: ValueError: bad")
    assert not e0.others_waiting() and not e0.stealable()
    with pytest.raises(RuntimeError, match="process 1 failed: data shard 1: ValueError: bad"):
        lend0.collect_results()


def test_a_process_that_never_reaches_the_call_is_a_timeout_not_a_hang():
    store = FakeStore()
    _, _, qs0 = _process(store, 0, 1, 0, timeout_s=0.2)
    e0 = qs0.engine(0)
    with e0.lock:
        e0.popleft()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"processes \[1\] did not reach this generate call"):
        while e0.others_waiting():
            e0.wait()
    assert time.monotonic() - t0 < 5
