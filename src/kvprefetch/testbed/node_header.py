"""Which node served a request, as the client behind a router sees it: an ASGI middleware (vLLM's
``--middleware kvprefetch.testbed.node_header.NodeHeader``) that adds ``x-kvprefetch-node: NAME`` to every HTTP
response of the server, NAME from the server's environment (`ENV`). vllm-router passes a worker's response
headers through to its client, so the bench's client (`kvprefetch.testbed.http_sessions`) records where each
request went, also with many in flight at once (a node's counters only say how many)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

ENV = "KVPREFETCH_NODE"
HEADER = "x-kvprefetch-node"


class NodeHeader:
    def __init__(self, app: Any):
        self.app = app
        self.name = os.environ.get(ENV, "").encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or not self.name:
            await self.app(scope, receive, send)
            return

        async def tagged(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = message | {"headers": [*message.get("headers", []), (HEADER.encode(), self.name)]}
            await send(message)

        await self.app(scope, receive, tagged)
