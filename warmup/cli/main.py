"""The ``kernel-cache`` command line (plan, warmup, verify, tune, bundles, housekeeping, keygen).

Subcommands: plan and warmup in :mod:`warmup.cli.build`; verify in
:mod:`warmup.cli.verify`; export, import, explain, ls, stats, gc, clear, keygen in
:mod:`warmup.cli.commands`; tune in :mod:`warmup.tune.cli`. Options several
subcommands take are parent parsers (:class:`warmup.cli.options.Parents`).
This module builds the parser, parses (naming the nearest option on a typo) and
runs the command.

ENGINE OPTIONS default to the built-in default plan
(:data:`kernel_cache.config.engine.DEFAULT_MODEL` with :class:`EngineConfig`'s
defaults, as ``make_config(DEFAULT_MODEL)``): ``kernel-cache warmup`` with no
options warms it.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys

from kernel_cache.errors import KernelCacheError
from warmup.cli.options import (  # noqa: F401 - re-exported: benchmarks and examples import them here
    CACHE_DIR_HELP,
    apply_unsigned_flag,
    bundle_option,
    cache_dir_of,
    config_from_args,
    engine_options,
    jobs_option,
    make_parents,
    trust_option,
)

#: ``kernel-cache --help``'s first line.
DESCRIPTION = (
    "kernel-cache: plan, compile (warmup), check (verify), tune and share compiled "
    "attention kernels; bundles, housekeeping and signing keys"
)


def build_parser() -> argparse.ArgumentParser:
    """The ``kernel-cache`` parser: top-level ``-v`` and ``--version``, then the
    subcommands (plan, warmup, verify, export, import, explain, ls, stats, gc,
    clear, keygen, tune), each with its ``func`` and ``-v``."""
    from warmup.cli.build import add_build_commands
    from warmup.cli.commands import add_commands
    from warmup.cli.verify import add_verify_command
    from warmup.tune.cli import add_tune_command

    p = argparse.ArgumentParser(prog="kernel-cache", description=DESCRIPTION)
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    p.add_argument("--version", action=_VersionAction)
    sub = p.add_subparsers(dest="command", required=True)
    parents = make_parents()
    add_build_commands(sub, parents)
    add_verify_command(sub, parents)
    add_commands(sub, parents)
    add_tune_command(sub, parents)
    _add_verbose_to_subcommands(sub)
    p.set_defaults(_subcommands=tuple(sub.choices))
    return p


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
        apply_unsigned_flag(args)
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
