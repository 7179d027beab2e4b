"""What a request must be before anything reads it (pure; the middleware is edge.py): its headers
are text (UTF-8), so no library that encodes one again (the tracing propagator with `baggage`,
the key hash with `Authorization`) meets bytes it cannot write back.

aiohttp decodes header bytes as UTF-8 with `surrogateescape`: a byte that is not UTF-8 becomes a
lone surrogate (U+DC80-U+DCFF), which any later `.encode()` refuses. Such a header is a malformed
request, answered 400 naming the header and never echoing its value (it may hold a secret).
"""

from __future__ import annotations

from collections.abc import Iterable

from shoal.shared.errors import InvalidRequest


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_header_text(headers: Iterable[tuple[str, str]]) -> None:
    """InvalidRequest (400, code invalid_header, param the header's name in lower case) for the
    first header whose name or value holds bytes that are not UTF-8."""
    for name, value in headers:
        if not (_is_text(value) and _is_text(name)):
            shown = name.lower() if _is_text(name) else "header"
            raise InvalidRequest(f"the {shown} header holds bytes that are not UTF-8 text",
                                 param=shown, code="invalid_header")
