"""``kernel-cache`` subcommands for bundles, housekeeping and keys:
export, import, explain, ls, stats, gc, clear, keygen.

``--keep-plan SPEC`` (gc, repeatable) names a plan to keep, either as ENGINE
OPTIONS in one quoted argument (``--keep-plan "--model llama-3.2-1b
--max-model-len 1024"``; ``--keep-plan ""`` is the built-in default) or as a
JSON file holding the plan's engine configuration: the output of ``kernel-cache
plan --json`` or a bundle's ``manifest.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import shutil
import sys
from pathlib import Path

from kernel_cache.config.engine import EngineConfig
from kernel_cache.errors import KernelCacheError
from warmup.cli.options import (
    Parents,
    cache_dir_of,
    config_from_args,
    engine_options,
    require_publish,
    require_publish_option,
)


def _when(ts) -> str:
    return dt.datetime.fromtimestamp(float(ts)).strftime("%Y-%m-%d %H:%M") if ts else "-"


def _existing_disk(args, *, read_only: bool = False):
    """The local cache tier, or a clear error if the directory does not exist
    (housekeeping never creates a cache)."""
    from kernel_cache.store.disk_tier import DiskTier

    d = Path(cache_dir_of(args))
    if not d.is_dir():
        raise KernelCacheError(
            f"no cache at {str(d)!r} (--cache-dir / $KERNEL_CACHE_DIR); warm one with "
            "kernel-cache warmup"
        )
    return DiskTier(d, read_only=read_only)


def _tiers(args):
    from kernel_cache.runtime.load import default_tiers

    return default_tiers(cache_dir_of(args), args.bundle)


def _sources(args):
    """The engine-start lookup's tiers with its policy (Redis hits are copied
    into the local cache)."""
    from kernel_cache.runtime.load import default_lookup

    return default_lookup(cache_dir_of(args), args.bundle).sources


# -- export / import ---------------------------------------------------------
def cmd_export(args) -> int:
    from kernel_cache.store.bundle import export_bundle
    from kernel_cache.store.housekeeping import format_size

    cfg = config_from_args(args)
    report = export_bundle(cfg, args.out, _sources(args), require_publish=require_publish(args))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"export: {report['variants']} variants, {report['files']} files, "
            f"{format_size(report['bytes'])} -> {report['out']} (read-only; fingerprint "
            f"{report['fingerprint']})"
        )
        by = report["signed_by"]
        print(
            f"signed: every entry by key {by}"
            if by
            else "signed: entries keep the signatures they were built with (no private key here)"
        )
    return 0


def cmd_import(args) -> int:
    from kernel_cache.store.bundle import import_bundle
    from kernel_cache.store.disk_tier import DiskTier
    from kernel_cache.store.housekeeping import format_size

    disk = DiskTier(cache_dir_of(args))
    try:
        report = import_bundle(args.dir, disk)
    finally:
        disk.close()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"import: {report['imported']} entries copied ({format_size(report['bytes'])}), "
            f"{report['present']} already present -> {cache_dir_of(args)}"
        )
    return 0


# -- keygen --------------------------------------------------------------------
def cmd_keygen(args) -> int:
    from kernel_cache.trust.keygen import generate_keypair
    from kernel_cache.trust.keys import ENV_SIGNING_KEY_FILE, ENV_TRUSTED_KEYS

    report = generate_keypair(args.dir, force=args.force)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"keygen: Ed25519 key {report['key_id']}\n"
            f"  private {report['private']} (mode 600; builders only): "
            f"{ENV_SIGNING_KEY_FILE}={report['private']}\n"
            f"  public  {report['public']} (engines): {ENV_TRUSTED_KEYS}={report['public']}"
        )
    return 0


# -- explain -------------------------------------------------------------------
def cmd_explain(args) -> int:
    from kernel_cache.plan.buckets import KernelVariant
    from warmup.check.explain import explain, render

    cfg = config_from_args(args)
    variants = [KernelVariant.parse(v) for v in args.variant] or None
    report = explain(cfg, _tiers(args), variants)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


# -- ls / stats / gc / clear ---------------------------------------------------
def _rows(args):
    """``(location, rows)`` of ``ls``: a bundle's, else the local cache's, read
    without writing; a cache directory that does not exist has no rows."""
    from kernel_cache.store.bundle import BundleTier
    from kernel_cache.store.housekeeping import list_entries

    if args.bundle:
        tier = BundleTier(args.bundle)
        return tier.location, list_entries(tier)
    d = Path(cache_dir_of(args))
    if not d.is_dir():
        return str(d), []
    tier = _existing_disk(args, read_only=True)
    try:
        return tier.location, list_entries(tier)
    finally:
        tier.close()


def _kernel_label(path: str | None) -> str:
    """``built-in`` for a slot's default factory, else the import path."""
    from kernel_cache.kernels.slots import builtin_paths

    if not path:
        return "-"
    return "built-in" if path in builtin_paths() else path


