"""The namespace lock: publishes share it, a change of names holds it alone, waiters in turn."""

from __future__ import annotations

import trio
import trio.testing

from kvfs.mount.bridge import NamespaceLock


async def _hold(
    lock: NamespaceLock, alone: bool, name: str, log: list[str], until: trio.Event
) -> None:
    if alone:
        async with lock:
            log.append(name)
            await until.wait()
    else:
        async with lock.shared():
            log.append(name)
            await until.wait()


def test_publishes_share_it_and_a_change_of_names_waits_for_them_all() -> None:
    async def main() -> None:
        lock, log = NamespaceLock(), list[str]()
        first, second, rename = trio.Event(), trio.Event(), trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_hold, lock, False, "publish 1", log, first)
            nursery.start_soon(_hold, lock, False, "publish 2", log, second)
            await trio.testing.wait_all_tasks_blocked()
            assert sorted(log) == ["publish 1", "publish 2"]  # both at once
            assert not lock.locked()  # in-memory changes may go on beside publishes
            nursery.start_soon(_hold, lock, True, "rename", log, rename)
            await trio.testing.wait_all_tasks_blocked()
            first.set()
            await trio.testing.wait_all_tasks_blocked()
            assert len(log) == 2  # one publish still holds it
            second.set()
            await trio.testing.wait_all_tasks_blocked()
            assert log[-1] == "rename" and lock.locked()
            rename.set()
        assert not lock.locked()

    trio.run(main)


def test_a_publish_that_comes_after_a_waiting_change_of_names_goes_after_it() -> None:
    async def main() -> None:
        lock, log = NamespaceLock(), list[str]()
        events = [trio.Event() for _ in range(3)]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_hold, lock, False, "publish 1", log, events[0])
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(_hold, lock, True, "rename", log, events[1])
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(_hold, lock, False, "publish 2", log, events[2])
            await trio.testing.wait_all_tasks_blocked()
            assert log == ["publish 1"]  # the rename is not starved by a stream of publishes
            for event in events:
                event.set()
                await trio.testing.wait_all_tasks_blocked()
        assert log == ["publish 1", "rename", "publish 2"]

    trio.run(main)


def test_a_waiter_cancelled_in_the_queue_lets_those_behind_it_go() -> None:
    async def main() -> None:
        lock, log = NamespaceLock(), list[str]()
        publish, shared_after = trio.Event(), trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_hold, lock, False, "publish", log, publish)
            await trio.testing.wait_all_tasks_blocked()
            waiting = trio.CancelScope()

            async def rename() -> None:
                with waiting:
                    async with lock:
                        log.append("rename")

            nursery.start_soon(rename)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(_hold, lock, False, "after", log, shared_after)
            await trio.testing.wait_all_tasks_blocked()
            assert log == ["publish"]  # "after" queued behind the waiting rename
            waiting.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert log == ["publish", "after"]  # the rename gave up its turn
            publish.set()
            shared_after.set()
        async with lock:  # nothing left held
            assert lock.locked()
        assert not lock.locked()

    trio.run(main)
