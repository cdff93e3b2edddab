"""``scripts/profile_scaling.py``: the pure helpers of its per-message and per-task figures."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "scripts"))

import profile_scaling  # noqa: E402


def test_an_actor_key_names_its_role_whatever_the_service_name() -> None:
    assert profile_scaling._role_of("msd-scaling-fixed-constructor-1-ab12cd34") == "constructor"
    assert profile_scaling._role_of("msd-a-loader-code-0-ab12cd34") == "loader"
    assert profile_scaling._role_of("msd-x-planner-0f0f0f0f") == "planner"
    assert profile_scaling._role_of("other-key") == "other-key"


def test_call_counts_are_per_step_and_apart_from_the_stack_samples() -> None:
    before = {"#call rpc constructor.submit": 10, "#loop Server._handle_comm": 0.5,
              "idle (waiting in select)": 100, "#writes": 3}
    after = {"#call rpc constructor.submit": 30, "#call direct SourceLoader.fetch": 20,
             "#loop Server._handle_comm": 0.7, "idle (waiting in select)": 300, "#writes": 9}
    lines = profile_scaling._calls(before, after, steps=40)
    assert lines[0].split() == ["0.500/step", "rpc", "constructor.submit"]
    assert lines[1].split() == ["0.500/step", "direct", "SourceLoader.fetch"]
    assert lines[2].strip() == "event loop CPU per task: 5.00 ms/step"
    assert lines[3].split() == ["5.000", "ms/step", "Server._handle_comm"]
    # the stack samples' shares leave the counts out
    assert profile_scaling._top(before, after) == [("idle (waiting in select)", 1.0)]


def test_the_schedulers_counts_are_kept_on_it_and_read_back(monkeypatch) -> None:
    """The consumer's row read its counts from the module's globals, which the counting
    function (reaching the in-process scheduler by value) never filled: they are kept on
    the scheduler object and read back from it."""
    import asyncio
    import asyncio.events

    from msd_dask.roles import direct

    # _count_calls patches these process-wide: put them back after the test
    monkeypatch.setattr(asyncio.events.Handle, "_run", asyncio.events.Handle._run)
    monkeypatch.setattr(direct._Local, "__getattr__", direct._Local.__getattr__)
    monkeypatch.setattr(direct._Local, "_msd_counted", False, raising=False)

    class Server:
        def __init__(self) -> None:
            self.handlers = {"ncores": lambda comm=None: {"w": 1}}
            self.stream_handlers = {"heartbeat-client": lambda comm=None: None}

    server = Server()
    profile_scaling._count_scheduler_calls(server)
    server.handlers["ncores"]()
    server.handlers["ncores"]()
    server.stream_handlers["heartbeat-client"]()

    async def tick() -> None:
        await asyncio.sleep(0)

    asyncio.run(tick())
    counts = profile_scaling._scheduler_counts(server)
    assert counts["#call rpc ncores"] == 2 and counts["#call stream heartbeat-client"] == 1
    assert any(k.startswith("#loop ") for k in counts)
    assert not any(k.startswith("#call") for k in profile_scaling._SAMPLES)


def test_an_event_loop_sample_names_the_outermost_msd_dask_function() -> None:
    """The docs and --help say the sample names the outermost msd_dask function on the
    stack; it named the innermost (review)."""
    inner: dict = {}
    exec(compile("import sys\ndef helper():\n    return sys._getframe()\n",
                 "/x/msd_dask/core/plan.py", "exec"), inner)
    outer: dict = {"helper": inner["helper"]}
    exec(compile("def plan_loop():\n    return helper()\n", "/x/msd_dask/roles/planner.py",
                 "exec"), outer)
    assert profile_scaling._where(outer["plan_loop"]()) == "msd_dask planner.py:plan_loop"
