"""The object-store tier on a ``file://`` directory, and the local cache refused
on a network or FUSE filesystem.

Fast tests run the tier on a directory of this machine. The shared-filesystem
tests mount one SeaweedFS filer directory twice with ``weed mount``
(:mod:`tests.fuse_mounts`), as a ReadWriteMany volume is mounted on two hosts;
they skip, saying why, where FUSE cannot run. Compiles are counted by
``KERNEL_CACHE_TEST_COMPILE_LOG`` (the compiler hook), not by warmup's report.
The compiling test builds the tiny plan with the oracle's plain kernels
(``PLAIN_KERNELS`` of ``tests/conftest.py``: one compile per variant holds for
any kernel, and those compile for less).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from kernel_cache.errors import ConfigError, NetworkFilesystemError
from kernel_cache.plan.buckets import Bucketer
from kernel_cache.plan.keys import build_key
from kernel_cache.store.disk_tier import DiskTier, PutOutcome, make_meta, verify_entry
from kernel_cache.store.fs_type import check_local, filesystem_type
from kernel_cache.store.redis import ACQUIRED, BUSY
from kernel_cache.store.remote import tiers_from_env
from kernel_cache.store.remote_base import RemoteUnavailableError
from kernel_cache.store.s3 import S3Settings, S3Tier
from kernel_cache.store.s3_objects import manifest_name

from ..conftest import PLAIN_KERNELS, ROOT, plain_args, run_cli, tiny_args
from ..fuse_mounts import SharedMounts, fuse_unavailable
from ..kc_helpers import check_lease_lifecycle, engine_start
from ..signing_keys import make_keypair

_CLEAN = (
    "KERNEL_CACHE_REDIS_URL",
    "KERNEL_CACHE_S3_URL",
    "KERNEL_CACHE_REMOTE_URL",
    "KERNEL_CACHE_SIGNING_KEY_FILE",
    "KERNEL_CACHE_TRUSTED_KEYS",
    "KERNEL_CACHE_DIR",
)


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _CLEAN}
    return {**env, **extra}


def _tier(directory, **kw) -> S3Tier:
    return S3Tier(S3Settings(url=f"file://{directory}", timeout_s=15), **kw)


# -- settings ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url, match",
    [
        ("http://x/y", "must start with s3://, gs://, az://"),
        ("file://host/x", "absolute directory path and no host"),
        ("file://relative", "absolute directory path"),
        ("gs:///p", "names no bucket"),
        ("file:///%2F", "absolute directory path"),  # the root, percent-encoded
        ("file:///tmp/kc%00x", "absolute directory path"),
    ],
)
def test_a_bad_remote_url_names_the_setting_and_the_forms(url, match):
    with pytest.raises(ConfigError, match=match) as e:
        S3Settings.from_env(url=url, environ={})
    assert "--remote-url" in str(e.value)


def test_remote_url_and_its_older_s3_name_are_one_setting(tmp_path):
    url = f"file://{tmp_path}"
    for var in ("KERNEL_CACHE_REMOTE_URL", "KERNEL_CACHE_S3_URL"):
        (tier,) = tiers_from_env({var: url})
        assert tier.location == url and tier.LABEL == "shared directory"
    both = {"KERNEL_CACHE_REMOTE_URL": url, "KERNEL_CACHE_S3_URL": "s3://kc-bucket/x"}
    with pytest.raises(ConfigError, match="KERNEL_CACHE_S3_URL") as e:
        tiers_from_env(both)
    assert "KERNEL_CACHE_REMOTE_URL" in str(e.value) and "s3://kc-bucket/x" in str(e.value)
    gs = S3Settings.from_env(environ={"KERNEL_CACHE_REMOTE_URL": "gs://kc-bucket/fleet"})
    assert (gs.scheme, gs.bucket, gs.prefix) == ("gs", "kc-bucket", "fleet")


def test_a_missing_shared_directory_is_unavailable_naming_it_and_the_fix(tmp_path):
    gone = tmp_path / "not-mounted"
    tier = _tier(gone, fail_open=False)
    with pytest.raises(RemoteUnavailableError) as e:
        tier.keys()
    assert str(gone) in str(e.value) and "mkdir -p" in str(e.value)
    assert not gone.exists()  # nothing is created where a mount is missing


# -- the tier on a directory -----------------------------------------------------------------


def test_a_file_entry_is_one_object_published_create_once(tmp_path, tiny_config):
    tier = _tier(tmp_path, fail_open=False)
    key = build_key(tiny_config, Bucketer(tiny_config).variants[0])
    data = bytes(range(256)) * 400
    meta = make_meta(key, "v", data, 1.0)
    assert tier.put(key.hexdigest, data, meta).outcome is PutOutcome.STORED
    e = tier.get(key.hexdigest)
    verify_entry(e)
    assert e.data == data and tier.get_meta(key.hexdigest) == meta
    assert tier.keys() == [key.hexdigest]
    stored = tmp_path / "entries" / key.hexdigest
    before = stored.read_bytes()
    other = data[::-1]
    again = tier.put(key.hexdigest, other, make_meta(key, "v", other, 2.0))
    assert again.outcome is PutOutcome.PRESENT and "create-once" in again.reason
    assert stored.read_bytes() == before  # the file itself, read from the disk
    # the plan manifest, create-once too
    assert tier.publish_manifest([key.hexdigest]).outcome is PutOutcome.STORED
    doc = json.loads((tmp_path / manifest_name([key.hexdigest])).read_text())
    assert doc["keys"] == [key.hexdigest]
    assert tier.publish_manifest([key.hexdigest]).outcome is PutOutcome.PRESENT
    tier.close()


def test_a_dangling_link_planted_as_an_entry_does_not_keep_the_entry_out(tmp_path, tiny_config):
    """A writer of the shared directory plants ``entries/<key>`` as a link to
    nothing: the next publish of the key replaces the link with the entry (read
    back from the disk) instead of keeping the key out of the store for good."""
    built = build_key(tiny_config, Bucketer(tiny_config).variants[0])
    key = built.hexdigest
    stored = tmp_path / "entries" / key
    stored.parent.mkdir(parents=True)
    stored.symlink_to(tmp_path / "nothing")
    tier = _tier(tmp_path, fail_open=False)
    data = bytes(range(256)) * 4
    assert tier.put(key, data, make_meta(built, "v", data, 1.0)).outcome is PutOutcome.STORED
    assert not stored.is_symlink() and stored.read_bytes().endswith(data)
    assert not (tmp_path / "nothing").exists()
    verify_entry(tier.get(key))
    tier.close()


def test_a_file_lease_is_exclusive_expires_is_taken_over_and_released(tmp_path):
    key = check_lease_lifecycle(_tier(tmp_path), _tier(tmp_path), wake_s=1.5)
    # one generation file is left, the last change
    assert len(os.listdir(tmp_path / "leases" / key)) == 1


def test_a_planted_link_in_place_of_the_lease_directory_is_not_followed(tmp_path):
    """A writer of the shared directory links ``leases/<key>`` elsewhere: the
    builder writes no lease file there, and compiles without the lease."""
    key = "ef" * 32
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    store = tmp_path / "store"
    (store / "leases").mkdir(parents=True)
    (store / "leases" / key).symlink_to(elsewhere)
    lease = _tier(store).build_lock(key, ttl_s=30, wait_s=1)
    assert lease.acquire() == "unavailable"
    assert os.listdir(elsewhere) == []


@pytest.mark.parametrize("planted", ["leases file", "key file", "key link", "many names"])
def test_a_planted_lease_folder_costs_the_lease_not_the_store(tmp_path, tiny_config, planted):
    """A file in place of ``leases`` or ``leases/<key>``, a link in place of
    the latter, or a lease folder filled with generations past
    ``GENERATIONS_MAX``: the builder compiles without the lease, and still
    publishes the entry (read back from the disk) and every other key's, its
    tier not marked down."""
    from kernel_cache.store.file_lease import GENERATIONS_MAX

    built = build_key(tiny_config, Bucketer(tiny_config).variants[0])
    key = built.hexdigest
    leases = tmp_path / "leases"
    if planted == "leases file":
        leases.write_text("x")
    else:
        leases.mkdir()
        target = leases / key
        if planted == "key file":
            target.write_text("x")
        elif planted == "many names":
            target.mkdir()
            for gen in range(1, GENERATIONS_MAX + 2):  # live leases, a writer's
                doc = {"holder": "w", "expires_at": time.time() + 30}
                (target / f"{gen:020d}").write_text(json.dumps(doc))
        else:
            (tmp_path / "elsewhere").mkdir()
            target.symlink_to(tmp_path / "elsewhere")
    tier = _tier(tmp_path)
    assert tier.build_lock(key, ttl_s=30, wait_s=1).acquire() == "unavailable"
    data = bytes(range(256))
    assert tier.put(key, data, make_meta(built, "v", data, 1.0)).outcome is PutOutcome.STORED
    assert (tmp_path / "entries" / key).read_bytes().endswith(data) and not tier.is_down()
    assert tier.build_lock("0" * 64, ttl_s=30, wait_s=1).acquire() in (ACQUIRED, "unavailable")
    assert not tier.is_down()


@pytest.mark.parametrize("expires_at", ["1e18", "NaN", '"soon"'])
def test_a_planted_file_lease_is_taken_over_at_once(tmp_path, expires_at):
    key = "cd" * 32
    gen = tmp_path / "leases" / key / f"{7:020d}"
    gen.parent.mkdir(parents=True)
    gen.write_text(f'{{"holder": "planted", "expires_at": {expires_at}}}')
    lease = _tier(tmp_path).build_lock(key, ttl_s=30, wait_s=60)
    t0 = time.monotonic()
    assert lease.acquire() == ACQUIRED and time.monotonic() - t0 < 5
    assert lease.holder() == lease.token and not gen.exists()
    lease.release()


@pytest.mark.parametrize("name", ["9" * 20, "0" * 19 + "\u00b2", "5"])
def test_a_planted_last_generation_leaves_the_lease_exclusive(tmp_path, name):
    """A generation named with the largest 20-digit number (its successor has 21
    digits), with a non-ASCII digit or not zero-padded: the first builder takes
    the lease over, and a second one finds it held, also after renewals."""
    key = "ab" * 32
    planted = tmp_path / "leases" / key / name
    planted.parent.mkdir(parents=True)
    planted.write_text('{"holder": "planted", "expires_at": 0}')
    first = _tier(tmp_path).build_lock(key, ttl_s=30, wait_s=60)
    second = _tier(tmp_path).build_lock(key, ttl_s=30, wait_s=0.5)
    assert first.acquire() == ACQUIRED
    for _ in range(3):  # renewals: generations n + 1, n + 2, ...
        assert first._extend()
    assert second.acquire(wait=False) == BUSY and second.holder() == first.token
    first.release()


def test_listing_a_shared_directory_does_not_follow_a_planted_link(tmp_path):
    """``entries/<key>`` links to a folder outside the store (as it could to
    ``/``): the tier's listing names the link, not the files under its target."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / ("ab" * 32)).write_bytes(b"x")
    (tmp_path / "store" / "entries").mkdir(parents=True)
    (tmp_path / "store" / "entries" / ("cd" * 32)).symlink_to(outside)
    tier = _tier(tmp_path / "store", fail_open=False)
    assert tier.keys() == ["cd" * 32] and list(tier.iter_meta()) == []


