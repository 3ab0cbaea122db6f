"""The ingress in front of the engine replicas: routes each OpenAI request, forwards it, relays the answer.

Completions and chats are routed by ``router.Router`` on the block digests of their whole prompt (a
chat is rendered with the model's chat template first, exactly as a replica renders it, so a
conversation routes on everything before its last turn, not on its first message). The replicas'
prefix-cache events are polled in the background and feed the router's index; a replica that fails
a call or a poll leaves the routing at once and comes back when a poll succeeds again (after Ray
Serve restarted it, with an empty cache). Embeddings route by their first input. Anthropic's messages
(``/v1/messages``) and responses (``/v1/responses``) route as the chat they run as, except that a
request naming a stored response (``previous_response_id``, or ``/v1/responses/{id}``) goes to the
replica that stored it, whose name its id carries; so do files and batches (``serve_objects.py``:
their lists merged from every replica). Every other route goes to the least loaded healthy replica;
schema changes go to all of them. No Ray import: ``serve_app.py`` wraps this in a deployment;
replicas are reached through anything shaped like a Ray Serve handle.

There may be several ingresses (Ray Serve's proxy picks one per request): each follows every
replica's events as its own consumer (``kv/cache_events.py``: a cursor each), so each holds the
whole index, but loads and sessions are each ingress's own: a session sticks to its replica only
while the proxy sends it to the same ingress (its prompt's prefix still routes it to the replica
holding it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter

from prefixserve.kv.cache_events import prompt_digests
from prefixserve.protocols.anthropic.prepare import MESSAGES_ROUTE, prepare_message
from prefixserve.protocols.errors import APIError
from prefixserve.protocols.openai import format as fmt
from prefixserve.protocols.openai.prepare import OpenAIContext, prepare, prompt_ids, truncated
from prefixserve.protocols.openai.salt_scope import public_tokens
from prefixserve.protocols.pooling.embeddings import EMBEDDINGS_ROUTE, prepare_embedding
from prefixserve.protocols.responses.prepare import RESPONSES_ROUTE, prepare_response
from prefixserve.protocols.vllm.cache_reset import RESET_ROUTE, reset_body
from prefixserve.ray_scaleout.router import Digests, Router, RoutingPolicy, replica_digests
from prefixserve.ray_scaleout.serve_metrics import merge_replica_metrics
from prefixserve.ray_scaleout.serve_objects import LISTED, merged_list, named_owner

log = logging.getLogger(__name__)

POLL_S = 0.25  # how often the replicas' cache events are drained
CALL_TIMEOUT_S = 5.0  # a poll or metrics call slower than this counts as a failure
SESSION_HEADER = "x-session-id"
REPLICA_HEADER = "X-Prefixserve-Replica"  # which replica answered (debugging, tests)
INGRESS_HEADER = "X-Prefixserve-Ingress"  # which ingress routed it (its consumer id)
HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}
RELAYED_NOT = HOP_HEADERS | {"x-request-id"}  # of a replica's answer: Ray's proxy sets its own X-Request-Id
ROUTED = {"/v1/completions", "/v1/chat/completions", RESPONSES_ROUTE, MESSAGES_ROUTE, EMBEDDINGS_ROUTE}


class ReplicaSet:
    """The replicas' handles, health, outstanding requests and cache index (one event loop's)."""

    def __init__(
        self, handles: dict[str, Any], policy: RoutingPolicy | None = None, consumer: str | None = None
    ) -> None:
        """``consumer``: this ingress's name to the replicas' event logs (default: a fresh one)."""
        if not handles:
            raise ValueError("need at least one replica")
        self.handles = handles
        self.consumer = consumer or uuid.uuid4().hex[:12]
        self.router = Router(policy)
        self.loads = dict.fromkeys(handles, 0)
        self.healthy: set[str] = set()  # a replica joins once a poll answered
        self.roots: dict[str, bytes | None] = {}  # each replica's chain root (CacheEvents.root)
        self._incarnation: dict[str, str] = {}
        self._need_full = set(handles)  # the next poll asks for a snapshot
        self._poller: asyncio.Task[None] | None = None
        self._first_round = asyncio.Event()  # every replica answered or failed a poll once
        self.registry = CollectorRegistry()
        self.routed = Counter(
            "prefixserve_router_requests", "Requests routed", ["replica"], registry=self.registry
        )
        self.hit_blocks = Counter(
            "prefixserve_router_cached_blocks",
            "Prompt blocks the chosen replica held when routed",
            ["replica"],
            registry=self.registry,
        )
        self.failures = Counter(
            "prefixserve_router_replica_failures",
            "Calls a replica failed",
            ["replica"],
            registry=self.registry,
        )

    # ---- health and cache events ---------------------------------------------------------------
    def ensure_polling(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    async def ready(self, timeout: float = CALL_TIMEOUT_S) -> None:
        """Wait for the first poll round: a new ingress (the proxy may pick one that just started)
        routes nothing before it, and would answer 503 with replicas serving."""
        if self._first_round.is_set():
            return
        self.ensure_polling()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._first_round.wait(), timeout)

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(self.poll(name) for name in self.handles))
            self._first_round.set()
            await asyncio.sleep(POLL_S)

    async def poll(self, name: str) -> None:
        """Drain one replica's cache events into the index; a failure takes it out of routing."""
        full = name in self._need_full
        try:
            call = self.handles[name].cache_events.remote(full, self.consumer)
            incarnation, events = await asyncio.wait_for(_result(call), CALL_TIMEOUT_S)
        except Exception as exc:
            if name in self.healthy:
                log.warning("replica %s does not answer (%s); routing around it", name, exc)
            self.failed(name)
            return
        if not full and name in self._need_full:
            return  # it failed while this poll was out: these changes are on top of a forgotten state
        if incarnation != self._incarnation.get(name):
            self.router.forget_replica(name)  # a new process: nothing it held before is there
            self._incarnation[name] = incarnation
        self.router.index.apply(name, events)
        self.roots[name] = events.root
        self._need_full.discard(name)
        if name not in self.healthy:
            log.info("replica %s is serving", name)
            self.healthy.add(name)

    def failed(self, name: str) -> None:
        """Out of routing until a poll succeeds; what it held is forgotten (it may restart empty)."""
        if name in self.healthy:
            self.failures.labels(name).inc()
        self.healthy.discard(name)
        self.router.forget_replica(name)
        self._need_full.add(name)

    # ---- routing ---------------------------------------------------------------------------------
    def chain_roots(self) -> dict[str, bytes | None]:
        """The chain root each serving replica gives a prompt's blocks (``prompt_digests``'s ``root``):
        None for a model-dtype cache; an FP8 cache's names its scheme and scales, the same on every
        replica of one deployment (the calibration is deterministic), but not across a rollout that
        changes the KV format."""
        return {name: self.roots.get(name) for name in sorted(self.healthy)}

    def choose(self, digests: Digests, session: str | None) -> str:
        """``digests``: the prompt's block digests, or each replica's where their chain roots differ."""
        loads = {name: self.loads[name] for name in self.healthy}
        if not loads:
            raise APIError(503, "no engine replica is serving now; retry shortly")
        name = self.router.choose(digests, loads, session)
        self.routed.labels(name).inc()
        held = self.router.index.match(replica_digests(digests, name), [name])[name]
        if held:
            self.hit_blocks.labels(name).inc(held)
        return name