def cmd_ls(args) -> int:
    from rich.console import Console

    where, rows = _rows(args)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    corrupt = [r for r in rows if r["status"] == "corrupt"]
    title = f"{where}: {len(rows)} entries" + (f", {len(corrupt)} corrupt" if corrupt else "")
    if not rows and not args.bundle and not Path(where).is_dir():
        title += " (no cache directory there yet)"
    table = _ls_table(title, rows, with_status=bool(corrupt))
    Console(width=max(160, shutil.get_terminal_size().columns)).print(table)
    for r in corrupt:
        print(f"  corrupt {r['key'][:12]}: {r['reason']}")
    if corrupt:
        print(
            "  kernel-cache warmup quarantines and rebuilds a corrupt entry of its plan; "
            "gc and clear remove them"
        )
    return 0


def _ls_table(title: str, rows: list[dict], *, with_status: bool):
    """``ls``'s rich Table of ``rows`` (from
    :func:`kernel_cache.store.housekeeping.list_entries`), one line per entry,
    with a status column when ``with_status``."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    cols = ("variant", "model", "dtype", "target", "kernel", "key", "size", "compile s")
    cols += ("created",)
    cols += ("last used",)
    # The kernel column names the import path in full, folded over lines in a
    # narrow table rather than cut: two factories of one module differ at its end.
    for col in cols + (("status",) if with_status else ()):
        table.add_column(
            col,
            justify="right" if col in ("size", "compile s") else "left",
            overflow="fold" if col == "kernel" else "ellipsis",
            # Names a user passes on (variant, target) and times are never cut.
            no_wrap=col in ("variant", "target", "key", "created", "last used"),
        )
    for r in rows:
        table.add_row(*_ls_cells(r), *((r["status"],) if with_status else ()))
    return table


def _ls_cells(r: dict) -> list[str]:
    """The cells of ``ls``'s line for the row ``r``, status excluded."""
    from kernel_cache.store.housekeeping import format_size

    cs = r["compile_seconds"]
    dtype = r["dtype"] or "-"
    if r["device"] and r["device"] != "cpu":
        dtype += f" {r['device']}"
    return [
        r["variant"],
        r["model"],
        dtype,
        r.get("device_arch") or "-",
        _kernel_label(r.get("kernel")),
        r["key"][:12],
        format_size(r["size"]),
        f"{cs:.1f}" if isinstance(cs, (int, float)) else "-",
        _when(r["created"]),
        _when(r["last_used"]),
    ]


def cmd_stats(args) -> int:
    from kernel_cache.store.housekeeping import cache_stats, empty_stats, format_size

    d = Path(cache_dir_of(args))
    if d.is_dir():
        tier = _existing_disk(args, read_only=True)
        try:
            s = cache_stats(tier)
        finally:
            tier.close()
    else:
        s = empty_stats(d)
    if args.json:
        print(json.dumps(s, indent=2))
    else:
        corrupt = f" ({s['corrupt']} corrupt: see kernel-cache ls)" if s["corrupt"] else ""
        none = "" if s.get("exists", True) else " (no cache directory there yet)"
        print(
            f"{s['location']}: {s['entries']} entries{corrupt}, {format_size(s['bytes'])} of "
            f"artifacts ({format_size(s['disk_bytes'])} on disk); {s['hits']} hits, "
            f"{s['misses']} misses since {_when(s['since'])}{none}"
        )
    return 0


def keep_plan_config(spec: str) -> EngineConfig:
    """An engine configuration from a ``--keep-plan`` SPEC (see the module docstring).

    Raises:
        KernelCacheError: neither engine options nor a readable plan file (says both forms).
    """
    forms = (
        'give ENGINE OPTIONS in one quoted argument (--keep-plan "--model llama-3.2-1b '
        '--max-model-len 1024") or a JSON file from `kernel-cache plan --json` or a '
        "bundle's manifest.json"
    )
    if not spec.strip() or spec.lstrip().startswith("-"):
        p = argparse.ArgumentParser(prog="kernel-cache gc --keep-plan", add_help=False)
        engine_options(p)
        try:
            ns = p.parse_args(shlex.split(spec))
        except SystemExit:
            raise KernelCacheError(f"--keep-plan {spec!r}: not valid ENGINE OPTIONS") from None
        return config_from_args(ns)
    path = Path(spec)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise KernelCacheError(f"--keep-plan {spec!r}: no such file; {forms}") from None
    except (OSError, ValueError) as e:
        raise KernelCacheError(f"--keep-plan {spec!r}: not a JSON file ({e}); {forms}") from None
    cfg = None
    if isinstance(doc, dict):
        cfg = doc.get("config") or (doc.get("plan") or {}).get("config")
    if not isinstance(cfg, dict):
        raise KernelCacheError(f"--keep-plan {spec!r}: holds no engine 'config'; {forms}")
    try:
        return EngineConfig.model_validate(cfg)
    except ValueError as e:
        raise KernelCacheError(f"--keep-plan {spec!r}: invalid engine config: {e}") from None


