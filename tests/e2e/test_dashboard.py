"""The dashboard in a real browser (Debian's Chromium driven by Playwright; no browser is ever
downloaded) against a real stack that requires API keys: the key prompt, a READY worker, the
deploy form with its dry run, SmolLM2 RUNNING, a streamed chat and completion in the playground
whose "view code" Python runs as shown, a reasoning model's reasoning folded above its answer, a
cross-encoder's ranking in the Rerank tab (its Python runs too), live metrics, a key created and
revoked, the model deleted; at 1280 px and at phone width, and with the keyboard alone where a
person would use it.

One stack for the whole module (the form's model, plus the reasoning and rerank ones by API);
screenshots go to test-output/dashboard/.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import urlparse

import aiohttp
import pytest

from shoal.services.engine import smollm2_gguf_path
from shoal.shared.embedded import free_port
from shoal.shared.schemas.registry import ApiKeyCreate, ApiKeyScope
from tests.integration.conftest import make_settings, running_services
from tests.integration.sched_helpers import delete_models
from tests.tiny_models import save_tiny_cross_encoder

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]
RUNNING_TIMEOUT_MS = 300_000
ANSWER_TIMEOUT_MS = 120_000  # a few dozen tokens; generous, since the machine may be shared
PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1280, "height": 900}


def chromium() -> str:
    path = os.environ.get("SHOAL_CHROMIUM") or shutil.which("chromium")
    if not path:
        pytest.fail("the dashboard tests need Debian's Chromium: `apt-get install chromium` "
                    "(.ci/run and `make test` install it when they can)")
    return path


@pytest.fixture(scope="module")
def shots(request: pytest.FixtureRequest) -> Path:
    out = Path(os.environ.get("SHOAL_TEST_OUTPUT", request.config.rootpath / "test-output"))
    folder = out / "dashboard"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
async def stack(servers, tmp_path_factory):
    """Registry, scheduler, a real worker (labelled, so the form pins the model to it) and a
    gateway with SHOAL_REQUIRE_API_KEY=true; yields (url, admin key secret, worker name, client)."""
    tag = uuid.uuid4().hex[:6]
    settings = make_settings(servers, tmp_path_factory.mktemp("dashboard-e2e"),
                             heartbeat_interval=1.0, heartbeat_timeout=10.0, drain_timeout=2.0,
                             gateway_port=free_port(None), scheduler_interval=1.0,
                             require_api_key=True, gateway_key_cache_ttl=0.2,
                             gateway_engine_dead_after=10.0)  # tolerant of a loaded machine
    worker = f"ui-{tag}"
    async with running_services(settings, worker={"worker_name": worker,
                                                  "worker_labels": {"ui": tag}},
                                gateway={}, name="dashboard-e2e") as stack:
        client = stack.client
        admin = await client.create_key(ApiKeyCreate(name=f"admin-{tag}",
                                                     scope=ApiKeyScope.ADMIN))
        try:
            yield stack.url, admin.secret, worker, client
        finally:  # a failed run must not leave its models to the next modules' schedulers
            await delete_models(client, tag)


@pytest.fixture(scope="module")
async def browser(tmp_path_factory):
    from playwright.async_api import async_playwright

    profile = tmp_path_factory.mktemp("chromium-profile")
    async with async_playwright() as pw:
        context = await pw.chromium.launch_persistent_context(
            str(profile), executable_path=chromium(), args=CHROMIUM_FLAGS, headless=True,
            viewport=DESKTOP)
        try:
            yield context
        finally:
            await context.close()


class Watch:
    """What the page did that it should not: console errors (CSP refusals among them), uncaught
    exceptions, and any request to a host other than the gateway."""

    def __init__(self, page, url: str) -> None:
        self.problems: list[str] = []
        host = urlparse(url).netloc
        def console(m) -> None:  # noqa: ANN001 - playwright's ConsoleMessage
            if m.type == "error":
                self.problems.append(f"console: {m.text}")

        def request(r) -> None:  # noqa: ANN001 - playwright's Request
            if urlparse(r.url).scheme in ("http", "https") and urlparse(r.url).netloc != host:
                self.problems.append(f"left: {r.url}")

        page.on("console", console)
        page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        page.on("request", request)

    def expected(self, status: int) -> None:
        """Drop the console's note of a refusal the test asked for (the key-less 401s that
        bring up the key prompt, a 400 for a bad field)."""
        self.problems = [p for p in self.problems if f"status of {status}" not in p]


async def tab_to(page, js_test: str, limit: int = 60) -> None:
    """Press Tab until the focused element passes `js_test` (a function of `el`)."""
    for _ in range(limit):
        await page.keyboard.press("Tab")
        if await page.evaluate(f"(el => {js_test})(document.activeElement)"):
            return
    raise AssertionError(f"{js_test} never got the focus with Tab")


async def no_sideways_scroll(page) -> None:
    width = await page.evaluate("document.documentElement.scrollWidth")
    assert width <= PHONE["width"] + 1, f"the page is {width}px wide at phone width"


async def deploy_by_api(url: str, admin_key: str, worker: str, name: str, source: str,
                        engine_args: dict[str, object]) -> None:
    """A model deployed beside the form's (the playground's reasoning and rerank models),
    loading while the test goes on."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {admin_key}"}) as http:
        async with http.post(f"{url}/api/v1/models", json={
                "name": name, "source": source, "device": "cpu", "max_model_len": 512,
                "worker_selector": {"ui": worker[3:]},
                "engine_args": {"num_threads": 1, **engine_args}}) as r:
            assert r.status == 201, await r.text()


