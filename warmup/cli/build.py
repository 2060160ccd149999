"""``kernel-cache plan`` and ``kernel-cache warmup``: show a plan (its buckets,
variants, kernels, launch configs, a shard of it) and compile what it misses
(:func:`warmup.builder.planner.warmup`)."""

from __future__ import annotations

import json
import signal
import sys

from kernel_cache.errors import KernelCacheError
from kernel_cache.plan.buckets import Bucketer
from kernel_cache.plan.launch import describe_plan, format_plan
from warmup.cli.options import (
    Parents,
    cache_dir_of,
    config_from_args,
    fleet_options,
    jobs_of,
    remote_settings_of,
    require_publish,
    shard_options,
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
        + (f", KV cache {cfg.kv_cache_dtype}" if cfg.kv_fp8 else "")
    )
    print(f"kv buckets (tokens):   {list(b.kv_buckets)}")
    print(f"kv buckets (blocks):   {list(b.num_blocks_buckets)}")
    print(f"query buckets:         {list(b.query_buckets)}")
    print(f"num_seqs buckets:      {list(b.num_seqs_buckets)}")
    for slot, path in doc["kernels"].items():
        print(f"kernel {slot}: {path}")
    n_pa = sum(v.kernel == "paged_attention" for v in b.variants)
    n_bd = sum(v.kernel == "batched_decode" for v in b.variants)
    declared = "".join(
        f", {sum(v.kernel == s.name for v in b.variants)} {s.name}" for s in cfg.slots
    )
    print(
        f"variants: {len(b.variants)} ({n_pa} paged_attention, "
        f"{n_bd} batched_decode{declared}); fingerprint {doc['fingerprint']}"
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

    names = [*SLOTS, *(s.name for s in cfg.slots)]
    return {slot: kernel_path(cfg, slot) for slot in names}


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


def cmd_warmup(args) -> int:
    from kernel_cache.config import settings
    from kernel_cache.trust.keys import load_trusted_keys
    from warmup.builder.planner import WarmupInterrupted, warmup

    cfg = config_from_args(args)
    variants, shard = _shard_of(cfg, args.shard, args.shards)
    jobs = jobs_of(args)
    if args.lock_timeout is not None and not args.lock_timeout >= 0:
        raise KernelCacheError(f"--lock-timeout {args.lock_timeout}: must be >= 0 seconds")
    max_size = (
        settings.parse_size(args.max_size, "--max-size")
        if args.max_size
        else settings.get("max_size")
    )
    load_trusted_keys(required=args.require_signed or None)
    remote = remote_settings_of(args)
    must_publish = require_publish(args)
    if must_publish and remote is None:
        raise KernelCacheError(
            "--require-publish / KERNEL_CACHE_REQUIRE_PUBLISH: no shared tier to publish to; "
            "set --remote-url / KERNEL_CACHE_REMOTE_URL or --redis-url / KERNEL_CACHE_REDIS_URL"
        )
    try:
        report = warmup(
            cfg,
            cache_dir_of(args),
            jobs=jobs,
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
        _print_warmup(report, cache_dir_of(args), shard)
    status = _warmup_status(report)
    if must_publish and report["not_published"]:
        print(
            "kernel-cache warmup: error: --require-publish: the shared tier did not get every "
            f"entry: {report['not_published']}",
            file=sys.stderr,
        )
        return status or 1
    return status


def _shard_of(cfg, spec: str | None, shards: int | None) -> tuple[list | None, dict | None]:
    """``(variants, shard report)`` of ``--shard I/N|auto`` and ``--shards N``
    (``(None, None)`` without ``--shard``; see
    :func:`warmup.builder.shard.resolve_shard`).

    Raises:
        ConfigError: a bad ``--shard`` / ``--shards`` / ``JOB_COMPLETION_INDEX`` /
            ``KERNEL_CACHE_SHARDS``, or ``--shards`` without ``--shard``.
    """
    from kernel_cache.errors import ConfigError
    from warmup.builder.shard import resolve_shard, shard_costs, split_plan

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
    line = _publish_line(report)
    if line:
        print(line)


def _publish_line(report: dict) -> str | None:
    """The summary's last line with a shared tier: how many entries it got from
    this run, signed by which key, and why it lacks any (None without a remote)."""
    if not report["remote"]:
        return None
    n, by = report["published"], report["signed_by"]
    signed = f", signed by key {by}" if by else ", unsigned" if n else ""
    if report["not_published"]:
        got = f"published {n} entries" if n else "published nothing"
        return f"{got} to {report['remote']}{signed}: {report['not_published']}"
    return f"published {n} entries to {report['remote']}{signed}"


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


def add_build_commands(sub, parents: Parents) -> None:
    """Register ``plan`` and ``warmup`` on ``sub`` (the subparsers action)."""
    sp = sub.add_parser(
        "plan",
        parents=[parents.engine, parents.json],
        help="print the buckets and variants of a plan",
    )
    shard_options(sp.add_argument_group("sharding (as warmup takes it)"), "list only")
    sp.set_defaults(func=cmd_plan)

    sw = sub.add_parser(
        "warmup",
        parents=[
            parents.engine,
            parents.cache_dir,
            parents.jobs,
            parents.json,
            parents.trust,
            parents.unsigned,
        ],
        help="compile every missing variant of the plan",
    )
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
    sw.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress on stderr (by default a progress bar in a terminal, one line per "
        "variant otherwise)",
    )
    fleet_options(sw, warmup=True)
    sw.set_defaults(func=cmd_warmup)
