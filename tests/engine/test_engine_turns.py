"""Engine turns: which waiting engine call runs next, the slot never lost (cancelled
waiters, a failing policy, a session that does not come back), light calls beside the
one computing. The calls are plain functions run in the worker threads the engine's
calls run in; the engine-level behaviour is covered by every session test, all of
whose engine calls go through here."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from functools import partial

import anyio
import anyio.lowlevel
import pytest

from kvrt import policies
from kvrt._engine.turns import EngineTurns, Join, Served
from kvrt.policy import TurnView

pytestmark = pytest.mark.anyio


class Gate:
    """A call that runs until the test opens it (so the slot stays taken meanwhile)."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.opened = threading.Event()

    def __call__(self) -> str:
        self.started.set()
        assert self.opened.wait(10)
        return "held"


async def started(gate: Gate) -> None:
    with anyio.fail_after(10):
        while not gate.started.is_set():
            await anyio.sleep(0.001)


async def queued(turns: EngineTurns, n: int) -> None:
    with anyio.fail_after(10):
        while turns.waiting < n:
            await anyio.sleep(0.001)


async def order_under(policy: str) -> list[str]:
    """Four commands' calls queued behind a held slot, in the order they then ran."""
    turns = EngineTurns(1, policies.get("engine_turn", policy))
    ran: list[str] = []
    gate = Gate()
    accounts = {
        "long, served 2 s, 900 left": Served(seconds=2.0, left=900),
        "fresh, 600 left": Served(seconds=0.0, left=600),
        "short, served 0.1 s, 2 left": Served(seconds=0.1, left=2),
        "medium, served 0.5 s, 40 left": Served(seconds=0.5, left=40),
    }
    async with anyio.create_task_group() as tg:
        tg.start_soon(turns.run, None, "prefill", gate)
        await started(gate)
        for i, (name, account) in enumerate(accounts.items()):
            tg.start_soon(turns.run, account, "step", lambda name=name: ran.append(name))
            await queued(turns, i + 1)
        gate.opened.set()
    assert turns.busy == 0 and turns.waiting == 0
    return ran


async def test_the_policy_picks_which_waiting_call_runs_next() -> None:
    assert await order_under("fifo") == [
        "long, served 2 s, 900 left",
        "fresh, 600 left",
        "short, served 0.1 s, 2 left",
        "medium, served 0.5 s, 40 left",
    ]
    assert await order_under("least_served") == [
        "fresh, 600 left",
        "short, served 0.1 s, 2 left",
        "medium, served 0.5 s, 40 left",
        "long, served 2 s, 900 left",
    ]
    assert await order_under("fewest_left") == [
        "short, served 0.1 s, 2 left",
        "medium, served 0.5 s, 40 left",
        "fresh, 600 left",
        "long, served 2 s, 900 left",
    ]


async def test_engine_time_counts_to_the_command() -> None:
    turns = EngineTurns(1, policies.get("engine_turn", "least_served"))
    served = Served()
    await turns.run(served, "step", lambda: time.sleep(0.05))
    await turns.run(served, "evict", lambda: time.sleep(0.02), light=True)
    assert 0.07 <= served.seconds < 5


async def test_a_slot_is_never_lost_to_a_cancelled_waiter() -> None:
    turns = EngineTurns(1, policies.get("engine_turn", "least_served"))
    gate = Gate()
    async with anyio.create_task_group() as tg:
        tg.start_soon(turns.run, None, "prefill", gate)
        await started(gate)
        with anyio.move_on_after(0.05):
            await turns.run(Served(), "step", lambda: None)
        assert turns.waiting == 0
        # One granted the slot as it is cancelled hands it on.
        waiter = anyio.CancelScope()

        async def cancelled_when_granted() -> None:
            with waiter:
                await turns.run(Served(), "step", lambda: None)

        tg.start_soon(cancelled_when_granted)
        await queued(turns, 1)
        gate.opened.set()
        waiter.cancel()
    assert turns.busy == 0
    with anyio.fail_after(5):
        assert await turns.run(Served(), "step", lambda: "ran") == "ran"


class Failing:
    def pick(self, waiting: Sequence[TurnView]) -> int:
        raise RuntimeError("a broken policy")


class Wrong:
    def pick(self, waiting: Sequence[TurnView]) -> int:
        return 10_000


@pytest.mark.parametrize("policy", [Failing(), Wrong()], ids=["raises", "picks nobody"])
async def test_a_policy_that_fails_still_hands_the_slot_on(policy: object) -> None:
    turns = EngineTurns(1, policy)  # type: ignore[arg-type]
    gate = Gate()
    ran: list[int] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(turns.run, None, "prefill", gate)
        await started(gate)
        for i in range(3):
            tg.start_soon(turns.run, Served(), "step", lambda i=i: ran.append(i))
            await queued(turns, i + 1)
        gate.opened.set()
    assert ran == [0, 1, 2]  # the longest-waiting first


