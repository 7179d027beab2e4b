"""The dashboard (/ui/) and the interactive API docs (/docs), served by the gateway itself.

Plain files shipped in the package (static/: HTML, CSS and ES modules, no build step) and
Swagger UI from the `swagger-ui-bundle-v2` wheel; nothing is fetched from the network at run
time, and the Content-Security-Policy makes the browser refuse anything that is not from here.
The pages hold no data: everything comes from the public API with the user's key, so they are
served without one (auth/keys.py PUBLIC_PREFIXES).
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web
from swagger_ui_bundle import swagger_ui_path

STATIC = Path(__file__).parent / "static"
CSP = ("default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
       "script-src 'self'; connect-src 'self'; frame-ancestors 'none'; base-uri 'self'; "
       "form-action 'self'")
UI_PREFIXES = ("/ui", "/docs")

routes = web.RouteTableDef()


@routes.get("/")
@routes.get("/ui")
async def to_dashboard(request: web.Request) -> web.Response:
    raise web.HTTPFound("/ui/")


@routes.get("/ui/")
async def dashboard(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html")


@routes.get("/docs")
async def docs(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "docs.html")


async def _headers(request: web.Request, response: web.StreamResponse) -> None:
    """CSP on the pages and their files; `no-cache` so an upgraded gateway serves new files
    at once (the browser still revalidates cheaply with the files' ETag)."""
    if request.path.startswith(UI_PREFIXES) and response.status < 400:
        response.headers["Content-Security-Policy"] = CSP
        response.headers["Cache-Control"] = "no-cache"
        response.headers["X-Content-Type-Options"] = "nosniff"


def add_ui(app: web.Application) -> None:
    app.add_routes(routes)
    app.router.add_static("/ui/", STATIC, name="ui")
    app.router.add_static("/docs/assets/", Path(str(swagger_ui_path)), name="swagger_ui")
    app.on_response_prepare.append(_headers)
