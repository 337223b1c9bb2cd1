"""The warm-up API: a client names the next turn's head in its own terms, before the turn arrives.

Served by `kvprefetch serve` on vLLM's own port (vLLM's ``--middleware``, no second address)::

    POST   /v1/kvprefetch/warm        {"model", "messages" | "prompt" | "prompt_token_ids", "cache_salt", "ttl_s": 30}
           -> 200 {"id", "chunks", "in_dram", "on_disk", "remote", "missing", "ttl_s"}   (at once: reads go on)
    GET    /v1/kvprefetch/warm/{id}   -> the same counts now (how many chunks have reached DRAM)
    DELETE /v1/kvprefetch/warm/{id}   -> the lease ends

A warm-up names its prompt's identity as the completion that follows will: ``model`` (the base model, or a LoRA
adapter the server serves), ``cache_salt``, and the images (audio, video) in its messages, rendered by vLLM's own
renderer into their placeholder tokens and content hashes; its chunks are keyed under that identity
(`kvprefetch.vllm.identity`),
so a warm-up counts, reads and leases only the chunks a completion of that identity could load, never another
tenant's or another adapter's. The routes are vLLM's own (added to its app, `install_routes`): every request to
them passes through vLLM's middleware, its ``--api-key`` check included, as ``/v1/completions`` does.

Messages and prompts are tokenized by vLLM's own tokenization service (the server's tokenizer and chat
template, as ``/tokenize`` does), so the chunks named are those the next real request will look up. A chat body
renders *without* the generation prompt by default (``add_generation_prompt: false``): the next turn appends a
tool result or a user message after these messages, and a generation prompt here would differ from what follows
them there.

Two halves, two processes: the middleware (`WarmMiddleware`) runs in vLLM's API server, which has the tokenizer
but no connector; the connector's scheduler side (`SchedulerSide.warm`) runs in the engine-core process, which
has the keys, the store and the lease budget. They talk over a unix socket in the abstract namespace named after
vLLM's engine id (`socket_name`; nothing on disk), one JSON request and one JSON answer per connection
(`WarmServer`). A hint never blocks a request: the engine side only looks keys up and queues reads at prefetch
priority, on its own thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvprefetch.vllm.identity import MMItem, Untiered, named_identity

log = logging.getLogger("kvprefetch.vllm")

PATH = "/v1/kvprefetch/warm"
MAX_MESSAGE_BYTES = 64 << 20  # a warm-up of a million-token prompt is ~8 MB of JSON


def socket_name(engine_id: str) -> str:
    return f"\0kvprefetch-warm-{engine_id}"


# ---- engine side --------------------------------------------------------------------------------------------
class WarmServer:
    """Answers warm-up requests in the engine-core process, on a thread of its own; also expires leases while the
    engine is idle (the scheduler's own calls expire them while it runs)."""

    def __init__(self, name: str, handle: Callable[[dict[str, Any]], dict[str, Any]], tick: Callable[[], Any]):
        self._handle = handle
        self._tick = tick
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(name)
        self._sock.listen(16)
        self._sock.settimeout(0.5)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvprefetch-warm", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                self._safely(self._tick)
                continue
            except OSError:
                return
            with conn:
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        try:
            request = json.loads(_read_message(conn))
            answer = self._handle(request)
        except Exception as err:  # a bad call gets an answer, never the server's thread
            answer = {"status": 500, "error": f"{type(err).__name__}: {err}"}
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps(answer).encode() + b"\n")

    @staticmethod
    def _safely(fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as err:
            log.warning("kvprefetch: lease expiry failed: %s", err)

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.close()
        self._thread.join(timeout=2)


def _read_message(conn: socket.socket) -> bytes:
    buf = bytearray()
    while not buf.endswith(b"\n"):
        part = conn.recv(1 << 16)
        if not part:
            break
        buf += part
        if len(buf) > MAX_MESSAGE_BYTES:
            raise ValueError("message too large")
    return bytes(buf)


def engine_handler(sched: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The engine side's answers (`SchedulerSide.warm` / `warm_status` / `end_lease`), as JSON with a status."""

    def handle(req: dict[str, Any]) -> dict[str, Any]:
        op, lease_id = req.get("op"), str(req.get("id") or "")
        if op == "warm":
            tokens = req.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                return {"status": 400, "error": "tokens must be a list of token ids"}
            who = dict(req.get("identity") or {})
            who["mm"] = tuple(MMItem(str(i), int(o), int(n)) for i, o, n in who.get("mm") or ())
            identity = named_identity(**who)
            if isinstance(identity, Untiered):  # (what a completion of it would be served as: without the tiers)
                why = f"{identity.reason}: {identity.detail}"
                return {"status": 422, "error": f"this prompt's chunks cannot be keyed ({why}): its requests are "
                                                "served without the tiers"}  # fmt: skip
            return sched.warm(tokens, float(req.get("ttl_s") or 30.0), lease_id, identity).as_json()
        if op == "status":
            counts = sched.warm_status(lease_id)
            return counts.as_json() if counts is not None else {"status": 404, "error": f"no warm-up {lease_id!r} "
                                                                 "(unknown, expired or ended)"}  # fmt: skip
        if op == "end":
            if sched.end_lease(lease_id):
                return {"id": lease_id, "ended": True}
            return {"status": 404, "error": f"no warm-up {lease_id!r} (unknown, expired or ended)"}
        if op == "leases":  # `kvprefetch status`
            sched.leases.expire()
            return sched.leases.snapshot() | {"list": sched.leases.describe()}
        return {"status": 400, "error": f"unknown op {op!r}"}

    return handle


def live_engines(proc_net_unix: str = "/proc/net/unix") -> list[str]:
    """Engine ids of the warm servers listening on this node (their abstract sockets, as the kernel lists them)."""
    prefix = "@" + socket_name("")[1:]
    try:
        lines = Path(proc_net_unix).read_text().splitlines()[1:]
    except OSError:
        return []
    names = {line.split()[-1] for line in lines if len(line.split()) >= 8}
    return sorted(n.removeprefix(prefix) for n in names if n.startswith(prefix))


def engine_leases(engine_id: str, timeout: float = 2.0) -> dict[str, Any]:
    """One engine's leases (`Leases.snapshot` and `describe`), or {"error": ...} if it does not answer."""
    try:
        return engine_call(socket_name(engine_id), {"op": "leases"}, timeout)
    except (OSError, ValueError) as err:
        return {"error": f"{type(err).__name__}: {err}"}


def engine_call(name: str, request: dict[str, Any], timeout: float = 10) -> dict[str, Any]:
    """One request to the engine side (blocking; the middleware runs it in a thread)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(name)
        s.sendall(json.dumps(request).encode() + b"\n")
        return json.loads(_read_message(s))


# ---- API server side ----------------------------------------------------------------------------------------
class WarmBody(BaseModel):
    """POST /v1/kvprefetch/warm: exactly one of messages, prompt, prompt_token_ids."""

    model_config = ConfigDict(extra="forbid")

    model: str
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    cache_salt: str | None = Field(default=None, description="As a completion's: only chunks of this salt are warmed.")
    ttl_s: float = Field(default=30.0, gt=0, le=3600)
    add_generation_prompt: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> WarmBody:
        given = [n for n in ("messages", "prompt", "prompt_token_ids") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of messages, prompt, prompt_token_ids (got {given or 'none'})")
        return self

    @field_validator("cache_salt")
    @classmethod
    def _salt_as_vllm_takes_it(cls, salt: str | None) -> str | None:
        from vllm.entrypoints.generate.base.protocol import validate_cache_salt

        try:
            validate_cache_salt(salt)
        except Exception as err:  # (vLLM's VLLMValidationError: reported as the field's, as pydantic reports its own)
            raise ValueError(str(err)) from None
        return salt


class WarmError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError"):
        super().__init__(message)
        self.status, self.kind = status, kind


def _error(status: int, message: str, kind: str) -> tuple[int, dict[str, Any]]:
    return status, {"error": {"message": message, "type": kind, "code": status}}


class WarmMiddleware:
    """ASGI middleware for vLLM's OpenAI server (``--middleware kvprefetch.vllm.warm_api.WarmMiddleware``): adds the
    warm-up API's routes to vLLM's app the first time the server calls it (`install_routes`), and passes every
    request through untouched.

    A middleware named with ``--middleware`` wraps vLLM's own (its ``--api-key`` check among them): a route served
    here, in front of them, would answer callers vLLM refuses. As routes of vLLM's app, behind its middleware, the
    warm-up API refuses what ``/v1/completions`` refuses, with the same status."""

    def __init__(self, app: Any):
        self.app = app
        self._installed = False

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if not self._installed and scope.get("app") is not None:  # (Starlette puts its app in every scope)
            install_routes(scope["app"])
            self._installed = True
        await self.app(scope, receive, send)


def install_routes(app: Any) -> None:
    """/v1/kvprefetch/warm[/{id}] as routes of vLLM's app (every method: a wrong one gets our 405, saying which)."""
    methods = ["GET", "POST", "PUT", "PATCH", "DELETE"]
    app.router.add_route(PATH, warm_route, methods=methods, include_in_schema=False)
    app.router.add_route(PATH + "/{lease_id}", warm_route, methods=methods, include_in_schema=False)


async def warm_route(request: Any) -> Any:
    from starlette.responses import JSONResponse

    try:
        status, body = await _route(request, str(request.path_params.get("lease_id", "")))
    except WarmError as err:
        status, body = _error(err.status, str(err), err.kind)
    return JSONResponse(body, status_code=status)


async def _route(request: Any, lease_id: str) -> tuple[int, dict[str, Any]]:
    method = request.method
    if not lease_id and method == "POST":
        return await _warm(request)
    if lease_id and method in ("GET", "DELETE"):
        op = "status" if method == "GET" else "end"
        return await _engine(request, {"op": op, "id": lease_id})
    allowed = "POST" if not lease_id else "GET, DELETE"
    raise WarmError(405, f"{method} {request.url.path}: not allowed (use {allowed})", "MethodNotAllowed")


async def _warm(request: Any) -> tuple[int, dict[str, Any]]:
    try:
        body = WarmBody.model_validate(json.loads(await request.body()))
    except (ValueError, ValidationError) as err:  # (JSONDecodeError is a ValueError)
        raise WarmError(400, f"malformed warm-up body: {_short(err)}") from None
    identity: dict[str, Any] = {"cache_salt": body.cache_salt} | _adapter(request.app.state, body.model)
    if body.prompt_token_ids is not None:
        tokens = body.prompt_token_ids
    else:
        tokens, identity["mm"] = await _tokenize(request, body)
    lease_id = f"warm-{uuid.uuid4().hex[:16]}"
    return await _engine(request, {"op": "warm", "id": lease_id, "tokens": tokens, "ttl_s": body.ttl_s,
                                   "identity": identity})  # fmt: skip


def _adapter(state: Any, model: str) -> dict[str, str]:
    """The LoRA adapter a model name names, as vLLM resolves a completion's (none for the base model); 404 for a
    name the server serves neither as a model nor as an adapter."""
    served = _served_models(state)
    if model in served:
        return {}
    lora = _adapters(state).get(model)
    if lora is None:
        adapters = sorted(_adapters(state))
        raise WarmError(404, f"The model `{model}` does not exist (served: {', '.join(served + adapters)}).",
                        "NotFoundError")  # fmt: skip
    return {"lora_name": lora.lora_name, "lora_path": lora.lora_path}


async def _engine(request: Any, call: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    import asyncio

    name = socket_name(_engine_id(request.app.state))
    try:
        answer = await asyncio.to_thread(engine_call, name, call)
    except OSError as err:
        raise WarmError(503, f"kvprefetch's connector is not reachable in the engine ({err}): is the server "
                             "running with the kvprefetch connector?", "ServiceUnavailable") from None  # fmt: skip
    status = int(answer.pop("status", 200))
    if status != 200:
        kind = {404: "NotFoundError", 400: "BadRequestError", 422: "BadRequestError"}.get(status, "InternalError")
        return _error(status, str(answer.get("error")), kind)
    return status, answer


def _short(err: Exception) -> str:
    if isinstance(err, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in err.errors())
    return str(err)


def _served_models(state: Any) -> list[str]:
    models = getattr(state, "openai_serving_models", None)
    return [p.name for p in getattr(models, "base_model_paths", ())]


def _adapters(state: Any) -> dict[str, Any]:
    """The LoRA adapters the server serves, by name (vLLM's `LoRARequest`s)."""
    return getattr(getattr(state, "openai_serving_models", None), "lora_requests", {})


def _engine_id(state: Any) -> str:
    config = getattr(getattr(state, "vllm_config", None), "kv_transfer_config", None)
    if config is None or not getattr(config, "engine_id", None):
        raise WarmError(503, "this server runs without a KV connector: start it with `kvprefetch serve`",
                        "ServiceUnavailable")  # fmt: skip
    return str(config.engine_id)


async def _tokenize(request: Any, body: WarmBody) -> tuple[list[int], list[list[Any]]]:
    """Tokens exactly as vLLM's tokenization service makes them for the next real request, and its multimodal items
    ([identifier, offset, length], in prompt order) as vLLM's input processor names them."""
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest, TokenizeCompletionRequest

    service = request.app.state.serving_tokenization
    if body.messages is not None:
        chat = TokenizeChatRequest(
            model=body.model, messages=body.messages, add_generation_prompt=body.add_generation_prompt,
            chat_template_kwargs=body.chat_template_kwargs, tools=body.tools,
        )  # fmt: skip
        return await _render_chat(request, service, chat)
    out = await service.create_tokenize(TokenizeCompletionRequest(model=body.model, prompt=body.prompt), request)
    tokens = getattr(out, "tokens", None)
    if tokens is None:  # vLLM's ErrorResponse
        _raise(out)
    return list(tokens), []


async def _render_chat(request: Any, service: Any, chat: Any) -> tuple[list[int], list[list[Any]]]:
    """A chat body rendered as vLLM's tokenization service renders it for ``/tokenize`` (its template, its media
    processing, without touching the multimodal cache the engine shares), keeping what ``/tokenize`` drops: the
    content hash and placeholder range of each image, audio or video (`_rendered_mm_items`)."""
    error = await service._check_model(chat)
    if error is None:
        error = service.online_renderer.validate_chat_template(
            request_chat_template=chat.chat_template, chat_template_kwargs=chat.chat_template_kwargs,
            trust_request_chat_template=service.trust_request_chat_template,
        )  # fmt: skip
    if error is not None:
        _raise(error)
    tools = None if chat.tools is None else [tool.model_dump() for tool in chat.tools]
    _, inputs = await service.online_renderer.preprocess_chat(
        chat, chat.messages, default_template=service.chat_template,
        default_template_content_format=service.chat_template_content_format,
        default_template_kwargs=service.default_chat_template_kwargs, tool_dicts=tools, skip_mm_cache=True,
    )  # fmt: skip
    (engine_input,) = inputs
    return list(engine_input["prompt_token_ids"]), _rendered_mm_items(request.app.state, engine_input, chat.model)


def _rendered_mm_items(state: Any, engine_input: Any, model: str) -> list[list[Any]]:
    """Each multimodal item of a rendered prompt as the engine will name it (`MultiModalFeatureSpec`): its content
    hash (prefixed with the adapter's name where vLLM's tower LoRA makes the embeddings the adapter's) and its
    placeholder range."""
    if engine_input.get("type") != "multimodal":
        return []
    lora = _adapters(state).get(model)
    lora_config = getattr(getattr(state, "vllm_config", None), "lora_config", None)
    prefix = f"{lora.lora_name}:" if lora and getattr(lora_config, "enable_tower_connector_lora", False) else ""
    items = []
    for modality, hashes in engine_input["mm_hashes"].items():
        for h, where in zip(hashes, engine_input["mm_placeholders"][modality], strict=True):
            items.append([prefix + h, int(where.offset), int(where.length)])
    return sorted(items, key=lambda item: item[1])


def _raise(error: Any) -> None:
    err = getattr(error, "error", error)  # (vLLM's ErrorResponse)
    raise WarmError(int(getattr(err, "code", 400) or 400), str(getattr(err, "message", err)))
