"""Which idle tenants' state to retire, so per-tenant state stays bounded whatever clients send.

Without API keys the tenant is the client's `user` field, so a client can name a new tenant on
every request. The scheduler keeps per-tenant state (the policy's counter, the service ledger);
the tenants with a request in flight are bounded by the queue and the batch, and the idle ones
are bounded here: a tenant whose last request finished is retired `idle_s` seconds later, or
earlier, least recently active first, while more than `max_idle` tenants are idle.

Retiring forgets a tenant's counter and service. Under vtc that is what the counter lift does
anyway for a tenant that comes back: it starts no lower than the least served tenant queued.
"""

from __future__ import annotations

from collections import OrderedDict


class IdleTenants:
    """Tenants with no request in flight, least recently active first."""

    def __init__(self, idle_s: float | None, max_idle: int | None) -> None:
        self.idle_s = idle_s
        self.max_idle = max_idle
        self._since: OrderedDict[str, float] = OrderedDict()  # tenant -> when it went idle

    def __len__(self) -> int:
        return len(self._since)

    def busy(self, tenant: str) -> None:
        """The tenant has a request in flight again: not a candidate for retirement."""
        self._since.pop(tenant, None)

    def idle(self, tenant: str, now: float) -> None:
        """The tenant's last request in flight finished at `now`."""
        self._since[tenant] = now
        self._since.move_to_end(tenant)

    def expired(self, now: float) -> list[str]:
        """Remove and return the tenants to retire now: idle for `idle_s`, or the least
        recently active beyond `max_idle`."""
        retired = []
        while self._since:
            tenant, since = next(iter(self._since.items()))
            too_many = self.max_idle is not None and len(self._since) > self.max_idle
            too_old = self.idle_s is not None and now - since >= self.idle_s
            if not (too_many or too_old):
                break
            del self._since[tenant]
            retired.append(tenant)
        return retired
