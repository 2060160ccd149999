"""Signed artifacts: Ed25519 key pairs (builders sign, engines hold public keys only),
signatures over the whole metadata record, and refusal of every altered field by
engine start and ``verify``, from bundles and from a real Redis.

One warmed tiny-plan cache (the session's ``warm_cache``) serves every case:
tampered copies of one signed bundle and rewritten Redis hashes, so nothing
here compiles except the one test that shows a warmup without the private key
keeps its compile local.
"""

from __future__ import annotations

import base64
import copy
import json
import logging
import os
import shutil
import subprocess
import sys

import pytest

from kernel_cache.errors import ConfigError, CorruptEntryError, MissingVariantsError
from kernel_cache.plan.buckets import Bucketer
from kernel_cache.plan.keys import build_key
from kernel_cache.store.bundle import MANIFEST, export_bundle, import_bundle
from kernel_cache.store.disk_tier import DiskTier, make_meta
from kernel_cache.store.lookup import Lookup, Source
from kernel_cache.store.redis import ENV_REDIS_URL, RedisSettings, RedisTier
from kernel_cache.trust.keys import (
    ENV_ALLOW_UNSIGNED,
    ENV_REQUIRE_SIGNED,
    ENV_SIGNING_KEY,
    ENV_SIGNING_KEY_FILE,
    ENV_TRUSTED_KEYS,
    SigningKeyError,
    load_signer,
    load_trusted_keys,
)
from kernel_cache.trust.signing import SignatureError, check_signature, sign_meta

from ..conftest import N_TINY, ROOT, plain_args, run_cli, tiny_args
from ..kc_helpers import knowing_cxx
from ..redis_server import ENV_TEST_REDIS_URL, RedisServer, redis_server_binary
from ..signing_keys import make_keypair, raw_key_id

NO_KEYS = {
    ENV_SIGNING_KEY: "",
    ENV_SIGNING_KEY_FILE: "",
    ENV_TRUSTED_KEYS: "",
    ENV_REQUIRE_SIGNED: "",
    ENV_ALLOW_UNSIGNED: "",
}
#: the features a CPU artifact built for x86-64-v3 records (stripped by one tamper)
V3 = {"avx", "avx2", "fma", "f16c", "bmi2"}


@pytest.fixture(autouse=True)
def _no_keys_leak_in(monkeypatch):
    for var in (*NO_KEYS, ENV_REDIS_URL):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """Three key pairs: ``a`` and ``b`` (the fleet's, for rotation) and ``evil``."""
    d = tmp_path_factory.mktemp("keys")
    return {name: make_keypair(d / name) for name in ("a", "b", "evil")}


class SharedDisk(DiskTier):
    """A real disk tier named "shared" in reports; the lookup gives it Redis's
    policy (:func:`_as_shared`), so Lookup's rules are tested without Redis."""

    name = "shared"


def _as_shared(tier, **policy) -> Source:
    """``tier`` as a shared store: untrusted, a bad entry is a miss."""
    return Source(tier, trusted=False, corrupt_is_miss=True, **policy)


def _ckey(tiny_config, index=0):
    return build_key(tiny_config, Bucketer(tiny_config).variants[index])


def _record(tiny_config, index=0, data=b"artifact bytes " * 8000, **extra) -> tuple:
    """A realistic record (as warmup writes it for a CPU artifact) and its bytes."""
    key = _ckey(tiny_config, index)
    meta = make_meta(
        key,
        str(Bucketer(tiny_config).variants[index]),
        data,
        1.25,
        timings={"export_s": 0.5, "total_s": 1.25},
        kernel=key.as_dict()["kernel"],
        cpu_target="x86-64-v3",
        cpu_features=sorted(V3),
        **extra,
    )
    return key.hexdigest, data, meta


def _ring(*pairs):
    return load_trusted_keys({ENV_TRUSTED_KEYS: ",".join(str(p.public) for p in pairs)})


# -- keys ----------------------------------------------------------------------------


