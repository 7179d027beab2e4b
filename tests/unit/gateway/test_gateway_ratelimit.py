"""OpenAI's rate-limit headers and 429 shapes from a quota grant, the tokens a request reserves,
and the CLI's --limit specs."""

from __future__ import annotations

import pytest

from shoal.cli import build_parser, main
from shoal.cli.commands import parse_limit
from shoal.services.gateway.errors import error_response
from shoal.services.gateway.auth.ratelimit import duration, ratelimit_headers, refusal
from shoal.services.gateway.auth.reservation import chat_tokens, prompt_tokens, reservation
from shoal.shared.errors import InvalidRequest
from shoal.shared.schemas.registry import MAX_LIMIT, ApiKeyCreate, KeyLimit, QuotaGrant


def test_durations_as_openai_writes_them() -> None:
    assert [duration(x) for x in (0.02, 0.9994, 1.0, 59.6, 60.0, 361.0)] == [
        "20ms", "999ms", "1s", "1m0s", "1m0s", "6m1s"]


def test_headers_only_for_the_limits_a_key_has() -> None:
    assert ratelimit_headers(QuotaGrant(allowed=True)) == {}
    grant = QuotaGrant(allowed=True, limit_requests=60, remaining_requests=59, reset_requests=1.5,
                       limit_tokens=1000, remaining_tokens=10, reset_tokens=30.2)
    assert ratelimit_headers(grant) == {
        "x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "2s", "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "10", "x-ratelimit-reset-tokens": "30s"}


def test_refusals_in_openai_shapes() -> None:
    rpm = QuotaGrant(allowed=False, code="rate_limit_exceeded", message="RPM", retry_after=12.2,
                     limit_requests=3, remaining_requests=0, reset_requests=12.2)
    response = error_response(refusal(rpm))
    assert response.status == 429 and response.headers["Retry-After"] == "13"
    assert response.headers["x-ratelimit-remaining-requests"] == "0"
    error = refusal(rpm).to_dict()
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    tpm = QuotaGrant(allowed=False, code="rate_limit_exceeded", retry_after=0.2,
                     limit_tokens=5, remaining_tokens=0, reset_tokens=0.2)
    assert refusal(tpm).to_dict()["type"] == "tokens"
    assert error_response(refusal(tpm)).headers["Retry-After"] == "1"
    budget = refusal(QuotaGrant(allowed=False, code="insufficient_quota", message="spent"))
    assert (budget.type, budget.code) == ("insufficient_quota", "insufficient_quota")
    assert "Retry-After" not in error_response(budget).headers


def test_cli_limit_specs() -> None:
    assert parse_limit("rpm=60, tpm=1000") == KeyLimit(rpm=60, tpm=1000)
    assert parse_limit("model=smol,token_budget=5") == KeyLimit(model="smol", token_budget=5)
    for bad in ("rpm", "rpm=1,foo=2", "model=x"):
        with pytest.raises((InvalidRequest, ValueError)):
            parse_limit(bad)
    args = build_parser().parse_args(["keys", "create", "app", "--scope", "inference",
                                      "--limit", "rpm=1", "--limit", "model=m,tpm=2"])
    assert args.scope == "inference" and args.limit == ["rpm=1", "model=m,tpm=2"]
    args = build_parser().parse_args(["keys", "usage", "--key", "app", "--since", "2026-11-01"])
    assert (args.key, args.since, args.model) == ("app", "2026-11-01", None)
    with pytest.raises(ValueError):  # one limit per model
        ApiKeyCreate(name="a", limits=[KeyLimit(rpm=1), KeyLimit(tpm=2)])


def test_keys_create_warns_only_about_gateways_that_do_not_require_keys() -> None:
    from shoal.cli.commands import open_gateways_warning
    from shoal.shared.schemas.gateway import GatewayInfo

    locked = GatewayInfo(address="10.0.0.1:8000", keys_required=True)
    assert open_gateways_warning([]) is None and open_gateways_warning([locked]) is None
    warning = open_gateways_warning([locked, GatewayInfo(address="h:8000", keys_required=False)])
    assert warning is not None and "h:8000" in warning and "10.0.0.1" not in warning
    assert "SHOAL_REQUIRE_API_KEY=true" in warning


def test_a_budget_has_token_headers_but_no_reset() -> None:
    grant = QuotaGrant(allowed=True, limit_tokens=1000, remaining_tokens=890)
    assert ratelimit_headers(grant) == {"x-ratelimit-limit-tokens": "1000",
                                        "x-ratelimit-remaining-tokens": "890"}


def test_limits_beyond_the_counters_are_refused_by_the_cli(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`shoal keys create|update --limit rpm=1e20` was accepted (then every request of the key
    failed): exit 2 naming the field and the bound, before anything is sent."""
    assert parse_limit(f"rpm={MAX_LIMIT}") == KeyLimit(rpm=MAX_LIMIT)
    for argv in (["keys", "create", "app", "--limit", "rpm=100000000000000000000"],
                 ["keys", "update", "app", "--limit", f"model=m,token_budget={MAX_LIMIT + 1}"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert ("rpm" in err or "token_budget" in err) and f"{MAX_LIMIT:,}".replace(
            ",", "") in err.replace(",", "").replace("_", ""), err


def test_a_reservation_is_the_most_a_request_can_spend() -> None:
    """Per prompt: its tokens (ids exact, text one per 4 bytes) plus n x its output, capped by
    max_tokens and by what the context leaves."""
    assert prompt_tokens([1, 2, 3]) == 3 and prompt_tokens("abcde") == 2
    assert prompt_tokens("é" * 4) == 2  # bytes, not characters
    assert reservation([3] * 20, 8, 64, 2048) == 20 * (3 + 8 * 64)
    assert reservation([100], 2, None, 512) == 100 + 2 * 412
    assert reservation([100], 1, 10**9, 512) == 100 + 412  # the context caps max_tokens
    assert reservation([600], 1, 5, 512) == 600  # too long: the engine refuses it
    assert reservation([7], 1, None, None) == 7 + 16  # nothing known: vLLM's default
    assert chat_tokens(["hello", ""]) == (2 + 4) + (0 + 4)
    assert chat_tokens(["hello"], template_tokens=30) == 30 + 2 + 4
