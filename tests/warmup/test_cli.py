"""The command line itself: options, help, errors (no compiles but one)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from kernel_cache.config.engine import make_config
from warmup.cli.main import build_parser, main

from ..conftest import N_TINY, TINY_LIMITS, run_cli, tiny_args


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
    from kernel_cache.config.engine import EngineConfig

    with pytest.raises(SystemExit):
        main(["warmup", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for field in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens"):
        flag = "--" + field.replace("_", "-")
        default = EngineConfig.model_fields[field].default
        assert flag in out and f"(default {default})" in out.split(flag + " N ", 1)[1][:200]


def test_tune_options_have_help_and_are_in_the_readme_and_the_tuning_doc():
    """Every option of ``tune`` beyond the engine options says what it does in
    ``--help`` and appears in the usage lines of README.md and docs/launch_tuning.md."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    tune = sub.choices["tune"]
    engine = {a.dest for a in sub.choices["plan"]._actions}
    own = [a for a in tune._actions if a.dest not in engine | {"help", "verbose"}]
    assert {a.option_strings[0] for a in own} >= {"--block-m", "--out", "--cache-dir", "--jobs"}
    assert [a.option_strings[0] for a in own if not a.help] == []
    readme = (root / "README.md").read_text()
    usage = readme[readme.index("kernel-cache tune    [") : readme.index("ENGINE OPTIONS:")]
    doc = (root / "docs" / "launch_tuning.md").read_text()
    doc_usage = doc[doc.index("kernel-cache tune [") : doc.index("For each variant")]
    for a in own:
        assert a.option_strings[0] in usage and a.option_strings[0] in doc_usage, a.option_strings


TINY = [
    "--model", "llama-3.2-1b", "--max-model-len", "128", "--block-size", "64",
    "--max-num-seqs", "4", "--max-num-batched-tokens", "128",
]  # fmt: skip


