"""The fleet recipe of docs/fleet.md: its files parse and its steps work.

The fast tests read ``examples/fleet/warmup-job.yaml`` (PyYAML), the
Dockerfile and docs/fleet.md, and parse every ``kernel-cache`` command line in
them with the real parser (:func:`warmup.cli.main.build_parser`): a renamed or
misspelt option fails here, not in a user's cluster. The compiling test runs
the recipe's steps without Kubernetes or Docker against a real SeaweedFS server:
two ``--shard auto`` builders (``JOB_COMPLETION_INDEX`` 0 and 1) sign into one
bucket, a release step exports a bundle with only the public key, and the
image's check stage (import, verify from the bundle alone) passes. It compiles
the tiny plan with the oracle's plain kernels (``PLAIN_KERNELS`` of
``tests/conftest.py``): the recipe's steps work whatever the kernels compute,
and those compile for less.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from kernel_cache.plan.buckets import Bucketer
from warmup.builder.shard import resolve_shard, split_plan
from warmup.cli.main import build_parser, config_from_args, parse_args

from ..conftest import ROOT, plain_args, run_cli
from ..signing_keys import make_keypair
from ..store.test_s3_tier import s3, s3_server  # noqa: F401 - fixtures: the shared SeaweedFS server

FLEET = ROOT / "examples" / "fleet"
JOB = FLEET / "warmup-job.yaml"
DOCKERFILE = FLEET / "Dockerfile"
DOC = ROOT / "docs" / "fleet.md"


def _parse(argv: list[str]):
    """``kernel-cache ARGV`` through the real parser; fails the test on a parse error."""
    assert argv[0].endswith("kernel-cache"), argv
    try:
        return parse_args(build_parser(), argv[1:])
    except SystemExit as e:
        pytest.fail(f"`{shlex.join(argv)}` does not parse (exit {e.code})")


def _container(doc: dict) -> dict:
    (c,) = doc["spec"]["template"]["spec"]["containers"]
    return c


def test_the_job_is_an_indexed_job_whose_pods_cover_the_plan():
    doc = yaml.safe_load(JOB.read_text())
    spec = doc["spec"]
    assert doc["apiVersion"] == "batch/v1" and doc["kind"] == "Job"
    assert spec["completionMode"] == "Indexed"
    n = spec["completions"]
    assert spec["parallelism"] == n and spec["template"]["spec"]["restartPolicy"] == "Never"
    args = _parse(_container(doc)["command"])
    assert args.command == "warmup" and args.shard == "auto" and args.shards == n
    assert args.s3_url.startswith("s3://") and args.require_signed and args.require_publish
    cfg = config_from_args(args)
    plan = Bucketer(cfg).variants
    assert len(plan) == 17  # the built-in default plan, spelled out
    pods = [resolve_shard("auto", args.shards, {"JOB_COMPLETION_INDEX": str(i)}) for i in range(n)]
    assert pods == [(i, n) for i in range(n)]
    shards = split_plan(cfg, plan, n)
    assert sorted(map(str, (v for s in shards for v in s))) == sorted(map(str, plan))


def test_the_job_takes_credentials_and_the_private_key_from_secrets():
    doc = yaml.safe_load(JOB.read_text())
    c = _container(doc)
    env = {e["name"]: e for e in c["env"]}
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert env[name]["valueFrom"]["secretKeyRef"]["key"] == name
    assert "KERNEL_CACHE_SIGNING_KEY" not in env  # the retired inline secret
    key_file = env["KERNEL_CACHE_SIGNING_KEY_FILE"]["value"]
    volumes = {v["name"]: v for v in doc["spec"]["template"]["spec"]["volumes"]}
    (mount,) = [m for m in c["volumeMounts"] if key_file.startswith(m["mountPath"] + "/")]
    assert mount["readOnly"] is True
    secret = volumes[mount["name"]]["secret"]
    assert secret["defaultMode"] == 0o400
    assert os.path.basename(key_file) == "signing.key"


def _dockerfile_commands() -> tuple[list[list[str]], list[str]]:
    """Every ``kernel-cache`` command of the Dockerfile (ARG defaults expanded)
    and its stages as text, in order."""
    text = DOCKERFILE.read_text()
    logical = re.sub(r"\\\n\s*", " ", text)  # join continuation lines
    args = dict(re.findall(r'^ARG (\w+)="?([^"\n]*)"?$', logical, re.M))
    cmds = []
    for line in logical.splitlines():
        if line.startswith("RUN "):
            parts = line[4:].split("&&")
        elif line.startswith("CMD "):
            parts = [json.loads(line[4:])[-1].removeprefix("exec ")]
        else:
            continue
        for part in parts:
            part = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), part)
            words = shlex.split(part)
            if words and words[0] == "exec":
                words = words[1:]
            if words and words[0].endswith("kernel-cache"):
                cmds.append(words)
    stages = re.split(r"^FROM ", logical, flags=re.M)[1:]
    return cmds, stages


def test_dockerfile_checks_the_signed_bundle_and_ships_no_private_key():
    cmds, stages = _dockerfile_commands()
    parsed = [_parse(c) for c in cmds]
    assert [a.command for a in parsed] == ["import", "verify", "verify"]
    imp, verify, run = parsed
    assert verify.bundle == [imp.dir] and verify.require_signed
    job = _parse(_container(yaml.safe_load(JOB.read_text()))["command"])
    assert config_from_args(run) == config_from_args(verify) == config_from_args(job)  # one plan
    check, engine = stages
    assert check.startswith("${PYTHON_IMAGE} AS check")
    assert "KERNEL_CACHE_TRUSTED_KEYS=/etc/kernel-cache/signing.pub" in check
    assert engine.startswith("${PYTHON_IMAGE} AS engine")
    assert "COPY --from=check /opt/kernel-cache-bundle" in engine  # so `check` always runs
    for needle in ("KERNEL_CACHE_BUNDLE=", "KERNEL_CACHE_TRUSTED_KEYS=", "REQUIRE_SIGNED=1"):
        assert needle in engine
    text = DOCKERFILE.read_text()
    assert "SIGNING_KEY_FILE" not in text and "signing.key" not in text
    assert "g++" not in text  # neither stage compiles


def test_the_doc_shows_the_example_files_as_they_are():
    doc = DOC.read_text()
    for path, lang in ((JOB, "yaml"), (DOCKERFILE, "dockerfile")):
        assert f"```{lang}\n{path.read_text()}```" in doc, f"docs/fleet.md differs from {path}"


def test_every_command_of_the_doc_parses():
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S)
    lines = [
        line
        for b in blocks
        for line in re.sub(r"\\\n\s*", " ", b).splitlines()
        if line.startswith("kernel-cache ")
    ]
    assert len(lines) >= 3
    for line in lines:
        _parse(shlex.split(line.split("#", 1)[0]))


# -- the recipe's steps, without Kubernetes or Docker (compiles the tiny plan) --------------


@pytest.mark.compile
def test_recipe_indexed_builders_to_s3_then_a_signed_bundle(s3, tiny_model, plain_config, tmp_path):  # noqa: F811
    """Two builders as the Job's pods (``--shard auto --shards 2``, JOB_COMPLETION_INDEX
    0 and 1, the private key as a file) compile each variant once into one
    bucket; the release export with only the public key makes a bundle that the
    image's check stage (import, then verify from the bundle alone, signatures
    required) accepts; a release trusting another key refuses the bucket."""
    fleet, other = make_keypair(tmp_path / "fleet"), make_keypair(tmp_path / "other")
    log = tmp_path / "compiles.log"
    base = {k: v for k, v in os.environ.items() if not k.startswith("KERNEL_CACHE_")}
    base.update(s3["env"], KERNEL_CACHE_S3_TIMEOUT="15")
    # The run's precompiled headers, as the run's other warmups use: headers of
    # each pod's own would cost a header build per pod and prove nothing here.
    if "KERNEL_CACHE_PCH_DIR" in os.environ:
        base["KERNEL_CACHE_PCH_DIR"] = os.environ["KERNEL_CACHE_PCH_DIR"]
    builders = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "warmup.cli.main",
                "warmup",
                *plain_args(tiny_model),
                "--shard",
                "auto",
                "--shards",
                "2",
                "--s3-url",
                s3["url"],
                "--require-signed",
                "--jobs",
                "1",
                "--json",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={
                **base,
                "JOB_COMPLETION_INDEX": str(i),
                "KERNEL_CACHE_SIGNING_KEY_FILE": str(fleet.private),
                "KERNEL_CACHE_DIR": str(tmp_path / f"pod{i}"),
                "KERNEL_CACHE_TEST_COMPILE_LOG": str(log),
            },
        )  # fmt: skip
        for i in range(2)
    ]
    reports = []
    for p in builders:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err
        reports.append(json.loads(out))
    plan = sorted(str(v) for v in Bucketer(plain_config).variants)
    assert [(r["shard"]["index"], r["shard"]["count"]) for r in reports] == [(0, 2), (1, 2)]
    assert sorted(v for r in reports for v in r["shard"]["variants"]) == plan
    assert sorted(line.split()[1] for line in log.read_text().splitlines()) == plan

    release = {**base, "KERNEL_CACHE_S3_URL": s3["url"]}
    bundle = tmp_path / "kc-release" / "bundle"
    refused = run_cli(
        "export", *plain_args(tiny_model), "--cache-dir", tmp_path / "rel0", "--out", bundle,
        env={**release, "KERNEL_CACHE_TRUSTED_KEYS": str(other.public)},
    )  # fmt: skip
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "rejected s3 entry" in refused.stderr and "which is not trusted" in refused.stderr
    assert not bundle.exists()
    run_cli(
        "export", *plain_args(tiny_model), "--cache-dir", tmp_path / "rel", "--out", bundle,
        env={**release, "KERNEL_CACHE_TRUSTED_KEYS": str(fleet.public)}, check=True,
    )  # fmt: skip

    image = {**base, "KERNEL_CACHE_TRUSTED_KEYS": str(fleet.public)}
    image["KERNEL_CACHE_REQUIRE_SIGNED"] = "1"  # the check stage's environment
    run_cli("import", bundle, "--cache-dir", tmp_path / "kc-import", env=image, check=True)
    proc = run_cli(
        "verify", *plain_args(tiny_model), "--bundle", bundle, "--cache-dir", tmp_path / "none",
        "--require-signed", "--json", env=image,
    )  # fmt: skip
    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["ok"], proc.stderr
    assert report["loaded"] == len(plan) and report["compiled"] == 0
    assert list(report["sources"]) == [str(bundle)]
    assert not (tmp_path / "none").exists()
