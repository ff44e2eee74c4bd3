"""The A2A door's tasks: in memory, the most recent ``max_tasks`` of them.

a2a-sdk's ``InMemoryTaskStore`` keeps every task for the life of the process, and every query the
purple agent answers is a task (its message, its status, its result artifact): an evaluator's
thousands of queries, or a long-running agent, grow the process without bound. This store drops
the task saved least recently once there are more than ``max_tasks``; ``tasks/get`` on a dropped
task answers "task not found", as for any unknown id. A task is saved at each state change, so one
still working is among the most recent.
"""

from __future__ import annotations

from collections import OrderedDict

from a2a.server.context import ServerCallContext
from a2a.server.owner_resolver import resolve_user_scope
from a2a.server.tasks import InMemoryTaskStore, TaskStore
from a2a.types.a2a_pb2 import ListTasksRequest, ListTasksResponse, Task


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

    def __len__(self) -> int:
        return len(self._recent)
