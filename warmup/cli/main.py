"""The ``kernel-cache`` command line (plan, warmup, verify, bundles, housekeeping).

Subcommands: plan, warmup, verify here; export, import, explain, ls, stats, gc,
clear in :mod:`warmup.cli.commands`; tune in :mod:`warmup.tune`.

ENGINE OPTIONS default to the built-in default plan
(:data:`kernel_cache.config.engine.DEFAULT_MODEL` with :class:`EngineConfig`'s
defaults, as ``make_config(DEFAULT_MODEL)``): ``kernel-cache warmup`` with no
options warms it.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import sys

from kernel_cache.config import settings
from kernel_cache.errors import KernelCacheError
from kernel_cache.plan.buckets import Bucketer
from kernel_cache.plan.launch import describe_plan, format_plan
from warmup.cli.options import (  # noqa: F401 - re-exported: benchmarks and examples import them here
    CACHE_DIR_HELP,
    _cache_dir,
    bundle_option,
    config_from_args,
    engine_options,
    jobs_option,
    trust_option,
)


def cmd_plan(args) -> int:
    cfg = config_from_args(args)
    b = Bucketer(cfg)
    shard_variants, shard = _shard_of(cfg, args.shard, args.shards)
    doc = {"config": cfg.model_dump(mode="json"), **b.describe(), "kernels": _kernels(cfg)}
    launch = _plan_launch(cfg, b)
    if launch is not None:
        doc["launch"] = describe_plan(launch[0])
    if shard is not None:
        doc["shard"] = shard
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(
        f"model {cfg.model}: {cfg.num_heads} heads, {cfg.num_kv_heads} KV heads, "
        f"head_dim {cfg.head_dim}, {cfg.dtype} on {cfg.device}"
    )
    print(f"kv buckets (tokens):   {list(b.kv_buckets)}")
    print(f"kv buckets (blocks):   {list(b.num_blocks_buckets)}")
    print(f"query buckets:         {list(b.query_buckets)}")
    print(f"num_seqs buckets:      {list(b.num_seqs_buckets)}")
    for slot, path in doc["kernels"].items():
        print(f"kernel {slot}: {path}")
    n_pa = sum(v.kernel == "paged_attention" for v in b.variants)
    print(
        f"variants: {len(b.variants)} ({n_pa} paged_attention, "
        f"{len(b.variants) - n_pa} batched_decode); fingerprint {doc['fingerprint']}"
    )
    if shard is not None:
        print(
            f"shard {shard['index']}/{shard['count']}: {len(shard_variants)} variants, "
            f"expected compile {shard['expected_compile_s']:.1f} s"
        )
    for v in b.variants if shard_variants is None else shard_variants:
        print(f"  {v}")  # the names explain --variant and verify take
    if launch is not None:
        print(format_plan(*launch))
    else:
        print(
            "launch config: not resolved (no usable CUDA device here; the lookup needs the "
            "GPU architecture): run this plan on the GPU machine to see it"
        )
    return 0


def _kernels(cfg) -> dict:
    """``{slot: import path}`` of every slot of ``cfg``'s plan (built-in or the engine's)."""
    from kernel_cache.kernels.slots import SLOTS, kernel_path

    return {slot: kernel_path(cfg, slot) for slot in SLOTS}


def _plan_launch(cfg, bucketer):
    """The plan's resolved launch configs and their sources line, or None for a CUDA
    plan on a machine without a GPU (the lookup needs the device architecture)."""
    from kernel_cache.plan.keys import device_arch
    from kernel_cache.plan.launch import Resolver, source_counts

    resolver = Resolver()  # validates KERNEL_CACHE_TUNING even where nothing resolves
    if cfg.device == "cuda":
        import torch  # only here: a CPU plan's launch configs need no torch

        if not torch.cuda.is_available():
            return None
    arch = device_arch(cfg.device, cfg.cpu_target)
    resolved = {v: resolver.resolve(cfg, v, arch) for v in bucketer.variants}
    return resolved, resolver.sources(arch, source_counts(resolved))


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
        "--s3-url",
        default=None,
        help="shared S3 tier, s3://BUCKET/PREFIX; endpoint and credentials from AWS_ENDPOINT_URL, "
        "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION (env KERNEL_CACHE_S3_URL)"
        + ("" if warmup else "; verify then checks that S3 alone holds the plan"),
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


def _remote_settings(args):
    """The remote tier's settings: S3 (``--s3-url`` / ``KERNEL_CACHE_S3_URL``),
    else Redis; None for neither.

    Raises:
        KernelCacheError: both are set (warmup and verify use one remote).
    """
    from kernel_cache.store.redis import RedisSettings
    from kernel_cache.store.s3 import S3Settings

    s3 = S3Settings.from_env(url=args.s3_url, timeout_s=args.s3_timeout)
    if s3 is not None:
        if args.redis_url or settings.is_set("redis_url"):
            raise KernelCacheError(
                f"both a Redis URL and an S3 URL ({s3.url}) are set; warmup and verify use "
                "one remote tier: unset KERNEL_CACHE_REDIS_URL / --redis-url or "
                "KERNEL_CACHE_S3_URL / --s3-url"
            )
        return s3
    return RedisSettings.from_env(
        url=args.redis_url,
        timeout_s=args.redis_timeout,
        ttl_s=getattr(args, "redis_ttl", None),
    )


def cmd_warmup(args) -> int:
    from kernel_cache.trust.signing import load_trusted_keys
    from warmup.build.planner import WarmupInterrupted, warmup

    cfg = config_from_args(args)
    variants, shard = _shard_of(cfg, args.shard, args.shards)
    if args.jobs < 1:
        raise KernelCacheError(f"--jobs {args.jobs}: must be >= 1")
    if args.lock_timeout is not None and not args.lock_timeout >= 0:
        raise KernelCacheError(f"--lock-timeout {args.lock_timeout}: must be >= 0 seconds")
    max_size = (
        settings.parse_size(args.max_size, "--max-size")
        if args.max_size
        else settings.get("max_size")
    )
    load_trusted_keys(required=args.require_signed or None)
    remote = _remote_settings(args)
    try:
        report = warmup(
            cfg,
            _cache_dir(args),
            jobs=args.jobs,
            progress=not args.quiet,
            variants=variants,
            max_size=max_size,
            lock_timeout=args.lock_timeout,
            allow_shared_dir=args.insecure_allow_shared_dir or None,
            remote=remote,
        )
    except WarmupInterrupted as e:
        r = e.report
        print(
            f"kernel-cache warmup: {e}; a second warmup compiles only the "
            f"{r['not_started'] + len(r['failed'])} left",
            file=sys.stderr,
        )
        if args.json:
            print(json.dumps({**r, "interrupted": signal.Signals(e.signum).name}, indent=2))
        return 128 + e.signum
    report["shard"] = shard
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_warmup(report, _cache_dir(args), shard)
    return _warmup_status(report)


def _shard_of(cfg, spec: str | None, shards: int | None) -> tuple[list | None, dict | None]:
    """``(variants, shard report)`` of ``--shard I/N|auto`` and ``--shards N``
    (``(None, None)`` without ``--shard``; see
    :func:`warmup.build.shard.resolve_shard`).

    Raises:
        ConfigError: a bad ``--shard`` / ``--shards`` / ``JOB_COMPLETION_INDEX`` /
            ``KERNEL_CACHE_SHARDS``, or ``--shards`` without ``--shard``.
    """
    from kernel_cache.errors import ConfigError
    from warmup.build.shard import resolve_shard, shard_costs, split_plan

    if spec is None:
        if shards is not None:
            raise ConfigError(
                f"--shards {shards} without --shard: add --shard auto (the index from "
                "JOB_COMPLETION_INDEX) or --shard I/N"
            )
        return None, None
    index, count = resolve_shard(spec, shards)
    shards = split_plan(cfg, Bucketer(cfg).variants, count)
    return shards[index], {
        "index": index,
        "count": count,
        "variants": [str(v) for v in shards[index]],
        "expected_compile_s": shard_costs(cfg, shards)[index],
    }


def _print_warmup(report: dict, cache_dir: str, shard: dict | None) -> None:
    """The human-readable summary of a warmup report (stdout)."""
    from kernel_cache.store.housekeeping import format_size

    remote = report["remote"]
    if remote and report["remote_error"]:
        remote = f"{remote} (unavailable: local only)"
    where = cache_dir + (f" and {remote}" if remote else "")
    part = f" (shard {shard['index']}/{shard['count']})" if shard else ""
    print(
        f"warmup{part}: {report['variants']} variants, {report['compiled']} compiled, "
        f"{report['cached']} cached, {report['fetched']} fetched from the remote, "
        f"{len(report['failed'])} failed in {report['seconds']:.1f} s -> {where}"
    )
    for q in report["quarantined"]:
        print(f"  quarantined {q['variant']}: {q['reason']} -> {q['path']}")
    if "gc" in report:
        g = report["gc"]
        print(
            f"size limit {format_size(g['max_size'])}: removed {len(g['removed'])} "
            f"least recently used entries of other plans ({format_size(g['removed_bytes'])}),"
            f" cache now {format_size(g['after_bytes'])}"
        )


def _warmup_status(report: dict) -> int:
    """Exit status of a finished warmup: 1 if a variant failed or the plan alone
    is above the size limit (both explained on stderr), else 0."""
    for f in report["failed"]:
        print(f"  failed {f['variant']}: {f['error']}", file=sys.stderr)
    over = "gc" in report and not report["gc"]["under_limit"]
    if over:
        g = report["gc"]
        print(
            f"kernel-cache warmup: error: the cache holds {g['after_bytes']} bytes of this "
            f"plan's artifacts, above the size limit {g['max_size']} bytes "
            "(--max-size / KERNEL_CACHE_MAX_SIZE); nothing else is left to remove: "
            "raise the limit",
            file=sys.stderr,
        )
    return 1 if report["failed"] or over else 0


def cmd_verify(args) -> int:
    from kernel_cache.trust.signing import load_trusted_keys
    from warmup.check.verify import verify_plan

    cfg = config_from_args(args)
    load_trusted_keys(required=args.require_signed or None)
    tiers = None
    if args.redis_url or args.s3_url:  # coverage: the remote alone must hold the whole plan
        tiers = [_remote_settings(args).tier(fail_open=False)]
    if args.rebuild:
        return _verify_rebuild(args, cfg, tiers)
    report = verify_plan(
        cfg,
        _cache_dir(args),
        bundles=args.bundle,
        tiers=tiers,
        allow_shared_dir=args.insecure_allow_shared_dir or None,
    )
    if tiers:
        report["tier"] = tiers[0].location
        if report.get("repair"):  # the warmup that repairs the remote must publish to it
            report["repair"] += f" --{'s3' if args.s3_url else 'redis'}-url {tiers[0].location}"
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
            _cache_dir(args),
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
TIER_KINDS = {"bundle": "bundle", "disk": "local cache", "redis": "Redis", "s3": "S3"}


def source_lines(report: dict) -> list[str]:
    """Where verify loaded the plan from, one line per tier:
    ``"  6 from bundle /opt/kernel-cache-bundle"``."""
    kinds = report.get("source_kinds", {})
    return [
        f"  {n} from {TIER_KINDS.get(kinds.get(where), kinds.get(where, 'tier'))} {where}"
        for where, n in report["sources"].items()
    ]


def build_parser() -> argparse.ArgumentParser:
    """The ``kernel-cache`` parser: top-level ``-v`` and ``--version``, then the
    subcommands (plan, warmup, verify, export, import, explain, ls, stats, gc,
    clear, keygen, tune), each with its ``func`` and ``-v``."""
    p = argparse.ArgumentParser(prog="kernel-cache", description=__doc__.splitlines()[0])
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    p.add_argument("--version", action=_VersionAction)
    sub = p.add_subparsers(dest="command", required=True)
    _add_plan(sub)
    _add_warmup(sub)
    _add_verify(sub)

    from warmup.cli.commands import add_commands

    add_commands(sub)

    from warmup.tune import add_tune_command

    add_tune_command(sub)
    _add_verbose_to_subcommands(sub)
    p.set_defaults(_subcommands=tuple(sub.choices))
    return p


def _add_plan(sub) -> None:
    """The ``plan`` subcommand's parser on ``sub`` (the subparsers action)."""
    sp = sub.add_parser("plan", help="print the buckets and variants of a plan")
    engine_options(sp)
    shard_options(sp.add_argument_group("sharding (as warmup takes it)"), "list only")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_plan)