def test_keygen_writes_a_pem_pair_and_never_overwrites_a_key_unasked(tmp_path, capsys):
    from warmup.cli.main import main

    d = tmp_path / "kc"
    proc = run_cli("keygen", d, "--json", env=NO_KEYS, check=True)
    out = json.loads(proc.stdout)
    private, public = d / "signing.key", d / "signing.pub"
    assert out["private"] == str(private) and out["public"] == str(public)
    assert private.stat().st_mode & 0o777 == 0o600
    assert public.stat().st_mode & 0o777 == 0o644
    assert private.read_text().startswith("-----BEGIN PRIVATE KEY-----")  # PKCS#8
    assert public.read_text().startswith("-----BEGIN PUBLIC KEY-----")  # SubjectPublicKeyInfo
    assert out["key_id"] == raw_key_id(public.read_bytes())
    before = private.read_bytes()

    again = run_cli("keygen", d, env=NO_KEYS)
    assert again.returncode == 2 and "refusing to overwrite" in again.stderr
    assert "--force" in again.stderr and private.read_bytes() == before

    assert main(["keygen", str(d), "--force"]) == 0  # the text output, in this process
    text = capsys.readouterr().out
    assert private.read_bytes() != before and private.stat().st_mode & 0o777 == 0o600
    new_id = raw_key_id(public.read_bytes())  # the pair matches
    assert new_id != out["key_id"] and f"Ed25519 key {new_id}" in text
    assert f"{ENV_SIGNING_KEY_FILE}={private}" in text
    assert f"{ENV_TRUSTED_KEYS}={public}" in text


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl binary")
def test_keys_made_by_openssl_work(tmp_path, tiny_config):
    """PEM PKCS#8 / SubjectPublicKeyInfo: keys from standard tools sign and check."""
    priv, pub = tmp_path / "k.pem", tmp_path / "k.pub"
    subprocess.run(["openssl", "genpkey", "-algorithm", "ed25519", "-out", priv], check=True)
    subprocess.run(["openssl", "pkey", "-in", priv, "-pubout", "-out", pub], check=True)
    priv.chmod(0o600)
    signer = load_signer({ENV_SIGNING_KEY_FILE: str(priv)})
    key, data, meta = _record(tiny_config)
    signed = sign_meta(meta, data, signer)
    check_signature(key, signed, data, load_trusted_keys({ENV_TRUSTED_KEYS: str(pub)}))
    assert signed["signature"]["key_id"] == raw_key_id(pub.read_bytes())


def test_trusted_keys_readers_and_builders(keys):
    a, b = keys["a"], keys["b"]
    assert load_trusted_keys({}) is None and load_signer({}) is None
    ring = load_trusted_keys({ENV_TRUSTED_KEYS: f" {a.public} ,{b.public},"})
    assert list(ring.keys) == [a.key_id, b.key_id]
    # a builder trusts its own public key too (it must not take unsigned Redis entries)
    ring = load_trusted_keys({ENV_SIGNING_KEY_FILE: str(b.private)})
    assert list(ring.keys) == [b.key_id]
    # --require-signed: public keys are enough for a reader
    assert load_trusted_keys({ENV_TRUSTED_KEYS: str(a.public)}, required=True) is not None
    with pytest.raises(SigningKeyError) as e:
        load_trusted_keys({ENV_REQUIRE_SIGNED: "1"})
    for word in (ENV_TRUSTED_KEYS, ENV_SIGNING_KEY_FILE, "kernel-cache keygen", "required"):
        assert word in str(e.value)


def test_bad_key_settings_are_clear_config_errors(keys, tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519

    hmac_file = tmp_path / "hmac-secret"
    hmac_file.write_text("0123456789abcdef0123456789abcdef\n")
    hmac_file.chmod(0o600)
    ec_pub = tmp_path / "ec.pub"
    ec_pub.write_bytes(
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    encrypted = tmp_path / "enc.key"
    encrypted.write_bytes(
        ed25519.Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"pw"),
        )
    )
    big = tmp_path / "big.pub"
    big.write_bytes(keys["a"].public.read_bytes() * 1000)
    fifo = tmp_path / "fifo.pub"
    os.mkfifo(fifo)
    cases = [
        ({ENV_SIGNING_KEY: "0123456789abcdef-old-secret"}, "HMAC signing is retired"),
        ({ENV_SIGNING_KEY_FILE: str(hmac_file)}, "not a PEM Ed25519 private key"),
        ({ENV_SIGNING_KEY_FILE: str(encrypted)}, "encrypted"),
        ({ENV_SIGNING_KEY_FILE: "/nonexistent/signing.key"}, "cannot read it"),
        ({ENV_TRUSTED_KEYS: str(keys["a"].private)}, "holds a private key"),
        ({ENV_TRUSTED_KEYS: str(ec_pub)}, "not an Ed25519 public key"),
        ({ENV_TRUSTED_KEYS: f"{keys['a'].public},/nonexistent/x.pub"}, "cannot read it"),
        # a key file that is not one: refused before reading (a FIFO would block
        # engine start for ever, /dev/zero fill its memory)
        ({ENV_TRUSTED_KEYS: str(big)}, "above the 65536-byte limit"),
        ({ENV_TRUSTED_KEYS: str(fifo)}, "not a regular file"),
        ({ENV_TRUSTED_KEYS: "/dev/zero"}, "not a regular file"),
        ({ENV_SIGNING_KEY_FILE: str(fifo)}, "not a regular file"),
        ({ENV_REQUIRE_SIGNED: "ture"}, f"{ENV_REQUIRE_SIGNED}='ture'"),
        # set to separators only: not "no checks" in silence (blank is unset, as for
        # every variable; KERNEL_CACHE_REQUIRE_SIGNED=1 makes that an error at start)
        ({ENV_TRUSTED_KEYS: ","}, "names no public key file"),
        ({ENV_TRUSTED_KEYS: " , "}, "names no public key file"),
    ]
    for environ, match in cases:
        with pytest.raises(SigningKeyError, match=match) as e:
            load_trusted_keys(environ)
        assert isinstance(e.value, ConfigError)
    # the migration is spelt out, and the retired secret is never echoed
    with pytest.raises(SigningKeyError) as e:
        load_signer({ENV_SIGNING_KEY: "0123456789abcdef-old-secret"})
    assert "kernel-cache keygen" in str(e.value) and ENV_TRUSTED_KEYS in str(e.value)
    assert "old-secret" not in str(e.value)