def cmd_gc(args) -> int:
    from kernel_cache.config import settings
    from kernel_cache.store.housekeeping import format_size, gc, plan_digests

    max_size = (
        settings.parse_size(args.max_size, "--max-size")
        if args.max_size
        else settings.get("max_size")
    )
    if max_size is None:
        raise KernelCacheError("gc needs a limit: --max-size SIZE (or $KERNEL_CACHE_MAX_SIZE)")
    keep: set[str] = set()
    per_spec = []
    for spec in args.keep_plan:
        digests = plan_digests(keep_plan_config(spec))
        per_spec.append((spec, digests))
        keep |= digests
    tier = _existing_disk(args)
    try:
        _warn_unmatched_keep_plans(tier, per_spec)
        report = gc(tier, max_size, keep)
    finally:
        tier.close()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"gc: removed {len(report['removed'])} entries ({format_size(report['removed_bytes'])}"
            f"), {format_size(report['before_bytes'])} -> {format_size(report['after_bytes'])}, "
            f"limit {format_size(max_size)}; kept plans hold {format_size(report['kept_bytes'])}"
        )
        for r in report["removed"]:
            print(f"  removed {r['variant']} {r['key'][:12]} {format_size(r['size'])}")
        _print_orphans(report["orphans"])
    if not report["under_limit"]:
        raise KernelCacheError(
            f"the kept plans alone hold {report['kept_bytes']} bytes, above --max-size "
            f"{max_size} bytes; nothing else is left to remove: raise the limit or keep fewer plans"
        )
    return 0


def _warn_unmatched_keep_plans(tier, per_spec: list[tuple[str, set[str]]]) -> None:
    """On stderr, a warning for each ``--keep-plan`` SPEC of ``per_spec``
    (``[(spec, its runtime digests)]``) that matches no entry of ``tier``: it
    keeps nothing."""
    from kernel_cache.store.housekeeping import list_entries

    stored = {r["runtime_digest"] for r in list_entries(tier)} if per_spec else set()
    for spec, digests in per_spec:
        if not digests & stored:
            print(
                f"kernel-cache gc: warning: --keep-plan {spec!r} matches none of the entries "
                f"in {tier.location} (none of its {len(digests)} variants is stored: another "
                "dtype, device, torch or launch table?); nothing is kept for it. "
                "See `kernel-cache ls` and `kernel-cache explain`.",
                file=sys.stderr,
            )


def cmd_gc_remote(args) -> int:
    from kernel_cache.store.housekeeping import format_size
    from kernel_cache.store.remote_gc import gc_remote, parse_age
    from kernel_cache.store.s3 import S3Settings
    from warmup.cli.options import remote_url_arg

    age = parse_age(args.older_than)
    remote = S3Settings.from_env(url=remote_url_arg(args), timeout_s=args.s3_timeout)
    if remote is None:
        raise KernelCacheError(
            "gc-remote needs the shared store: --remote-url URL (or KERNEL_CACHE_REMOTE_URL)"
        )
    report = gc_remote(remote.tier(fail_open=False), age, dry_run=args.dry_run)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    verb = "would remove" if args.dry_run else "removed"
    print(
        f"gc-remote {report['url']}: {verb} {len(report['removed'])} objects "
        f"({format_size(report['removed_bytes'])}) older than {args.older_than}; kept "
        f"{report['kept_entries']} entries ({report['kept_by_manifests']} keys listed by "
        f"{report['manifests_read']} recent plan manifests)"
    )
    for r in report["removed"]:
        print(f"  {verb} {r['path']} {format_size(r['size'])}, {r['age_s'] / 86400:.1f} days old")
    return 0


def cmd_clear(args) -> int:
    from kernel_cache.store.housekeeping import clear, format_size

    tier = _existing_disk(args)
    try:
        report = clear(tier)
    finally:
        tier.close()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"clear: removed {report['removed']} entries ({format_size(report['removed_bytes'])})"
            f" and {report['quarantine_removed']} quarantined from {tier.location}"
        )
        _print_orphans(report["orphans"])
    return 0