async def test_dashboard_end_to_end(stack, browser, shots: Path, tmp_path: Path) -> None:
    from playwright.async_api import expect

    url, admin_key, worker, client = stack
    tag = worker[3:]
    # SmolLM2 under DeepSeek-R1's parser: with no </think>, its whole answer is reasoning
    await deploy_by_api(url, admin_key, worker, f"think-{tag}", str(smollm2_gguf_path()),
                        {"reasoning_parser": "deepseek_r1", "max_num_seqs": 4,
                         "kv_cache_memory": 32 * 2**20})
    reranker = save_tiny_cross_encoder(tmp_path / "cross-encoder")
    await deploy_by_api(url, admin_key, worker, f"rerank-{tag}", str(reranker), {})
    page = await browser.new_page()
    watch = Watch(page, url)

    # -- the key prompt, answered with the keyboard alone
    await page.goto(f"{url}/")
    dialog = page.locator("#key-dialog")
    await expect(dialog).to_be_visible()
    await expect(dialog.locator(".reason")).to_contain_text("API key")
    await page.keyboard.type(admin_key)
    await page.keyboard.press("Enter")
    await expect(dialog).to_be_hidden()
    await expect(page.locator("#key-status")).to_contain_text(f"Key {admin_key[:12]}")
    watch.expected(401)

    # -- cluster: our worker READY, with its devices and labels
    card = page.locator(f"article[data-worker='{worker}']")
    await expect(card.locator(".badge").first).to_have_text("READY")
    await expect(card).to_contain_text("CPU ·")
    await expect(card).to_contain_text(f"ui={worker[3:]}")
    await expect(card.get_by_role("meter", name="Memory")).to_be_visible()
    await page.screenshot(path=shots / "cluster.png")

    # -- models: Tab to the section link (a visible focus ring), Enter, then the deploy form
    await tab_to(page, "el.dataset.view === 'models'")
    outline = await page.evaluate("getComputedStyle(document.activeElement).outlineStyle")
    assert outline != "none"
    await page.keyboard.press("Enter")
    await expect(page.get_by_role("heading", name="Models", level=1)).to_be_focused()
    await page.get_by_role("button", name="Deploy a model").click()
    form = page.get_by_role("form", name="Deploy a model")
    name = f"smol-{worker[3:]}"
    await form.get_by_label("Name").fill(name)
    await form.get_by_label("Source").fill(str(smollm2_gguf_path()))
    await form.get_by_label("Device").select_option("cpu")
    await form.get_by_label("Max model length").fill("512")
    await form.get_by_text("Placement", exact=True).click()
    await form.get_by_label("Worker selector").fill(f"ui={worker[3:]}")
    await form.get_by_text("Engine", exact=True).click()
    await form.get_by_label("Max num seqs").fill("8")
    await form.get_by_label("KV cache memory (bytes)").fill(str(64 * 2**20))

    # a bad value is refused by the server and marked on its field
    await form.get_by_label("Replicas").fill("-1")
    await form.get_by_role("button", name="Preview placement").click()
    await expect(form.get_by_role("alert")).to_contain_text("replicas")
    await expect(form.get_by_label("Replicas")).to_have_attribute("aria-invalid", "true")
    await form.get_by_label("Replicas").fill("1")
    # the backend's fields (README "Backends"): a flag Shoal computes is refused, named
    await form.locator("summary", has_text="Backend").click()
    await form.get_by_label("Backend", exact=True).select_option("vllm")
    # one flag per line: a value may hold commas (JSON), which must reach the server whole
    spec = '--speculative-config={"method":"ngram","num_speculative_tokens":2}'
    await form.get_by_label("Backend parameters (raw flags)").fill(f"{spec}\n--port 9")
    async with page.expect_request(lambda r: "dry_run=true" in r.url) as asked:
        await form.get_by_role("button", name="Preview placement").click()
    sent = json.loads((await asked.value).post_data)
    assert sent["backend_parameters"] == [spec, "--port 9"], sent
    await expect(form.get_by_role("alert")).to_contain_text("--port is computed by Shoal")
    await expect(form.get_by_label("Backend parameters (raw flags)")).to_have_attribute(
        "aria-invalid", "true")
    await form.get_by_label("Backend parameters (raw flags)").fill("")
    await form.get_by_label("Backend", exact=True).select_option("shoal")
    watch.expected(400)

    # on GPUs it cannot fit (a CPU worker): the preview says why, and so does the instance,
    # PENDING with the scheduler's reason
    await form.get_by_label("Name").fill(f"nofit-{worker[3:]}")
    await form.get_by_label("Device").select_option("gpu")
    await form.get_by_role("button", name="Preview placement").click()
    no_fit = form.locator(".plan.no-fit")
    await expect(no_fit).to_contain_text("No placement.", timeout=60_000)  # reads the GGUF
    why = await no_fit.inner_text()
    await form.get_by_role("button", name="Deploy", exact=True).click()
    pending = page.locator(f"article[data-model='nofit-{worker[3:]}'] .instance")
    await expect(pending).to_have_attribute("data-state", "PENDING")
    await expect(pending.locator(".message")).to_contain_text("No eligible worker has a GPU",
                                                              timeout=30_000)
    assert (await pending.locator(".message").inner_text()) in why

    await page.get_by_role("button", name="Deploy a model").click()
    await form.get_by_label("Name").fill(name)
    await form.get_by_label("Device").select_option("cpu")
    await form.get_by_role("button", name="Preview placement").click()
    plan = form.locator(".plan.fits")
    await expect(plan).to_contain_text(f"Fits on {worker}")
    await expect(plan).to_contain_text("RAM")
    assert name not in {m.name for m in await client.list_models()}  # the dry run wrote nothing
    await form.evaluate("f => f.querySelectorAll('details').forEach(d => { d.open = false; })")
    await page.screenshot(path=shots / "deploy-preview.png", full_page=True)
    await form.get_by_role("button", name="Deploy", exact=True).click()

    model_card = page.locator(f"article[data-model='{name}']")
    await expect(model_card).to_be_visible()
    await expect(model_card.locator(".instance[data-state='RUNNING']")).to_have_count(
        1, timeout=RUNNING_TIMEOUT_MS)
    await expect(model_card).to_contain_text(f"{worker} · CPU · tp 1 · pp 1")
    await page.screenshot(path=shots / "models.png")

    # -- playground: keyboard to the section, the message sent with Enter, the answer streamed
    await page.evaluate("document.activeElement.blur()")  # the next Tab starts at the top
    await tab_to(page, "el.dataset.view === 'playground'")
    await page.keyboard.press("Enter")
    view = page.locator("main > section:not([hidden])")
    await expect(view.locator(f"option[value='{name}']")).to_have_count(1)
    await view.get_by_label("Model", exact=True).select_option(name)
    await view.get_by_label("Temperature").fill("0")
    await view.get_by_label("Max tokens").fill("16")
    message = page.get_by_role("textbox", name="Message")
    await message.fill("What is the capital of France?")
    await page.get_by_role("button", name="View code").first.click()
    code = page.locator("#code-panel")
    snippet = await code.get_by_label("Python (openai) code").inner_text()
    curl = await code.get_by_label("curl code").inner_text()
    body = json.loads(curl.split(" -d '", 1)[1].rsplit("'", 1)[0])
    assert body["messages"] == [{"role": "user", "content": "What is the capital of France?"}]
    assert body["stream"] is True and body["temperature"] == 0 and body["max_tokens"] == 16
    await page.evaluate("""() => {  // every length the answer had while it arrived
        window.__lengths = new Set();
        new MutationObserver(() => {
            const answer = document.querySelector('.msg.assistant:last-child p');
            if (answer) window.__lengths.add(answer.textContent.length);
        }).observe(document.querySelector('.chat-log'),
                   {subtree: true, characterData: true, childList: true});
    }""")
    await message.focus()
    await page.keyboard.press("Enter")
    answer = page.locator(".msg.assistant").last
    await expect(answer.locator(".stats")).to_contain_text("completion tokens",
                                                           timeout=ANSWER_TIMEOUT_MS)
    await expect(answer.locator(".stats")).to_contain_text("TTFT")
    await expect(answer.locator(".stats")).to_contain_text("tok/s")
    text = await answer.locator("p").first.inner_text()
    assert "Paris" in text
    lengths = await page.evaluate("[...window.__lengths]")
    assert len([n for n in lengths if 0 < n < len(text)]) >= 2, f"not streamed: {lengths}"
    await page.screenshot(path=shots / "playground.png")

    # the Python shown under "view code" runs as shown and gives the same greedy answer
    ran = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", snippet],
                                  capture_output=True, text=True, timeout=120,
                                  env={**os.environ, "SHOAL_API_KEY": admin_key})
    assert ran.returncode == 0, ran.stderr
    assert text.strip() in ran.stdout and "completion_tokens=" in ran.stdout

    # completions tab: the arrow keys move between tabs
    await page.get_by_role("tab", name="Chat").focus()
    await page.keyboard.press("ArrowRight")
    await expect(page.get_by_role("tab", name="Completions")).to_have_attribute(
        "aria-selected", "true")
    await view.get_by_label("Max tokens").fill("6")
    await page.get_by_role("textbox", name="Prompt").fill("The capital of France is")
    await page.get_by_role("button", name="Complete").click()
    await expect(page.locator("#panel-completions .stats")).to_contain_text(
        "6 completion tokens", timeout=ANSWER_TIMEOUT_MS)
    assert await page.locator("pre.completion .generated").count() >= 2

    # a reasoning model's reasoning: folded (closed) above the answer, opened by a click
    await page.get_by_role("tab", name="Chat").click()
    await expect(view.locator(f"option[value='think-{tag}']")).to_have_count(
        1, timeout=RUNNING_TIMEOUT_MS)
    await view.get_by_label("Model", exact=True).select_option(f"think-{tag}")
    await view.get_by_label("Max tokens").fill("8")
    await message.fill("Think about France.")
    await message.press("Enter")
    answer = page.locator(".msg.assistant").last
    await expect(answer.locator(".stats")).to_contain_text("completion tokens",
                                                           timeout=ANSWER_TIMEOUT_MS)
    folded = answer.locator("details.reasoning")
    await expect(folded).to_have_count(1)
    assert await folded.get_attribute("open") is None  # folded until a person opens it
    thought = folded.locator("p.reasoning")
    await expect(thought).to_be_hidden()
    await folded.locator("summary").click()
    await expect(thought).to_be_visible()
    assert (await thought.inner_text()).strip()
    await page.screenshot(path=shots / "playground-reasoning.png")

    # rerank tab (the arrow keys go on past Completions): a cross-encoder's documents, ranked
    await page.get_by_role("tab", name="Completions").focus()
    await page.keyboard.press("ArrowRight")
    await expect(page.get_by_role("tab", name="Rerank")).to_have_attribute(
        "aria-selected", "true")
    await expect(view.get_by_label("Temperature")).to_be_hidden()  # nothing sampled
    await expect(view.locator(f"option[value='rerank-{tag}']")).to_have_count(
        1, timeout=RUNNING_TIMEOUT_MS)
    await view.get_by_label("Model", exact=True).select_option(f"rerank-{tag}")
    docs = ["Paris is the capital of France.", "Bananas are yellow.", "France",
            "The Eiffel Tower is in Paris."]
    query = "What is the capital of France?"
    await page.get_by_role("textbox", name="Query").fill(query)
    await page.get_by_role("textbox", name="Documents").fill("\n".join(docs))
    await page.get_by_role("button", name="Rerank", exact=True).click()
    ranked = page.locator(".rerank-results .ranked")
    await expect(ranked).to_have_count(4, timeout=ANSWER_TIMEOUT_MS)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {admin_key}"}) as http:
        async with http.post(f"{url}/v1/rerank", json={"model": f"rerank-{tag}", "query": query,
                                                        "documents": docs}) as r:
            expected = [x["index"] for x in (await r.json())["results"]]
    assert [int(i) for i in await ranked.evaluate_all(
        "els => els.map(e => e.dataset.index)")] == expected
    await expect(page.locator("#panel-rerank .stats")).to_contain_text("prompt tokens")
    await page.screenshot(path=shots / "playground-rerank.png")
    view_code = page.get_by_role("button", name="View code")  # the visible panel's only
    if await view_code.get_attribute("aria-expanded") != "true":  # (still open from the chat)
        await view_code.click()
    snippet = await page.locator("#code-panel").get_by_label("Python (httpx) code").inner_text()
    ran = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", snippet],
                                  capture_output=True, text=True, timeout=120,
                                  env={**os.environ, "SHOAL_API_KEY": admin_key})
    assert ran.returncode == 0, ran.stderr
    assert [int(line.split()[0]) for line in ran.stdout.splitlines()] == expected

    # -- metrics, sampled in the background since the page loaded: the tokens generated above
    await page.wait_for_timeout(2500)  # one more sample after the last answer
    await page.get_by_role("link", name="Metrics").click()
    # this model's card: the session's database may still list engines of earlier modules
    metric = page.locator("article[data-engine]", has_text=name)
    await expect(metric).to_have_count(1)
    tps = metric.locator("figure", has_text="Tokens/s").locator("span.muted")
    max_tps = float((await tps.inner_text()).split()[-1])
    assert max_tps > 0
    await page.screenshot(path=shots / "metrics.png")

    # -- keys: create one (secret shown once, and it works), revoke it from the keyboard
    await page.get_by_role("link", name="API keys").click()
    await view.get_by_label("Name", exact=True).fill("ui-temp")
    await view.get_by_role("button", name="Create key").click()
    secret = await page.locator(".secret-value").inner_text()
    async with aiohttp.ClientSession() as http:
        async def status(key: str) -> int:
            async with http.get(f"{url}/v1/models",
                                headers={"Authorization": f"Bearer {key}"}) as r:
                return r.status

        assert await status(secret) == 200
        row = page.locator("tr[data-key='ui-temp']")
        await expect(row).to_contain_text("ACTIVE")
        await page.screenshot(path=shots / "keys.png")
        await row.get_by_role("button", name="Revoke ui-temp").focus()
        await page.keyboard.press("Enter")
        confirm = page.locator("#confirm-dialog")
        await expect(confirm).to_be_visible()
        await expect(confirm.get_by_role("button", name="Cancel")).to_be_focused()
        await page.keyboard.press("Tab")
        await expect(confirm.get_by_role("button", name="Revoke")).to_be_focused()
        await page.keyboard.press("Enter")
        await expect(row).to_contain_text("REVOKED")
        await expect(row.locator("th")).to_be_focused()  # the focus stays on the row
        await asyncio.sleep(0.5)  # the gateway's key cache (0.2 s here)
        assert await status(secret) == 401

    # -- phone width: every section fits the screen, nothing scrolls sideways
    await page.set_viewport_size(PHONE)
    for view in ("cluster", "models", "playground", "keys", "metrics"):
        await page.goto(f"{url}/ui/#/{view}")
        await expect(page.locator("section:not([hidden]) h1")).to_be_visible()
        await page.wait_for_timeout(300)
        await no_sideways_scroll(page)
        if view in ("cluster", "playground"):
            await page.screenshot(path=shots / f"phone-{view}.png", full_page=True)
    await page.set_viewport_size(DESKTOP)

    # -- delete both models, after confirming (Escape cancels first)
    await page.goto(f"{url}/ui/#/models")
    for model in (name, f"nofit-{worker[3:]}"):
        card = page.locator(f"article[data-model='{model}']")
        await card.get_by_role("button", name=f"Delete {model}").click()
        await page.keyboard.press("Escape")
        await expect(confirm).to_be_hidden()
        await expect(card.get_by_role("button", name=f"Delete {model}")).to_be_focused()
        await card.get_by_role("button", name=f"Delete {model}").click()
        await confirm.get_by_role("button", name="Delete").click()
        await expect(card).to_have_count(0)
    assert not {name, f"nofit-{worker[3:]}"} & {m.name for m in await client.list_models()}

    # -- the API docs: Swagger UI from the package, on /openapi.json
    await page.goto(f"{url}/docs")
    await expect(page.locator(".opblock").first).to_be_visible()
    assert await page.locator(".opblock").count() >= 20
    # "Try it out" carries the dashboard's key (Swagger UI's Authorize shows it as locked)
    await expect(page.locator("button.btn.authorize").first).to_have_class(re.compile(r"\blocked"))
    await page.screenshot(path=shots / "docs.png")

    assert watch.problems == []