def test_a_private_key_others_can_read_is_warned_about_once(keys, tmp_path, caplog):
    f = tmp_path / "shared.key"
    f.write_bytes(keys["a"].private.read_bytes())
    f.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="kernel_cache"):
        for _ in range(3):
            assert load_signer({ENV_SIGNING_KEY_FILE: str(f)}).key_id == keys["a"].key_id
    warned = [r.getMessage() for r in caplog.records if "readable by group" in r.getMessage()]
    assert len(warned) == 1 and "mode 0644" in warned[0] and "chmod 600" in warned[0]


def test_require_signed_without_any_key_fails_at_start(tiny_model, tmp_path, keys):
    for cmd in ("warmup", "verify"):
        proc = run_cli(
            cmd, *tiny_args(tiny_model), "--cache-dir", tmp_path, "--require-signed", env=NO_KEYS
        )
        assert proc.returncode == 2, proc.stderr
        assert "--require-signed" in proc.stderr and ENV_TRUSTED_KEYS in proc.stderr
    assert list(tmp_path.iterdir()) == []  # failed before touching the cache
    proc = run_cli(
        "verify",
        *tiny_args(tiny_model),
        "--cache-dir",
        tmp_path / "empty",
        "--require-signed",
        env={**NO_KEYS, **keys["a"].engine_env},
    )
    assert proc.returncode == 1 and "missing" in proc.stderr  # started: public keys suffice


# -- what a signature covers ---------------------------------------------------------


def test_the_signature_covers_every_field_and_names_the_one_changed(tiny_config, keys):
    """Every field of the record, nested members named, new fields included
    (``traced_files`` stands for a field added to the record later)."""
    a = keys["a"]
    key, data, meta = _record(tiny_config, traced_files={"kernel_cache/x.py": "ab12"})
    signed = sign_meta(meta, data, a.signer)
    sig = signed["signature"]
    assert sig["alg"] == "ed25519" and sig["key_id"] == a.key_id
    assert len(base64.b64decode(sig["sig"])) == 64
    ring = _ring(a)
    check_signature(key, signed, data, ring)
    # canonical: key order and a JSON round trip (indented, as a bundle writes it) do not matter
    shuffled = dict(reversed(list(json.loads(json.dumps(signed, indent=1)).items())))
    check_signature(key, shuffled, data, ring)
    # deterministic: the same record and key give the same signature
    assert sign_meta(meta, data, a.signer)["signature"] == sig

    other = str(Bucketer(tiny_config).variants[1])
    tampers = {
        "variant changed": lambda m: m.update(variant=other),
        "kernel changed": lambda m: m.update(kernel="evil.mod:Kernel"),
        "cpu_target changed": lambda m: m.update(cpu_target="native"),
        "cpu_features changed": lambda m: m.update(cpu_features=["sse2"]),
        "cpu_features removed": lambda m: m.pop("cpu_features"),
        "components.cxx changed": lambda m: m["components"].update(cxx="gcc 0.0"),
        "components.compile_options changed": lambda m: m["components"].update(
            compile_options="evil"
        ),
        "size changed": lambda m: m.update(size=m["size"] + 1),
        "compile_seconds changed": lambda m: m.update(compile_seconds=0.001),
        "timings.total_s changed": lambda m: m["timings"].update(total_s=9.0),
        "traced_files.kernel_cache/x.py changed": lambda m: m["traced_files"].update(
            {"kernel_cache/x.py": "ffff"}
        ),
        "note added": lambda m: m.update(note="x"),
        "key changed": lambda m: m.update(key="0" * 64),
    }
    for named, tamper in tampers.items():
        bad = copy.deepcopy(signed)
        tamper(bad)
        with pytest.raises(SignatureError) as e:
            check_signature(key, bad, data, ring)
        assert f"metadata record altered since it was signed ({named})" in e.value.reason, named

    with pytest.raises(SignatureError, match="artifact bytes differ"):
        check_signature(key, signed, data[:-1] + b"!", ring)
    # the unsigned fields: where a copy lives, never what it is
    check_signature(key, {**signed, "imported_from": "bundle", "file": "x"}, data, ring)


