"""What a request must be before anything reads it (pure; the middleware is edge.py):

- its headers are text (UTF-8), so no library that encodes one again (the tracing propagator
  with `baggage`, the key hash with `Authorization`) meets bytes it cannot write back. aiohttp
  decodes header bytes as UTF-8 with `surrogateescape`: a byte that is not UTF-8 becomes a lone
  surrogate, which any later `.encode()` refuses. 400 naming the header, never its value;
- its Host names this gateway (DNS rebinding: a page whose name the attacker's DNS points at
  127.0.0.1 calls the gateway "same-origin", with `Host: <that name>`). An IP address is always
  one (a page reaches an address literal only by loading from it, so it cannot rebind); a name
  must be allowed (edge.allowed_hosts). 400 otherwise;
- a browser's request from another origin does not reach the management API or change
  anything: `Sec-Fetch-Site` other than same-origin or none (a typed URL), or else an `Origin`
  that is not the request's own host, is a 403 there. Requests without either header (curl,
  SDKs: not browsers) pass. Only same-origin, not same-site: another port on the same host is
  another origin of the same site.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

from shoal.shared.errors import Forbidden, InvalidRequest

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
GUARDED_PREFIX = "/api/v1/"
"""The management API: every method is refused cross-origin (safe ones too: its data)."""
OWN_SITES = frozenset({"same-origin", "none"})
ANY_HOST = "*"


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


def host_name(header: str) -> str:
    """The name in a Host header: lower case, without its port or a final dot
    ("[::1]:8000" -> "::1", "Gateway.:80" -> "gateway")."""
    value = header.strip().lower()
    if value.startswith("["):
        return value[1:].partition("]")[0]
    if value.count(":") == 1:
        value = value.partition(":")[0]
    return value.rstrip(".")


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def check_host(header: str | None, allowed: frozenset[str]) -> None:
    """InvalidRequest (400, code host_not_allowed) unless the Host header is an IP address or
    a name in `allowed` ("*": any). No Host at all (HTTP/1.0, no browser) passes."""
    if header is None or ANY_HOST in allowed:
        return
    name = host_name(header)
    if _is_address(name) or name in allowed:
        return
    raise InvalidRequest(f"Host not allowed: {name[:100]!r}; add it to "
                         "SHOAL_GATEWAY_ALLOWED_HOSTS (the names this gateway is reached by, "
                         "comma separated; * for any)", param="host", code="host_not_allowed")


def check_origin(method: str, path: str, fetch_site: str | None, origin: str | None,
                 host: str | None) -> None:
    """Forbidden (403, code cross_origin) for a browser's request from another origin to the
    management API, or one that may change something (any method but GET, HEAD, OPTIONS)."""
    if method.upper() in SAFE_METHODS and not path.startswith(GUARDED_PREFIX):
        return
    if fetch_site is not None:
        if fetch_site.strip().lower() in OWN_SITES:
            return
        seen = f"Sec-Fetch-Site: {fetch_site[:40]}"
    elif origin is not None:
        if origin != "null" and host is not None and \
                urlsplit(origin.strip()).netloc.lower() == host.strip().lower():
            return
        seen = f"Origin: {origin[:100]}"
    else:
        return
    raise Forbidden(f"cross-origin request refused ({seen}): the management API, and any "
                    "request that changes something, answer only this gateway's own pages and "
                    "clients that are not browsers", code="cross_origin")