_FIFO_READER = """
import sys, time
from kernel_cache.errors import CorruptEntryError
from kernel_cache.store.s3 import S3Tier
tier, key = S3Tier(sys.argv[1]), sys.argv[2]
tier.expect([key])  # the plan's manifest is read first
for read in (tier.get, tier.get_meta):
    try:
        print(read(key))
    except CorruptEntryError as e:
        print("refused:", e)
lease = tier.build_lock(key, ttl_s=30, wait_s=5)
print(lease.acquire())
print(tier.get("cd" * 32), tier.is_down())  # a folder: no object, the tier is up
"""


def test_a_fifo_planted_in_a_shared_directory_never_hangs_a_reader(tmp_path):
    """A writer of the shared directory plants FIFOs as an entry, a manifest and
    a lease generation (opening one for reading waits for a writer forever): a
    reader refuses the entry, ignores the manifest and takes the lease over, in
    a process that ends within seconds. A folder planted as an entry is no
    object, and leaves the tier up."""
    key = "ab" * 32
    for name in (f"entries/{key}", manifest_name([key]), f"leases/{key}/{1:020d}"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(tmp_path / name)
    (tmp_path / "entries" / ("cd" * 32) / "sub").mkdir(parents=True)
    proc = subprocess.run(
        [sys.executable, "-c", _FIFO_READER, f"file://{tmp_path}", key],
        capture_output=True, text=True, timeout=30, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("refused:") and "not a regular file" in lines[0]
    assert lines[1].startswith("refused:") and lines[2] == ACQUIRED
    assert lines[3] == "None False"


def _bytes_read() -> int:
    """Bytes this process has read with read(2) and the like so far, by the
    kernel's count (``rchar`` of ``/proc/self/io``)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def test_a_planted_object_costs_its_first_chunk_and_a_looping_link_itself(tmp_path, tiny_config):
    """A writer of the shared directory plants, at entry names of the plan, a
    200 MiB object (sparse: it costs the writer nothing) and a link to itself:
    the reader refuses the first after its first 64 KiB (the kernel's count of
    bytes read), and the second alone, naming it, while the tier stays up and
    the plan's real entry loads."""
    from kernel_cache.errors import CorruptEntryError
    from kernel_cache.store.s3_objects import FILE_CHUNK

    tier = _tier(tmp_path, fail_open=True)
    good, big, loop = ("ab" * 32, "cd" * 32, "ef" * 32)
    built = build_key(tiny_config, Bucketer(tiny_config).variants[0])
    data = bytes(range(256)) * 64
    meta = make_meta(built, "v", data, 1.0)
    assert tier.put(built.hexdigest, data, meta).outcome is PutOutcome.STORED
    good = built.hexdigest
    with open(tmp_path / "entries" / big, "wb") as f:
        f.truncate(200 << 20)
    os.symlink(loop, tmp_path / "entries" / loop)
    tier.expect([big, loop, good])  # the plan's order: its manifest is absent
    before = _bytes_read()
    with pytest.raises(CorruptEntryError, match="bad magic"):
        tier.get(big)
    assert _bytes_read() - before < 2 * FILE_CHUNK  # its first chunk, and /proc/self/io's own
    for read in (tier.get, tier.get_meta):
        with pytest.raises(CorruptEntryError) as e:
            read(loop)
        assert f"entries/{loop} is a link that loops" in str(e.value), e.value
        assert "fix: remove it" in str(e.value)
    assert not tier.is_down()
    verify_entry(tier.get(good))
    tier.close()


# -- the local cache on a network filesystem -------------------------------------------------

#: lines of a real /proc/self/mountinfo: an NFS export, a FUSE mount, a local disk
MOUNTINFO = """\
22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw
40 22 0:50 / /mnt/shared rw,relatime shared:30 - nfs4 fs-1.efs.amazonaws.com:/ rw,vers=4.1
41 22 0:51 / /mnt/fuse\\040dir rw,nosuid - fuse.seaweedfs 127.0.0.1:8888:/shared rw
"""


def test_the_mount_table_gives_the_filesystem_of_the_longest_mount_prefix():
    assert filesystem_type("/mnt/shared/kc", MOUNTINFO) == ("nfs4", "/mnt/shared")
    assert filesystem_type("/mnt/fuse dir/a/b", MOUNTINFO) == ("fuse.seaweedfs", "/mnt/fuse dir")
    assert filesystem_type("/mnt/sharedX", MOUNTINFO) == ("ext4", "/")
    check_local("/var/cache/kc", MOUNTINFO)  # a local disk passes
    for path, fstype in (("/mnt/shared/kc", "nfs4"), ("/mnt/fuse dir/kc", "fuse.seaweedfs")):
        with pytest.raises(NetworkFilesystemError) as e:
            check_local(path, MOUNTINFO)
        msg = str(e.value)
        assert path in msg and fstype in msg and f"KERNEL_CACHE_REMOTE_URL=file://{path}" in msg


# -- one shared filesystem, two hosts (FUSE) ---------------------------------------------------


@pytest.fixture(scope="module")
def mounts():
    why = fuse_unavailable()
    if why:
        pytest.skip(f"two FUSE mounts cannot run here: {why}")
    try:
        m = SharedMounts(2)
    except RuntimeError as e:
        pytest.skip(f"two FUSE mounts cannot run here: {str(e).splitlines()[0]}")
    yield m
    m.stop()


def test_a_cache_dir_on_a_fuse_mount_is_refused_before_anything_is_written(
    mounts, tiny_model, tmp_path
):
    cache = mounts.dirs[0] / "kc-local"
    assert filesystem_type(cache)[0] == "fuse.seaweedfs"
    with pytest.raises(NetworkFilesystemError, match="fuse.seaweedfs"):
        DiskTier(cache).cache  # noqa: B018 - opening it is what is refused
    with pytest.raises(NetworkFilesystemError, match="fuse.seaweedfs"):
        DiskTier(cache, read_only=True).get("ab" * 32)  # engine start reads it so
    proc = run_cli("warmup", *tiny_args(tiny_model), "--cache-dir", cache, env=_env())
    assert proc.returncode != 0
    assert "fuse.seaweedfs" in proc.stderr and f"KERNEL_CACHE_REMOTE_URL=file://{cache}" in (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr
    assert not cache.exists() and os.listdir(mounts.dirs[1]) == []  # nothing written


@pytest.mark.compile
def test_two_hosts_warm_through_one_shared_directory_compile_each_variant_once(
    mounts, tiny_model, plain_config, tmp_path
):
    """Two concurrent cold warmups, each through its own mount of one shared
    directory (``file://``), local caches on local disk: the compiler runs once
    per variant in all; then an engine on each host, with an empty local cache,
    loads the whole plan from the shared directory with no compile."""
    keys = make_keypair(tmp_path / "keys")
    log = tmp_path / "compiles.log"
    signing = {
        "KERNEL_CACHE_SIGNING_KEY_FILE": str(keys.private),
        "KERNEL_CACHE_TRUSTED_KEYS": str(keys.public),
    }
    env = _env(**signing, KERNEL_CACHE_TEST_COMPILE_LOG=str(log))
    urls = [f"file://{d}/fleet" for d in mounts.dirs]
    (mounts.dirs[0] / "fleet").mkdir()
    deadline = time.monotonic() + 30
    while not (mounts.dirs[1] / "fleet").is_dir() and time.monotonic() < deadline:
        time.sleep(0.1)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "warmup.cli.main",
                "warmup",
                *plain_args(tiny_model),
                "--cache-dir",
                str(tmp_path / f"b{i}"),
                "--remote-url",
                urls[i],
                "--jobs",
                "1",
                "--json",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )  # fmt: skip
        for i in range(2)
    ]
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=1200)
        assert p.returncode == 0, err
        reports.append(json.loads(out))
    plan = {str(v): build_key(plain_config, v).hexdigest for v in Bucketer(plain_config).variants}
    compiled = sorted(line.split(" ", 1)[1] for line in log.read_text().splitlines())
    assert compiled == sorted(plan), compiled
    for r in reports:
        assert r["failed"] == [] and r["remote_error"] is None
    for i, url in enumerate(urls):
        tier = S3Tier(S3Settings(url=url), fail_open=False)
        assert sorted(tier.keys()) == sorted(plan.values())
        assert (mounts.dirs[i] / "fleet" / manifest_name(plan.values())).is_file()
        engine_env = {
            **_env(KERNEL_CACHE_TRUSTED_KEYS=str(keys.public)),
            "KERNEL_CACHE_TEST_COMPILE_LOG": str(log),
            "KERNEL_CACHE_DIR": str(tmp_path / f"engine{i}"),
            "KERNEL_CACHE_REMOTE_URL": url,
        }
        got = engine_start(tiny_model, env=engine_env, kernels=PLAIN_KERNELS)
        assert "missing" not in got, got["stderr"]
        assert got["stats"]["sources"] == {url: len(plan)} and got["compile_stack"] == []
    assert len(log.read_text().splitlines()) == len(plan)  # the engines compiled nothing
