"""Prefix caching: resume a request from the longest cached prefix of its prompt (:mod:`.prefix`)."""

from onnxgen.cache.prefix import Hit, PrefixCache, PrefixCacheStats, cache_costs

__all__ = ["Hit", "PrefixCache", "PrefixCacheStats", "cache_costs"]
