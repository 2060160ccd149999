"""The ``kernel-cache tune`` subcommand: its parser (:func:`add_tune_command`)
and :func:`cmd_tune`."""

from __future__ import annotations

import json

from kernel_cache.config.recipe import device_arch
from kernel_cache.plan.buckets import KernelVariant
from warmup.tune.candidates import TuneSettings
from warmup.tune.run import check_variants, tune
from warmup.tune.table import check_out, print_summary, write_table

#: The prefill tile options of ``tune`` and their defaults (:class:`TuneSettings`).
PREFILL_TILE_OPTIONS = {
    name: ",".join(map(str, TuneSettings.model_fields[name].default))
    for name in ("block_m", "block_n", "num_warps", "num_stages")
}


def cmd_tune(args) -> int:
    """``kernel-cache tune``: see the module docstring."""
    from kernel_cache.plan.buckets import parse_bucket_list
    from warmup.cli.options import cache_dir_of, config_from_args, jobs_of

    cfg = config_from_args(args)
    jobs = jobs_of(args)
    variants = [
        KernelVariant.parse(t, "--variants") for a in args.variants for t in a.split(",") if t
    ]
    tiles = {
        name: parse_bucket_list(getattr(args, name), f"--{name.replace('_', '-')}", example)
        for name, example in PREFILL_TILE_OPTIONS.items()
    }
    settings = TuneSettings(
        num_kv_splits=parse_bucket_list(args.num_kv_splits, "--num-kv-splits", "1,2,4"),
        chunks_per_split=parse_bucket_list(args.chunks_per_split, "--chunks-per-split", "1,2,4"),
        **tiles,
        rounds=args.rounds,
        target_ms=args.target_ms,
        min_gain=args.min_gain,
    )
    settings.check()
    check_variants(cfg, variants)
    # a device that cannot be used (cuda without a GPU) is refused before --out's
    # directories are created
    device_arch(cfg.device, cfg.cpu_target)
    check_out(args.out)  # before any compiling and timing, which can take hours
    echo = None if args.json else (lambda m: print(m, flush=True))
    report = tune(
        cfg, variants, cache_dir_of(args), settings, jobs=jobs, progress=not args.json,
        echo=echo,
    )  # fmt: skip
    out = write_table(report["table"], args.out)
    if args.json:
        print(json.dumps({k: v for k, v in report.items() if k != "table"} | {"out": str(out)}))
    else:
        print_summary(report, out)
    return 0


def add_tune_command(sub, parents) -> None:
    """Register ``tune`` on the ``kernel-cache`` subparsers (``parents``:
    :class:`warmup.cli.options.Parents`)."""
    st = sub.add_parser(
        "tune",
        parents=[parents.engine, parents.cache_dir, parents.jobs, parents.json],
        help="time launch-config candidates of decode (and CUDA prefill) variants, write a "
        "launch table",
        description="Compile the candidates of each variant, check them against the "
        "reference, time them warm (medians of interleaved rounds) and write the fastest "
        "that beats the defaults beyond noise to a table in the bundled format "
        "(use it with KERNEL_CACHE_TUNING=FILE). Results are cached; a rerun resumes.",
    )
    st.add_argument(
        "--variants",
        nargs="+",
        required=True,
        metavar="KERNEL:QUERY:BLOCKS:SEQS",
        help="variants of the plan, e.g. batched_decode:1:32:8; on CUDA also "
        "paged_attention ones (the prefill tiles), e.g. paged_attention:512:32:1",
    )
    st.add_argument("--out", required=True, help="the table to write (JSON)")
    st.add_argument("--num-kv-splits", default="1,2,4", help="split counts to try (default 1,2,4)")
    st.add_argument(
        "--chunks-per-split",
        default="1,2,4",
        help="online-softmax steps per split to try (default 1,2,4)",
    )
    for name, default in PREFILL_TILE_OPTIONS.items():
        st.add_argument(
            f"--{name.replace('_', '-')}",
            default=default,
            help=f"CUDA prefill: {name} values to try (default {default})",
        )
    st.add_argument("--rounds", type=int, default=15, help="timing rounds (default 15)")
    st.add_argument(
        "--target-ms", type=float, default=50.0, help="ms per timing sample (default 50)"
    )
    st.add_argument(
        "--min-gain",
        type=float,
        default=0.05,
        help="fraction a candidate must beat the defaults by (default 0.05)",
    )
    st.set_defaults(func=cmd_tune)
