"""Chat with API keys through a Postgres outage: a real stack (registry, scheduler, a worker
running SmolLM2 in an engine process, the gateway requiring keys) on its own embedded Postgres,
which is SIGKILLed mid-test. Keys verified before the outage keep chatting past the key cache's
TTL (served from their last verification); a key never verified is refused; once Postgres is
back, keys are verified again."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from pathlib import Path

import openai
import pytest

from shoal.services.engine.model_prep import smollm2_gguf_path
from shoal.shared.embedded import EmbeddedPostgres, free_port
from shoal.shared.schemas.registry import ApiKeyCreate, ModelCreate
from tests.e2e.test_serving import running_instance
from tests.integration.conftest import make_settings, running_services

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
HI = [{"role": "user", "content": "Hi"}]


def sdk(url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


async def test_keys_chat_through_a_postgres_outage(servers, tmp_path: Path) -> None:
    pg = await asyncio.to_thread(EmbeddedPostgres.start, tmp_path / "pg" / "data")
    settings = make_settings(
        servers, tmp_path / "data", database_url=pg.url, namespace=f"ko{uuid.uuid4().hex[:8]}",
        heartbeat_timeout=30.0, require_api_key=True, gateway_key_cache_ttl=1.0,
        gateway_key_stale_max=120.0, gateway_port=free_port(None), scheduler_interval=1.0)
    try:
        async with running_services(settings, worker={"worker_name": "ko"}, gateway={},
                                    name="key-outage") as stack:
            client, url = stack.client, stack.url
            # the keys first: a key event that reaches the gateway while it verifies a key
            # keeps that verification out of its cache (auth/keys.py), so none may be in flight
            key = (await client.create_key(ApiKeyCreate(name="chatter"))).secret
            never_used = (await client.create_key(ApiKeyCreate(name="idle"))).secret
            model = await client.create_model(ModelCreate(
                name="smol", source=str(smollm2_gguf_path()), device="cpu", max_model_len=256,
                engine_args={"max_num_seqs": 2, "kv_cache_memory": 16 * 2**20}))
            await running_instance(client, model.id)
            # RUNNING: the gateway serves it at once
            await sdk(url, key).chat.completions.create(model="smol", messages=HI, max_tokens=2)
            with pytest.raises(openai.AuthenticationError):
                await sdk(url, "sk-not-a-key").models.list()

            os.kill(pg.process.pid, signal.SIGKILL)  # the outage
            await asyncio.to_thread(pg.process.wait)
            await asyncio.sleep(1.5)  # past the key cache's TTL
            started = time.monotonic()
            while time.monotonic() - started < 4:  # every chat in the outage answers
                answer = await sdk(url, key).chat.completions.create(
                    model="smol", messages=HI, max_tokens=3)
                assert answer.choices[0].message.content is not None
            with pytest.raises(openai.APIStatusError) as refused:  # never verified: refused
                await sdk(url, never_used).chat.completions.create(model="smol", messages=HI,
                                                                   max_tokens=2)
            assert refused.value.status_code == 503
            with pytest.raises(openai.APIStatusError) as bad:  # an invalid key stays refused:
                await sdk(url, "sk-not-a-key").models.list()  # 401 if its refusal is cached,
            assert bad.value.status_code in (401, 503)  # 503 if a key event dropped it

            pg = await asyncio.to_thread(EmbeddedPostgres.start, tmp_path / "pg" / "data")
            for _ in range(60):  # the registry reconnects; keys are verified again
                try:
                    await sdk(url, never_used).chat.completions.create(
                        model="smol", messages=HI, max_tokens=2)
                    break
                except openai.APIStatusError as exc:
                    assert exc.status_code == 503, exc
                    await asyncio.sleep(0.5)
            else:
                raise AssertionError("keys not verified again after Postgres came back")
    finally:
        pg.stop()
