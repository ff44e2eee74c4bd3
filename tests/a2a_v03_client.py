"""Ask an A2A agent one question with the a2a-sdk 0.3 client, as the benchmark's evaluator does.

Runs in its own virtual environment (a2a-sdk 0.3 and 1.x cannot share one): prints a JSON line
``{"state": ..., "parsed": ..., "artifacts": n, "parts": [...]}``.
Usage: python a2a_v03_client.py URL MESSAGE_TEXT
"""

import asyncio
import json
import sys
import uuid

import httpx
from a2a.client import A2ACardResolver, ClientConfig, ClientFactory
from a2a.types import Message, Part, Role, Task, TextPart


def part_text(part) -> str:
    root = part.root
    return root.text if root.kind == "text" else json.dumps(root.data) if root.kind == "data" else ""


async def main(url: str, text: str) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        card = await A2ACardResolver(http, url).get_agent_card()
        client = ClientFactory(ClientConfig(httpx_client=http, streaming=False)).create(card)
        message = Message(role=Role.user, parts=[Part(root=TextPart(text=text))], message_id=uuid.uuid4().hex)
        task = None
        async for event in client.send_message(message):
            task = event[0] if isinstance(event, tuple) else event
        assert isinstance(task, Task), f"expected a task, got {type(task).__name__}"
        pieces = []
        if task.status.message:
            pieces += [part_text(p) for p in task.status.message.parts]
        parts = [p for a in task.artifacts or [] for p in a.parts]
        pieces += [part_text(p) for p in parts]
        joined = "".join(pieces)
        try:
            parsed = json.loads(joined)
        except json.JSONDecodeError:
            parsed = None
        print(
            json.dumps(
                {
                    "card_name": card.name,
                    "state": task.status.state.value,
                    "joined": joined,
                    "parsed": parsed,
                    "artifacts": len(task.artifacts or []),
                    "parts": [p.root.kind for p in parts],
                }
            )
        )


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
