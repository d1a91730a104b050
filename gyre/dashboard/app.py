"""The dashboard's web app: the page, its JSON (read-only: GET only), and plotly.js from the installed plotly
package (nothing is fetched from a network). Beyond localhost it asks for a token: `Authorization: Bearer …`,
or `?token=…` once, after which a cookie carries it.
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Any

import plotly
from fastapi import FastAPI, Request, Response
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from gyre.dashboard.source import ReadModel, UnknownExecution, UnknownRun

STATIC = Path(__file__).parent / "static"
PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
COOKIE = "gyre_dashboard_token"


def create_app(model: ReadModel, *, token: str | None = None, title: str = "Gyre") -> FastAPI:
    app = FastAPI(title=f"{title} dashboard", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        if request.method not in ("GET", "HEAD"):
            return JSONResponse({"detail": "the dashboard is read-only"}, status_code=405)
        if token is None:
            return await call_next(request)  # type: ignore[no-any-return]
        given = request.query_params.get("token") or request.cookies.get(COOKIE) or ""
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        if not hmac.compare_digest(given.encode(), token.encode()):
            return JSONResponse({"detail": "a token is needed: open the URL `gyre dashboard` printed "
                                           "(…?token=…) or send Authorization: Bearer <token>"}, status_code=401)
        response: Response = await call_next(request)
        if "token" in request.query_params:
            response.set_cookie(COOKIE, token, httponly=True, samesite="strict")
        return response

    @app.exception_handler(UnknownRun)
    @app.exception_handler(UnknownExecution)
    async def not_found(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/vendor/plotly.min.js", include_in_schema=False)
    async def plotly_js() -> FileResponse:
        return FileResponse(PLOTLY_JS, media_type="text/javascript", headers={"Cache-Control": "max-age=86400"})

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/api/runs")
    async def runs() -> list[dict[str, Any]]:
        return await model.runs()

    @app.get("/api/runs/{run_id}", response_model=None)
    async def run(run_id: str, since: int | None = None) -> dict[str, Any] | Response:
        view = await model.run(run_id, since=since)
        return Response(status_code=204) if view is None else view

    @app.get("/api/runs/{run_id}/executions/{execution_id}/calls")
    async def calls(run_id: str, execution_id: str) -> list[dict[str, Any]]:
        return await model.calls(run_id, execution_id)

    @app.get("/api/runs/{run_id}/executions/{execution_id}/calls/{call_index}")
    async def call(run_id: str, execution_id: str, call_index: int) -> dict[str, Any]:
        return await model.call(run_id, execution_id, call_index)

    @app.get("/api/runs/{run_id}/executions/{execution_id}/tree")
    async def tree(run_id: str, execution_id: str) -> dict[str, Any]:
        return await model.tree(run_id, execution_id)

    return app