def test_each_kind_of_bad_signature_is_refused(tiny_config, keys):
    a, b = keys["a"], keys["b"]
    key, data, meta = _record(tiny_config)
    signed = sign_meta(meta, data, a.signer)
    with pytest.raises(SignatureError, match="unsigned, but trusted keys are set"):
        check_signature(key, meta, data, _ring(a))
    with pytest.raises(SignatureError, match=f"signed by key {a.key_id}, which is not trusted"):
        check_signature(key, signed, data, _ring(b))
    relabelled = {**signed, "signature": {**signed["signature"], "key_id": b.key_id}}
    with pytest.raises(SignatureError, match="does not match the record and bytes"):
        check_signature(key, relabelled, data, _ring(a, b))  # a's signature, b's name
    forged = sign_meta(meta, data, keys["evil"].signer)
    forged["signature"]["key_id"] = a.key_id  # another key's signature under our key id
    with pytest.raises(SignatureError, match="forged or altered"):
        check_signature(key, forged, data, _ring(a))
    for bad, match in (
        ({**signed["signature"], "sig": "not base64!"}, "not base64"),
        ({**signed["signature"], "alg": "rsa"}, "malformed signature: field alg"),
        ({"alg": "hmac-sha256", "key_id": "0" * 16, "mac": "0" * 64}, "retired HMAC"),
        ("a string", "malformed signature"),
    ):
        with pytest.raises(SignatureError, match=match):
            check_signature(key, {**meta, "signature": bad}, data, _ring(a))
    assert isinstance(SignatureError(key, "x"), CorruptEntryError)


def test_untrusted_tier_forged_entry_rejected_logged_not_promoted(
    tiny_config, tmp_path, monkeypatch, caplog, keys
):
    """Right key, right checksum, record altered: never returned, never copied."""
    monkeypatch.setenv(ENV_TRUSTED_KEYS, str(keys["a"].public))
    local, shared = DiskTier(tmp_path / "local"), SharedDisk(tmp_path / "shared")
    promoted = _as_shared(shared, promote_into=local)  # the lookup's policy, not the tier's
    key, data, meta = _record(tiny_config)
    signed = sign_meta(meta, data, keys["a"].signer)
    shared.put(key, data, {**signed, "cpu_features": []})
    lookup = Lookup([local, promoted])
    with caplog.at_level(logging.WARNING, logger="kernel_cache"):
        result = lookup.search(_ckey(tiny_config))
    assert result.found is None
    assert "rejected shared entry" in caplog.text and "cpu_features changed" in caplog.text
    assert len(result.rejected) == 1 and isinstance(result.rejected[0].error, SignatureError)
    assert local.get(key) is None

    shared.put(key, data, signed)  # the genuine signed entry is used and promoted
    found = Lookup([local, promoted]).find(_ckey(tiny_config))
    assert found.entry.data == data and found.tier is shared and found.promoted.stored
    assert local.get(key).meta["signature"] == signed["signature"]
    assert Lookup([local, promoted]).find(_ckey(tiny_config)).tier is local


def test_untrusted_tier_without_keys_is_refused_unless_the_insecure_opt_out(
    tiny_config, tmp_path, monkeypatch
):
    shared = SharedDisk(tmp_path / "shared")
    key, data, meta = _record(tiny_config)
    shared.put(key, data, meta)
    with pytest.raises(SigningKeyError) as e:  # no key, no opt-out: refused when made
        Lookup([_as_shared(shared)])
    msg = str(e.value)
    for named in ("kernel-cache keygen", ENV_TRUSTED_KEYS, ENV_SIGNING_KEY_FILE):
        assert named in msg
    assert "KERNEL_CACHE_INSECURE_ALLOW_UNSIGNED=1" in msg and str(shared.location) in msg
    # the opt-out: checksums only
    monkeypatch.setenv(ENV_ALLOW_UNSIGNED, "1")
    assert Lookup([_as_shared(shared)]).find(_ckey(tiny_config)).entry.data == data
    shared.put(key, data + b"x", meta)  # wrong size: rejected as a miss, not raised
    result = Lookup([_as_shared(shared)]).search(_ckey(tiny_config))
    assert result.found is None and "size" in result.rejected[0].error.reason


