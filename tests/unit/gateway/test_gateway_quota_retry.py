"""The gateway's usage records outlive a registry outage: retried with back-off for as long as
keys are served from their last verification (auth/keys.py), lost (and said so) only after that."""

from __future__ import annotations

from shoal.services.gateway.auth.quota import Quota, Ticket
from shoal.shared.errors import Timeout, Unavailable
from shoal.shared.schemas.infer import Usage
from shoal.shared.schemas.registry import UsageRecord


class _Registry:
    """Refuses `failures` records (the database away), then takes them."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.recorded: list[UsageRecord] = []

    async def record_usage(self, record: UsageRecord) -> None:
        if self.failures:
            self.failures -= 1
            raise Unavailable("the database is unavailable")
        self.recorded.append(record)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds


async def test_a_record_waits_out_a_long_outage() -> None:
    clock, registry = _Clock(), _Registry(failures=40)  # about 6 minutes of back-off
    quota = Quota(registry, clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]
    quota.record(Ticket("k1", "m"), Usage(prompt_tokens=3, completion_tokens=5))
    await quota.drain()
    assert [(r.key_id, r.prompt_tokens, r.output_tokens) for r in registry.recorded] == [
        ("k1", 3, 5)]
    assert 300 < clock.now < 600


async def test_a_record_is_given_up_after_the_retry_window() -> None:
    clock, registry = _Clock(), _Registry(failures=1000)
    quota = Quota(registry, retry_s=60, clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]
    quota.record(Ticket("k1", "m"), None)
    await quota.drain()
    assert registry.recorded == [] and clock.now <= 60


class _SlowRegistry(_Registry):
    """Commits each record, but the first reply is lost (the bus request timed out)."""

    async def record_usage(self, record: UsageRecord) -> None:
        self.recorded.append(record)
        if self.failures:
            self.failures -= 1
            raise Timeout("no reply from the registry in time")


async def test_a_retry_carries_the_batch_id_of_its_first_attempt() -> None:
    clock, registry = _Clock(), _SlowRegistry(failures=1)
    quota = Quota(registry, clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]
    quota.record(Ticket("k1", "m", has_limits=True), Usage(prompt_tokens=3, completion_tokens=5))
    quota.record(Ticket("k2", "m"), Usage(prompt_tokens=1, completion_tokens=1))
    await quota.drain()
    ids = [r.batch_id for r in registry.recorded]
    assert len(ids) == 3 and all(ids)
    assert ids[0] == ids[1] != ids[2]  # the retry reuses the id; another record has its own
