"""A resume state is checked against the service it resumes: everything the stream order
depends on, or one clear error (``planner_state``)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from msd_dask.core.config import parse_config
from msd_dask.core.plan import Planner
from msd_dask.core.units import Unit
from msd_dask.errors import ServiceError
from msd_dask.roles.planner import make_state, planner_state


def _cfg(window: int = 4, **change: Any) -> Any:
    d = {"name": "rs", "parallel": {"dp": 2}, "batch": {"seq_len": 64},
         "sources": [{"name": n, "uri": f"memory://{n}/*.parquet", "format": "parquet",
                      "weight": 0.5, "shuffle_window": window} for n in ("a", "b")]}
    for k, v in change.items():
        if k == "source_b":
            d["sources"][1].update(v)
        else:
            d[k] = v
    return parse_config(d)


def _state(units: int = 10, cfg: Any = None) -> dict[str, Any]:
    cfg = cfg or _cfg()
    pl = Planner(cfg, {s.name: [Unit(f"{s.name}/u{i}.parquet") for i in range(units)]
                       for s in cfg.sources})
    pl.plan_step(lambda source, epoch, unit: [40, 30, 100])
    return make_state(cfg, 0, pl.state_dict(), {"a": units, "b": units})


def test_the_same_service_resumes() -> None:
    state = _state()
    assert planner_state(_cfg(), state, {"a": 10, "b": 10}) == state["planner"]
    # a state of a version that did not record units, shuffle windows and the settings of
    # reading: not checked
    old = {k: v for k, v in state.items() if k not in ("units", "shuffle_window", "reading")}
    assert planner_state(_cfg(8), old, {"a": 3, "b": 10}) == state["planner"]


def test_another_file_list_is_refused_by_source() -> None:
    """A state of 10 units resumed over 3 (files removed) planned a unit that no longer
    exists (an IndexError in the planner's worker); over 30 it went on with another
    stream, silently."""
    for now in (3, 30):
        with pytest.raises(ServiceError, match=rf"source 'a' had 10 units .* has {now} now"):
            planner_state(_cfg(), _state(), {"a": now, "b": 10})


def test_another_shuffle_window_is_refused_by_key() -> None:
    with pytest.raises(ServiceError, match=r"sources\[0\]\.shuffle_window 4 .* has 8"):
        planner_state(_cfg(8), _state())


@pytest.mark.parametrize("change, message", [
    (lambda s: s["planner"].pop("streams"), r"'planner' mapping lacks \['streams'\]"),
    (lambda s: s.update(seed="x"), r"'seed' is 'x', not an integer"),
    (lambda s: s.update(sources="ab"), r"'sources' is 'ab', not a list"),
    # the step was not checked: "5" was taken, and a step other than the planner's
    # served step 0 again instead of step 5 (a review)
    (lambda s: s.update(step="0"), r"'step' is '0', not an integer"),
    (lambda s: s.update(step=4), r"state is of step 4 but its planner's next step is 1"),
    # (a state without its held outliers was taken, and each of them lost; a review)
    (lambda s: s["planner"].pop("held"), r"'planner' mapping lacks \['held'\]"),
    # (a raw ValueError or AttributeError, or "shuffle_window 2 but the config has 2")
    (lambda s: s.update(units={"a": "x", "b": 10}), r"units\['a'\] is 'x', not an integer"),
    (lambda s: s.update(units=[10, 10]), r"'units' is \[10, 10\], not a mapping"),
    (lambda s: s.update(shuffle_window={"a": "4", "b": 4}),
     r"shuffle_window\['a'\] is '4', not an integer"),
    # the cost model and the live weight changes, read by resume_notes before the planner
    # takes the state: a bare ValueError, IndexError, TypeError or KeyError (a review)
    (lambda s: s["planner"].update(cost="x"), r"planner\.cost: 'x' is not \[linear, quadratic\]"),
    (lambda s: s["planner"].update(cost=[1]), r"planner\.cost: \[1\] is not \[linear, "),
    (lambda s: s["planner"].update(cost=[float("nan"), 1.0]),
     r"planner\.cost: \[nan, 1\.0\] is not \[linear, quadratic\] of finite numbers >= 0"),
    (lambda s: s["planner"].update(cost=[0, 0]),
     r"planner\.cost: \[0, 0\]: linear and quadratic cannot both be 0"),
    (lambda s: s["planner"].update(overrides=[5]), r"planner\.overrides\[0\]: 5 is not "
                                                   r"\[step, weights\]"),
    (lambda s: s["planner"].update(overrides={"a": 1}), r"planner\.overrides: \{'a': 1\} is "
                                                        r"not a list of \[step, weights\]"),
    (lambda s: s["planner"].update(overrides=[[-2, {"a": 1}]]),
     r"planner\.overrides\[0\]\[0\]: -2 is not an integer >= 0"),
    # read as the planner reads them: None, a source the config does not have, an integer
    # no float holds passed here and failed later, or raised a bare OverflowError (a review)
    (lambda s: s["planner"].update(cost=None), r"planner\.cost: None is not \[linear, "),
    (lambda s: s["planner"].update(overrides=None), r"planner\.overrides: None is not a list"),
    (lambda s: s["planner"].update(overrides=[[0, {"zz": 1.0}]]),
     r"planner\.overrides\[0\]: unknown source\(s\) \['zz'\] \(known: a, b\)"),
    (lambda s: s["planner"].update(cost=[10**400, 1]),
     r"planner\.cost: .* is not \[linear, quadratic\] of finite numbers >= 0"),
    # (set_weights refuses such a step: every later largest_weights() failed; a review)
    (lambda s: s["planner"].update(overrides=[[10**400, {"a": 1.0}]]),
     r"planner\.overrides\[0\]\[0\]: 1000+ is not a step below 2\*\*31"),
])
def test_a_malformed_state_is_one_clear_error(change: Any, message: str) -> None:
    state = copy.deepcopy(_state())
    change(state)
    with pytest.raises(ServiceError, match=message):
        planner_state(_cfg(), state)


@pytest.mark.parametrize("change, names", [
    ({"tokenizer": {"kind": "hf", "path": "tok.json"}}, r"tokenizer\.kind 'bytes' but the "
                                                        r"config has 'hf'"),
    ({"source_b": {"text_field": "body"}}, r"sources\[1\]\.text_field 'text' \(source 'b'\) "
                                           r"but the config has 'body'"),
    ({"source_b": {"preprocess": "msd_dask.examples.preprocess:clean"}},
     r"sources\[1\]\.preprocess None \(source 'b'\)"),
])
def test_another_way_of_reading_the_documents_is_refused_by_key(change: Any, names: str) -> None:
    """A state taken with the byte tokenizer resumed under a Hugging Face one: a stream's
    position counts pieces of documents whose lengths changed, and three documents of an
    epoch were never served (a review)."""
    with pytest.raises(ServiceError, match=names):
        planner_state(_cfg(**change), _state())
    # what does not change the documents' lengths is not refused: nor the padding id (it
    # was, saying the lengths depend on it: a review)
    assert planner_state(_cfg(timeout=60.0, prefetch=2), _state()) == _state()["planner"]
    hf = {"kind": "hf", "path": "tok.json", "pad_id": 0}
    state = _state(cfg=_cfg(tokenizer=hf))
    assert planner_state(_cfg(tokenizer=dict(hf, pad_id=1)), state) == state["planner"]
    state["reading"]["tokenizer"]["pad_id"] = 0  # (as a state of an earlier version has it)
    assert planner_state(_cfg(tokenizer=dict(hf, pad_id=1)), state) == state["planner"]


def test_what_the_state_keeps_over_the_config_is_said() -> None:
    """The state's cost model and its live weight changes win over a config that changed
    them, silently (a review): both keep the resume exact, and are now said."""
    from msd_dask.roles.planner import resume_notes

    state = _state()
    assert resume_notes(_cfg(), state) == []
    costly = _cfg(cost={"linear": 1.0, "quadratic": 0.01})
    (note,) = resume_notes(costly, state)
    assert "the state's cost model" in note and "quadratic 0.01" in note
    state["planner"]["overrides"] = [[3, {"a": 0.9, "b": 0.1}]]
    (note,) = resume_notes(_cfg(), state)
    assert "live weight change of step 3" in note and "stays in force" in note


@pytest.mark.parametrize("cost, why", [
    ([float("nan"), 1.0], "of finite numbers >= 0"), ([float("inf"), 0.0], "of finite numbers"),
    ([-1.0, -0.001], "of finite numbers >= 0"), ([1.0, -5.0], "of finite numbers >= 0"),
    ([0.0, 0.0], "cannot both be 0"), ([1.0, 1e199], r"at most 1e\+200"),
])
def test_a_state_s_cost_model_keeps_the_config_s_rule(cost: list[float], why: str) -> None:
    """The state's cost model plans on over the config's, and went past every rule of the
    config's: NaN failed a step later, infinite, negative or zero models planned steps of
    NaN or negative rank costs (a review).  The planner refuses it, naming ``cost``."""
    state = _state()["planner"]
    pl = Planner(_cfg(), {n: [Unit(f"{n}/u{i}.parquet") for i in range(10)] for n in "ab"})
    with pytest.raises(ValueError, match=rf"cost: .*{why}"):
        pl.load_state_dict(dict(state, cost=cost))
    pl.load_state_dict(dict(state, cost=[2.0, 0.5]))  # (another valid model: taken)
    assert (pl.cost.linear, pl.cost.quadratic) == (2.0, 0.5)


def test_a_config_weight_change_under_a_live_change_is_said_to_change_nothing() -> None:
    """A state whose live weight change is in force, resumed under a config of other
    weights, was said to change the mix from the next step on, and then said the live
    change stays in force: the first note was false (a review).  The planner plans with
    the live change; the notes say the config's weights change nothing.  A live change
    that starts after the state's step leaves the config's change said."""
    from msd_dask.roles.planner import resume_notes

    state = _state()
    state["planner"]["overrides"] = [[0, {"a": 0.9, "b": 0.1}]]
    changed = _cfg(source_b={"weight": 0.2})
    first, second = resume_notes(changed, state)
    assert first.startswith("resume: the config's weights differ from the state's "
                            "(sources[1].weight 0.5 -> 0.2 (source 'b')) but do not change the "
                            "mix: the state's live weight change of step 0 is in force"), first
    assert "live weight change of step 0" in second and "stays in force" in second
    pl = Planner(changed, {n: [Unit(f"{n}/u{i}.parquet") for i in range(10)] for n in "ab"})
    pl.load_state_dict(planner_state(changed, state))
    assert pl.weights_at(pl.step) == pytest.approx({"a": 0.9, "b": 0.1})
    state["planner"]["overrides"] = [[5, {"a": 0.9, "b": 0.1}]]  # (from step 5: not yet)
    first, _ = resume_notes(changed, state)
    assert first.startswith("resume: the config changes the mix from step 1 on: "), first


def test_a_weight_the_config_changed_on_resume_is_said() -> None:
    """A config whose weights changed was resumed under them without a word, where a changed
    cost model is said (a review): the state records the config's weights, and the note
    names each changed source's key, both weights and the step from which they apply.  A
    state of a version that did not record them gets no note."""
    import json

    from msd_dask.roles.planner import resume_notes

    state = json.loads(json.dumps(_state()))  # (as a checkpoint file gives it back)
    assert resume_notes(_cfg(), state) == []
    schedule = [{"until": 100, "weight": 0.9}, {"weight": 0.1}]
    (note,) = resume_notes(_cfg(source_b={"weight": schedule}), state)
    assert note.startswith("resume: the config changes the mix from step 1 on: ")
    assert "sources[1].weight 0.5 -> [{'until': 100, 'weight': 0.9}, {'weight': 0.1}] " \
           "(source 'b')" in note and "sources[0]" not in note
    del state["weights"]
    assert resume_notes(_cfg(source_b={"weight": 0.9}), state) == []


def test_the_tokenizers_file_and_credentials_are_not_recorded() -> None:
    """The state recorded the tokenizer's storage_options: credentials written into every
    state, and a resume refused once they rotated (a review of this change)."""
    hf = {"kind": "hf", "path": "tok.json", "storage_options": {"key": "AKIA_OLD"}}
    cfg = _cfg(tokenizer=hf)
    pl = Planner(cfg, {s.name: [Unit(f"{s.name}/u{i}.parquet") for i in range(10)]
                       for s in cfg.sources})
    state = make_state(cfg, -1, pl.state_dict(), {"a": 10, "b": 10})
    assert "AKIA_OLD" not in str(state)
    moved = dict(hf, path="elsewhere/tok.json", storage_options={"key": "AKIA_NEW"})
    assert planner_state(_cfg(tokenizer=moved), state) == state["planner"]


@pytest.mark.parametrize("reading", [[1], {"tokenizer": [1]}, {"sources": {"a": "x"}}])
def test_a_malformed_reading_is_one_clear_error(reading: Any) -> None:
    state = _state()
    state["reading"] = reading
    with pytest.raises(ServiceError, match=r"resume: the state was taken with a 'reading' "
                                           r"that is not one of a state_dict\(\)"):
        planner_state(_cfg(), state)


def test_with_a_fit_the_state_model_it_starts_from_is_said() -> None:
    """With ``cost.fit`` the fit starts from the state's model: a ``cost.model`` changed for
    the resume was never used, and nothing said so (a review of the cost fit).  The note
    says where the fit starts; none where the state's model is the config's."""
    from msd_dask.roles.planner import resume_notes

    state = _state()
    state["planner"]["cost"] = [1.0, 0.5]
    (note,) = resume_notes(_cfg(cost={"fit": True}), state)
    assert "the cost fit starts from the state's model (linear 1, quadratic 0.5)" in note
    (note,) = resume_notes(_cfg(), state)
    assert "the state's cost model plans on" in note
    assert resume_notes(_cfg(cost={"fit": True, "linear": 1.0, "quadratic": 0.5}), state) == []


def test_a_packed_snapshot_unpacks_to_the_same_state_row_by_row() -> None:
    """The planner's actor keeps a packed snapshot per recent step (its tables column by
    column and narrowed); unpacked, it is the same state, its tables row by row, and a
    planner loading it plans the same next steps as the one it was taken from."""
    import dataclasses

    import numpy as np

    from msd_dask.roles.planner import pack_snapshot, unpack_snapshot

    cfg = _cfg(outliers={"min_length": 0.25, "group": 2})
    units = {s.name: [Unit(f"{s.name}/u{i}.parquet") for i in range(10)] for s in cfg.sources}

    def lookup(source: str, epoch: int, unit: int) -> list[int]:
        return [40, 30, 100, 64, 17, 9, 63][unit % 3:]

    pl = Planner(cfg, units)
    for _ in range(3):
        pl.plan_step(lookup)
    snap = pl.snapshot()
    assert len(snap.held)
    # a wide table as the planner may hold it (int64), and one int32 cannot hold
    wide = dataclasses.replace(snap, held=snap.held.astype(np.int64))
    rows = snap.held.astype(np.int64)
    rows[:, 3] += 2**40
    huge = dataclasses.replace(snap, carry=rows[:3], held=rows)
    for original in (snap, wide, huge):
        back = unpack_snapshot(pack_snapshot(original))
        for name in ("carry", "held", "held_step"):
            a, b = getattr(original, name), getattr(back, name)
            assert b.flags.c_contiguous and b.tolist() == a.tolist(), name
        assert back.to_state() == original.to_state()
    other = Planner(cfg, units)
    other.load_snapshot(unpack_snapshot(pack_snapshot(wide)))
    for _ in range(3):
        np.testing.assert_array_equal(other.plan_step(lookup).table, pl.plan_step(lookup).table)


def test_a_tokenizer_file_changed_in_place_is_refused(corpus: Any, tmp_path: Any) -> None:
    """A tokenizer.json changed in place under the same path gives documents other lengths,
    so every stream's position points elsewhere: the resume went on, skipping and repeating
    documents without a word.  The planner records the file's SHA-256 (read where the
    service is placed, as it reads the tokenizer for its padding id) in its states and
    refuses a resume over another file's; the same file moved (another path) resumes."""
    import asyncio
    import hashlib
    import shutil

    from msd_dask import load_config
    from msd_dask.roles.planner import PlannerActor
    from msd_dask.sources.discover import discover_units
    from msd_dask.sources.tokenizer import make_tokenizer

    from corpus import config, train_bpe

    root, texts = corpus
    path = train_bpe(list(texts.values()), str(tmp_path / "tok.json"))
    cfg = load_config(config(root, tokenizer={"kind": "hf", "path": path}))
    units, roots = discover_units(cfg)

    def actor(c: Any, state: Any = None) -> PlannerActor:
        async def make() -> PlannerActor:  # (the file read as place_planner reads it)
            return PlannerActor(c.to_dict(), units, roots, state,
                                tokenizer_sha256=make_tokenizer(c.tokenizer).sha256)
        return asyncio.run(make())

    first = actor(cfg)
    with open(path, "rb") as f:
        assert first.tokenizer_sha256 == hashlib.sha256(f.read()).hexdigest()
    state = make_state(cfg, -1, first.planner.state_dict(),
                       {k: len(v) for k, v in units.items()}, first.tokenizer_sha256)
    assert state["tokenizer_sha256"] == first.tokenizer_sha256
    actor(cfg, state)  # the same file: resumes
    moved = shutil.copy(path, tmp_path / "moved.json")
    actor(load_config(config(root, tokenizer={"kind": "hf", "path": str(moved)})), state)
    train_bpe(list(texts.values())[:20], path, vocab=300)  # changed in place
    with pytest.raises(ServiceError, match=r"resume: the state was taken with a tokenizer file "
                       r"of SHA-256 .* but tokenizer\.path '.*tok\.json' now holds one of "
                       r".*changed in place"):
        actor(cfg, state)
    # a state of a version that did not record it, or the byte tokenizer's: not checked
    old = {k: v for k, v in state.items() if k != "tokenizer_sha256"}
    actor(cfg, old)
    assert actor(load_config(config(root))).tokenizer_sha256 is None


