"""``/v1/schemas``: register, list, get and remove Prompt Cache schemas (PML) on a running server.

The engine calls run where the engine is (its thread, or its process: the callables here are
module-level so they pickle), between two steps; registering encodes the modules then, unless
``encode`` is false.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prefixserve.engine.llm_engine import Engine
from prefixserve.entrypoints.openai.requests import ServerState, authorize, read_schema_request
from prefixserve.promptcache.pml import PMLError, parse_schema
from prefixserve.protocols.errors import APIError
from prefixserve.serving.engine_thread import EngineStopped


def _schema_card(info: dict[str, Any]) -> dict[str, Any]:
    return {"object": "schema", **info}


def _find_schema(engine: Engine, name: str) -> dict[str, Any] | None:
    return next((s for s in engine.list_schemas() if s["name"] == name), None)


class _SchemaExists(Exception):
    pass


def _register_schema(engine: Engine, pml: str, replace: bool, **options: Any) -> tuple[dict[str, Any], bool]:
    """Register a schema where the engine is (a module-level function: it pickles for the engine
    process); returns its card and whether it replaced one."""
    name = parse_schema(pml).name  # a PMLError names line, column and problem
    existed = _find_schema(engine, name) is not None
    if existed and not replace:
        raise _SchemaExists(name)
    engine.register_schema(pml, replace=replace, **options)
    info = _find_schema(engine, name)
    assert info is not None
    return info, existed


def add_schema_routes(app: FastAPI, state: ServerState) -> None:
    """Register, list and remove PML schemas. The engine calls run on the engine thread between two
    steps (registering encodes the modules now, unless ``encode`` is false)."""

    async def on_engine(fn: Any) -> Any:
        try:
            return await state.loop.run(fn)
        except EngineStopped as exc:
            raise APIError(503, str(exc)) from None

    @app.post("/v1/schemas")
    async def add_schema(request: Request) -> Response:
        authorize(state, request)
        req = await read_schema_request(state, request)
        try:
            register = functools.partial(
                _register_schema,
                pml=req.schema_,
                replace=req.replace,
                encode=req.encode,
                pin=req.pin,
                module_recompute=req.module_recompute,
            )
            info, replaced = await on_engine(register)
        except _SchemaExists as exc:
            message = f"schema {exc.args[0]!r} is already registered; send replace=true to replace it"
            raise APIError(409, message, param="schema", code="schema_exists") from None
        except PMLError as exc:
            raise APIError(400, str(exc), param="schema", code="invalid_pml") from None
        except ValueError as exc:  # no room in the KV pool for its modules, a bad module_recompute
            param = "module_recompute" if str(exc).startswith("module_recompute") else "schema"
            raise APIError(400, str(exc), param=param, code="invalid_value") from None
        return JSONResponse(_schema_card(info), status_code=200 if replaced else 201)

    @app.get("/v1/schemas")
    async def list_schemas(request: Request) -> Response:
        authorize(state, request)
        schemas = await on_engine(operator.methodcaller("list_schemas"))
        return JSONResponse({"object": "list", "data": [_schema_card(s) for s in schemas]})

    @app.get("/v1/schemas/{name}")
    async def get_schema(name: str, request: Request) -> Response:
        authorize(state, request)
        info = await on_engine(functools.partial(_find_schema, name=name))
        if info is None:
            raise APIError(404, f"no schema named {name!r}", param="name", code="schema_not_found")
        return JSONResponse(_schema_card(info))

    @app.delete("/v1/schemas/{name}")
    async def delete_schema(name: str, request: Request) -> Response:
        authorize(state, request)
        try:
            await on_engine(operator.methodcaller("unregister_schema", name))
        except KeyError:
            raise APIError(404, f"no schema named {name!r}", param="name", code="schema_not_found") from None
        return JSONResponse({"object": "schema", "name": name, "deleted": True})


__all__ = ["add_schema_routes"]
