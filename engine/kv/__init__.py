"""KV memory: refcounted block pools, per-sequence block tables, the prefix cache (radix
tree + exact-match index) and per-session eviction policies."""

from engine.kv.eviction import EVICTION_POLICIES
from engine.kv.manager import KVCacheManager

__all__ = ["EVICTION_POLICIES", "KVCacheManager"]
