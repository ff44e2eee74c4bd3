"""The A2A door's tasks: in memory, the most recent ``max_tasks`` of them; with ``serve --workers
N``, each on the worker that created it and reachable from every worker.

a2a-sdk's ``InMemoryTaskStore`` keeps every task for the life of the process, and every query the
purple agent answers is a task (its message, its status, its result artifact): an evaluator's
thousands of queries, or a long-running agent, grow the process without bound.
:class:`RecentTaskStore` drops the task saved least recently once there are more than
``max_tasks``; ``tasks/get`` on a dropped task answers "task not found", as for any unknown id. A
task is saved at each state change, so one still working is among the most recent.

Under ``--workers N`` a client cannot choose its worker: a ``tasks/get`` or a follow-up message on
a new connection may reach another worker than the one that ran the task. :class:`WorkerTasks`
gives each new task an id whose last byte is its worker's index (still a version-4 UUID, 120
random bits) and asks that worker, over the workers' channel, for a task it does not hold. The
hot path (a message answered where it arrived) never leaves the process.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from collections.abc import Callable

from a2a.auth.user import User
from a2a.server.context import ServerCallContext
from a2a.server.id_generator import IDGenerator, IDGeneratorContext
from a2a.server.owner_resolver import resolve_user_scope
from a2a.server.tasks import InMemoryTaskStore, TaskStore
from a2a.types.a2a_pb2 import ListTasksRequest, ListTasksResponse, Task

from serving.settings import MAX_WORKERS

log = logging.getLogger(__name__)


class RecentTaskStore(TaskStore):
    """a2a-sdk's in-memory store, bounded to the ``max_tasks`` saved most recently."""

    def __init__(self, max_tasks: int) -> None:
        self.max_tasks = max_tasks
        self._store = InMemoryTaskStore()
        # (owner, task id) -> the owner's context, to delete with; oldest save first
        self._recent: OrderedDict[tuple[str, str], ServerCallContext] = OrderedDict()

    async def save(self, task: Task, context: ServerCallContext) -> None:
        await self._store.save(task, context)
        key = (resolve_user_scope(context), task.id)
        self._recent[key] = ServerCallContext(user=context.user, tenant=context.tenant)
        self._recent.move_to_end(key)
        while len(self._recent) > self.max_tasks:
            (_, task_id), owner = self._recent.popitem(last=False)
            await self._store.delete(task_id, owner)

    async def get(self, task_id: str, context: ServerCallContext) -> Task | None:
        return await self._store.get(task_id, context)

    async def list(self, params: ListTasksRequest, context: ServerCallContext) -> ListTasksResponse:
        return await self._store.list(params, context)

    async def delete(self, task_id: str, context: ServerCallContext) -> None:
        self._recent.pop((resolve_user_scope(context), task_id), None)
        await self._store.delete(task_id, context)


class WorkerIds(IDGenerator):
    """Version-4 UUIDs whose last byte is the worker's index."""

    def __init__(self, index: int) -> None:
        if not 0 <= index < MAX_WORKERS:
            raise ValueError(f"worker index {index}: at most {MAX_WORKERS} workers")
        self.index = index

    def generate(self, context: IDGeneratorContext) -> str:
        return str(uuid.UUID(int=(uuid.uuid4().int & ~0xFF) | self.index))


def worker_of(task_id: str) -> int | None:
    """The index :class:`WorkerIds` put in ``task_id`` (None: not a UUID, so none of ours)."""
    try:
        return uuid.UUID(task_id).int & 0xFF
    except ValueError:
        return None


Ask = Callable[[int, str, str, str, bytes | None], bytes | None]  # (worker, operation, task id, owner, task)
ANSWER_TIMEOUT_S = 2.0  # a sibling's lookup in memory; past this the door's loop is stuck or stopping