def _add_warmup(sub) -> None:
    """The ``warmup`` subcommand's parser on ``sub`` (the subparsers action)."""
    sw = sub.add_parser("warmup", help="compile every missing variant of the plan")
    engine_options(sw)
    sw.add_argument("--cache-dir", default=None, metavar="DIR", help=CACHE_DIR_HELP)
    jobs_option(sw)
    sw.add_argument(
        "--max-size",
        default=None,
        metavar="SIZE",
        help="size limit of the cache (bytes or 500M, 2G; default $KERNEL_CACHE_MAX_SIZE): "
        "entries of other plans are removed, least recently used first",
    )
    sw.add_argument(
        "--lock-timeout",
        type=float,
        default=None,
        help="seconds to wait for another process compiling the same variant "
        "(env KERNEL_CACHE_LOCK_TIMEOUT, default 900)",
    )
    sw.add_argument("--json", action="store_true")
    sw.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress on stderr (by default a progress bar in a terminal, one line per "
        "variant otherwise)",
    )
    trust_option(sw)
    fleet_options(sw, warmup=True)
    sw.set_defaults(func=cmd_warmup)


def _add_verify(sub) -> None:
    """The ``verify`` subcommand's parser on ``sub`` (the subparsers action)."""
    sv = sub.add_parser("verify", help="load every variant of the plan and check it")
    engine_options(sv)
    sv.add_argument("--cache-dir", default=None, metavar="DIR", help=CACHE_DIR_HELP)
    bundle_option(sv)
    sv.add_argument("--json", action="store_true")
    sv.add_argument(
        "--rebuild",
        action="append",
        default=[],
        metavar="VARIANT",
        help="compile VARIANT (KERNEL:QUERY:BLOCKS:SEQS, as `plan` lists it) again in a "
        "scratch directory and compare its bytes with the stored entry, naming the package "
        "members that differ; repeatable; exit 1 unless all are identical",
    )
    trust_option(sv)
    fleet_options(sv, warmup=False)
    sv.set_defaults(func=cmd_verify)


