"""Bundles: export, the read-only bundle tier, import, and the container recipe without Docker."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kernel_cache import CorruptEntryError, load_plan
from kernel_cache.errors import BundleError
from kernel_cache.plan.buckets import Bucketer
from kernel_cache.plan.keys import build_key
from kernel_cache.runtime.load import default_tiers
from kernel_cache.store.bundle import MANIFEST, BundleTier, bundle_paths
from kernel_cache.store.disk_tier import DiskTier, PutOutcome
from kernel_cache.trust.keys import ENV_SIGNING_KEY_FILE, ENV_TRUSTED_KEYS

from ..conftest import N_TINY, ROOT, run_cli, tiny_args
from ..kc_helpers import engine_start, other_user_kwargs, snapshot, world_readable_dir
from ..signing_keys import make_keypair

pytestmark = pytest.mark.compile


@pytest.fixture(scope="module")
def bundle_key(tmp_path_factory):
    """The key pair these bundles are signed with (a bundle is a shared tier)."""
    return make_keypair(tmp_path_factory.mktemp("bundle-key"))


@pytest.fixture(autouse=True)
def _a_builder(bundle_key, monkeypatch):
    """Each test runs as a builder: it signs what it exports and trusts its own
    key (the container recipe's engine gets the public key alone)."""
    monkeypatch.setenv(ENV_SIGNING_KEY_FILE, str(bundle_key.private))
    monkeypatch.delenv(ENV_TRUSTED_KEYS, raising=False)


@pytest.fixture(scope="module")
def bundle(warm_cache, tiny_model, tmp_path_factory, bundle_key) -> Path:
    """The tiny plan exported from the session's warm cache (read-only), signed."""
    out = tmp_path_factory.mktemp("bundle") / "kc-bundle"
    run_cli(
        "export", *tiny_args(tiny_model), "--cache-dir", warm_cache[0], "--out", out,
        env={ENV_SIGNING_KEY_FILE: str(bundle_key.private)}, check=True,
    )  # fmt: skip
    return out


def _writable_copy(bundle: Path, dst: Path) -> Path:
    shutil.copytree(bundle, dst)
    for dirpath, _, files in os.walk(dst):
        os.chmod(dirpath, 0o755)
        for f in files:
            os.chmod(os.path.join(dirpath, f), 0o644)
    return dst


def test_export_writes_exactly_the_plan_content_addressed(bundle, tiny_config):
    doc = json.loads((bundle / MANIFEST).read_text())
    plan = Bucketer(tiny_config)
    assert doc["bundle_format"] == "kc-bundle-1"
    assert doc["plan"]["fingerprint"] == plan.fingerprint()
    assert doc["plan"]["variants"] == [str(v) for v in plan.variants]
    assert set(doc["tools"]) >= {"kernel_cache", "torch", "python", "cxx", "platform"}
    assert sorted(e["variant"] for e in doc["entries"]) == sorted(str(v) for v in plan.variants)
    for e in doc["entries"]:
        data = (bundle / e["file"]).read_bytes()
        assert e["file"] == f"artifacts/{hashlib.sha256(data).hexdigest()}.pt2"
        assert e["sha256"] == hashlib.sha256(data).hexdigest() and e["size"] == len(data)
        v = next(v for v in plan.variants if str(v) == e["variant"])
        assert e["components"] == build_key(tiny_config, v).as_dict()
    files = sorted(p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file())
    assert files == sorted([MANIFEST] + [e["file"] for e in doc["entries"]])
    for p in [bundle, *bundle.rglob("*")]:
        assert p.stat().st_mode & 0o222 == 0, f"{p} is writable"


def test_export_refuses_an_incomplete_plan_and_a_used_out_dir(cache_copy, tiny_model, tmp_path):
    tier = DiskTier(cache_copy)
    gone = sorted(tier.iter_meta(), key=lambda m: m["variant"])[0]
    tier.delete(gone["key"])
    tier.close()
    out = tmp_path / "b"
    proc = run_cli("export", *tiny_args(tiny_model), "--cache-dir", cache_copy, "--out", out)
    assert proc.returncode == 2
    assert "refusing to export an incomplete plan" in proc.stderr
    assert gone["variant"] in proc.stderr and "kernel-cache warmup" in proc.stderr
    assert not out.exists() and list(tmp_path.glob(".b.tmp-*")) == []
    used = tmp_path / "used"
    used.mkdir()
    (used / "x").write_text("keep me")
    proc = run_cli("export", *tiny_args(tiny_model), "--cache-dir", cache_copy, "--out", used)
    assert proc.returncode == 2 and "not an empty directory" in proc.stderr
    assert (used / "x").read_text() == "keep me"


def test_export_to_a_place_no_directory_can_be_made(cache_copy, tiny_model, tmp_path):
    """A file in the way of --out's parent: a clear error, no traceback, no leftovers."""
    blocker = tmp_path / "afile"
    blocker.write_text("")
    proc = run_cli(
        "export", *tiny_args(tiny_model), "--cache-dir", cache_copy, "--out", blocker / "b"
    )  # fmt: skip
    assert proc.returncode == 2 and "cannot create the bundle directory" in proc.stderr
    assert "Traceback" not in proc.stderr and "choose a writable location" in proc.stderr


# An export that SIGKILLs itself once every artifact is in its temporary
# directory, before the manifest is written and the directory renamed.
_KILLED_EXPORT = """
import os, signal, sys
import kernel_cache.store.bundle as bundle
from warmup.cli.main import main

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

bundle._manifest = die
sys.exit(main(sys.argv[1:]))
"""


def test_an_export_killed_midway_leaves_no_bundle_and_a_rerun_cleans_up(
    warm_cache, tiny_model, tmp_path
):
    out = tmp_path / "b"
    args = ["export", *tiny_args(tiny_model), "--cache-dir", str(warm_cache[0]), "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_EXPORT, *args], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == -9, proc.stderr
    left = list(tmp_path.glob(".b.tmp-*"))
    assert not out.exists() and len(left) == 1 and list((left[0] / "artifacts").iterdir())
    run_cli(*args, check=True)
    assert json.loads((out / MANIFEST).read_text())["plan"]["fingerprint"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_container_recipe_without_docker(bundle, tiny_model, bundle_key):
    """examples/Dockerfile's steps: warm (the session cache), export (the fixture),
    ship only the read-only bundle to another path, then start an engine with
    another HOME, an empty cache dir, another GPU index, no C++ compiler and
    another user: every variant loads from the bundle under its exact key (the
    compiler the bundle's manifest records), 0 compiles, nothing written; the
    image's ``verify``, which asks the (missing) compiler, accepts the recorded one."""
    user_kwargs, user_env = other_user_kwargs()
    with world_readable_dir() as root:
        image_bundle = root / "opt" / "kernel-cache-bundle"
        shutil.copytree(bundle, image_bundle)
        model = root / "config.json"
        shutil.copy(tiny_model, model)
        public = root / "opt" / "kernel-cache-signing.pub"  # the image's public key
        shutil.copy(bundle_key.public, public)
        os.chmod(public, 0o444)
        for p in [image_bundle, *image_bundle.rglob("*")]:  # the bundle ships read-only
            os.chmod(p, 0o555 if p.is_dir() else 0o444)
        home, cache = root / "home", root / "home" / "empty-cache"
        cache.mkdir(parents=True)
        if user_kwargs:
            for p in (home, cache):
                os.chown(p, 65534, 65534)
        before = snapshot(image_bundle)
        env = {
            **os.environ,
            **user_env,
            "HOME": str(home),
            "KERNEL_CACHE_DIR": str(cache),
            "KERNEL_CACHE_BUNDLE": str(image_bundle),
            ENV_TRUSTED_KEYS: str(public),  # an engine: the public key alone
            ENV_SIGNING_KEY_FILE: "",
            "CUDA_VISIBLE_DEVICES": "3",
            "CXX": str(root / "no-such-compiler" / "g++"),
        }
        doc = engine_start(model, "-", env=env, user_kwargs=user_kwargs)
        proc = subprocess.run(  # the image's CMD
            [sys.executable, "-m", "warmup.cli.main", "verify", *map(str, tiny_args(model))],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=env,
            timeout=300,
            **user_kwargs,
        )
        assert proc.returncode == 0, proc.stderr
        assert f"verify ok: {N_TINY}/{N_TINY} loaded, 0 compiled" in proc.stdout
        assert "build-only cxx: accepted" in proc.stdout
        assert snapshot(image_bundle) == before
        written = [p.name for p in cache.rglob("*") if p.suffix == ".val" or p.name == "usage.json"]
        assert written == []  # no artifact copied, no usage recorded: the bundle served all
    assert "missing" not in doc, doc
    assert doc["stats"]["loads"] == N_TINY and doc["stats"]["compiles"] == 0
    assert doc["compile_stack"] == [] and doc["out_shape"] == [3, 4, 8]
    assert doc["stats"]["sources"] == {str(image_bundle): N_TINY}
    assert doc["cxx"] == "none"  # no compiler here; the keys take the bundle's recorded one
    assert doc["stats"]["build_only_accepted"] == {}  # exact hits
    assert "build-only component cxx" not in doc["stderr"]


def test_bundles_come_before_the_local_cache_and_import_copies(bundle, tiny_config, tmp_path):
    local = tmp_path / "local"
    tiers = default_tiers(local, [bundle])
    assert [t.name for t in tiers] == ["bundle"]  # engine start creates no cache dir
    assert not local.exists()
    rt = load_plan(tiny_config, local, bundles=[bundle])
    assert rt.sources == {str(bundle): N_TINY}
    proc = run_cli("import", bundle, "--cache-dir", local, "--json", check=True)
    assert json.loads(proc.stdout) == {
        "imported": N_TINY,
        "present": 0,
        "bytes": sum(p.stat().st_size for p in (bundle / "artifacts").iterdir()),
    }
    assert load_plan(tiny_config, local).sources == {str(local): N_TINY}
    assert load_plan(tiny_config, local, bundles=[bundle]).sources == {str(bundle): N_TINY}
    proc = run_cli("import", bundle, "--cache-dir", local, "--json", check=True)
    assert json.loads(proc.stdout)["present"] == N_TINY


def test_a_damaged_bundle_file_is_never_loaded(bundle, tiny_config, tmp_path):
    b = _writable_copy(bundle, tmp_path / "b")
    doc = json.loads((b / MANIFEST).read_text())
    victim = b / doc["entries"][0]["file"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(CorruptEntryError, match="sha256") as e:
        load_plan(tiny_config, tmp_path / "none", bundles=[b])
    assert "export the bundle again" in str(e.value.reason)
    from warmup.check.verify import verify_plan

    report = verify_plan(tiny_config, tmp_path / "none", bundles=[b])
    assert report["ok"] is False and report["loaded"] == N_TINY - 1 and len(report["corrupt"]) == 1


def test_manifest_cannot_point_outside_the_bundle(bundle, tmp_path):
    b = _writable_copy(bundle, tmp_path / "b")
    doc = json.loads((b / MANIFEST).read_text())
    doc["entries"][0]["file"] = "../../etc/passwd"
    (b / MANIFEST).write_text(json.dumps(doc))
    tier = BundleTier(b)
    with pytest.raises(CorruptEntryError, match="expected artifacts/<its sha256>.pt2"):
        tier.get(doc["entries"][0]["key"])


def test_bundle_tier_writes_nothing_and_bad_paths_are_clear_errors(bundle, tmp_path):
    tier = BundleTier(bundle)
    refused = tier.put("k", b"x", {})
    assert refused.outcome is PutOutcome.READ_ONLY and "kernel-cache import" in refused.reason
    with pytest.raises(BundleError, match="read-only"):
        tier.delete(next(tier.iter_meta())["key"])
    with pytest.raises(BundleError, match="not a directory"):
        BundleTier(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BundleError, match="no manifest.json: not a kernel-cache bundle"):
        BundleTier(tmp_path / "empty")
    env = {"KERNEL_CACHE_BUNDLE": os.pathsep.join(["/a", "", "/b", "/a"])}
    assert bundle_paths(["/c"], env) == [Path("/c"), Path("/a"), Path("/b")]


def test_a_fifo_or_a_device_in_a_bundle_is_refused_at_once(bundle, tmp_path):
    """An artifact file replaced by a FIFO (a read would block for ever) or by a
    link to ``/dev/zero`` (a read would fill memory), and a manifest that is a
    FIFO: each is refused without reading, naming the file."""
    b = _writable_copy(bundle, tmp_path / "b")
    doc = json.loads((b / MANIFEST).read_text())
    fifo, device = doc["entries"][0], doc["entries"][1]
    (b / fifo["file"]).unlink()
    os.mkfifo(b / fifo["file"])
    (b / device["file"]).unlink()
    (b / device["file"]).symlink_to("/dev/zero")
    tier = BundleTier(b)
    for entry in (fifo, device):
        with pytest.raises(CorruptEntryError, match="not a regular file") as e:
            tier.get(entry["key"])
        assert entry["file"] in str(e.value)
    m = tmp_path / "m"
    m.mkdir()
    os.mkfifo(m / MANIFEST)
    with pytest.raises(BundleError, match="manifest.json.*not a regular file"):
        BundleTier(m)
