"""Command-line options shared by every ``kernel-cache`` subcommand module
(:mod:`warmup.cli.main`, :mod:`warmup.cli.commands`, :mod:`warmup.tune`, the benchmarks
and examples): ENGINE OPTIONS derived from :class:`EngineConfig`, the cache
directory, bundles and the trust opt-out. It imports none of those modules, so
they never import each other through it.
"""

from __future__ import annotations

import argparse
import os
import typing
from pathlib import Path

from kernel_cache.config import settings
from kernel_cache.config.engine import (
    DEFAULT_MODEL,
    ENGINE_OPTION_FIELDS,
    PRESETS,
    EngineConfig,
    make_config,
    option_flag,
)
from kernel_cache.kernels.slots import parse_kernel_option
from kernel_cache.plan.buckets import Bucketer, parse_bucket_list
from kernel_cache.store.tier import ENV_CACHE_DIR, check_cache_dir_path, default_cache_dir


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
    """``--jobs N``: compile worker processes (default ``min(2, cpus)``), for
    ``warmup`` and ``tune``."""
    p.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="compile worker processes (default min(2, cpus))",
    )


def trust_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--insecure-allow-shared-dir",
        action="store_true",
        help="load from a cache directory other users can write (a deliberately shared "
        "group directory); env KERNEL_CACHE_INSECURE_ALLOW_SHARED_DIR=1",
    )


def config_from_args(args) -> EngineConfig:
    """Flags win over ``KERNEL_CACHE_*_BUCKETS``, which win over computed ladders."""
    fields = {}
    for field in ENGINE_OPTION_FIELDS:
        value = getattr(args, field)
        if field.endswith("_buckets"):
            value = parse_bucket_list(value, option_flag(field)) if value else None
        elif field == "kernels":
            value = [parse_kernel_option(v, option_flag(field)) for v in value or ()] or None
        fields[field] = value
    cfg = make_config(args.model, **fields)
    Bucketer(cfg)  # validate overrides against the limits now, with a clear error
    return cfg


#: ``--cache-dir``'s help.
CACHE_DIR_HELP = (
    "the local cache (default $KERNEL_CACHE_DIR, else $XDG_CACHE_HOME/kernel_cache, "
    "else ~/.cache/kernel_cache)"
)


def _cache_dir(args) -> str:
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
