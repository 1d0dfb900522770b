"""Stored responses (`store: true`): what GET /v1/responses/{id} returns and what a
`previous_response_id` continues.

A record keeps the Response object, the conversation it ended (its input and history as chat
messages, its own output included) and the exact token ids of its prompt and output, from which
a chained response's prompt continues, so the KV its chain keeps pinned covers the history.
Records are bounded like sessions: at most `max_per_tenant` per tenant and `max_total` in all
(least recently used evicted first), and dropped after `idle_s` without use. A tenant sees
only its own records.

Each chain (a first response and every response continuing it) keeps one KV pin, named by the
chain; the store remembers which record is the chain's latest, whose removal (DELETE, eviction,
expiry) releases that pin through `release_pin`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from compat.request_types import ChatMessage
from compat.responses_types import Response


@dataclass
class StoredResponse:
    response: Response
    tenant: str
    chain: str  # the KV session its chain pins under
    messages: list[ChatMessage]  # the conversation, instructions excluded, output included
    token_ids: list[int]  # prompt then output, as the next turn's prompt begins
    render_key: str  # instructions and tools: a continuation renders alike only with the same
    input_items: list[dict[str, Any]] = field(default_factory=list)
    last_used: float = field(default_factory=time.monotonic)

    @property
    def id(self) -> str:
        return self.response.id


class ResponseStore:
    def __init__(
        self,
        max_per_tenant: int,
        max_total: int,
        idle_s: float,
        release_pin: Callable[[str, str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_per_tenant = max_per_tenant
        self.max_total = max_total
        self.idle_s = idle_s
        self._release_pin = release_pin  # (tenant, chain): the chain's KV pin goes
        self._clock = clock
        self._records: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()  # LRU first
        self._counts: dict[str, int] = {}
        self._latest: dict[tuple[str, str], str] = {}  # (tenant, chain) -> its latest record

    def __len__(self) -> int:
        return len(self._records)

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's record, now most recently used; None when unknown, expired or another
        tenant's."""
        self._expire()
        record = self._records.get((tenant, response_id))
        if record is not None:
            record.last_used = self._clock()
            self._records.move_to_end((tenant, response_id))
        return record

    def put(self, record: StoredResponse) -> None:
        """Store a record as its chain's latest; the tenant's least recently used go past
        its quota."""
        self._expire()
        key = (record.tenant, record.id)
        record.last_used = self._clock()
        self._records[key] = record
        self._counts[record.tenant] = self._counts.get(record.tenant, 0) + 1
        self._latest[(record.tenant, record.chain)] = record.id
        if self._counts[record.tenant] > self.max_per_tenant:
            oldest = next(k for k in self._records if k[0] == record.tenant)
            self._remove(oldest)
        while len(self._records) > self.max_total:
            self._remove(next(iter(self._records)))

    def delete(self, tenant: str, response_id: str) -> bool:
        self._expire()
        if (tenant, response_id) not in self._records:
            return False
        self._remove((tenant, response_id))
        return True

    def _expire(self) -> None:
        before = self._clock() - self.idle_s
        while self._records:
            key, record = next(iter(self._records.items()))
            if record.last_used >= before:
                break
            self._remove(key)

    def _remove(self, key: tuple[str, str]) -> None:
        record = self._records.pop(key)
        self._counts[record.tenant] -= 1
        if not self._counts[record.tenant]:
            del self._counts[record.tenant]
        chain = (record.tenant, record.chain)
        if self._latest.get(chain) == record.id:
            del self._latest[chain]
            self._release_pin(record.tenant, record.chain)