def _add_verbose_to_subcommands(sub) -> None:
    """``-v``/``--verbose`` on every subcommand of ``sub`` (after the
    subcommand as well as before it), and ``_subparser``: the subcommand's own
    parser, for :func:`parse_args`'s messages."""
    for sp in sub.choices.values():
        # before or after the subcommand; SUPPRESS: absent here unless given, so a
        # -v before the subcommand is not reset by the subcommand's default
        sp.add_argument(
            "-v",
            "--verbose",
            action="store_true",
            default=argparse.SUPPRESS,
            help="log at INFO level",
        )
        sp.set_defaults(_subparser=sp)


class _VersionAction(argparse.Action):
    """``--version``: print :func:`version` and exit. The string is made only when
    the option is given (argparse's ``version`` action needs it at parser build,
    for every command)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, **kwargs):
        kwargs.setdefault("help", "show the versions (kernel-cache, torch, Python) and exit")
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version())
        parser.exit()


def version() -> str:
    """``kernel-cache 0.1.0 (torch 2.13.0+cpu, Python 3.11.7)``: the versions that
    are key components too."""
    import platform

    from kernel_cache import __version__
    from kernel_cache.plan.keys import torch_version

    py = platform.python_version()
    return f"kernel-cache {__version__} (torch {torch_version()}, Python {py})"


def parse_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """``parser.parse_args``, but an unknown subcommand or argument is reported
    with the nearest name there is (``did you mean --jobs?``), an argument with
    the subcommand's usage."""
    import difflib

    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    commands = parser.get_default("_subcommands") or ()
    # the top-level options take no value: the first other word is the subcommand
    word = next((a for a in argv if not a.startswith("-")), None)
    if word is not None and commands and word not in commands:
        near = difflib.get_close_matches(word, commands, n=1)
        parser.error(
            f"unknown subcommand {word!r}"
            + (f"; did you mean {near[0]}?" if near else f"; choose from {', '.join(commands)}")
        )
    args, extra = parser.parse_known_args(argv)
    if extra:
        sp = args._subparser
        flags = [f for f in sp._option_string_actions if f.startswith("--")]
        first = next((a for a in extra if a.startswith("-")), "")
        near = difflib.get_close_matches(first.split("=", 1)[0], flags, n=1)
        hint = f"; did you mean {near[0]}?" if near else f"; see kernel-cache {args.command} -h"
        sp.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    return args


#: Exit status after the reader of stdout went away (``| head``): 128 + SIGPIPE,
#: what a shell reports for a command the closed pipe killed.
EXIT_CLOSED_STDOUT = 141


def quiet_on_closed_stdout(main_fn):
    """Wrap a command's ``main``: when stdout's reader has gone (``kernel-cache ls
    --json | head``), exit with :data:`EXIT_CLOSED_STDOUT` and no traceback.

    stdout is flushed before returning, so the error surfaces here rather than
    at interpreter exit, then pointed at ``/dev/null`` so that the final flush
    of what is still buffered succeeds."""

    @functools.wraps(main_fn)
    def wrapper(*args, **kwargs):
        try:
            try:
                return main_fn(*args, **kwargs)
            finally:
                sys.stdout.flush()
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            return EXIT_CLOSED_STDOUT

    return wrapper


@quiet_on_closed_stdout
def main(argv=None) -> int:
    args = parse_args(build_parser(), argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    try:
        return args.func(args)
    except KernelCacheError as e:
        print(f"kernel-cache {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside a warmup's pool (which reports its own)
        kept = "; what was published is kept" if args.command == "warmup" else ""
        print(f"kernel-cache {args.command}: interrupted by SIGINT{kept}", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
