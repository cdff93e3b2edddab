"""A DataConstructor's bookkeeping of held and handed-over batches, in one process, without
Dask: what a rank's request for its next round answers, and that nothing of a batch every
member has stays held (a constructor can serve hundreds of DP ranks)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from msd_dask.core.packing import from_wire, join_pieces
from msd_dask.roles.constructor import DataConstructor

from checks import step_pieces


def _bare(members: dict[int, list[int]], timeout: float = 30.0) -> DataConstructor:
    """A constructor whose conditions exist (as :meth:`DataConstructor.setup` makes them)."""
    con = DataConstructor("unit", 0, members, 8, 0, prefetch=4, timeout=timeout)
    con._room = asyncio.Condition()
    return con


@pytest.mark.parametrize("dp_ranks", [64, 1024])
def test_a_constructor_keeps_nothing_of_the_batches_every_member_has(dp_ranks: int) -> None:
    """80 steps of ``dp_ranks`` batches, each handed over to its two member ranks (one
    asks, the other had it already): nothing of them stays held, whatever the DP ranks
    (it used to keep every claimed ``(step, dp)`` of a window of 64 steps)."""

    async def replay() -> None:
        members = {d: [2 * d, 2 * d + 1] for d in range(dp_ranks)}
        con = _bare(members)
        for step in range(80):
            for d, ranks in members.items():
                con._ready[(step, d)] = {}
                con._unclaimed[(step, d)] = set(ranks)
                con._unclaimed_steps[d][step] = None
                con._rounds[ranks[0]].append([step])
            con._held_steps[step] = dp_ranks
            for d, ranks in members.items():
                await con._hand_over((step, d), [ranks[0]])
                await con._release((step, d), ranks[1])
        assert not con._ready and not con._unclaimed and not con._held_steps
        assert not con._unclaimed_steps

    asyncio.run(replay())


async def _built(con: DataConstructor, rounds: int) -> None:
    """Wait (up to 5 s) until ``con`` has built ``rounds`` rounds."""
    for _ in range(500):
        if con.rounds_built >= rounds:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{con.rounds_built} rounds built in 5 s, not {rounds}")


class ToyLoader:
    """Answers every piece with ``end - start + 1`` copies of its row."""

    key = "toy"

    async def fetch(self, requests: np.ndarray) -> Any:
        return join_pieces([np.full(int(e) - int(s) + 1, int(r), dtype=np.uint16)
                            for _ep, _u, r, s, e in requests])


async def _serving(members: dict[int, list[int]], steps: int) -> DataConstructor:
    """A constructor building from a :class:`ToyLoader`, with ``steps`` rounds of one step
    submitted: row ``10 * step + dp`` of each DP rank (pieces of 4 tokens)."""
    con = _bare(members, timeout=60.0)
    con.loaders = {"toy": {0: ToyLoader()}}
    con._work = asyncio.Queue()
    con._task = asyncio.create_task(con._builder())
    for step in range(steps):
        await con.submit(_toy_round(members, [step]))
    return con


def _toy_round(members: dict[int, list[int]], steps: list[int]) -> list[Any]:
    """A round of ``steps`` as the planner submits it: row ``10 * step + dp`` of each DP
    rank (pieces of 4 tokens of a :class:`ToyLoader`)."""
    return [(step, step_pieces({d: [[("toy", 0, 0, 0, 10 * step + d, 0, 3, 0,
                                      f"f:{10 * step + d}")]] for d in members}))
            for step in steps]


def _sent(round_steps: list[Any]) -> bytes:
    """A round as a planner on another worker sends it: each step's work packed as the
    planner keeps it (``pack_work``), pickled together."""
    import pickle

    from msd_dask.roles.constructor import pack_work

    return pickle.dumps([(step, pack_work(work)) for step, work in round_steps], protocol=5)


def test_next_round_skips_what_a_rank_has_and_mark_had_releases_only_its_group() -> None:
    """Two DP groups of two ranks, three rounds of one step: a rank's call finds its
    group's rounds, skips (releases) the steps it says it has, ``mark_had`` releases
    only the rank's group's batches, a fully handed-over step frees its room, and a
    notice reaches a rank after its last round."""

    async def run() -> None:
        con = await _serving({0: [0, 1], 1: [2, 3]}, 3)
        got = await con.next_round(2, -1)
        assert got["steps"] == [0]
        b = from_wire(got["payloads"][0])
        assert (b["step"], b["dp"]) == (0, 1) and b["input_ids"][0, :3].tolist() == [1] * 3
        assert b["cost"] == 2.0  # DP rank 1's own cost (step_pieces: d + 1)
        got = await con.next_round(3, 0)  # rank 3 had step 0: released, step 1 sent
        assert got["steps"] == [1] and from_wire(got["payloads"][0])["input_ids"][0, 0] == 11
        await _built(con, 3)  # step 2 too
        await con.mark_had(1, 1)  # rank 1 has steps 0 and 1: group 0 waits on rank 0 only
        assert (await con.stats())["unclaimed"] == {
            "0/0": [0], "1/0": [0], "1/1": [2], "2/0": [0, 1], "2/1": [2, 3]}
        assert (await con.next_round(0, -1))["steps"] == [0]
        stats = await con.stats()
        assert stats["held_steps"] == 2 and "0/0" not in stats["unclaimed"]
        # rank 1 told the constructor it has steps 0 and 1: its next round is step 2
        assert (await con.next_round(1, -1))["steps"] == [2]
        assert await con.next_round(1, 2, wait=0.2) is None
        # nothing is pending for rank 1: the steps mark_had released count as taken (they
        # did not, and its queue depth, a metric, stayed 2 for good: a review)
        assert (await con.stats())["queue_depth"][1] == 0
        with pytest.raises(KeyError, match="not served"):
            await con.next_round(4, -1)
        await con.notify("planner failed at step 3")
        assert (await con.next_round(0, 0))["steps"] == [1]  # its rounds first
        assert (await con.next_round(0, 1))["steps"] == [2]
        assert await con.next_round(0, 2) == {"error": "planner failed at step 3", "g": 0}
        await con.close()
        con._task.cancel()

    asyncio.run(run())


def test_a_closed_constructor_sends_readers_on_or_tells_them_the_owner_closed() -> None:
    async def run() -> None:
        replaced, closed = _bare({0: [0]}), _bare({0: [0]})
        await replaced.close()
        with pytest.raises(RuntimeError, match="was closed"):
            await replaced.next_round(0, -1)
        waiting = asyncio.ensure_future(closed.next_round(0, -1, wait=30.0))
        await asyncio.sleep(0.1)
        await closed.close("closed by its owner")
        assert await asyncio.wait_for(waiting, 5) == {"error": "closed by its owner", "g": 0}

    asyncio.run(run())


def test_a_round_taken_for_several_ranks_of_a_group_is_sent_once_and_counts_for_each() -> None:
    """A host agent reads once for the ranks of a DP group on its host: the round counts
    as handed over to each of them, the others' posts of it are dropped, the group's
    rank not in the call still gets its own copy, and a rank of another group is refused."""

    async def run() -> None:
        con = await _serving({0: [0, 1, 2], 1: [3]}, 2)
        await _built(con, 2)
        got = await con.next_round(0, -1, ranks=[0, 1])
        assert got["steps"] == [0] and len(got["payloads"]) == 1
        assert (await con.stats())["unclaimed"]["0/0"] == [2]
        assert list(con._rounds[1]) == [[1]]  # step 0 taken for it
        assert (await con.next_round(2, -1))["steps"] == [0]  # its own copy
        assert (await con.next_round(1, 0))["steps"] == [1]
        with pytest.raises(KeyError, match="not in the DP group"):
            await con.next_round(0, 0, ranks=[3])
        await con.returned_through(0, 1, [0, 1])
        stats = await con.stats()
        assert stats["returned"] == {0: 1, 1: 1, 2: -1}
        assert stats["batches_sent"] == 3  # step 0 once for ranks 0 and 1, once for 2; step 1
        await con.close()
        con._task.cancel()

    asyncio.run(run())


def test_a_round_sent_pickled_is_built_as_one_sent_as_it_is_and_answered_pickled() -> None:
    """A planner on another worker sends a round as ``bytes`` (:func:`_sent`) and a reader
    asks ``next_round_packed``: the same batches as the round sent as objects and asked
    for with ``next_round``."""
    import pickle

    async def answers(pickled: bool) -> list[Any]:
        con = _bare({0: [0]}, timeout=60.0)
        con.loaders = {"toy": {0: ToyLoader()}}
        con._work = asyncio.Queue()
        con._task = asyncio.create_task(con._builder())
        work = [(step, step_pieces({0: [[("toy", 0, 0, 0, 10 * step, 0, 3, 0,
                                           f"f:{10 * step}")]]}))
                for step in range(2)]
        await con.submit(_sent(work) if pickled else work)
        if pickled:
            got = [pickle.loads(await con.next_round_packed(0, -1)),
                   pickle.loads(await con.next_round_packed(0, 1, wait=0.1))]
        else:
            got = [await con.next_round(0, -1), await con.next_round(0, 1, wait=0.1)]
        await con.close()
        con._task.cancel()
        return got

    plain, pickled = asyncio.run(answers(False)), asyncio.run(answers(True))
    assert pickled[1] is None and plain[1] is None
    assert pickled[0]["steps"] == plain[0]["steps"] == [0, 1]
    for a, b in zip(pickled[0]["payloads"], plain[0]["payloads"], strict=True):
        a, b = from_wire(a), from_wire(b)
        assert a.keys() == b.keys()
        np.testing.assert_equal(a, b)


def test_an_agents_claims_count_what_its_ranks_took_not_the_steps_before_the_round() -> None:
    """A host agent claims rounds ahead of its ranks and says what they took
    (``returned``): the constructor counts that, not the steps before the round, in
    ``next_round`` and ``next_round_packed`` alike; a claim without it counts the steps
    before the round (a direct reader)."""
    import pickle

    async def run() -> None:
        con = await _serving({0: [0, 1], 1: [2]}, 4)
        await _built(con, 4)
        # the agent of ranks 0 and 1 reads steps 0-2 before its ranks took any
        assert (await con.next_round(0, -1, ranks=[0, 1], returned=-1))["steps"] == [0]
        got = pickle.loads(await con.next_round_packed(0, 0, ranks=[0, 1], returned=-1))
        assert got["steps"] == [1]
        assert (await con.next_round(0, 1, ranks=[0, 1], returned=-1))["steps"] == [2]
        assert 0 not in con.returned and 1 not in con.returned
        # its ranks took step 0, and it reads step 3
        got = pickle.loads(await con.next_round_packed(0, 2, ranks=[0, 1], returned=0))
        assert got["steps"] == [3]
        assert {r: (con.returned[r], con.returned_by[r]) for r in (0, 1)} == {
            0: (0, "taken"), 1: (0, "taken")}
        # a direct reader's claims count the steps before each round
        for step in range(3):
            assert (await con.next_round(2, step - 1))["steps"] == [step]
        assert (con.returned[2], con.returned_by[2]) == (1, "claim")
        await con.close()
        con._task.cancel()

    asyncio.run(run())


def test_a_round_delivered_twice_is_built_and_handed_out_once() -> None:
    """A call retried after its connection failed may deliver a round twice (pickled, as a
    planner on another worker sends it), after the first or while the first waits for
    room: each step is built, posted and handed out once, and holds room once."""
    async def run() -> None:
        members = {0: [0]}
        con = await _serving(members, 0)
        first = _sent(_toy_round(members, [0, 1, 2, 3]))
        await asyncio.wait_for(con.submit(first), 5)
        # the room of prefetch = 4 is full: dropped, not waiting for room
        await asyncio.wait_for(con.submit(first), 5)
        # the next round, twice, both waiting for room
        second = _sent(_toy_round(members, [4, 5]))
        waiting = [asyncio.ensure_future(con.submit(second)) for _ in range(2)]
        await _built(con, 1)
        assert (await con.next_round(0, -1))["steps"] == [0, 1, 2, 3]
        await asyncio.wait_for(asyncio.gather(*waiting), 5)
        await _built(con, 2)
        assert (await con.next_round(0, 3))["steps"] == [4, 5]
        assert await con.next_round(0, 5, wait=0.2) is None
        stats = await con.stats()
        assert (stats["rounds_built"], stats["batches_built"], stats["batches_sent"]) == (2, 6, 6)
        assert stats["held_steps"] == 0 and not stats["unclaimed"]
        await con.close()
        con._task.cancel()

    asyncio.run(run())


def test_a_replacing_constructor_takes_the_re_sent_steps_before_a_later_round() -> None:
    """The planner publishes a re-created constructor, then re-sends it the steps not every
    rank claimed; its next round may arrive first.  That round waits: the re-sent steps are
    accepted, built and handed out first, and none is dropped as delivered already."""

    async def run() -> None:
        members = {0: [0]}
        con = DataConstructor("unit", 0, members, 8, 0, prefetch=4, timeout=60.0,
                              replacing=True)
        con._room = asyncio.Condition()
        con.loaders = {"toy": {0: ToyLoader()}}
        con._work = asyncio.Queue()
        con._task = asyncio.create_task(con._builder())
        later = asyncio.ensure_future(con.submit(_toy_round(members, [3, 4])))
        await asyncio.sleep(0.2)
        assert not later.done() and (await con.stats())["rounds_built"] == 0
        await asyncio.wait_for(con.submit(_toy_round(members, [1, 2]), force=True), 5)
        await asyncio.wait_for(later, 5)
        await _built(con, 2)
        assert (await con.next_round(0, 0))["steps"] == [1, 2]
        assert (await con.next_round(0, 2))["steps"] == [3, 4]
        await con.close()
        con._task.cancel()

    asyncio.run(run())


def test_a_round_that_cannot_be_built_is_named_whole() -> None:
    """A round of steps 1 and 2 whose step 2 holds a corrupt document: the round is
    fetched and built together, so the error names both steps, with the loader's message
    naming the document (it used to name step 1 alone, whose documents were fine)."""
    from msd_dask.errors import DataError

    class CorruptStep2(ToyLoader):
        async def fetch(self, requests: np.ndarray) -> Any:
            for _ep, _u, r, _s, _e in requests.tolist():
                if r // 10 == 2:
                    raise DataError(f"corrupt document at row {r}")
            return await super().fetch(requests)

    async def run() -> None:
        members = {0: [0, 1]}
        con = _bare(members, timeout=5.0)
        con.loaders = {"toy": {0: CorruptStep2()}}
        con._work = asyncio.Queue()
        con._task = asyncio.create_task(con._builder())
        await con.submit(_toy_round(members, [0]))
        await con.submit(_toy_round(members, [1, 2]))
        await asyncio.wait_for(con._task, 5)
        error = (await con.stats())["error"]
        assert error == ("constructor 0 failed to build steps 1-2: "
                         "DataError('corrupt document at row 20')")
        assert (await con.next_round(0, -1))["steps"] == [0]  # the step built before
        assert (await con.next_round(0, 0)) == {"error": error, "g": 0}
        # the planner hears it too: the failed round's steps stayed held, and its next
        # submit and wait for room waited for ever (a review)
        for call in (con.submit(_toy_round(members, [3, 4, 5, 6])), con.wait_room(4)):
            with pytest.raises(RuntimeError, match="failed to build steps 1-2"):
                await asyncio.wait_for(call, 5)

    asyncio.run(run())


def test_a_moved_constructors_successor_holds_nothing_the_ranks_showed_they_took() -> None:
    """A constructor moves: the planner re-sends its last ``prefetch`` steps (0-3) to the
    successor, while rank 1 still reads on from the old one (steps 0-3; its claim of step 3
    showed it has 0-2).  Told what the ranks showed the old one (``steps_shown``), the
    successor holds for rank 1 only step 3, so the next round has room, and rank 0 (moved
    to the successor after step 0) reads on.  It used to hold steps 0-3 for rank 1: no
    room for the next step, which rank 0 waited for, while rank 1, which had its steps,
    had no reason to ask (a CI run waited out its timeout)."""

    async def run() -> None:
        members = {0: [0], 1: [1]}
        old = await _serving(members, 4)
        assert (await old.next_round(0, -1))["steps"] == [0]
        for step in range(4):
            assert (await old.next_round(1, step - 1))["steps"] == [step]
        new = await _serving(members, 0)
        await new.submit(_toy_round(members, [0, 1, 2, 3]), force=True)  # the re-send
        await old.close()
        assert await old.steps_shown() == {1: 2}  # (rank 0's claim showed nothing)
        await new.mark_had_all(await old.steps_shown())
        assert (await new.stats())["held_steps"] == 4  # rank 0 lacks 1-3, both lack 3...
        assert (await new.next_round(0, 0))["steps"] == [1, 2, 3]  # ... rank 0 takes them
        assert (await new.stats())["held_steps"] == 1  # step 3, for rank 1
        await asyncio.wait_for(new.submit(_toy_round(members, [4])), 5)  # room for it
        assert (await new.next_round(0, 3))["steps"] == [4]
        assert (await new.next_round(1, 3))["steps"] == [4]  # step 3 released, 4 sent
        for con in (old, new):
            await con.close()
            con._task.cancel()

    asyncio.run(run())


class _HungLoader:
    """A loader stuck reading a unit (a store that hangs): its fetch never answers, its
    stats say what it reads."""

    key = "hung"

    async def fetch(self, requests: np.ndarray) -> Any:
        await asyncio.Event().wait()

    async def stats(self) -> dict[str, Any]:
        return {"reading": [{"path": "s3://bucket/part-7.parquet", "epoch": 1, "seconds": 42.0}]}


def test_a_fetch_from_a_loader_stuck_reading_says_what_it_reads() -> None:
    """'loader slot toy#0 did not answer' sent users looking for a lost worker, where the
    loader answered and one of its reads hung (an audit of the waits)."""
    async def run() -> None:
        con = _bare({0: [0]}, timeout=1.0)
        con.loaders = {"toy": {0: _HungLoader()}}
        with pytest.raises(RuntimeError, match=r"loader slot toy#0 did not answer within 1s; "
                                               r"it is reading s3://bucket/part-7\.parquet "
                                               r"\(epoch 1\) for 42s"):
            await con._fetch("toy", 0, np.zeros((1, 5), dtype=np.int64))

    asyncio.run(run())


def test_a_round_whose_answer_was_lost_is_sent_again_by_the_next_generation() -> None:
    """Rank 0 is handed steps 0 and 1, but the answer never reaches it; the planner is lost
    and re-created.  The new constructors were told the ranks had what they were *handed*
    (``last_claimed``), so they never sent the re-planned steps 0 and 1 to rank 0, whose
    reader went on with step 2 (a review of the claim protocol).  What the old ones say
    the ranks *showed* they have (``stats()["shown"]``, :func:`close_service_roles`) is
    what the next generation starts from."""
    from msd_dask.roles.keys import constructor_key
    from msd_dask.roles.supervisor import close_service_roles

    members = {0: [0, 1], 1: [2, 3]}

    class Worker:  # what close_service_roles looks at on a worker
        def __init__(self, actors: dict[str, Any]):
            self.state = type("State", (), {"actors": actors})()

    async def run() -> None:
        old = DataConstructor("u", 0, members, 8, 0, prefetch=4)
        await old.setup({"toy": {0: ToyLoader()}})
        await old.submit(_toy_round(members, [0, 1]))
        await _built(old, 1)
        assert (await old.next_round(0, -1))["steps"] == [0, 1]  # (the answer is lost)
        assert (await old.next_round(2, -1))["steps"] == [0, 1]
        assert (await old.next_round(2, 1, wait=0.1)) is None  # rank 2 shows it has them
        stats = await old.stats()
        assert stats["last_claimed"] == {0: 1, 2: 1} and stats["shown"] == {2: 1}
        closed = await close_service_roles("u", ["toy"],
                                           dask_worker=Worker({constructor_key("u", 0): old}))
        assert closed == {"closed": 1, "shown": {2: 1}}
        new = DataConstructor("u", 0, members, 8, 0, prefetch=4, generation=1)
        await new.setup({"toy": {0: ToyLoader()}}, had=closed["shown"])
        await new.submit(_toy_round(members, [0, 1]))  # re-planned from the checkpoint
        await new.submit(_toy_round(members, [2, 3]))
        await _built(new, 2)
        assert (await new.next_round(0, -1))["steps"] == [0, 1]  # again: it never had them
        assert (await new.next_round(2, -1))["steps"] == [2, 3]  # it had them: not again
        await new.close()
        new._task.cancel()

    asyncio.run(run())


def test_a_large_step_is_packed_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole round was packed on the constructor's event loop: at 64 DP ranks x 8 rows x
    128K the worker answered nothing (claims, the planner's submits, heartbeats) for
    seconds (a review of the data path).  A step of THREAD_PACK_FROM pieces or more is
    packed in a thread; a small one on the loop, sparing it the hop."""
    import threading

    from msd_dask.roles import constructor as constructor_module

    where: list[bool] = []  # per pack_rows call: on the event loop's thread
    real = constructor_module.pack_rows

    def watched(*args: Any, **kwargs: Any) -> Any:
        where.append(threading.current_thread() is threading.main_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(constructor_module, "pack_rows", watched)
    monkeypatch.setattr(constructor_module, "THREAD_PACK_FROM", 3)  # (a toy step: 2 pieces a rank)
    members = {0: [0], 1: [1]}

    async def run(steps: list[int], pieces_per_rank: int) -> list[int]:
        con = await _serving(members, 0)
        rnd = [(step, step_pieces({d: [[("toy", 0, 0, 0, 10 * step + d, 4 * j, 4 * j + 3, j,
                                         f"f:{10 * step + d}")
                                        for j in range(pieces_per_rank)]] for d in members}))
               for step in steps]
        await con.submit(rnd)
        await _built(con, 1)
        got = await con.next_round(0, -1)
        con._task.cancel()
        return got["steps"]

    assert asyncio.run(run([0, 1], 1)) == [0, 1] and where == [True] * 4  # 2 pieces a step
    where.clear()
    assert asyncio.run(run([0, 1], 2)) == [0, 1] and where == [False] * 4  # 4 pieces a step


class _ReadsDifferently:
    """Answers every fetch with the error a loader gives where a file read differently."""

    key = "r"

    async def fetch(self, requests: np.ndarray) -> Any:
        raise RuntimeError("source 'toy', file 'f.parquet', row 3 (epoch 0): the file read "
                           "differently; reading it again")


class _Short(ToyLoader):
    """Answers one piece fewer than asked."""

    async def fetch(self, requests: np.ndarray) -> Any:
        return join_pieces([])


class _WrongLength(ToyLoader):
    """Answers every piece two tokens short."""

    async def fetch(self, requests: np.ndarray) -> Any:
        return join_pieces([np.zeros(int(e) - int(s) - 1, dtype=np.uint16)
                            for _ep, _u, _r, s, e in requests])


def _error_of(loader: Any) -> str:
    """What rank 0 is told where ``loader`` answers its constructor's fetch of step 0."""
    async def run() -> Any:
        con = _bare({0: [0]}, timeout=1.0)
        con.loaders = {"toy": {0: loader}}
        con._work = asyncio.Queue()
        con._task = asyncio.create_task(con._builder())
        try:
            await con.submit(_toy_round({0: [0]}, [0]))
            answer = None
            while answer is None:
                answer = await con.next_round(0, -1, wait=1)
            return answer
        finally:
            await con.close()

    return str(asyncio.run(asyncio.wait_for(run(), 30)).get("error", ""))


def test_a_loader_that_answers_with_an_error_is_said_to_with_its_error() -> None:
    """A loader that answered every fetch with its error (one naming the file) was said,
    at the timeout, not to answer, its error lost (a review)."""
    error = _error_of(_ReadsDifferently())
    assert "loader slot toy#0 answered with an error for 1s" in error, error
    assert "file 'f.parquet', row 3 (epoch 0): the file read differently" in error, error
    assert "did not answer" not in error, error


def test_a_loader_answer_that_does_not_fit_names_the_loader_or_document() -> None:
    """Python's words ("zip() argument 2 is shorter", "piece of 3 tokens given 2 token
    ids") named neither the loader nor the document (a review)."""
    assert "loader slot toy#0 answered 0 pieces for 1 asked of step 0" in _error_of(_Short())
    error = _error_of(_WrongLength())
    assert ("step 0, DP rank 0, row 0, piece 0: a piece of 3 tokens given 2 token ids: source "
            "'toy', document 'f:0', chunk 0") in error, error


def test_a_claim_with_a_view_of_no_rank_hands_nothing_over() -> None:
    """A claim whose view is no rank of the mesh (``cp_rank`` 2 of ``cp`` 2) was refused by
    ``view_for_rank`` after the round's steps were marked handed: the rank's retry with a
    good view was told they were gone (a review).  It is refused before."""
    async def run() -> Any:
        con = await _serving({0: [0, 1]}, 2)
        try:
            await _built(con, 2)
            with pytest.raises(ValueError, match="cp_rank 2 is not a rank of cp 2"):
                await con.next_round(0, -1, view=(2, 2, 0, 1))
            with pytest.raises(ValueError, match="pp_rank 1 is not a stage of pp 1"):
                await con.next_round(0, -1, view=(0, 1, 1, 1))
            assert (await con.stats())["last_claimed"] == {}
            return await con.next_round(0, -1, view=(0, 1, 0, 1), wait=1)
        finally:
            await con.close()

    answer = asyncio.run(asyncio.wait_for(run(), 30))
    assert answer is not None and answer["steps"] == [0], answer


def test_a_fetch_that_failed_is_not_said_to_go_on() -> None:
    """``stats()["fetching"]`` was cleared only after a fetch succeeded: one that failed
    (bad input, a timeout) or was cancelled went on being named for good (a review)."""
    from msd_dask.errors import DataError

    class Bad(ToyLoader):
        async def fetch(self, requests: np.ndarray) -> Any:
            raise DataError("corrupt document at row 0")

    async def run() -> dict[str, Any]:
        con = _bare({0: [0]}, timeout=5.0)
        con.loaders = {"toy": {0: Bad()}}
        con._work = asyncio.Queue()
        con._task = asyncio.create_task(con._builder())
        try:
            await con.submit(_toy_round({0: [0]}, [0]))
            await asyncio.wait_for(con._task, 10)
            return await con.stats()
        finally:
            await con.close()

    stats = asyncio.run(run())
    assert "corrupt document at row 0" in stats["error"] and stats["fetching"] is None, stats
