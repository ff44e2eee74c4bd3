"""The A2A door's task stores: the bound on what is kept, and workers reaching each other's tasks.
Two `WorkerTasks` run on event loops of their own and call each other's `answer` as the workers'
channel would (the channel itself, through the real doors: tests/test_workers.py)."""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest
from a2a.server.context import ServerCallContext
from a2a.server.id_generator import IDGeneratorContext
from a2a.types.a2a_pb2 import Task, TaskState, TaskStatus

from serving.a2a_tasks import RecentTaskStore, WorkerIds, WorkerTasks, worker_of

CONTEXT = ServerCallContext()


def _task(task_id: str, state: int = TaskState.TASK_STATE_COMPLETED) -> Task:
    return Task(id=task_id, context_id="c", status=TaskStatus(state=state))


def test_the_task_saved_least_recently_is_dropped():
    async def run() -> list[bool]:
        store = RecentTaskStore(2)
        for task_id in ("a", "b"):
            await store.save(_task(task_id), CONTEXT)
        await store.save(_task("a"), CONTEXT)  # saved again: "b" is now the oldest
        await store.save(_task("c"), CONTEXT)
        return [await store.get(task_id, CONTEXT) is not None for task_id in ("a", "b", "c")]

    assert asyncio.run(run()) == [True, False, True]


def test_a_workers_ids_are_version_4_uuids_that_name_it():
    ids = {WorkerIds(7).generate(IDGeneratorContext()) for _ in range(100)}
    assert len(ids) == 100 and all(uuid.UUID(i).version == 4 and worker_of(i) == 7 for i in ids)
    assert worker_of("not-a-uuid") is None
    with pytest.raises(ValueError, match="at most 256 workers"):
        WorkerIds(256)


@pytest.fixture
def two_workers():
    """Workers 0 and 1, each on an event loop in a thread of its own; ``down`` makes one unreachable."""
    loops = [asyncio.new_event_loop() for _ in range(2)]
    threads = [threading.Thread(target=loop.run_forever, daemon=True) for loop in loops]
    for thread in threads:
        thread.start()
    down: set[int] = set()
    stores: list[WorkerTasks] = []

    def ask(worker: int, *args) -> bytes | None:
        if worker in down:
            raise ConnectionError(f"worker {worker} is restarting")
        return stores[worker].answer(*args)

    stores.extend(WorkerTasks(100, index, 2, ask) for index in range(2))

    def on(worker: int, work):
        return asyncio.run_coroutine_threadsafe(work, loops[worker]).result(timeout=10)

    yield stores, on, down
    for loop in loops:
        loop.call_soon_threadsafe(loop.stop)
    for thread in threads:
        thread.join(timeout=10)


def test_a_task_is_got_saved_and_deleted_through_the_worker_that_holds_it(two_workers):
    stores, on, _ = two_workers
    task_id = stores[1].ids.generate(IDGeneratorContext())
    on(1, stores[1].save(_task(task_id, TaskState.TASK_STATE_WORKING), CONTEXT))  # worker 1 ran it
    assert on(0, stores[0].get(task_id, CONTEXT)).status.state == TaskState.TASK_STATE_WORKING
    on(0, stores[0].save(_task(task_id), CONTEXT))  # an update arriving at worker 0 goes to worker 1
    assert on(0, stores[0].local.get(task_id, CONTEXT)) is None
    assert on(1, stores[1].get(task_id, CONTEXT)).status.state == TaskState.TASK_STATE_COMPLETED
    on(0, stores[0].delete(task_id, CONTEXT))
    assert on(1, stores[1].get(task_id, CONTEXT)) is None and on(0, stores[0].get(task_id, CONTEXT)) is None


def test_a_down_worker_s_task_is_not_found_and_an_id_naming_no_worker_stays_here(two_workers):
    stores, on, down = two_workers
    task_id = stores[1].ids.generate(IDGeneratorContext())
    on(1, stores[1].save(_task(task_id), CONTEXT))
    down.add(1)
    assert on(0, stores[0].get(task_id, CONTEXT)) is None  # its tasks went with it
    on(0, stores[0].save(_task(task_id), CONTEXT))  # dropped with a warning, no error
    foreign = str(uuid.UUID(int=(uuid.uuid4().int & ~0xFF) | 9))  # worker 9 of 2: none of ours
    on(0, stores[0].save(_task(foreign), CONTEXT))
    assert on(0, stores[0].local.get(foreign, CONTEXT)) is not None