def test_an_eod_id_spelled_out_as_the_files_own_resumes(corpus: Any, tmp_path: Any) -> None:
    """A state taken with no ``tokenizer.eod_id`` (the file's ``<|endoftext|>``, id 0) was
    refused by a config that spelled out ``eod_id: 0``, the same id ("tokenizer.eod_id None
    but the config has 0"; a review).  The planner records the id its tokenizer ends
    documents with, so either spelling resumes, and another id is refused naming the key,
    before the start (the config's id against the state's) and in the planner (the
    tokenizer's against the state's)."""
    import asyncio

    from msd_dask import load_config
    from msd_dask.roles.planner import PlannerActor
    from msd_dask.sources.discover import discover_units
    from msd_dask.sources.tokenizer import make_tokenizer

    from corpus import config, train_bpe

    root, texts = corpus
    path = train_bpe(list(texts.values()), str(tmp_path / "tok.json"))

    def cfg_of(**ids: int) -> Any:
        return load_config(config(root, tokenizer={"kind": "hf", "path": path, **ids}))

    cfg = cfg_of()
    units, roots = discover_units(cfg)

    def actor(c: Any, state: Any = None) -> PlannerActor:
        async def make() -> PlannerActor:  # (the tokenizer made as place_planner makes it)
            tok = make_tokenizer(c.tokenizer)
            return PlannerActor(c.to_dict(), units, roots, state, tokenizer_sha256=tok.sha256,
                                eod_id=tok.eod_id)
        return asyncio.run(make())

    first = actor(cfg)
    assert first.eod_id == 0
    n_units = {k: len(v) for k, v in units.items()}
    state = make_state(cfg, -1, first.planner.state_dict(), n_units, first.tokenizer_sha256,
                       first.eod_id)
    assert state["reading"]["tokenizer"]["eod_id"] == 0
    for again in (cfg, cfg_of(eod_id=0)):
        planner_state(again, state)  # (the check before the start)
        actor(again, state)
    # the other way round: a state taken with eod_id spelled out, resumed without it
    spelled = actor(cfg_of(eod_id=0))
    actor(cfg, make_state(cfg_of(eod_id=0), -1, spelled.planner.state_dict(), n_units,
                          spelled.tokenizer_sha256, spelled.eod_id))
    refusal = r"resume: the state was taken with tokenizer\.eod_id 0 but the config has 1"
    with pytest.raises(ServiceError, match=refusal):
        planner_state(cfg_of(eod_id=1, pad_id=0), state)
    with pytest.raises(ServiceError, match=refusal):
        actor(cfg_of(eod_id=1, pad_id=0), state)
    # a state of the version that recorded the config's id (none: the file's) resumes
    # under a config that leaves it to the file, and is refused under another id
    old = copy.deepcopy(state)
    old["reading"]["tokenizer"]["eod_id"] = None
    actor(cfg, old)
    with pytest.raises(ServiceError, match=r"tokenizer\.eod_id None but the config has 1"):
        actor(cfg_of(eod_id=1, pad_id=0), old)


def test_the_sources_in_another_order_are_refused_by_position() -> None:
    """The mix breaks its ties and sums its weights in the sources' order: a config listing
    them in another order was taken without a word, and planned other steps (a review)."""
    cfg = _cfg()
    swapped = parse_config({**cfg.to_dict(), "sources": cfg.to_dict()["sources"][::-1]})
    with pytest.raises(ServiceError, match=r"sources\[0\] is 'b' but the state's is 'a' \("
                                           r"the state's order: \['a', 'b'\]\)"):
        planner_state(swapped, _state())
