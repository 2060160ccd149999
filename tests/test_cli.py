"""The command line itself: options, help, errors (no compiles)."""

import pytest

from warmup.cli import build_parser, main


@pytest.mark.parametrize(
    "argv,verbose",
    [
        (["plan"], False),
        (["-v", "plan"], True),
        (["plan", "-v"], True),
        (["ls", "--verbose"], True),
    ],
)
def test_verbose_before_or_after_the_subcommand(argv, verbose):
    assert build_parser().parse_args(argv).verbose is verbose


def test_version(capsys):
    import torch

    from kernel_cache import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"kernel-cache {__version__} ") and torch.__version__ in out


@pytest.mark.parametrize(
    "argv,near",
    [
        (["warmup", "--jbos", "2"], "did you mean --jobs?"),
        (["plan", "--max-model-lenn=128"], "did you mean --max-model-len?"),
        (["explain", "--varaint", "batched_decode:1:1:4"], "did you mean --variant?"),
        (["plan", "stray"], "see kernel-cache plan -h"),
    ],
)
def test_unknown_argument_shows_the_subcommands_usage_and_the_nearest_option(capsys, argv, near):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: kernel-cache {argv[0]} ")
    assert f"kernel-cache {argv[0]}: error: unrecognized arguments: " in err
    assert err.rstrip().endswith(near)


def test_help_shows_the_engine_limits_defaults(capsys):
    from kernel_cache.config import EngineConfig

    with pytest.raises(SystemExit):
        main(["warmup", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for field in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens"):
        flag = "--" + field.replace("_", "-")
        default = EngineConfig.model_fields[field].default
        assert flag in out and f"(default {default})" in out.split(flag + " N ", 1)[1][:200]
