"""Hostile objects and bad settings for the S3 tier, against a real SeaweedFS
server, in fresh engine processes: a writer of the bucket without the signing
key, a deeply nested metadata record, an endpoint without a scheme and a
timeout Python prints in exponent notation. Each must end in a miss or a
clear error naming the input, never a crash of engine start."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kernel_cache.plan.buckets import Bucketer
from kernel_cache.plan.keys import build_key, environment
from kernel_cache.store import imports_memo
from kernel_cache.store.s3 import S3Settings, S3Tier
from kernel_cache.store.s3_objects import pack

from ..conftest import ROOT
from ..kc_helpers import knowing_cxx
from . import test_s3_tier
from .test_s3_tier import _env

# the S3 tier's fixtures: the shared server, a fresh prefix of the test bucket
s3_server = test_s3_tier.s3_server
s3 = test_s3_tier.s3


#: Engine start of the tiny plan (model argv[1], cache argv[2]): prints
#: "missing N" or "loaded"; any exception is the process's own traceback.
ENGINE = r"""
import sys
from kernel_cache import load_plan, make_config
from kernel_cache.errors import MissingVariantsError
cfg = make_config(sys.argv[1], max_model_len=32, block_size=16, max_num_seqs=4,
                  max_num_batched_tokens=32, kv_buckets=(32,))
try:
    load_plan(cfg, sys.argv[2])
except MissingVariantsError as e:
    print("missing", len(e.missing))
else:
    print("loaded")
"""


def _engine(model, cache, env, code: str = ENGINE) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, str(model), str(cache)],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300,
    )  # fmt: skip


def test_a_deeply_nested_record_in_the_bucket_is_a_miss_not_a_crash(
    s3, tiny_model, tiny_config, tmp_path
):
    import obstore

    tier = S3Tier(S3Settings(url=s3["url"], timeout_s=15))
    keys = [build_key(tiny_config, v).hexdigest for v in Bucketer(tiny_config).variants]
    poison = pack(b"", b"[" * 200_000)  # json.loads raises RecursionError on it
    for k in keys:
        obstore.put(tier.store, f"entries/{k}", poison)
    # The engine's local cache records this machine's compiler as warmup leaves it
    # (engine start runs none), so it asks for these exact keys and reads the poison.
    local = tmp_path / "c"
    local.mkdir(mode=0o700)
    assert imports_memo.save(local, cxx=environment(tiny_config)["cxx"])
    proc = _engine(tiny_model, local, _env(KERNEL_CACHE_S3_URL=s3["url"]))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["missing", str(len(keys))]
    assert "RecursionError" not in proc.stderr and "nested too deep" in proc.stderr
    tier.close()


def test_an_endpoint_without_a_scheme_is_a_clear_error_not_a_panic(s3, tiny_model, tmp_path):
    env = _env(KERNEL_CACHE_S3_URL=s3["url"], AWS_ENDPOINT_URL="127.0.0.1:9000")
    proc = _engine(tiny_model, tmp_path / "c", env)
    assert proc.returncode != 0
    assert "PanicException" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "ConfigError" in last and "AWS_ENDPOINT_URL='127.0.0.1:9000'" in last
    assert "https://" in last  # the fix


def test_a_small_timeout_reaches_the_client_as_a_duration_it_parses(s3):
    # str(1e-05) is "1e-05", which obstore's duration parser refuses: the tier
    # then never made a request and called the store "unavailable"
    tier = S3Tier(S3Settings(url=s3["url"], timeout_s=1e-05), warn=False)
    tier.contains("0" * 64)
    assert tier.error is None or "parse" not in tier.error, tier.error
    tier.close()
    ok = S3Tier(S3Settings(url=s3["url"], timeout_s=15), fail_open=False)
    assert ok.contains("0" * 64) is False and ok.error is None
    assert json.loads(ok.settings.model_dump_json())["timeout_s"] == 15
    ok.close()


def _peak_rss_mib(model, cache, env) -> tuple[subprocess.CompletedProcess, float]:
    """An engine start in a child, and that child's peak resident size (MiB), read
    by the child from the kernel at exit (``VmHWM`` of ``/proc/self/status``: its
    own memory since exec, where ``ru_maxrss`` would count the parent's at fork)."""
    code = ENGINE + (
        "\nprint(next(ln.split()[1] for ln in open('/proc/self/status') "
        "if ln.startswith('VmHWM:')))\n"
    )
    proc = _engine(model, cache, env, code)
    return proc, int(proc.stdout.split()[-1]) / 1024


@pytest.mark.slow
def test_an_object_over_the_size_limit_is_refused_before_its_body_is_read(
    s3, tiny_model, tiny_config, tmp_path
):
    """A bucket writer cannot fill an engine's memory: a 200 MiB object under an
    entry's name is refused from its size header (the engine's peak RSS stays
    within 50 MiB of a start that finds nothing)."""
    import obstore

    tier = S3Tier(S3Settings(url=s3["url"], timeout_s=15))
    keys = [build_key(tiny_config, v).hexdigest for v in Bucketer(tiny_config).variants]
    env = _env(KERNEL_CACHE_S3_URL=s3["url"], KERNEL_CACHE_S3_MAX_OBJECT="1M")
    control, base = _peak_rss_mib(tiny_model, knowing_cxx(tmp_path / "c0"), env)
    assert control.stdout.split()[:2] == ["missing", str(len(keys))], control.stderr[-2000:]
    obstore.put(tier.store, f"entries/{keys[0]}", pack(b"\0" * (200 << 20), b"{}"))
    try:
        proc, peak = _peak_rss_mib(tiny_model, knowing_cxx(tmp_path / "c1"), env)
    finally:  # the run's shared server holds 2 GiB: leave the room to later tests
        obstore.delete(tier.store, f"entries/{keys[0]}")
        tier.close()
    assert proc.stdout.split()[:2] == ["missing", str(len(keys))], proc.stderr[-2000:]
    assert "over the limit of 1048576 (KERNEL_CACHE_S3_MAX_OBJECT)" in proc.stderr
    assert peak - base < 50, (peak, base)
