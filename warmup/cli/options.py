"""Command-line options shared by every ``kernel-cache`` subcommand module
(:mod:`warmup.cli.main`, :mod:`warmup.cli.build`, :mod:`warmup.cli.verify`,
:mod:`warmup.cli.commands`, :mod:`warmup.tune.cli`, the benchmarks and examples):
ENGINE OPTIONS derived from :class:`EngineConfig`, the cache directory, ``--json``,
``--jobs``, bundles, the trust opt-out and the fleet options. An option several
subcommands take is declared once, in a parent parser (:class:`Parents`,
``parents=[...]`` of ``add_parser``). It imports none of those modules, so they
never import each other through it.
"""

from __future__ import annotations

import argparse
import os
import typing
from pathlib import Path
from typing import NamedTuple

from kernel_cache.config import settings
from kernel_cache.config.engine import (
    DEFAULT_MODEL,
    ENGINE_OPTION_FIELDS,
    PRESETS,
    EngineConfig,
    make_config,
    option_flag,
)
from kernel_cache.config.slot_spec import parse_slot_option
from kernel_cache.errors import KernelCacheError
from kernel_cache.kernels.slots import parse_kernel_option
from kernel_cache.plan.buckets import Bucketer, parse_bucket_list
from kernel_cache.store.disk_tier import ENV_CACHE_DIR, check_cache_dir_path, default_cache_dir


def engine_options(p: argparse.ArgumentParser) -> None:
    """Add the ENGINE OPTIONS: ``--model`` and one flag per :class:`EngineConfig`
    field (:data:`~kernel_cache.config.engine.ENGINE_OPTION_FIELDS`), with the model's
    defaults, descriptions and accepted values."""
    g = p.add_argument_group(
        "engine options",
        "the plan's model and limits; make_config() takes the same names and defaults",
    )
    g.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        metavar="NAME|PATH",
        help=f"a preset ({', '.join(PRESETS)}) or a path to a Hugging Face config.json "
        "(default %(default)s)",
    )
    for field in ENGINE_OPTION_FIELDS:
        info = EngineConfig.model_fields[field]
        kw: dict = {"dest": field, "help": info.description}
        if field == "kernels":  # --kernel SLOT=PATH, repeatable
            g.add_argument(
                option_flag(field), dest=field, action="append", metavar="SLOT=PATH",
                help=info.description,
            )  # fmt: skip
            continue
        if field == "slots":  # --slot JSON|@FILE, repeatable
            g.add_argument(
                option_flag(field), dest=field, action="append", metavar="JSON|@FILE",
                help=info.description,
            )  # fmt: skip
            continue
        if typing.get_origin(info.annotation) is typing.Literal:
            kw["choices"] = typing.get_args(info.annotation)
        elif info.annotation is int:
            kw["type"] = int
            kw["metavar"] = "N"
        else:  # a bucket list, parsed by config_from_args to name the flag in errors
            kw["metavar"] = "N,N,..."
        # dtype's default follows the device (make_config picks it)
        kw["default"] = None if field == "dtype" else info.default
        if kw["default"] is not None:
            kw["help"] += " (default %(default)s)"
        g.add_argument(option_flag(field), **kw)


def jobs_option(p: argparse.ArgumentParser) -> None:
    """``--jobs N``: compile worker processes, for ``warmup`` and ``tune``
    (:func:`jobs_of` gives the number to use)."""
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="compile worker processes (default $KERNEL_CACHE_JOBS, else min(2, cpus))",
    )


def jobs_of(args) -> int:
    """The worker count: ``--jobs``, else ``KERNEL_CACHE_JOBS``, else ``min(2, cpus)``.

    Raises:
        KernelCacheError: ``--jobs`` below 1 or above the limit of ``KERNEL_CACHE_JOBS``
            (1024; the variable is checked by its setting).
    """
    if args.jobs is not None:
        top = settings.JOBS_MAX
        if not 1 <= args.jobs <= top:
            raise KernelCacheError(
                f"--jobs {args.jobs}: expected an integer >= 1 and <= {top}; fix: pass "
                "e.g. --jobs 2, or leave it out for $KERNEL_CACHE_JOBS, else min(2, CPUs)"
            )
        return args.jobs
    env = settings.get("jobs")
    return env if env is not None else min(2, os.cpu_count() or 1)


def trust_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--insecure-allow-shared-dir",
        action="store_true",
        help="load from a cache directory other users can write (a deliberately shared "
        "group directory); env KERNEL_CACHE_INSECURE_ALLOW_SHARED_DIR=1",
    )


