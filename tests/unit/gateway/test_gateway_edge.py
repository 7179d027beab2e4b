"""The gateway's edge rules (pure): header bytes that are not text, numbers JSON cannot carry."""

from __future__ import annotations

import pytest

from shoal.services.gateway.auth.edge_rules import check_header_text
from shoal.services.gateway.json_body import load_json
from shoal.shared.errors import InvalidRequest


def _surrogated(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")  # how aiohttp hands header bytes over


def test_a_header_that_is_not_utf8_is_refused_by_name_without_its_value() -> None:
    check_header_text([("Host", "x"), ("baggage", "k=v"), ("X-Name", "é")])
    secret = "sk-shoal-abc"
    for name, value in (("baggage", _surrogated(b"k=\xff")),
                        ("Authorization", _surrogated(b"Bearer " + secret.encode() + b"\xfe"))):
        with pytest.raises(InvalidRequest) as err:
            check_header_text([("Host", "x"), (name, value)])
        assert err.value.param == name.lower() and err.value.code == "invalid_header"
        assert secret not in err.value.message and err.value.http_status == 400
    with pytest.raises(InvalidRequest) as err:
        check_header_text([(_surrogated(b"X-\xff"), "v")])
    assert err.value.param == "header"


@pytest.mark.parametrize("raw,param", [
    (b'{"repetition_penalty": 1e309}', "repetition_penalty"),
    (b'{"temperature": NaN}', "temperature"),
    (b'{"a": {"b": [1, -Infinity]}}', "a.b.1"),
])
def test_a_number_that_is_not_finite_is_refused_naming_where(raw: bytes, param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        load_json(raw)
    assert err.value.param == param and "finite" in err.value.message


def test_finite_numbers_pass() -> None:
    assert load_json(b'{"temperature": 1.7976931348623157e308, "n": 1e3}')["n"] == 1000.0


def test_host_names_and_the_allowlist() -> None:
    from shoal.services.gateway.auth.edge_rules import check_host, host_name

    assert host_name("Gateway.:8000") == "gateway" and host_name("[::1]:80") == "::1"
    assert host_name("localhost") == "localhost" and host_name("fe80::1") == "fe80::1"
    allowed = frozenset({"localhost", "gateway"})
    for ok in ("localhost:8000", "GATEWAY", "127.0.0.1:8000", "10.1.2.3", "[::1]:8000", None):
        check_host(ok, allowed)  # names allowed, any IP address, no Host at all
    for bad in ("rebound.test:8000", "localhost.evil.com", "127.0.0.1.nip.io", "2130706433"):
        with pytest.raises(InvalidRequest) as err:
            check_host(bad, allowed)
        assert err.value.code == "host_not_allowed" and err.value.http_status == 400
        assert "SHOAL_GATEWAY_ALLOWED_HOSTS" in err.value.message
    check_host("anything.example", frozenset({"*"}))


@pytest.mark.parametrize("method,path,site,origin,refused", [
    ("POST", "/api/v1/models", "cross-site", None, True),
    ("POST", "/api/v1/models", "same-site", None, True),  # another port: another origin
    ("GET", "/api/v1/keys", "cross-site", None, True),  # the management API's data
    ("POST", "/v1/chat/completions", "cross-site", None, True),  # changes something
    ("POST", "/api/v1/models", "same-origin", "http://h:8000", False),  # the dashboard
    ("GET", "/api/v1/models", "none", None, False),  # a URL typed in
    ("GET", "/v1/models", "cross-site", None, False),  # safe, and not management
    ("POST", "/api/v1/models", None, "http://evil.example", True),  # a browser without
    ("POST", "/api/v1/models", None, "null", True),  # Sec-Fetch-* (older ones)
    ("POST", "/api/v1/models", None, "http://h:8000", False),
    ("POST", "/api/v1/models", None, None, False),  # curl, SDKs
])
def test_cross_origin_requests(method: str, path: str, site: str | None, origin: str | None,
                               refused: bool) -> None:
    from shoal.services.gateway.auth.edge_rules import check_origin
    from shoal.shared.errors import Forbidden

    if not refused:
        check_origin(method, path, site, origin, "h:8000")
        return
    with pytest.raises(Forbidden) as err:
        check_origin(method, path, site, origin, "h:8000")
    assert err.value.code == "cross_origin" and err.value.http_status == 403


def test_the_default_allowed_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from shoal.services.gateway.auth.edge import allowed_hosts
    from shoal.shared.config import Settings

    monkeypatch.setattr(socket, "gethostname", lambda: "Box")
    monkeypatch.setattr(socket, "getfqdn", lambda: "box.lan.")
    names = allowed_hosts(Settings(gateway_host="0.0.0.0",
                                   gateway_allowed_hosts=" gateway, Api.Example.COM "))
    assert {"localhost", "box", "box.lan", "gateway", "api.example.com"} <= names