class WorkerTasks(TaskStore):
    """One worker's tasks (a :class:`RecentTaskStore`), and its siblings' reached through ``ask``, a
    call over the workers' channel that raises ``ConnectionError`` while that worker is down. An id
    that names no sibling (not one of ours) is looked up here; ``tasks/list`` lists this worker's own.
    A task is cancelled where it runs: ``tasks/cancel`` reaching another worker marks it cancelled
    without stopping it."""

    def __init__(self, max_tasks: int, index: int, count: int, ask: Ask) -> None:
        self.local = RecentTaskStore(max_tasks)
        self.index, self.count, self.ids = index, count, WorkerIds(index)
        self._ask = ask
        self._loop: asyncio.AbstractEventLoop | None = None  # the door's, where the local store is used

    async def save(self, task: Task, context: ServerCallContext) -> None:
        if not await self._sibling(task.id, "save", context, task):
            await self.local.save(task, context)

    async def get(self, task_id: str, context: ServerCallContext) -> Task | None:
        owner = self._owner(task_id)
        if owner is None:
            return await self.local.get(task_id, context)
        try:
            found = await asyncio.to_thread(self._ask, owner, "get", task_id, resolve_user_scope(context), None)
        except ConnectionError:
            return None  # that worker is restarting: its tasks went with it
        return None if found is None else Task.FromString(found)

    async def list(self, params: ListTasksRequest, context: ServerCallContext) -> ListTasksResponse:
        self._loop = asyncio.get_running_loop()
        return await self.local.list(params, context)

    async def delete(self, task_id: str, context: ServerCallContext) -> None:
        if not await self._sibling(task_id, "delete", context):
            await self.local.delete(task_id, context)

    def answer(self, operation: str, task_id: str, owner: str, task: bytes | None) -> bytes | None:
        """A sibling's call (on the channel's thread): run it on the local store, in the door's loop
        (None: not found, or this worker is stopping)."""
        if self._loop is None:
            return None  # no A2A request has reached this worker: it holds no task
        context = ServerCallContext(user=_Owner(owner))
        if operation == "get":
            work = self.local.get(task_id, context)
        elif operation == "save":
            work = self.local.save(Task.FromString(task), context)
        elif operation == "delete":
            work = self.local.delete(task_id, context)
        else:
            raise ValueError(f"no task operation {operation!r}")
        try:
            future = asyncio.run_coroutine_threadsafe(work, self._loop)
        except RuntimeError:  # the loop has closed: this worker is stopping, its tasks with it
            work.close()
            return None
        try:
            found = future.result(timeout=ANSWER_TIMEOUT_S)
        except TimeoutError:
            future.cancel()
            log.warning("A2A task %s: a sibling's %s found this worker's door stuck; not done", task_id, operation)
            return None
        return found.SerializeToString() if isinstance(found, Task) else None

    def _owner(self, task_id: str) -> int | None:
        """The sibling that holds ``task_id`` (None: this worker)."""
        self._loop = asyncio.get_running_loop()
        owner = worker_of(task_id)
        return owner if owner is not None and owner != self.index and owner < self.count else None

    async def _sibling(
        self, task_id: str, operation: str, context: ServerCallContext, task: Task | None = None
    ) -> bool:
        """Whether ``task_id`` is a sibling's (False: do ``operation`` here); if so, it was done there,
        or dropped with a warning while that sibling is down (its tasks went with it)."""
        owner = self._owner(task_id)
        if owner is None:
            return False
        payload = None if task is None else task.SerializeToString()
        try:
            await asyncio.to_thread(self._ask, owner, operation, task_id, resolve_user_scope(context), payload)
        except ConnectionError as exc:
            log.warning("A2A task %s: its worker %d is down (%s); %s dropped", task_id, owner, exc, operation)
        return True


class _Owner(User):
    """The owner a sibling named: tasks are kept per owner (a2a-sdk's ``resolve_user_scope``)."""

    def __init__(self, name: str) -> None:
        self._name = name

    @property
    def is_authenticated(self) -> bool:
        return bool(self._name)

    @property
    def user_name(self) -> str:
        return self._name
