"""What a gateway says about itself on the bus (shoal.<ns>.gateway.info)."""

from __future__ import annotations

from shoal.shared.schemas.common import Wire


class GatewayInfo(Wire):
    address: str
    """host:port where the gateway listens, as it advertises its /metrics."""
    keys_required: bool
    """SHOAL_REQUIRE_API_KEY or a fixed key (vLLM's --api-key): requests without a key get 401."""