async def _result(response: Any) -> Any:
    """Await a Ray Serve ``DeploymentResponse`` (or any awaitable)."""
    return await response


class IngressCore:
    """The ingress's request handling, given the replica set and the model's tokenizer context."""

    def __init__(self, replicas: ReplicaSet, ctx: OpenAIContext, block_size: int) -> None:
        self.replicas, self.ctx, self.block_size = replicas, ctx, block_size

    async def routing_key(self, path: str, body: bytes, headers: Any) -> tuple[Digests, str | None]:
        """(the block digests of the request's first prompt, its session); ([], ...) when the body
        is not a valid request: the replica then answers the error itself.

        Computed on a worker thread: parsing, the chat template, encoding and hashing take
        milliseconds for a long prompt, and the event loop meanwhile relays every stream's tokens."""
        return await asyncio.to_thread(self._routing_key, path, body, headers)

    def _routing_key(self, path: str, body: bytes, headers: Any) -> tuple[Digests, str | None]:
        try:
            data = json.loads(body)
            if path == RESPONSES_ROUTE:  # the chat it runs as (a stored conversation goes to its owner)
                prep = prepare_response(self.ctx, data, None).prep
            elif path == MESSAGES_ROUTE:  # Anthropic's: the chat it runs as
                prep = prepare_message(self.ctx, data).prep
            elif path == EMBEDDINGS_ROUTE:  # by its first input
                prep = prepare_embedding(self.ctx, data).prep
            else:
                prep = prepare(self.ctx, path, data)
        except (ValueError, APIError, AttributeError, TypeError):
            return [], headers.get(SESSION_HEADER)
        # the header, else OpenAI's prompt_cache_key, else the body's user (a chat's ``user``,
        # Anthropic's ``metadata.user_id``): requests naming one go to one replica
        key = getattr(prep.req, "prompt_cache_key", None)
        session = headers.get(SESSION_HEADER) or key or getattr(prep.req, "user", None)
        ids = prompt_ids(self.ctx, prep, prep.prompts[0] if prep.prompts else "")
        if ids is None:  # a Prompt Cache document, no tokenizer
            return [], session
        ids = self.ctx.engine_ids(truncated(prep, ids, None), prep.application)  # as the engine's intake
        salt = getattr(prep.req, "cache_salt", None)  # the replicas' keys follow the salt's scope
        public = public_tokens(self.ctx, prep, ids)
        # an FP8 cache's digests chain from its scheme: each replica's root, hashed once a root
        roots = self.replicas.chain_roots()
        by_root = {
            root: prompt_digests(ids, self.block_size, salt=salt, public=public, root=root)
            for root in set(roots.values()) or {None}
        }
        if len(by_root) == 1:
            return next(iter(by_root.values())), session
        return {name: by_root[root] for name, root in roots.items()}, session

    async def forward(self, request: Request) -> Response:
        """Route and forward one request; relay the replica's answer (streamed as it comes)."""
        await self.replicas.ready()
        path, body = request.url.path, await request.body()
        if path in ROUTED and request.method == "POST":
            digests, session = await self.routing_key(path, body, request.headers)
        else:
            digests, session = [], None
        if request.method != "GET" and (path.startswith("/v1/schemas") or path == RESET_ROUTE):
            return await self._broadcast(request, body)
        if request.method == "GET" and path in LISTED:
            names = sorted(self.replicas.healthy)
            if not names:
                raise APIError(503, "no engine replica is serving now; retry shortly")
            auth = [(k, v) for k, v in request.headers.items() if k.lower() in ("authorization", "x-api-key")]

            async def fetch(name: str, path: str, query: str) -> tuple[int, Any]:
                return await self._fetch(name, path, query, auth)

            return JSONResponse(await merged_list(fetch, names, path, dict(request.query_params)))
        owner = named_owner(request.method, path, body)
        if owner is not None and owner in self.replicas.handles:
            if owner not in self.replicas.healthy:
                message = f"{owner}, which holds what this request names, is not serving now; retry shortly"
                raise APIError(503, message)
            return await self._call(owner, request, body)
        name = self.replicas.choose(digests, session)
        return await self._call(name, request, body)

    async def _fetch(
        self, name: str, path: str, query: str, headers: list[tuple[str, str]]
    ) -> tuple[int, Any]:
        """A GET of ``path?query`` on one replica (``headers``: the client's credentials): (status, JSON)."""
        handle = self.replicas.handles[name].options(stream=True)
        chunks = handle.handle.remote("GET", path, query, headers, b"")
        start, *rest = [c async for c in chunks]
        return start["status"], json.loads(b"".join(bytes(c) for c in rest))

    def _request_args(
        self, request: Request, body: bytes
    ) -> tuple[str, str, str, list[tuple[str, str]], bytes]:
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_HEADERS]
        return request.method, request.url.path, request.url.query, headers, body

    async def _call(self, name: str, request: Request, body: bytes) -> Response:
        replicas = self.replicas
        replicas.loads[name] += 1
        handle = replicas.handles[name].options(stream=True)
        chunks: AsyncIterator[Any] = handle.handle.remote(*self._request_args(request, body)).__aiter__()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                replicas.loads[name] -= 1

        try:
            start = await chunks.__anext__()
            headers = {k: v for k, v in start["headers"] if k.lower() not in RELAYED_NOT}
            headers[REPLICA_HEADER] = name
            headers[INGRESS_HEADER] = replicas.consumer
            if not headers.get("content-type", "").startswith("text/event-stream"):
                content = b"".join([bytes(c) async for c in chunks])
                release()
                return Response(content, status_code=start["status"], headers=headers)
        except Exception as exc:
            release()
            replicas.failed(name)
            log.warning("replica %s failed a request: %s", name, exc)
            error = APIError(503, f"engine replica {name} failed while answering: {type(exc).__name__}")
            tags = {REPLICA_HEADER: name, INGRESS_HEADER: replicas.consumer}
            return JSONResponse(error.body(), status_code=503, headers=tags)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in chunks:
                    yield bytes(chunk)
            except Exception as exc:
                replicas.failed(name)
                log.warning("replica %s failed mid-stream: %s", name, exc)
                error = APIError(500, f"engine replica {name} failed mid-stream", code="engine_error")
                yield fmt.sse(error.body()).encode()
                if request.url.path.endswith("completions"):  # a chat / completion stream ends with it
                    yield fmt.DONE.encode()
            finally:
                release()
                with contextlib.suppress(Exception):
                    await chunks.aclose()  # type: ignore[attr-defined]

        return StreamingResponse(relay(), status_code=start["status"], headers=headers)

    async def _broadcast(self, request: Request, body: bytes) -> Response:
        """Schema changes and prefix-cache resets go to every healthy replica; the first one's answer
        is returned, except for a reset: a failed replica's error if any failed, else ``reset: true``
        only where every replica's said so."""
        names = sorted(self.replicas.healthy)
        if not names:
            raise APIError(503, "no engine replica is serving now; retry shortly")
        answers = await asyncio.gather(*(self._call(n, request, body) for n in names))
        if request.url.path != RESET_ROUTE:
            return answers[0]
        failed = [a for a in answers if a.status_code != 200]
        if failed:  # a replica that did not reset: its error, not another's success
            return failed[0]
        each = {n: bool(json.loads(bytes(a.body)).get("reset")) for n, a in zip(names, answers, strict=True)}
        return JSONResponse(reset_body(all(each.values()), each))

    async def health(self) -> Response:
        await self.replicas.ready()
        states = {name: name in self.replicas.healthy for name in self.replicas.handles}
        body = {
            "status": "ok" if any(states.values()) else "unavailable",
            "replicas": states,
            "outstanding": dict(self.replicas.loads),
        }
        return JSONResponse(body, status_code=200 if any(states.values()) else 503)

    async def metrics(self) -> Response:
        """Every healthy replica's metrics with a ``replica`` label, and the router's own."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        names = sorted(self.replicas.healthy)
        calls = [_result(self.replicas.handles[n].metrics_text.remote()) for n in names]
        texts = await asyncio.gather(
            *(asyncio.wait_for(c, CALL_TIMEOUT_S) for c in calls), return_exceptions=True
        )
        per_replica = {n: t.decode() for n, t in zip(names, texts, strict=True) if isinstance(t, bytes)}
        merged = merge_replica_metrics(per_replica) + generate_latest(self.replicas.registry)
        return Response(merged, media_type=CONTENT_TYPE_LATEST)


__all__ = ["INGRESS_HEADER", "REPLICA_HEADER", "SESSION_HEADER", "IngressCore", "ReplicaSet"]