@pytest.mark.parametrize("below", [False, True])
@pytest.mark.parametrize("command", [["warmup", *TINY], ["verify", *TINY], ["import", "DIR"]])
def test_cache_dir_that_is_a_file_is_named_with_the_fix(
    tmp_path, monkeypatch, capsys, command, below
):
    """Not a NotADirectoryError traceback, and verify suggests no repair that would
    fail the same way."""
    f = tmp_path / "a-file"
    f.write_text("")
    cache = f / "cache" if below else f
    monkeypatch.setenv("KERNEL_CACHE_DIR", str(cache))
    argv = [str(tmp_path) if a == "DIR" else a for a in command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kernel-cache {command[0]}: error: cache directory {cache} ")
    assert "(from $KERNEL_CACHE_DIR)" in err and "a file, not a directory" in err
    assert f"move {f} out of the way" in err and "repair" not in err
    assert f.read_text() == ""


@pytest.mark.parametrize("too_long", ["a folder name", "the index path"])
@pytest.mark.parametrize("command", [["ls"], ["warmup", *TINY], ["import", "DIR"]])
def test_a_cache_dir_too_long_to_hold_the_cache_is_named_with_the_limit(
    tmp_path, capsys, command, too_long
):
    """A folder name over 255 characters (``ENAMETOOLONG`` from the file
    system), or a path whose index SQLite cannot open (over 511 characters):
    named, with the limit and the fix, before anything is created."""
    if too_long == "a folder name":
        cache, says = tmp_path / ("x" * 300), "is 300 characters, over the 255"
    else:
        cache = tmp_path.joinpath(*["y" * 200] * 3)
        says = "characters, over the 511 SQLite opens"
    argv = [str(tmp_path) if a == "DIR" else a for a in command]
    assert main([*argv, "--cache-dir", str(cache)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kernel-cache {command[0]}: error: cache directory {str(cache)[:120]}")
    assert says in err and "fix: point --cache-dir or $KERNEL_CACHE_DIR at a shorter path" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_default_cache_dir_honours_xdg_cache_home(tmp_path, monkeypatch):
    from kernel_cache.store.disk_tier import default_cache_dir

    monkeypatch.delenv("KERNEL_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "kernel_cache"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # invalid per the spec: ignored
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "kernel_cache"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "kernel_cache"
    monkeypatch.setenv("KERNEL_CACHE_DIR", str(tmp_path / "kc"))
    assert default_cache_dir() == tmp_path / "kc"


def run_with_closed_stdout(*argv):
    """Run ``python ARGV`` with stdout a pipe whose reader has already gone (as in
    ``| head`` once head has exited): every write to stdout fails."""
    from ..conftest import ROOT

    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run(
            [sys.executable, *map(str, argv)],
            stdout=w,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            timeout=300,
        )
    finally:
        os.close(w)


@pytest.mark.parametrize(
    "args,rc",
    [
        (["plan", "--json"], 141),
        (["ls", "--json", "--cache-dir", "DIR"], 141),
        (["ls", "--cache-dir", "DIR"], 1),  # rich's own handling: quiet, exit 1
        (["plan", "--help"], 0),  # argparse ignores a failed write of the help
    ],
)
def test_closed_stdout_exits_quietly(tmp_path, args, rc):
    args = [tmp_path if a == "DIR" else a for a in args]
    proc = run_with_closed_stdout("-m", "warmup.cli.main", *args)
    assert (proc.returncode, proc.stderr) == (rc, "")


def test_replay_without_its_trace_names_trace_before_loading_anything(tmp_path):
    """A clone without ../shared: the error names the default, --trace and where to
    get a trace, before any plan is loaded (none is warm here)."""
    from ..conftest import ROOT

    clone = tmp_path / "clone"
    (clone / "examples").mkdir(parents=True)
    shutil.copy(ROOT / "examples" / "replay_trace.py", clone / "examples")
    proc = subprocess.run(
        [sys.executable, "examples/replay_trace.py", "--cache-dir", tmp_path / "empty"],
        capture_output=True,
        text=True,
        cwd=clone,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    err = proc.stderr
    assert f"trace {tmp_path / 'shared/data/azure-llm-trace-2023/conv.csv'}: no such file" in err
    assert "../shared/data/azure-llm-trace-2023/conv.csv relative to the repository" in err
    assert "--trace PATH" in err and "AzurePublicDataset" in err
    assert "not cached" not in err


@pytest.mark.compile
def test_replay_to_a_closed_stdout_exits_quietly(warm_cache, tiny_model):
    from ..conftest import TRACE, tiny_args

    if not TRACE.is_file():
        pytest.skip(f"no trace at {TRACE}")
    proc = run_with_closed_stdout(
        "examples/replay_trace.py", *tiny_args(tiny_model), "--cache-dir", warm_cache[0],
        "--trace", TRACE, "--limit", "8",
    )  # fmt: skip
    assert (proc.returncode, proc.stderr) == (141, "")


def test_explain_a_variant_outside_the_plan_says_so(tmp_path, capsys):
    import json

    argv = ["explain", *TINY, "--cache-dir", tmp_path]
    argv += ["--variant", "batched_decode:1:1:3", "--variant", "batched_decode:1:1:4"]
    assert main(list(map(str, argv))) == 0
    out = capsys.readouterr().out
    assert "1 miss, 1 not in the plan" in out
    line = next(x for x in out.splitlines() if x.startswith("batched_decode:1:1:3"))
    assert "not in the plan: num_seqs 3 is not a decode-batch bucket of this plan (4)" in line
    assert "warmup never builds it" in line and "dispatch runs that shape as " in line
    assert "batched_decode:1:1:4" in line and " miss " not in line
    assert main(list(map(str, [*argv, "--json"]))) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["status"] for r in doc["results"]] == ["not_in_plan", "miss"]
    assert (doc["hits"], doc["misses"], doc["not_in_plan"]) == (0, 1, 1)


@pytest.mark.parametrize(
    "variant,says",
    [
        # the default plan: query buckets 1, 512, 1024; 128-token blocks
        ("paged_attention:1024:1:1", "no prefill chunk of 513 to 1024 tokens fits in 1 block"),
        ("batched_decode:2:1:4", "batched_decode variants have query_len 1"),
        ("batched_decode:1:1:16", "beyond the plan's limits: num_seqs 16 is above"),
    ],
)
def test_explain_says_why_no_call_has_the_shape(tmp_path, capsys, variant, says):
    argv = ["explain", "--cache-dir", str(tmp_path), "--variant", variant]
    assert main(argv) == 0
    assert says in capsys.readouterr().out


def test_verify_names_the_kind_of_each_source():
    from warmup.cli.verify import source_lines

    report = {
        "sources": {"/opt/b": 4, "/c": 1, "redis://h:6379/0": 1},
        "source_kinds": {"/opt/b": "bundle", "/c": "disk", "redis://h:6379/0": "redis"},
    }
    assert source_lines(report) == [
        "  4 from bundle /opt/b",
        "  1 from local cache /c",
        "  1 from Redis redis://h:6379/0",
    ]


@pytest.mark.compile
def test_verify_says_whether_the_plan_came_from_a_bundle_or_the_cache(
    warm_cache, tiny_model, tmp_path
):
    from ..conftest import run_cli, tiny_args
    from ..signing_keys import make_keypair

    cache = warm_cache[0]
    engine = tiny_args(tiny_model)
    out = run_cli("verify", *engine, "--cache-dir", cache, check=True).stdout
    assert f"\n  {N_TINY} from local cache {cache}\n" in out
    bundle = tmp_path / "bundle"
    keys = make_keypair(tmp_path / "keys")  # a bundle is signed by a builder, checked by engines
    run_cli(
        "export", *engine, "--cache-dir", cache, "--out", bundle, env=keys.builder_env, check=True
    )
    out = run_cli(
        "verify", *engine, "--cache-dir", cache, "--bundle", bundle, env=keys.engine_env,
        check=True,
    ).stdout  # fmt: skip
    assert f"\n  {N_TINY} from bundle {bundle}\n" in out and "local cache" not in out


@pytest.mark.parametrize(
    "argv,says",
    [
        (["warmpu"], "unknown subcommand 'warmpu'; did you mean warmup?"),
        (["-v", "expalin", "--json"], "unknown subcommand 'expalin'; did you mean explain?"),
        (["frobnicate"], "unknown subcommand 'frobnicate'; choose from plan, warmup, verify"),
    ],
)
def test_unknown_subcommand_gets_the_nearest_name(capsys, argv, says):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert f"kernel-cache: error: {says}" in capsys.readouterr().err


def test_plan_lists_every_variant_by_the_name_explain_and_verify_take(tiny_model):
    """``plan``'s text names each variant (``explain --variant`` sends the user there)."""
    from kernel_cache.plan.buckets import Bucketer

    out = run_cli("plan", *tiny_args(tiny_model), check=True).stdout
    listed = [line.strip() for line in out.splitlines() if line.startswith("  ")]
    cfg = make_config(str(tiny_model), **TINY_LIMITS)
    names = [str(v) for v in Bucketer(cfg).variants]
    assert [n for n in listed if n in names] == names


def test_explain_names_each_changed_compile_option_with_both_values_uncut():
    """A differing JSON-object component (compile options, launch config, geometry)
    is shown field by field, not cut to its first characters."""
    from warmup.check.explain import format_difference

    here = {"aot_inductor.debug_compile": False, "cpp.march": "x86-64-v3", "max_autotune": False}
    stored = {"aot_inductor.debug_compile": True, "max_autotune": False, "old": 1}
    line = format_difference(
        {
            "component": "compile_options",
            "here": json.dumps(here),
            "stored": json.dumps(stored),
            "build_only": False,
        }
    )
    assert line == (
        "compile_options: aot_inductor.debug_compile: false != true; "
        'cpp.march new ("x86-64-v3"); old gone (was 1)'
    )


@pytest.mark.parametrize(
    ("flag", "env", "jobs"),
    [(None, None, min(2, os.cpu_count() or 1)), (None, "3", 3), (["--jobs", "2"], "1", 2)],
)
def test_jobs_come_from_the_flag_then_kernel_cache_jobs_then_the_cpus(monkeypatch, flag, env, jobs):
    from warmup.cli.options import jobs_of

    monkeypatch.delenv("KERNEL_CACHE_JOBS", raising=False)
    if env is not None:
        monkeypatch.setenv("KERNEL_CACHE_JOBS", env)
    args = build_parser().parse_args(["warmup", *(flag or [])])
    assert jobs_of(args) == jobs


@pytest.mark.parametrize(("env", "says"), [("0", ">= 1"), ("two", "integer"), ("2000", "1024")])
def test_a_bad_kernel_cache_jobs_is_named_before_anything_compiles(tmp_path, env, says):
    cache = tmp_path / "cache"
    proc = run_cli("warmup", "--cache-dir", cache, env={"KERNEL_CACHE_JOBS": env})
    assert proc.returncode != 0
    assert "KERNEL_CACHE_JOBS" in proc.stderr and env in proc.stderr, proc.stderr
    assert says in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not cache.exists() or not any(cache.rglob("*.pt2"))


@pytest.mark.parametrize("cmd", ["warmup", "tune"])
@pytest.mark.parametrize("jobs", ["0", "1025", "99999999999999999999"])
def test_a_jobs_flag_out_of_the_variables_range_is_refused_with_its_fix(tmp_path, cmd, jobs):
    """``--jobs`` has the limits of ``KERNEL_CACHE_JOBS`` (1..1024): a huge count is
    refused before any worker starts or any file is written, not passed to the pool."""
    cache = tmp_path / "cache"
    extra = ["--variants", "batched_decode:1:32:4", "--out", str(tmp_path / "t.json")]
    proc = run_cli(cmd, "--cache-dir", cache, "--jobs", jobs, *(extra if cmd == "tune" else []))
    assert proc.returncode == 2, proc.stderr
    assert f"--jobs {jobs}" in proc.stderr and "<= 1024" in proc.stderr, proc.stderr
    assert "fix:" in proc.stderr and "Traceback" not in proc.stderr
    assert not cache.exists() and not (tmp_path / "t.json").exists()