async def test_a_slot_kept_for_a_session_that_does_not_come_back_is_handed_on() -> None:
    """The policy prefers the session whose call just ended (it has had the least engine
    time): its slot is kept for it a moment, then given to the waiting call."""
    turns = EngineTurns(1, policies.get("engine_turn", "least_served"), grace=0.2)
    gate = Gate()
    young = Served(seconds=0.0)
    waited = 0.0

    async def old() -> None:
        nonlocal waited
        began = time.perf_counter()
        await turns.run(Served(seconds=5.0), "step", lambda: None)
        waited = time.perf_counter() - began

    async with anyio.create_task_group() as tg:
        tg.start_soon(turns.run, young, "prefill", gate)
        await started(gate)
        tg.start_soon(old)
        await queued(turns, 1)
        gate.opened.set()
    assert 0.18 <= waited < 5
    assert turns.busy == 0


async def test_a_returning_session_keeps_its_turn() -> None:
    """A generation's steps follow one another while the policy prefers it: none of the
    older command's calls runs between them."""
    turns = EngineTurns(1, policies.get("engine_turn", "least_served"), grace=1.0)
    ran: list[str] = []
    young, old = Served(), Served(seconds=5.0)

    async def generate() -> None:
        for _ in range(20):
            await turns.run(young, "step", lambda: ran.append("young"))

    gate = Gate()
    async with anyio.create_task_group() as tg:
        tg.start_soon(turns.run, young, "prefill", gate)
        await started(gate)
        tg.start_soon(turns.run, old, "step", lambda: ran.append("old"))
        await queued(turns, 1)
        gate.opened.set()
        await generate()
    assert ran == ["young"] * 20 + ["old"]  # in arrival order, "old" would have run first


async def test_light_calls_run_beside_the_call_computing() -> None:
    turns = EngineTurns(1, policies.get("engine_turn", "least_served"))
    gate = Gate()
    async with anyio.create_task_group() as tg:
        tg.start_soon(turns.run, None, "prefill", gate)
        await started(gate)
        with anyio.fail_after(5):
            assert await turns.run(Served(), "evict", lambda: "dropped", light=True) == "dropped"
        gate.opened.set()


class Joint:
    """An engine call several calls can share: records each call's items; an item of
    ``"bad"`` fails its own part only."""

    def __init__(self, most: int = 8) -> None:
        self.calls: list[list[str]] = []
        self.most = most

    def __call__(self, items: list[str]) -> list[object]:
        self.calls.append(list(items))
        time.sleep(0.005)
        return [ValueError(f"{i} refused") if i == "bad" else f"{i} done" for i in items]

    def join(self, item: str) -> Join:
        return Join(self, item, self, self.most)


