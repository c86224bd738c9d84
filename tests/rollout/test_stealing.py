"""The prompt queues of work stealing (rollout/stealing.py), without an engine: who may take
what, and when a waiting engine wakes. The engines' side is in test_paged_dp.py."""

import threading

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
