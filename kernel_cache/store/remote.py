"""The shared remote tiers (Redis, S3) as one kind of thing for their callers.

Each remote's settings model (:class:`~kernel_cache.store.redis.RedisSettings`,
:class:`~kernel_cache.store.s3.S3Settings`) carries a ``kind`` and makes its tier
(``settings.tier()``); warmup sends the settings to its workers as JSON and
:func:`settings_from_json` makes them again. A remote's client package is
imported only when its URL is set.
"""

from __future__ import annotations

from collections.abc import Mapping

from kernel_cache.config import settings as env_settings
from kernel_cache.store.disk_tier import Tier


def settings_from_json(text: str):
    """The remote settings model (Redis or S3) of ``text`` (from ``model_dump_json``)."""
    import json

    if json.loads(text).get("kind") == "s3":
        from kernel_cache.store.s3 import S3Settings

        return S3Settings.model_validate_json(text)
    from kernel_cache.store.redis import RedisSettings

    return RedisSettings.model_validate_json(text)


def tiers_from_env(environ: Mapping[str, str] | None = None) -> list[Tier]:
    """The remote tiers set in the environment, in lookup order: Redis
    (``KERNEL_CACHE_REDIS_URL``), then the object store (``KERNEL_CACHE_REMOTE_URL``,
    or its older name ``KERNEL_CACHE_S3_URL``)."""
    out: list[Tier] = []
    if env_settings.is_set("redis_url", environ):  # else the client module is not imported
        from kernel_cache.store import redis

        out += redis.tiers_from_env(environ)
    if env_settings.is_set("remote_url", environ) or env_settings.is_set("s3_url", environ):
        from kernel_cache.store import s3

        out += s3.tiers_from_env(environ)
    return out