# -- one signed plan, tampered field by field -------------------------------------


def _tampers(variants: list[str], donor: dict, evil_key_id: str) -> dict:
    """``{case: (tamper(meta) in place, what the refusal must say)}``. ``donor``
    is another entry's record (its artifact is a valid package of another shape)."""

    def strip(m):
        m["cpu_features"] = [f for f in m["cpu_features"] if f not in V3]

    def swap_bytes(m):  # another variant's (valid) artifact under this key
        m.update(sha256=donor["sha256"], size=donor["size"])
        if "file" in m:
            m["file"] = donor["file"]

    return {
        "variant": (lambda m: m.update(variant=variants[-1]), "variant changed"),
        "kernel": (lambda m: m.update(kernel="evil.mod:Kernel"), "kernel changed"),
        "cpu_target": (lambda m: m.update(cpu_target="native"), "cpu_target changed"),
        "cpu_features": (strip, "cpu_features changed"),
        "components": (
            lambda m: m["components"].update(cxx="gcc 0.0"),
            "components.cxx changed",
        ),
        "compile_options": (
            lambda m: m["components"].update(compile_options='{"evil": true}'),
            "components.compile_options changed",
        ),
        "sizes": (swap_bytes, "sha256 changed, size changed"),
        "created": (lambda m: m.update(created=1.0), "created changed"),
        "added": (lambda m: m.update(note="x"), "note added"),
        "removed": (lambda m: m.pop("cpu_features"), "cpu_features removed"),
        "other_key": (
            lambda m: m["signature"].update(key_id=evil_key_id),
            f"signed by key {evil_key_id}, which is not trusted",
        ),
        "unsigned": (lambda m: m.pop("signature"), "unsigned"),
    }


def _rounds(cases: list[str], per_round: int) -> list[list[str]]:
    return [cases[i : i + per_round] for i in range(0, len(cases), per_round)]


def _writable_copy(src, dst):
    shutil.copytree(src, dst)
    for p in [dst, *dst.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)


