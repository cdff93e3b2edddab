"""Shared reading and assertions on delivered batches: records, every rank's steps, content,
exactly-once, mix; and waiting for a condition."""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np

from msd_dask.sources.tokenizer import ByteTokenizer


def record(batch: Any) -> dict[str, Any]:
    """What tests keep of a Batch (picklable, small)."""
    def arr(t: Any) -> Any:
        return None if t is None else t.numpy().copy()

    return {
        "step": batch.step, "rank": batch.rank, "cost": batch.cost,
        "input_ids": arr(batch.input_ids), "labels": arr(batch.labels),
        "position_ids": arr(batch.position_ids),
        "cu_seqlens": None if batch.cu_seqlens is None else [arr(c) for c in batch.cu_seqlens],
        "documents": batch.documents, "epochs": batch.epochs,
    }


def read_steps(svc: Any, steps: int, *, readers: list[Any] | None = None,
               on_step: Callable[[int], Any] | None = None) -> list[dict[str, Any]]:
    """Read ``steps`` steps on every rank of ``svc`` (or on ``readers``), step by step (a rank
    read alone stalls after ``prefetch`` steps); their records, by step then rank.

    Each batch is the next step of its reader and of its rank; ``on_step(i)`` runs before
    the ``i``-th step is read.  Readers made here are dropped on return: pass ``readers``
    (and keep them) where the service must still count what they returned
    (:meth:`DataService.consumed_step`, ``state_dict()``).
    """
    if readers is None:
        readers = [svc.reader(r) for r in range(svc.config.parallel.world_size)]
    first = [0 if rd.step is None else rd.step + 1 for rd in readers]  # a fresh reader: step 0
    out = []
    for i in range(steps):
        if on_step is not None:
            on_step(i)
        for rd, f in zip(readers, first, strict=True):
            b = next(rd)
            assert b.step == f + i and b.rank == rd.rank, (b.step, f + i, b.rank, rd.rank)
            out.append(record(b))
    return out