def unsigned_option(p: argparse.ArgumentParser) -> None:
    """``--insecure-allow-unsigned``: the flag of ``KERNEL_CACHE_INSECURE_ALLOW_UNSIGNED``
    (:func:`apply_unsigned_flag` sets the variable for this process and its workers)."""
    p.add_argument(
        "--insecure-allow-unsigned",
        action="store_true",
        help="load and publish unsigned entries of shared tiers (Redis, S3, bundles) when no "
        "key is set: anyone who can write the shared store can run code on every engine "
        "(env KERNEL_CACHE_INSECURE_ALLOW_UNSIGNED=1; default: a shared tier needs "
        "KERNEL_CACHE_TRUSTED_KEYS or KERNEL_CACHE_SIGNING_KEY_FILE)",
    )


def require_publish_option(p) -> None:
    """``--require-publish``: the flag of ``KERNEL_CACHE_REQUIRE_PUBLISH``."""
    p.add_argument(
        "--require-publish",
        action="store_true",
        help="exit non-zero unless the shared tier got every entry, signed: no signing key, "
        "an unavailable or refusing store fail the step (a CI builder; env "
        "KERNEL_CACHE_REQUIRE_PUBLISH=1)",
    )


def apply_unsigned_flag(args) -> None:
    """``--insecure-allow-unsigned`` given: set its variable for this process (and
    the warmup workers it starts, which read it from their environment)."""
    import os

    if getattr(args, "insecure_allow_unsigned", False):
        os.environ[settings.var("insecure_allow_unsigned")] = "1"


def require_publish(args) -> bool:
    """``--require-publish`` or ``KERNEL_CACHE_REQUIRE_PUBLISH``."""
    return bool(getattr(args, "require_publish", False) or settings.get("require_publish"))


def config_from_args(args) -> EngineConfig:
    """Flags win over ``KERNEL_CACHE_*_BUCKETS``, which win over computed ladders."""
    fields = {}
    for field in ENGINE_OPTION_FIELDS:
        value = getattr(args, field)
        if field.endswith("_buckets"):
            value = parse_bucket_list(value, option_flag(field)) if value else None
        elif field == "kernels":
            value = [parse_kernel_option(v, option_flag(field)) for v in value or ()] or None
        elif field == "slots":
            value = [s for v in value or () for s in parse_slot_option(v, option_flag(field))]
            value = value or None
        fields[field] = value
    cfg = make_config(args.model, **fields)
    Bucketer(cfg)  # validate overrides against the limits now, with a clear error
    return cfg


#: ``--cache-dir``'s help.
CACHE_DIR_HELP = (
    "the local cache (default $KERNEL_CACHE_DIR, else $XDG_CACHE_HOME/kernel_cache, "
    "else ~/.cache/kernel_cache)"
)


def cache_dir_of(args) -> str:
    """The cache directory of ``--cache-dir`` or :func:`default_cache_dir`.

    Raises:
        ConfigError: the path, or a folder above it, exists and is not a
            directory (names both, where the path came from, and the fix).
    """
    d = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    if args.cache_dir:
        source = "--cache-dir"
    elif settings.is_set("dir"):
        source = f"${ENV_CACHE_DIR}"
    else:
        source = "the default"
    check_cache_dir_path(d, source, f"--cache-dir or ${ENV_CACHE_DIR}")
    return str(d)


def bundle_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--bundle",
        action="append",
        default=[],
        metavar="DIR",
        help="a bundle searched before the local cache (repeatable; also $KERNEL_CACHE_BUNDLE, "
        "os.pathsep-separated)",
    )


def cache_dir_option(p: argparse.ArgumentParser) -> None:
    """``--cache-dir DIR`` (read with :func:`cache_dir_of`)."""
    p.add_argument("--cache-dir", default=None, metavar="DIR", help=CACHE_DIR_HELP)


def json_option(p: argparse.ArgumentParser) -> None:
    """``--json``: the command's report as JSON on stdout."""
    p.add_argument("--json", action="store_true", help="print the report as JSON")


class Parents(NamedTuple):
    """The parent parsers of the options several subcommands take, made once per
    ``kernel-cache`` parser (:func:`make_parents`) and named in each
    subcommand's ``parents=[...]``."""

    engine: argparse.ArgumentParser  #: ENGINE OPTIONS (:func:`engine_options`)
    cache_dir: argparse.ArgumentParser  #: ``--cache-dir``
    json: argparse.ArgumentParser  #: ``--json``
    jobs: argparse.ArgumentParser  #: ``--jobs`` (:func:`jobs_option`)
    bundle: argparse.ArgumentParser  #: ``--bundle``, repeatable (:func:`bundle_option`)
    trust: argparse.ArgumentParser  #: ``--insecure-allow-shared-dir``
    unsigned: argparse.ArgumentParser  #: ``--insecure-allow-unsigned``