#: A fresh engine process: ``load_plan`` once per bundle given in argv (JSON
#: ``[[bundle, local cache], ...]``), each into its own empty local cache; prints
#: ``{bundle: "loaded N" | "<error type>: <message>"}``.
ENGINE_STARTS = """
import json, sys
from kernel_cache import load_plan
from kernel_cache.config.engine import make_config
cfg = make_config(sys.argv[1], max_model_len=32, block_size=16, max_num_seqs=4,
                  max_num_batched_tokens=32, kv_buckets=(32,))
out = {}
for bundle, local in json.loads(sys.argv[2]):
    try:
        out[bundle] = f"loaded {load_plan(cfg, local, bundles=[bundle]).stats()['loads']}"
    except Exception as e:
        out[bundle] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def _engine_starts(tiny_model, pairs, env) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE_STARTS, str(tiny_model), json.dumps(pairs)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **NO_KEYS, **env},
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def signed_bundle(warm_cache, tiny_config, keys, tmp_path_factory):
    """The warmed plan exported as a bundle by a builder holding key ``a``."""
    out = tmp_path_factory.mktemp("signed") / "bundle"
    mp = pytest.MonkeyPatch()
    try:
        for var, value in {**NO_KEYS, **keys["a"].builder_env}.items():
            mp.setenv(var, value)
        export_bundle(tiny_config, out, [DiskTier(warm_cache[0])])
    finally:
        mp.undo()
    return out


def test_a_signed_bundle_carries_whole_records_and_loads_with_public_keys_only(
    signed_bundle, warm_cache, tiny_model, tmp_path, keys, monkeypatch
):
    doc = json.loads((signed_bundle / MANIFEST).read_text())
    local = DiskTier(warm_cache[0])
    for e in doc["entries"]:
        assert e["signature"]["key_id"] == keys["a"].key_id
        built = local.get_meta(e["key"])  # every field of the record as built is there
        assert {k: v for k, v in e.items() if k not in ("file", "signature")} == built
    engine = keys["a"].engine_env  # no private key in this process
    starts = _engine_starts(tiny_model, [[str(signed_bundle), str(tmp_path / "l")]], engine)
    assert starts == {str(signed_bundle): f"loaded {N_TINY}"}
    proc = run_cli(
        "verify", *tiny_args(tiny_model), "--cache-dir", tmp_path / "v", "--bundle",
        signed_bundle, "--require-signed", "--json", env=engine,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["loaded"] == N_TINY
    # imported into a local cache (checked first), then loaded from there
    for var, value in engine.items():
        monkeypatch.setenv(var, value)
    assert import_bundle(signed_bundle, DiskTier(tmp_path / "imported"))["imported"] == N_TINY


@pytest.mark.slow
def test_every_tampered_bundle_field_is_refused_at_start_and_by_verify(
    signed_bundle, tiny_config, tiny_model, tmp_path, keys
):
    """Tampered copies of one signed bundle, one field each. Engine start (a fresh
    process holding only the public key, ``load_plan``) refuses each copy naming
    the field; ``verify`` reports each entry corrupt with the same reason
    (as many tampers per bundle as it has entries, one per entry)."""
    doc = json.loads((signed_bundle / MANIFEST).read_text())
    variants = [e["variant"] for e in doc["entries"]]
    tampers = _tampers(variants, doc["entries"][1], keys["evil"].key_id)
    engine = keys["a"].engine_env

    # engine start: one copy per tamper, always entry 0
    pairs, expect = [], {}
    for case, (tamper, message) in tampers.items():
        copy_dir = tmp_path / f"start-{case}"
        _writable_copy(signed_bundle, copy_dir)
        bad = json.loads(json.dumps(doc))
        tamper(bad["entries"][0])
        (copy_dir / MANIFEST).write_text(json.dumps(bad))
        pairs.append([str(copy_dir), str(tmp_path / f"local-{case}")])
        expect[str(copy_dir)] = message
    starts = _engine_starts(tiny_model, pairs, engine)
    for bundle, message in expect.items():
        got = starts[bundle]
        assert got.startswith("CorruptEntryError: ") and message in got, (bundle, got)
        assert variants[0] in got and "export the bundle again" in got

    # verify: one bundle per round of tampers, entry i gets tamper i
    for n, cases in enumerate(_rounds(list(tampers), len(variants))):
        copy_dir = tmp_path / f"verify-{n}"
        _writable_copy(signed_bundle, copy_dir)
        bad = json.loads(json.dumps(doc))
        for i, case in enumerate(cases):
            tampers[case][0](bad["entries"][i])
        (copy_dir / MANIFEST).write_text(json.dumps(bad))
        proc = run_cli(
            "verify", *tiny_args(tiny_model), "--cache-dir", tmp_path / f"v{n}", "--bundle",
            copy_dir, "--json", env=engine,
        )  # fmt: skip
        assert proc.returncode == 1, proc.stderr
        report = json.loads(proc.stdout)
        corrupt = {c["variant"]: c["reason"] for c in report["corrupt"]}
        assert report["loaded"] == len(variants) - len(cases)
        for i, case in enumerate(cases):
            assert tampers[case][1] in corrupt[variants[i]], (case, corrupt)


# -- Redis -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_url():
    url = os.environ.get(ENV_TEST_REDIS_URL)
    if url:
        yield url
        return
    if redis_server_binary() is None:
        pytest.skip("no redis-server binary (Debian: apt-get install -y redis-server)")
    server = RedisServer()
    yield server.url
    server.stop()


@pytest.fixture
def redis_db(shared_servers, redis_url):
    """The shared Redis, emptied, as a tier; the servers' lock held."""
    tier = RedisTier(redis_url, fail_open=False)
    tier.client.flushdb()
    yield tier
    tier.close()


def _publish(warm_dir, tier: RedisTier, signer_for) -> dict[str, dict]:
    """Every entry of a local cache into Redis, signed by ``signer_for(index)``
    (None: unsigned); returns ``{variant: meta as published}``."""
    local = DiskTier(warm_dir)
    out = {}
    for n, meta in enumerate(sorted(local.iter_meta(), key=lambda m: m["variant"])):
        e = local.get(meta["key"])
        out[meta["variant"]] = sign_meta(e.meta, e.data, signer_for(n))
        tier.put(e.key, e.data, out[meta["variant"]])
    local.close()
    return out