def wait_until(cond: Callable[[], Any], timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Poll ``cond`` every ``interval`` seconds until it is true (``True``) or ``timeout``
    seconds passed (``False``)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def check_content(records: list[dict[str, Any]], texts: dict[tuple[str, str], str],
                  seq_len: int) -> dict[str, int]:
    """Every segment's tokens equal its document's text; labels and positions are right.

    Returns the tokens delivered per source.
    """
    tok = ByteTokenizer()
    encoded: dict[tuple[str, str], np.ndarray] = {}
    tokens: dict[str, int] = defaultdict(int)
    for rec in records:
        for m, docs in enumerate(rec["documents"]):
            cu = rec["cu_seqlens"][m]
            assert cu[0] == 0 and len(cu) == len(docs) + 1
            for j, (src, key, chunk) in enumerate(docs):
                if (src, key) not in encoded:
                    encoded[(src, key)] = tok.encode(texts[(src, key)])
                full = encoded[(src, key)]
                a, b = int(cu[j]), int(cu[j + 1])
                start = chunk * seq_len
                seg = rec["input_ids"][m, a:b]
                np.testing.assert_array_equal(seg, full[start:start + (b - a)],
                                              err_msg=f"{src} {key} chunk {chunk}")
                nxt = full[start + 1:start + 1 + (b - a)]
                lab = rec["labels"][m, a:b]
                np.testing.assert_array_equal(lab[:len(nxt)], nxt)
                assert (lab[len(nxt):] == -100).all()
                np.testing.assert_array_equal(rec["position_ids"][m, a:b], np.arange(b - a))
                tokens[src] += b - a
            used = int(cu[-1])
            assert (rec["input_ids"][m, used:] == tok.pad_id).all()
            assert (rec["labels"][m, used:] == -100).all()
    return dict(tokens)


def _chunks(n_tokens: int, seq_len: int) -> int:
    """The pieces of a document of ``n_tokens`` (its end-of-document id included): none for
    a text of no tokens, which the loaders drop."""
    return 0 if n_tokens <= 1 else -(-n_tokens // seq_len)


def check_exactly_once(records: list[dict[str, Any]], texts: dict[tuple[str, str], str],
                       seq_len: int, carry_steps: int = 3, min_complete: int = 1) -> dict[str, int]:
    """Every piece of a source is delivered exactly once per source epoch.

    Every epoch must hold every piece of the source exactly once, except the
    last one seen, and the one before it if the last began at most
    ``carry_steps`` steps before the last record: a piece of epoch ``e`` can be
    delivered a few steps after epoch ``e + 1`` began (the planner carries a
    drawn piece to a later step), so a run that stops there has seen it not yet.
    Partial epochs must hold no piece twice and no unknown piece.  Records
    without a ``"step"`` (pieces still pending) count as the last step.
    Returns the number of epochs found complete per source, which must be at least
    ``min_complete`` for every source: a run that completes no epoch only shows that
    no piece came twice (a lost one passes), so a test whose run is that short says so
    with ``min_complete=0``.
    """
    tok = ByteTokenizer()
    counts: dict[tuple[str, int], Counter[tuple[str, int]]] = defaultdict(Counter)
    first: dict[tuple[str, int], int] = {}
    steps = [int(rec["step"]) for rec in records if rec.get("step") is not None]
    last_step = max(steps, default=0)
    for rec in records:
        step = rec.get("step")
        step = last_step if step is None else int(step)
        for docs, eps in zip(rec["documents"], rec["epochs"], strict=True):
            for (src, key, chunk), e in zip(docs, eps, strict=True):
                counts[(src, e)][(key, chunk)] += 1
                first[(src, e)] = min(first.get((src, e), step), step)
    complete = {}
    for src in {s for s, _ in counts}:
        # (a text of no tokens, the empty string, is dropped: its end-of-document id alone)
        expected = Counter({(k, ch): 1 for (s, k), t in texts.items() if s == src
                            for ch in range(_chunks(len(tok.encode(t)), seq_len))})
        epochs = sorted(e for s, e in counts if s == src)
        assert epochs == list(range(len(epochs))), f"{src}: epochs {epochs} are not contiguous"
        complete[src] = 0
        for e in epochs:
            got = counts[(src, e)]
            if got == expected:
                complete[src] += 1
                continue
            may_be_partial = e == epochs[-1] or (
                e == epochs[-1] - 1 and first[(src, e + 1)] >= last_step - carry_steps)
            assert may_be_partial, (
                f"{src}: epoch {e} is not exactly-once: missing {sorted(expected - got)[:8]}, "
                f"extra {sorted(got - expected)[:8]} (of {len(expected)} pieces)")
            assert max(got.values()) == 1, f"{src}: a piece repeats inside epoch {e}"
            assert set(got) <= set(expected), f"{src}: unknown pieces delivered in epoch {e}"
    least = min(complete.values(), default=0)
    assert least >= min_complete, (
        f"epochs complete per source {complete}, at least {min_complete} wanted: read more "
        "steps, or pass min_complete=0 where the run only shows that no piece comes twice")
    return complete


def shares(tokens: dict[str, int]) -> dict[str, float]:
    total = sum(tokens.values())
    return {k: v / total for k, v in tokens.items()}


def step_pieces(work: dict[int, list[list[tuple[Any, ...]]]]) -> Any:
    """A constructor's work of one step, ``{dp: [row: [WorkItem, ...]]}``, as the planner
    sends it (:class:`~msd_dask.roles.constructor.StepPieces`; keys ``f"{path}:{row}"``);
    DP rank ``d`` costs ``d + 1``."""
    from msd_dask.roles.constructor import StepPieces

    sources: list[str] = []
    paths: list[str] = []
    table = []
    for rows in work.values():
        for row in rows:
            for src, li, ep, u, r, a, b, ch, key in row:
                path, _, at = key.rpartition(":")
                assert int(at) == r, f"a key is path:row, not {key!r} for row {r}"
                for values, v in ((sources, src), (paths, path)):
                    if v not in values:
                        values.append(v)
                table.append((sources.index(src), li, ep, u, r, a, b, ch, paths.index(path)))
    dps = sorted(work)
    return StepPieces(
        dps=np.asarray(dps, dtype=np.int64),
        rows=np.asarray([len(work[d]) for d in dps], dtype=np.int64),
        lengths=np.asarray([len(row) for d in dps for row in work[d]], dtype=np.int64),
        pieces=np.asarray(table, dtype=np.int64).reshape(-1, 9),
        sources=tuple(sources), paths=tuple(paths),
        costs=np.asarray(dps, dtype=np.float64) + 1.0)


def next_in_a_thread(reader: Any) -> tuple[threading.Thread, list[BaseException]]:
    """A thread started on ``next(reader)`` (a daemon: one that waits for ever holds no
    exit), and the list of what it raised (empty until it does)."""
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            next(reader)
        except BaseException as e:  # noqa: BLE001 - the caller checks it
            errors.append(e)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    return t, errors
