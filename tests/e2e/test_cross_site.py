"""Hostile web pages against a default stack (no API keys), in a real browser (Debian's Chromium
driven by Playwright, as tests/e2e/test_dashboard.py does): a page from another origin fires a
`no-cors` fetch with a Blob body (no Content-Type, so it needs no preflight) and a form POST at
the management API, and a page whose name is rebound to the gateway's address (DNS rebinding)
calls it "same-origin". Issue 24: the first one deployed a model. Nothing may be created; the
gateway's own dashboard keeps working. A registry and a gateway, no worker: a deploy only has
to write a row to count.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from shoal.shared.embedded import free_port
from shoal.shared.schemas.registry import DeleteRequest
from tests.e2e.test_dashboard import CHROMIUM_FLAGS, chromium
from tests.integration.conftest import make_settings, running_services

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
REBOUND = "rebound.test"
"""A name Chromium resolves to 127.0.0.1 (--host-resolver-rules), as an attacker's DNS would
once it rebinds."""
NO_PRIVATE_NETWORK_ACCESS = ("--disable-features=PrivateNetworkAccessSendPreflights,"
                             "PrivateNetworkAccessRespectPreflightResults,"
                             "BlockInsecurePrivateNetworkRequests,LocalNetworkAccessChecks")
"""Chromium alone refuses a public page's requests to a loopback address (Private Network
Access); Firefox and Safari do not, so the gateway must not rely on it: switched off here."""

ATTACK = """<!doctype html><meta charset="utf-8"><title>cat pictures</title>
<form id="f" method="POST" enctype="text/plain" action="{gw}/api/v1/models">
  <input name='{{"name": "{tag}-form", "source": "/x.gguf", "pad": "' value='"}}'>