def _print_orphans(o: dict) -> None:
    from kernel_cache.store.housekeeping import ORPHAN_GRACE_S, format_size

    if o["removed"]:
        print(
            f"  removed {o['removed']} orphan artifact files ({format_size(o['removed_bytes'])}) "
            "that no entry referenced"
        )
    if o["kept_young"]:
        print(
            f"  kept {o['kept_young']} unreferenced artifact files younger than "
            f"{ORPHAN_GRACE_S / 60:.0f} minutes (possibly being published)"
        )


def add_commands(sub, parents: Parents) -> None:
    """Register the subcommands on ``sub`` (the ``kernel-cache`` parser's subparsers)."""
    p = parents
    s = sub.add_parser(
        "export",
        parents=[p.engine, p.cache_dir, p.bundle, p.json, p.unsigned],
        help="write a read-only bundle of exactly the plan's artifacts",
    )
    s.add_argument("--out", required=True, metavar="DIR", help="a new or empty directory")
    require_publish_option(s)
    s.set_defaults(func=cmd_export)

    s = sub.add_parser(
        "import",
        parents=[p.cache_dir, p.json, p.unsigned],
        help="copy a bundle's entries into the local cache",
    )
    s.add_argument("dir", metavar="DIR", help="a bundle written by kernel-cache export")
    s.set_defaults(func=cmd_import)

    s = sub.add_parser(
        "explain",
        parents=[p.engine, p.cache_dir, p.bundle, p.json, p.unsigned],
        help="why a variant misses: nearest entries and differences",
    )
    s.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="KERNEL:QUERY:BLOCKS:SEQS",
        help="explain this variant (repeatable; default: every missing variant of the plan)",
    )
    s.set_defaults(func=cmd_explain)

    s = sub.add_parser("ls", parents=[p.cache_dir, p.json], help="list the cache's entries")
    s.add_argument("--bundle", default=None, metavar="DIR", help="list this bundle instead")
    s.set_defaults(func=cmd_ls)

    sub.add_parser(
        "stats",
        parents=[p.cache_dir, p.json],
        help="entries, bytes, hits and misses of the cache (zeros if it does not exist)",
    ).set_defaults(func=cmd_stats)

    s = sub.add_parser(
        "gc",
        parents=[p.cache_dir, p.json],
        help="remove least recently used entries down to a size limit",
    )
    s.add_argument(
        "--max-size",
        default=None,
        metavar="SIZE",
        help="bytes, or 500M, 2G (powers of 1024); default $KERNEL_CACHE_MAX_SIZE",
    )
    s.add_argument(
        "--keep-plan",
        action="append",
        default=[],
        metavar="SPEC",
        help="never remove this plan's entries: quoted ENGINE OPTIONS, or a file from "
        "'kernel-cache plan --json' or a bundle's manifest.json (repeatable)",
    )
    s.set_defaults(func=cmd_gc)

    s = sub.add_parser(
        "gc-remote",
        parents=[p.json],
        help="remove entries of the shared object store that no recent plan manifest "
        "lists, older than --older-than, with old manifests and leases",
    )
    s.add_argument(
        "--older-than",
        required=True,
        metavar="AGE",
        help="remove what is older than this: 30d, 12h, 90m, 3600s, 2w",
    )
    s.add_argument(
        "--dry-run", action="store_true", help="list what would be removed; remove nothing"
    )
    s.add_argument(
        "--remote-url",
        default=None,
        help="the shared store, s3://, gs://, az:// or file:// (env KERNEL_CACHE_REMOTE_URL)",
    )
    s.add_argument("--s3-url", default=None, help="the older name of --remote-url")
    s.add_argument(
        "--s3-timeout",
        type=float,
        default=None,
        help="seconds any store call may wait to connect or read (default 2; env "
        "KERNEL_CACHE_S3_TIMEOUT)",
    )
    s.set_defaults(func=cmd_gc_remote)

    sub.add_parser(
        "clear",
        parents=[p.cache_dir, p.json],
        help="remove every entry, quarantined entry and orphan file of the local cache",
    ).set_defaults(func=cmd_clear)

    s = sub.add_parser(
        "keygen",
        parents=[p.json],
        help="make an Ed25519 key pair: DIR/signing.key (builders sign) and DIR/signing.pub "
        "(engines check)",
    )
    s.add_argument("dir", metavar="DIR", help="where to write signing.key and signing.pub")
    s.add_argument("--force", action="store_true", help="replace an existing DIR/signing.key")
    s.set_defaults(func=cmd_keygen)
