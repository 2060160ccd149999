"""``kernel-cache verify``: load every variant of the plan and check it against
the eager reference (:func:`warmup.check.verify.verify_plan`), or with
``--rebuild`` compile variants again and compare bytes
(:func:`warmup.check.rebuild.rebuild_variant`)."""

from __future__ import annotations

import json
import sys

from warmup.cli.options import (
    Parents,
    cache_dir_of,
    config_from_args,
    fleet_options,
    remote_settings_of,
    remote_url_arg,
)


def cmd_verify(args) -> int:
    from kernel_cache.trust.keys import load_trusted_keys
    from warmup.check.verify import verify_plan

    cfg = config_from_args(args)
    load_trusted_keys(required=args.require_signed or None)
    tiers = None
    remote_url = remote_url_arg(args)
    if args.redis_url or remote_url:  # coverage: the remote alone must hold the whole plan
        tiers = [remote_settings_of(args).tier(fail_open=False)]
    if args.rebuild:
        return _verify_rebuild(args, cfg, tiers)
    report = verify_plan(
        cfg,
        cache_dir_of(args),
        bundles=args.bundle,
        tiers=tiers,
        allow_shared_dir=args.insecure_allow_shared_dir or None,
    )
    if tiers:
        report["tier"] = tiers[0].location
        if report.get("repair"):  # the warmup that repairs the remote must publish to it
            report["repair"] += f" --{'remote' if remote_url else 'redis'}-url {tiers[0].location}"
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_verify(report)
    return 0 if report["ok"] else 1


def _verify_rebuild(args, cfg, tiers) -> int:
    """``verify --rebuild VARIANT ...``: rebuild each variant and compare bytes
    with the stored entry (:func:`warmup.check.rebuild.rebuild_variant`); 0 if
    every one is identical."""
    from warmup.check.rebuild import rebuild_variant

    reports = [
        rebuild_variant(
            cfg,
            v,
            cache_dir_of(args),
            tiers=tiers,
            bundles=args.bundle,
            allow_shared_dir=args.insecure_allow_shared_dir or None,
        )
        for v in args.rebuild
    ]
    if args.json:
        print(json.dumps(reports, indent=2))
    for r in reports:
        if args.json:
            break
        if r["where"] is None:
            print(f"rebuild {r['variant']}: missing (key {r['key'][:16]})", file=sys.stderr)
            continue
        status = "identical" if r["identical"] else "DIFFERS"
        print(
            f"rebuild {r['variant']}: {status} to the entry in {r['where']} "
            f"(sha256 {r['stored_sha256'][:16]}, rebuilt {r['rebuilt_sha256'][:16]}, "
            f"{r['compile_s']:.1f} s)"
        )
        for m in r["differs"]:
            print(f"  differs {m['member']}: {m['stored_size']} / {m['rebuilt_size']} bytes")
        for n in r["only_stored"]:
            print(f"  only stored: {n}")
        for n in r["only_rebuilt"]:
            print(f"  only rebuilt: {n}")
    return 0 if all(r["identical"] for r in reports) else 1


def _print_verify(report: dict) -> None:
    """``verify``'s text summary of ``report`` (from
    :func:`warmup.check.verify.verify_plan`): the status line, the tiers loaded
    from, the kernels, mismatched and build-only-accepted variants on stdout;
    corrupt, unrunnable and missing variants and the repair command on stderr."""
    status = "ok" if report["ok"] else "FAILED"
    print(
        f"verify {status}: {report['loaded']}/{report['variants']} loaded, "
        f"{report['compiled']} compiled, {len(report['missing'])} missing, "
        f"{len(report['corrupt'])} corrupt, {len(report['unrunnable'])} cannot run here, "
        f"{len(report['mismatched'])} mismatched, "
        f"max abs err {report['max_abs_err']:.2e}, {report['seconds']:.2f} s"
        + (f" ({report['tier']} alone)" if "tier" in report else "")
    )
    for line in source_lines(report):
        print(line)
    print(f"  {report['signatures']}")
    for slot, path in report["kernels"].items():
        print(f"  kernel {slot}: {path}")
    for m in report["mismatched"]:
        print(f"  mismatched {m['variant']} ({m['kernel']}): max abs err {m['max_abs_err']:.2e}")
        for r in m["rows"]:
            err = "" if r["max_abs_err"] is None else f", max abs err {r['max_abs_err']:.2e}"
            which = f" (rows {', '.join(map(str, r['differing']))})" if r["differing"] else ""
            print(
                f"    {r['kind']} rows: {len(r['differing'])} of {r['rows']} differ{which}{err}; "
                f"must hold {r['must_hold']}"
            )
        print(f"    contract ({m['variant'].split(':')[0]}): {m['contract']}")
        print(f"    fix: {m['fix']}")
    if report["compile_stack_imported"]:
        print(f"  compile stack imported: {', '.join(report['compile_stack_imported'])}")
    for name, a in report["build_only_accepted"].items():
        print(
            f"  build-only {name}: accepted {', '.join(a['stored'])} recorded at build "
            f"(this process: {a['here']})"
        )
    for c in report["corrupt"]:
        print(f"  corrupt {c['variant']}: {c['reason']}", file=sys.stderr)
    for c in report["unrunnable"]:
        print(f"  cannot run here {c['variant']}: {c['reason']}", file=sys.stderr)
    if report["missing"]:
        print(f"  missing: {', '.join(report['missing'])}", file=sys.stderr)
    if report.get("repair"):
        print(f"  repair: {report['repair']}", file=sys.stderr)


#: How verify names the kind of tier an entry came from.
TIER_KINDS = {"bundle": "bundle", "disk": "local cache", "redis": "Redis", "s3": "object store"}


def source_lines(report: dict) -> list[str]:
    """Where verify loaded the plan from, one line per tier:
    ``"  6 from bundle /opt/kernel-cache-bundle"``."""
    kinds = report.get("source_kinds", {})
    return [
        f"  {n} from {TIER_KINDS.get(kinds.get(where), kinds.get(where, 'tier'))} {where}"
        for where, n in report["sources"].items()
    ]


def add_verify_command(sub, parents: Parents) -> None:
    """Register ``verify`` on ``sub`` (the subparsers action)."""
    sv = sub.add_parser(
        "verify",
        parents=[
            parents.engine,
            parents.cache_dir,
            parents.bundle,
            parents.json,
            parents.trust,
            parents.unsigned,
        ],
        help="load every variant of the plan and check it",
    )
    sv.add_argument(
        "--rebuild",
        action="append",
        default=[],
        metavar="VARIANT",
        help="compile VARIANT (KERNEL:QUERY:BLOCKS:SEQS, as `plan` lists it) again in a "
        "scratch directory and compare its bytes with the stored entry, naming the package "
        "members that differ; repeatable; exit 1 unless all are identical",
    )
    fleet_options(sv, warmup=False)
    sv.set_defaults(func=cmd_verify)
