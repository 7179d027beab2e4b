"""The dashboard and API docs as the gateway serves them, with SHOAL_REQUIRE_API_KEY=true: the
pages and their files load without a key (they hold no data) while the API still needs one,
every file the page names is served with the right type and a Content-Security-Policy, and
nothing outside the static folder can be read through it."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import aiohttp
import pytest
from yarl import URL
from tests.integration.test_gateway import running_gateway

from shoal.services.gateway.management.ui import STATIC
from shoal.shared.config import Settings

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
async def locked(settings: Settings, registry) -> AsyncIterator[str]:
    async with running_gateway(settings.model_copy(update={"require_api_key": True})) as url:
        yield url


async def test_pages_load_without_a_key_and_the_api_still_needs_one(locked: str) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{locked}/", allow_redirects=False) as r:
            assert r.status == 302 and r.headers["Location"] == "/ui/"
        async with http.get(f"{locked}/ui/") as r:
            page = await r.text()
            assert r.status == 200 and r.content_type == "text/html"
            assert "default-src 'self'" in r.headers["Content-Security-Policy"]
        named = re.findall(r'(?:src|href)="(/(?:ui|docs)/[^"#]+)"', page)
        assert "/ui/js/main.js" in named
        modules = [f"/ui/{p.relative_to(STATIC).as_posix()}" for p in STATIC.rglob("*.js")]
        for path in set(named) | set(modules):
            async with http.get(f"{locked}{path}") as r:
                assert r.status == 200, path
                if path.endswith(".js"):  # ES modules are refused under any other type
                    assert r.content_type in ("application/javascript", "text/javascript"), path
        async with http.get(f"{locked}/docs") as r:
            docs = await r.text()
            assert r.status == 200 and "/docs/assets/swagger-ui-bundle.js" in docs
        async with http.get(f"{locked}/docs/assets/swagger-ui-bundle.js") as r:
            assert r.status == 200 and len(await r.read()) > 100_000
        async with http.get(f"{locked}/api/v1/models") as r:
            assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"


async def test_nothing_outside_the_static_folder(locked: str) -> None:
    async with aiohttp.ClientSession() as http:
        for path in ("/ui/../ui.py", "/ui/%2e%2e/ui.py", "/ui/..%2fui.py",
                     "/ui/js/../../ui.py", "/ui/no-such-file.js"):
            async with http.get(URL(f"{locked}{path}", encoded=True)) as r:  # sent as written
                assert r.status in (401, 403, 404), path  # 401: a path outside /ui/ is the API's
                assert "STATIC" not in await r.text()
