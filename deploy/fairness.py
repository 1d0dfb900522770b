"""VTC across replicas: each replica's counters also count what the other replicas served.

Each replica schedules its own queue with VTC (engine/sched/policy.py). Alone, a replica sees
only its own service: a tenant served heavily on replica A looks unserved on replica B and
takes B's turns from a tenant that B is the only one serving. So every few tenths of a second
each replica tells one shared ledger (a one-replica Serve deployment, a Ray actor) the tokens it
served each tenant since its last exchange, and gets back what the other replicas served them
meanwhile, which it charges to its own counters (`Scheduler.charge_remote`). Counters thus
approximate the global service, lagging by one exchange; the per-replica service ledger
(/api/metrics) stays local, and summing it over replicas gives the global service.

Tenants are not pinned to replicas instead (see deploy/routing.py): that would confine a
tenant, and without API keys everyone (the `default` tenant), to one replica, and override the
session and prefix affinity that keeps caches warm.
"""

from __future__ import annotations

Usage = dict[str, tuple[int, int]]  # tenant -> (prompt tokens, output tokens)


def _add(into: Usage, usage: Usage) -> None:
    for tenant, (prompt, output) in usage.items():
        p, o = into.get(tenant, (0, 0))
        into[tenant] = (p + prompt, o + output)


class ServiceLedger:
    """What each replica has yet to be told: the service the others gave since its last
    exchange. A replica that has not exchanged for `stale_s` (gone) is dropped, so the ledger
    holds at most the tenants served within one exchange period per live replica."""

    def __init__(self, stale_s: float = 30.0) -> None:
        self.stale_s = stale_s
        self._owed: dict[str, Usage] = {}
        self._seen: dict[str, float] = {}

    def exchange(self, replica: str, served: Usage, now: float) -> Usage:
        """Record what `replica` served since its last exchange; return what the others
        served since then (nothing on its first exchange)."""
        for other, owed in self._owed.items():
            if other != replica:
                _add(owed, served)
        mine = self._owed.get(replica, {})
        self._owed[replica] = {}
        self._seen[replica] = now
        for gone in [r for r, seen in self._seen.items() if now - seen > self.stale_s]:
            del self._owed[gone], self._seen[gone]
        return mine


class ServedSince:
    """Per-tenant tokens served since the last call, from a scheduler's running totals."""

    def __init__(self) -> None:
        self._last: Usage = {}

    def delta(self, totals: Usage) -> Usage:
        out: Usage = {}
        for tenant, (prompt, output) in totals.items():
            p, o = self._last.get(tenant, (0, 0))
            if prompt < p or output < o:  # retired (idle) and back: its totals restarted
                p, o = 0, 0
            if (prompt, output) != (p, o):
                out[tenant] = (prompt - p, output - o)
        self._last = dict(totals)
        return out