async def test_waiting_steps_run_as_one_engine_call() -> None:
    turns = EngineTurns(1, policies.get("engine_turn", "least_served"))
    joint = Joint()
    gate = Gate()
    got: dict[str, object] = {}

    async def step(name: str) -> None:
        try:
            got[name] = await turns.run(Served(), "step", lambda: "alone", join=joint.join(name))
        except ValueError as exc:
            got[name] = str(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(turns.run, None, "prefill", gate)
        await started(gate)
        for i, name in enumerate(["a", "bad", "c"]):
            tg.start_soon(step, name)
            await queued(turns, i + 1)
        tg.start_soon(turns.run, Served(), "prefill", lambda: got.setdefault("prefill", "ran"))
        await queued(turns, 4)
        gate.opened.set()
    assert joint.calls == [["a", "bad", "c"]]  # one engine call; the prefill joins nothing
    assert got == {"a": "a done", "bad": "bad refused", "c": "c done", "prefill": "ran"}
    assert turns.joint == 1


async def test_sessions_stepping_together_stay_together() -> None:
    """After a joint step the slot waits for its sessions' next steps: they run together
    again, not the first one back alone and the rest after it."""
    turns = EngineTurns(1, policies.get("engine_turn", "least_served"), grace=0.5)
    joint = Joint()
    gate = Gate()

    async def generate(name: str) -> None:
        served = Served()
        for _ in range(6):
            await turns.run(served, "step", lambda: None, join=joint.join(name))
            await anyio.sleep(0.002 * ord(name[0]) % 5)  # sampling takes its time

    async with anyio.create_task_group() as tg:
        tg.start_soon(turns.run, None, "prefill", gate)
        await started(gate)
        for i, name in enumerate(["a", "b", "c"]):
            tg.start_soon(generate, name)
            await queued(turns, i + 1)
        gate.opened.set()
    assert [sorted(c) for c in joint.calls] == [["a", "b", "c"]] * 6


async def test_the_policy_says_who_joins_and_the_engine_how_many() -> None:
    class Pairs:
        def pick(self, waiting: Sequence[TurnView]) -> int:
            return min(w.arrived for w in waiting)

        def join(self, chosen: TurnView, others: Sequence[TurnView]) -> list[int]:
            return [o.id for o in others if o.left >= 10]

    turns = EngineTurns(1, Pairs())
    joint = Joint(most=2)
    gate = Gate()
    async with anyio.create_task_group() as tg:
        tg.start_soon(turns.run, None, "prefill", gate)
        await started(gate)
        for i, (name, left) in enumerate([("a", 50), ("short", 1), ("b", 40), ("c", 30)]):
            tg.start_soon(partial(turns.run, Served(left=left), "step", str, join=joint.join(name)))
            await queued(turns, i + 1)
        gate.opened.set()
    # "short" is left out by the policy, "c" by the engine's limit of two; "short" runs
    # next (it waited longest) and "c" joins it
    assert joint.calls == [["a", "b"], ["short", "c"]]


async def test_a_cancelled_step_gets_the_result_of_its_part_and_loses_no_slot() -> None:
    turns = EngineTurns(1, policies.get("engine_turn", "fifo"))
    joint = Joint()
    gate = Gate()
    scopes = {name: anyio.CancelScope() for name in ["a", "b"]}
    outcome: dict[str, str] = {}

    async def step(name: str) -> None:
        with scopes[name]:
            outcome[name] = await turns.run(Served(), "step", str, join=joint.join(name))
            await anyio.lowlevel.checkpoint()
            outcome[name] += ", not cancelled"

    async with anyio.create_task_group() as tg:
        tg.start_soon(turns.run, None, "prefill", gate)
        await started(gate)
        for i, name in enumerate(scopes):
            tg.start_soon(step, name)
            await queued(turns, i + 1)
        gate.opened.set()
        while not joint.calls:
            await anyio.lowlevel.checkpoint()
        scopes["a"].cancel()  # the one running the joint call
        scopes["b"].cancel()
    # each call's result comes back (its part ran); the cancellation lands after it
    assert joint.calls == [["a", "b"]]
    assert outcome == {"a": "a done", "b": "b done"}
    with anyio.fail_after(5):
        assert await turns.run(Served(), "step", lambda: "ran") == "ran"


async def test_a_step_waits_for_the_next_joint_call_rather_than_run_beside_one() -> None:
    """With a slot free, steps that could join the joint call running now wait and run
    as the next one: beside it, the engine would run the two one after another, or pay
    for the windows split between them (OpenVINO's rows)."""
    turns = EngineTurns(2, policies.get("engine_turn", "least_served"), grace=0.5)
    calls: list[list[str]] = []
    gate = Gate()

    def run(items: list[str]) -> list[object]:
        calls.append(list(items))
        if len(calls) == 1:
            gate()
        return [f"{i} done" for i in items]

    async def step(name: str) -> None:
        await turns.run(Served(), "step", str, join=Join("engine", name, run, 8))

    async with anyio.create_task_group() as tg:
        tg.start_soon(step, "a")
        await started(gate)
        tg.start_soon(step, "b")
        await queued(turns, 1)
        tg.start_soon(step, "c")
        await queued(turns, 2)
        assert turns.busy == 1  # the free slot stays free for other calls
        with anyio.fail_after(5):
            assert await turns.run(Served(), "prefill", lambda: "beside") == "beside"
        gate.opened.set()
    assert calls == [["a"], ["b", "c"]] and turns.waiting == 0


async def test_an_engine_that_pays_for_a_missing_window_waits_longer() -> None:
    """The join's own grace (an engine whose windows leave its joint call when they
    miss a step) keeps sessions that sample slowly together; the default would not."""
    joint = Joint()

    async def steps(grace: float | None) -> list[list[str]]:
        turns = EngineTurns(1, policies.get("engine_turn", "least_served"))
        joint.calls = []
        gate = Gate()

        async def generate(name: str) -> None:
            for _ in range(4):
                join = Join(joint, name, joint, 8, grace)
                await turns.run(Served(), "step", str, join=join)
                await anyio.sleep(0.03 if name == "slow" else 0)

        async with anyio.create_task_group() as tg:
            tg.start_soon(turns.run, None, "prefill", gate)
            await started(gate)
            for i, name in enumerate(["a", "slow"]):
                tg.start_soon(generate, name)
                await queued(turns, i + 1)
            gate.opened.set()
        return joint.calls

    assert [sorted(c) for c in await steps(0.5)] == [["a", "slow"]] * 4
    assert len(await steps(None)) > 4  # "a" goes on without the slow one