def _write_raw(tier, key: str, data: bytes, meta: dict) -> None:
    """Write an entry's hash as a writer of Redis without a key would (HSET), not
    through ``put``, which keeps a stored record that already stands for it."""
    tier.client.hset(tier._name("entry", key), mapping={"meta": json.dumps(meta), "data": data})


ENGINE_START_REDIS = """
import json, sys
from kernel_cache import load_plan
from kernel_cache.config.engine import make_config
cfg = make_config(sys.argv[1], max_model_len=32, block_size=16, max_num_seqs=4,
                  max_num_batched_tokens=32, kv_buckets=(32,))
try:
    print(json.dumps({"loads": load_plan(cfg, sys.argv[2]).stats()["loads"]}))
except Exception as e:
    missing = sorted(str(v) for v in getattr(e, "missing", ()))
    print(json.dumps({"error": type(e).__name__, "missing": missing, "message": str(e)}))
"""


@pytest.mark.slow
def test_every_tampered_redis_field_is_refused_at_start_and_by_verify(
    redis_db, warm_cache, tiny_model, tmp_path, keys
):
    """Signed Redis entries whose hashes are rewritten, one field each: a fresh
    engine process (public key only, empty local cache) refuses them all as
    misses and logs each with the field; ``verify --redis-url`` reports each
    corrupt with the reason; nothing rejected reaches the local cache."""
    url, a = redis_db.location, keys["a"]
    published = _publish(warm_cache[0], redis_db, lambda n: a.signer)
    variants = sorted(published)
    donor = dict(published[variants[1]])
    tampers = _tampers(variants, donor, keys["evil"].key_id)
    engine = {**a.engine_env, ENV_REDIS_URL: url}
    donor_data = redis_db.get(donor["key"]).data
    for n, cases in enumerate(_rounds(list(tampers), len(variants))):
        redis_db.client.flushdb()
        _publish(warm_cache[0], redis_db, lambda n: a.signer)
        tampered = {}
        for i, case in enumerate(cases):
            meta = copy.deepcopy(published[variants[i]])
            tampers[case][0](meta)
            data = donor_data if case == "sizes" else redis_db.get(meta["key"]).data
            _write_raw(redis_db, meta["key"], data, meta)
            tampered[variants[i]] = (meta["key"], tampers[case][1])

        # warmup's record of the builders' compiler, so the engine asks for the
        # exact keys even where every record of the plan is tampered
        local = knowing_cxx(tmp_path / f"local-{n}")
        proc = subprocess.run(
            [sys.executable, "-c", ENGINE_START_REDIS, str(tiny_model), str(local)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, **NO_KEYS, **engine},
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout)
        assert result["error"] == "MissingVariantsError", result
        assert result["missing"] == sorted(tampered)
        for variant, (key, message) in tampered.items():
            line = next(x for x in proc.stderr.splitlines() if f"entry {key[:16]}" in x)
            assert "rejected redis entry" in line and message in line, (variant, line)
        kept = DiskTier(local)
        assert [kept.get(k) for k, _ in tampered.values()] == [None] * len(tampered)
        assert len(list(kept.iter_meta())) == len(variants) - len(tampered)
        kept.close()

        proc = run_cli("verify", *tiny_args(tiny_model), "--redis-url", url, "--json", env=engine)
        assert proc.returncode == 1, proc.stderr
        corrupt = {c["variant"]: c["reason"] for c in json.loads(proc.stdout)["corrupt"]}
        assert set(corrupt) == set(tampered)
        for variant, (_, message) in tampered.items():
            assert message in corrupt[variant], (variant, corrupt[variant])


def test_key_rotation_either_trusted_key_loads_a_dropped_key_is_refused(
    redis_db, warm_cache, tiny_config, tmp_path, monkeypatch, caplog, keys
):
    """Part of the plan signed by the old key ``a``, the rest by the new key ``b``."""
    a, b = keys["a"], keys["b"]
    half = N_TINY // 2
    published = _publish(warm_cache[0], redis_db, lambda n: a.signer if n < half else b.signer)
    old = sorted(v for v, m in published.items() if m["signature"]["key_id"] == a.key_id)
    assert len(old) == half >= 1
    monkeypatch.setenv(ENV_REDIS_URL, redis_db.location)
    monkeypatch.setenv(ENV_TRUSTED_KEYS, f"{b.public},{a.public}")
    from kernel_cache import load_plan

    assert load_plan(tiny_config, tmp_path / "both").stats()["loads"] == N_TINY
    monkeypatch.setenv(ENV_TRUSTED_KEYS, str(b.public))  # a dropped
    with caplog.at_level(logging.WARNING, logger="kernel_cache"):
        with pytest.raises(MissingVariantsError) as e:
            load_plan(tiny_config, tmp_path / "b-only")
    assert sorted(str(v) for v in e.value.missing) == old
    assert caplog.text.count(f"signed by key {a.key_id}, which is not trusted") == half