</form>
<script>
window.attack = (async () => {{
  const deploy = (how) => JSON.stringify({{name: "{tag}-" + how, source: "/x.gguf"}});
  const results = {{}};
  // no Content-Type at all: a "simple" request, sent without asking the server first
  await fetch("{gw}/api/v1/models", {{method: "POST", mode: "no-cors",
                                      body: new Blob([deploy("blob")])}});
  await fetch("{gw}/api/v1/models", {{method: "POST", mode: "no-cors",
    headers: {{"Content-Type": "text/plain"}}, body: deploy("text")}});
  try {{  // a JSON request needs a CORS preflight first
    await fetch("{gw}/api/v1/models", {{method: "POST",
      headers: {{"Content-Type": "application/json"}}, body: deploy("cors")}});
    results.cors = "sent";
  }} catch (e) {{ results.cors = "blocked"; }}
  return results;
}})();
</script>"""

REBIND = """<!doctype html><meta charset="utf-8"><title>rebound</title>
<script>
window.attack = (async () => {{
  const resp = await fetch("/api/v1/models", {{method: "POST",
    headers: {{"Content-Type": "application/json"}},
    body: JSON.stringify({{name: "{tag}-rebound", source: "/x.gguf"}})}});
  return {{status: resp.status, body: await resp.text()}};
}})();
</script>"""


@pytest.fixture(scope="module")
async def gateway(servers, tmp_path_factory) -> AsyncIterator[tuple[str, object]]:
    settings = make_settings(servers, tmp_path_factory.mktemp("cross-site"),
                             gateway_port=free_port(None))
    async with running_services(settings, scheduler=False, gateway={},
                                name="cross-site-e2e") as stack:
        yield stack.url, stack.client


@pytest.fixture(scope="module")
async def browser(tmp_path_factory) -> AsyncIterator[object]:
    from playwright.async_api import async_playwright

    profile = tmp_path_factory.mktemp("chromium-cross-site")
    flags = [*CHROMIUM_FLAGS, f"--host-resolver-rules=MAP {REBOUND} 127.0.0.1",
             NO_PRIVATE_NETWORK_ACCESS]
    async with async_playwright() as pw:
        context = await pw.chromium.launch_persistent_context(
            str(profile), executable_path=chromium(), args=flags, headless=True)
        try:
            yield context
        finally:
            await context.close()


async def _attacker_site(html: str) -> tuple[web.AppRunner, int]:
    """Another origin on this machine (another port) serving `html`."""
    app = web.Application()
    app.router.add_get("/", lambda _r: web.Response(text=html, content_type="text/html"))
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port(None)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


async def _created(client, tag: str) -> list[str]:  # noqa: ANN001 - the registry client
    return [m.name for m in await client.list_models() if m.name.startswith(tag)]


@pytest.mark.parametrize("site_host", ["localhost", "127.0.0.1"])  # cross-site, same-site
async def test_a_page_from_another_origin_changes_nothing(gateway, browser,
                                                          site_host: str) -> None:
    url, client = gateway
    tag = f"xs-{uuid.uuid4().hex[:6]}"
    runner, port = await _attacker_site(ATTACK.format(gw=url, tag=tag))
    try:
        page = await browser.new_page()
        await page.goto(f"http://{site_host}:{port}/")
        results = await page.evaluate("window.attack")
        assert results["cors"] == "blocked"
        async with page.expect_navigation():
            await page.evaluate("document.getElementById('f').submit()")
        answer = await page.content()  # the form's answer, as the browser shows it
        assert "cross-origin" in answer or "Content-Type" in answer, answer
        await asyncio.sleep(0.5)
        assert await _created(client, tag) == []
        await page.close()
    finally:
        await runner.cleanup()
        for m in await client.list_models():
            if m.name.startswith(tag):
                await client.delete_model(DeleteRequest(id=m.id))


async def test_a_rebound_name_is_not_a_host_of_the_gateway(gateway, browser) -> None:
    """The page is the attacker's (fulfilled here) at http://rebound.test:<gateway port>/; its
    "same-origin" fetch then reaches the gateway with `Host: rebound.test:<port>`."""
    url, client = gateway
    tag = f"rb-{uuid.uuid4().hex[:6]}"
    port = url.rsplit(":", 1)[1]
    page = await browser.new_page()
    await page.route(f"http://{REBOUND}:{port}/attack", lambda route: route.fulfill(
        status=200, content_type="text/html", body=REBIND.format(tag=tag)))
    await page.goto(f"http://{REBOUND}:{port}/attack")
    result = await page.evaluate("window.attack")
    assert result["status"] == 400, result
    error = json.loads(result["body"])["error"]
    assert error["code"] == "host_not_allowed" and "SHOAL_GATEWAY_ALLOWED_HOSTS" in error["message"]
    assert await _created(client, tag) == []
    await page.close()


async def test_the_dashboard_itself_still_deploys(gateway, browser) -> None:
    """Same origin: the dashboard's own requests pass, and its API keys page says that this
    gateway does not require keys (issue 24 item 3)."""
    from playwright.async_api import expect

    url, client = gateway
    tag = f"ui-{uuid.uuid4().hex[:6]}"
    page = await browser.new_page()
    await page.goto(f"{url}/ui/")
    status = await page.evaluate("""async (name) => (await fetch("/api/v1/models", {
        method: "POST", headers: {"Content-Type": "application/json"},
        body: JSON.stringify({name, source: "/x.gguf", replicas: 0})})).status""", f"{tag}-ok")
    assert status == 201
    assert await _created(client, tag) == [f"{tag}-ok"]
    await page.get_by_role("link", name="API keys").click()
    await expect(page.locator("#keys-open-notice")).to_be_visible()
    await expect(page.locator("#keys-open-notice")).to_contain_text("does not require API keys")
    await page.close()
    async with aiohttp.ClientSession() as http:  # curl and SDKs send no Origin: unaffected
        async with http.delete(f"{url}/api/v1/models/{tag}-ok") as r:
            assert r.status == 200