def make_parents() -> Parents:
    """One parent parser (``add_help=False``) per shared option set."""

    def parent(add) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(add_help=False)
        add(p)
        return p

    return Parents(
        engine=parent(engine_options),
        cache_dir=parent(cache_dir_option),
        json=parent(json_option),
        jobs=parent(jobs_option),
        bundle=parent(bundle_option),
        trust=parent(trust_option),
        unsigned=parent(unsigned_option),
    )


def fleet_options(p: argparse.ArgumentParser, *, warmup: bool) -> None:
    """Options of the shared Redis tier, signing and (warmup) sharding."""
    g = p.add_argument_group("fleet options (a cache shared across machines)")
    g.add_argument(
        "--redis-url",
        default=None,
        help="shared Redis tier, e.g. redis://10.0.0.5:6379/0 (env KERNEL_CACHE_REDIS_URL)"
        + ("" if warmup else "; verify then checks that Redis alone holds the plan"),
    )
    g.add_argument(
        "--redis-timeout",
        type=float,
        default=None,
        help="seconds any Redis call may block (default 2; env KERNEL_CACHE_REDIS_TIMEOUT)",
    )
    g.add_argument(
        "--remote-url",
        default=None,
        help="shared object-store tier: s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, "
        "az://CONTAINER/PREFIX or file:///DIRECTORY (a shared filesystem); S3 endpoint and "
        "credentials from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION "
        "(env KERNEL_CACHE_REMOTE_URL)"
        + ("" if warmup else "; verify then checks that the store alone holds the plan"),
    )
    g.add_argument(
        "--s3-url",
        default=None,
        help="the older name of --remote-url (env KERNEL_CACHE_S3_URL)",
    )
    g.add_argument(
        "--s3-timeout",
        type=float,
        default=None,
        help="seconds any S3 call may wait to connect or read (default 2; env "
        "KERNEL_CACHE_S3_TIMEOUT)",
    )
    g.add_argument(
        "--require-signed",
        action="store_true",
        help="fail at start unless a key to check signatures is set: "
        "KERNEL_CACHE_TRUSTED_KEYS (public) or KERNEL_CACHE_SIGNING_KEY_FILE (private) "
        "(env KERNEL_CACHE_REQUIRE_SIGNED=1)",
    )
    if warmup:
        g.add_argument(
            "--redis-ttl",
            type=int,
            default=None,
            help="seconds a Redis entry lives (default: no expiry; env KERNEL_CACHE_REDIS_TTL)",
        )
        require_publish_option(g)
        shard_options(g, "compile only")


def shard_options(g, verb: str) -> None:
    """``--shard I/N|auto`` and ``--shards N`` on ``g`` (warmup: what to compile;
    plan: which shard to show)."""
    g.add_argument(
        "--shard",
        default=None,
        metavar="I/N|auto",
        help=f"{verb} shard I (0-based) of N, balanced by expected compile time; auto: I from "
        "a Kubernetes Indexed Job's JOB_COMPLETION_INDEX, N from --shards",
    )
    g.add_argument(
        "--shards",
        type=int,
        default=None,
        metavar="N",
        help="the shard count for --shard auto: the Indexed Job's completions "
        "(env KERNEL_CACHE_SHARDS)",
    )


def remote_url_arg(args) -> str | None:
    """``--remote-url``, else its older name ``--s3-url``; None for neither.

    Raises:
        KernelCacheError: both given, with different URLs.
    """
    new, old = getattr(args, "remote_url", None), getattr(args, "s3_url", None)
    if new and old and new != old:
        raise KernelCacheError(
            f"--remote-url {new} and its older name --s3-url {old} name different stores; give one"
        )
    return new or old


def remote_settings_of(args):
    """The remote tier's settings: the object store (``--remote-url`` /
    ``KERNEL_CACHE_REMOTE_URL``, or the older ``--s3-url`` / ``KERNEL_CACHE_S3_URL``),
    else Redis; None for neither.

    Raises:
        KernelCacheError: both are set (warmup and verify use one remote).
    """
    from kernel_cache.store.redis import RedisSettings
    from kernel_cache.store.s3 import S3Settings

    s3 = S3Settings.from_env(url=remote_url_arg(args), timeout_s=args.s3_timeout)
    if s3 is not None:
        if args.redis_url or settings.is_set("redis_url"):
            raise KernelCacheError(
                f"both a Redis URL and an object-store URL ({s3.url}) are set; warmup and "
                "verify use one remote tier: unset KERNEL_CACHE_REDIS_URL / --redis-url or "
                "KERNEL_CACHE_REMOTE_URL / --remote-url"
            )
        return s3
    return RedisSettings.from_env(
        url=args.redis_url,
        timeout_s=args.redis_timeout,
        ttl_s=getattr(args, "redis_ttl", None),
    )
