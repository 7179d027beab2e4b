"""The gateway's edge rules (pure): header bytes that are not text, numbers JSON cannot carry."""

from __future__ import annotations

import pytest

from shoal.services.gateway.edge_rules import check_header_text
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