@pytest.mark.compile  # compiles one variant
def test_a_node_without_the_private_key_publishes_nothing_the_fleet_would_refuse(
    redis_db, plain_cache_copy, plain_config, tiny_model, tmp_path, keys, monkeypatch, caplog
):
    """An engine node (public key only) runs warmup against Redis: its unsigned
    local entries are not uploaded, what it compiles stays local (one compile,
    counted by the compiler hook), and it says so. A builder holding the
    private key then publishes the plan signed, and the engine loads it."""
    from warmup.builder.planner import warmup

    a = keys["a"]
    url = redis_db.location
    for var, value in a.engine_env.items():
        monkeypatch.setenv(var, value)
    with caplog.at_level(logging.WARNING, logger="kernel_cache"):
        report = warmup(
            plain_config, plain_cache_copy, progress=False, remote=RedisSettings(url=url)
        )
    assert report["uploaded"] == 0 and redis_db.keys() == []
    assert "no private key" in caplog.text and "not published" in caplog.text

    # one variant missing locally: compiled here, kept here, not published
    victim = str(Bucketer(plain_config).variants[0])
    vkey = build_key(plain_config, Bucketer(plain_config).variants[0]).hexdigest
    DiskTier(plain_cache_copy).delete(vkey)
    log = tmp_path / "compiles.log"
    proc = run_cli(
        "warmup", *plain_args(tiny_model), "--cache-dir", plain_cache_copy, "--redis-url", url,
        "--json", "-q", env={**a.engine_env, "KERNEL_CACHE_TEST_COMPILE_LOG": str(log)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[1] for line in log.read_text().splitlines()] == [victim]
    assert "no private key" in proc.stderr and ENV_SIGNING_KEY_FILE in proc.stderr
    assert redis_db.keys() == [] and "signature" not in DiskTier(plain_cache_copy).get_meta(vkey)

    # a builder publishes the same local entries signed; the engine loads them
    proc = run_cli(
        "warmup", *plain_args(tiny_model), "--cache-dir", plain_cache_copy, "--redis-url", url,
        "--json", "-q", env=a.builder_env,
    )  # fmt: skip
    assert proc.returncode == 0 and json.loads(proc.stdout)["uploaded"] == N_TINY, proc.stderr
    assert all(redis_db.get_meta(k)["signature"]["key_id"] == a.key_id for k in redis_db.keys())
    from kernel_cache import load_plan

    monkeypatch.setenv(ENV_REDIS_URL, url)
    assert load_plan(plain_config, tmp_path / "engine").stats()["loads"] == N_TINY


def test_export_without_the_private_key_refuses_what_the_fleet_would_refuse(
    warm_cache, tiny_config, tmp_path, monkeypatch, keys
):
    from kernel_cache.errors import BundleError

    monkeypatch.setenv(ENV_TRUSTED_KEYS, str(keys["a"].public))
    with pytest.raises(BundleError, match=f"{N_TINY} entries .*unsigned.*{ENV_SIGNING_KEY_FILE}"):
        export_bundle(tiny_config, tmp_path / "b", [DiskTier(warm_cache[0])])
    assert not (tmp_path / "b").exists()


def test_keygen_never_writes_through_a_planted_file_and_refuses_a_shared_dir(tmp_path):
    """A link planted at a predictable temporary name (``.signing.key.tmp-<pid>``)
    is not followed: the private key never lands in a file another user owns. A
    directory others can write is refused (they could swap ``signing.pub``)."""
    from kernel_cache.trust.keygen import generate_keypair
    from kernel_cache.trust.keys import SigningKeyError

    d = tmp_path / "kc"
    d.mkdir(mode=0o700)
    decoy = tmp_path / "decoy"
    decoy.write_bytes(b"")
    (d / f".signing.key.tmp-{os.getpid()}").symlink_to(decoy)
    out = generate_keypair(d)
    private = d / "signing.key"
    assert not private.is_symlink() and private.stat().st_mode & 0o777 == 0o600
    assert decoy.read_bytes() == b""
    assert out["private"] == str(private)

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    with pytest.raises(SigningKeyError) as e:
        generate_keypair(shared)
    assert "mode 1777" not in str(e.value) and "0777" in str(e.value)
    assert f"chmod go-w {shared}" in str(e.value)
    assert not (shared / "signing.key").exists()
