"""The tier interface: typed put results, the lookup's per-tier policy, the
pydantic models of the store's JSON formats, and (read from the source with
ast) no caller in the runtime or warmup testing which tier it holds."""

from __future__ import annotations

import ast
import hashlib
import json
import logging

import pytest

from kernel_cache.errors import BundleError, CorruptEntryError
from kernel_cache.store import usage
from kernel_cache.store.bundle import MANIFEST, BundleManifest, BundleTier, read_manifest
from kernel_cache.store.disk_tier import (
    DiskTier,
    Entry,
    EntryMeta,
    PutOutcome,
    make_meta,
    parse_meta,
    verify_entry,
)
from kernel_cache.store.lookup import Lookup, Source
from kernel_cache.store.redis import RedisSettings, RedisTier
from kernel_cache.trust.keys import ENV_ALLOW_UNSIGNED

from ..conftest import ROOT
from ..redis_server import free_port

DATA = b"artifact bytes " * 100


class K:
    """A stand-in for CacheKey (make_meta reads hexdigest and as_dict)."""

    def __init__(self, tag: str = "a"):
        self.components = {"format": "kc2", "tag": tag}
        self.hexdigest = hashlib.sha256(tag.encode()).hexdigest()

    def as_dict(self):
        return dict(self.components)


def _real_key(tiny_config):
    from kernel_cache.plan.buckets import Bucketer
    from kernel_cache.plan.keys import build_key

    return build_key(tiny_config, Bucketer(tiny_config).variants[0])


def _down_redis(**kw) -> RedisTier:
    """A fail-open Redis tier at a loopback port nothing listens on."""
    return RedisTier(RedisSettings(url=f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5), **kw)


# -- typed put results -----------------------------------------------------------------


def test_disk_put_says_stored_then_present_then_stored_for_new_metadata(tmp_path):
    tier = DiskTier(tmp_path)
    k = K()
    meta = make_meta(k, "v", DATA, 1.0)
    first = tier.put(k.hexdigest, DATA, meta)
    assert first.outcome is PutOutcome.STORED and first.stored and first.where == str(tmp_path)
    again = tier.put(k.hexdigest, DATA, meta)
    assert again.outcome is PutOutcome.PRESENT and again.ok and not again.stored
    changed = tier.put(k.hexdigest, DATA, {**meta, "cpu_features": ["avx2"]})
    assert changed.outcome is PutOutcome.STORED
    assert tier.get(k.hexdigest).meta["cpu_features"] == ["avx2"]
    tier.close()


def test_redis_down_fail_open_put_fails_with_a_reason_and_the_lookup_goes_on(
    tmp_path, tiny_config, caplog, monkeypatch
):
    monkeypatch.setenv(ENV_ALLOW_UNSIGNED, "1")  # a shared tier of unsigned entries
    remote = _down_redis()
    key = _real_key(tiny_config)
    meta = make_meta(key, "v", DATA, 1.0)
    result = remote.put(key.hexdigest, DATA, meta)
    assert result.outcome is PutOutcome.FAILED and not result.ok
    assert remote.location in result.reason and "unavailable" in result.reason

    local = DiskTier(tmp_path)
    local.put(key.hexdigest, DATA, meta)
    # Redis first (a miss while down), then the local cache
    found = Lookup([Source(remote, promote_into=local), local]).find(key)
    assert found is not None and found.tier is local and found.entry.data == DATA
    # a hit copied into a down Redis: logged, and the hit is returned all the same
    with caplog.at_level(logging.WARNING, logger="kernel_cache"):
        found = Lookup([local], promote_into=remote).find(key)
    assert found.tier is local and found.promoted.outcome is PutOutcome.FAILED
    assert "could not copy" in caplog.text and remote.location in caplog.text
    local.close()


def test_promotion_into_a_read_only_tier_is_refused_and_reported(
    tmp_path, tiny_config, monkeypatch
):
    monkeypatch.setenv(ENV_ALLOW_UNSIGNED, "1")  # a shared tier of unsigned entries
    key = _real_key(tiny_config)
    shared = DiskTier(tmp_path / "shared")
    shared.put(key.hexdigest, DATA, make_meta(key, "v", DATA, 1.0))
    (tmp_path / "ro").mkdir()
    ro = DiskTier(tmp_path / "ro", read_only=True)
    found = Lookup([Source(shared, trusted=False, promote_into=ro)]).find(key)
    assert found.entry.data == DATA and found.promoted.outcome is PutOutcome.READ_ONLY
    assert "read-only" in found.promoted.reason
    assert list((tmp_path / "ro").iterdir()) == []


def test_lookup_policy_decides_trust_not_the_tier(tmp_path, tiny_config, caplog, monkeypatch):
    """The same disk tier is trusted (a damaged entry raises) or a shared store
    (rejected, logged, a miss) as the lookup says."""
    monkeypatch.setenv(ENV_ALLOW_UNSIGNED, "1")  # a shared tier of unsigned entries
    key = _real_key(tiny_config)
    tier = DiskTier(tmp_path)
    tier.put(key.hexdigest, DATA + b"!", make_meta(key, "v", DATA, 1.0))
    with pytest.raises(CorruptEntryError, match="size"):
        Lookup([tier]).find(key)
    lookup = Lookup([Source(tier, trusted=False, corrupt_is_miss=True)])
    with caplog.at_level(logging.WARNING, logger="kernel_cache"):
        result = lookup.search(key)
    assert result.found is None and result.failed is None
    assert len(result.rejected) == 1 and result.rejected[0].tier is tier
    assert "rejected disk entry" in caplog.text
    strict = Lookup([Source(tier, trusted=False)])
    with pytest.raises(CorruptEntryError):
        strict.find(key)
    failed = strict.search(key).failed  # the refusal that ended the lookup, with its tier
    assert failed.tier is tier and isinstance(failed.error, CorruptEntryError)


def test_a_lookup_answer_depends_on_no_earlier_lookup(tmp_path, tiny_config, monkeypatch):
    """:meth:`Lookup.search` returns what it found and why; nothing of one lookup
    is left on the Lookup for the next: a refused entry, then a good one, then a
    missing key, from two threads at once, each answer the same as alone."""
    from concurrent.futures import ThreadPoolExecutor

    from kernel_cache.plan.buckets import Bucketer
    from kernel_cache.plan.keys import build_key

    monkeypatch.setenv(ENV_ALLOW_UNSIGNED, "1")
    bad, good, missing = (build_key(tiny_config, v) for v in Bucketer(tiny_config).variants[:3])
    tier = DiskTier(tmp_path)
    tier.put(bad.hexdigest, DATA + b"!", make_meta(bad, "v", DATA, 1.0))
    tier.put(good.hexdigest, DATA, make_meta(good, "v", DATA, 1.0))
    lookup = Lookup([Source(tier, trusted=False, corrupt_is_miss=True)])

    def answer(key):
        r = lookup.search(key)
        return (r.found is not None, len(r.rejected), r.failed is None, r.changes)

    alone = {k.hexdigest: answer(k) for k in (bad, good, missing)}
    assert alone == {
        bad.hexdigest: (False, 1, True, ()),
        good.hexdigest: (True, 0, True, ()),
        missing.hexdigest: (False, 0, True, ()),
    }
    order = [bad, good, missing] * 20
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(answer, order))
    assert got == [alone[k.hexdigest] for k in order]
    tier.close()


# -- the models of the JSON formats --------------------------------------------------------


@pytest.mark.parametrize(
    "damage, field, what",
    [
        (lambda m: m.pop("sha256"), "sha256", "Field required"),
        (lambda m: m.update(size="12"), "size", "valid integer"),
        (lambda m: m.update(size=-1), "size", "greater than or equal to 0"),
        (lambda m: m.update(components=["x"]), "components", "valid dictionary"),
        (lambda m: m.update(created=10**400), "created", "beyond the float range"),
    ],
)
def test_malformed_metadata_names_the_entry_the_field_and_what_was_wrong(
    tmp_path, damage, field, what
):
    k = K()
    meta = make_meta(k, "v", DATA, 1.0)
    damage(meta)
    tier = DiskTier(tmp_path)
    tier.put(k.hexdigest, DATA, meta)
    with pytest.raises(CorruptEntryError) as e:
        tier.get(k.hexdigest)
    assert f"field {field}" in e.value.reason and what in e.value.reason
    assert e.value.key == k.hexdigest and e.value.where == str(tmp_path)
    with pytest.raises(CorruptEntryError, match=f"field {field}"):
        verify_entry(Entry(k.hexdigest, meta, DATA))
    tier.close()


def test_metadata_that_is_not_an_object_is_corrupt_not_a_crash():
    with pytest.raises(CorruptEntryError, match="JSON list, not an object") as e:
        parse_meta(b"[1, 2]", "k" * 64, "here")
    assert e.value.where == "here"


def test_metadata_round_trips_unchanged_and_models_are_frozen():
    raw = {"key": "a" * 64, "sha256": "b" * 64, "size": 3, "created": 5, "timings": {"x": 1}}
    assert parse_meta(json.dumps(raw), raw["key"]) == raw
    model = EntryMeta.model_validate(raw)
    assert model.record() == raw  # 5 stays 5, extra fields kept
    with pytest.raises(ValueError):
        model.size = 4
    k = K()
    assert set(make_meta(k, "v", DATA, 1.0)) == {
        "key", "variant", "components", "sha256", "size", "compile_seconds", "created", "format",
    }  # fmt: skip


def _manifest(entries) -> dict:
    return {"bundle_format": "kc-bundle-1", "created": 1.0, "entries": entries}


def _bundle_entry(k: K) -> dict:
    sha = hashlib.sha256(DATA).hexdigest()
    meta = make_meta(k, "v", DATA, 1.0)
    return {**meta, "file": f"artifacts/{sha}.pt2"}


def test_malformed_manifest_names_the_file_and_the_field(tmp_path):
    good, bad = _bundle_entry(K("a")), _bundle_entry(K("b"))
    bad["size"] = "big"
    del bad["file"]
    (tmp_path / MANIFEST).write_text(json.dumps(_manifest([good, bad])))
    with pytest.raises(BundleError) as e:
        BundleTier(tmp_path)
    msg = str(e.value)
    assert str(tmp_path / MANIFEST) in msg
    assert "field entries.1.size: Input should be a valid integer" in msg
    assert "field entries.1.file: Field required" in msg
    assert "entries.0" not in msg


def test_a_manifest_listing_a_key_twice_is_refused(tmp_path):
    e = _bundle_entry(K("a"))
    (tmp_path / MANIFEST).write_text(json.dumps(_manifest([e, e])))
    with pytest.raises(BundleError, match=r"entries\.1: key [0-9a-f]{16}\.\.\. is listed twice"):
        read_manifest(tmp_path)


def test_a_valid_manifest_reads_as_a_frozen_model_and_entries_keep_their_fields(tmp_path):
    k = K("a")
    e = {**_bundle_entry(k), "cpu_features": ["avx2"]}
    (tmp_path / MANIFEST).write_text(json.dumps(_manifest([e])))
    m = read_manifest(tmp_path)
    assert isinstance(m, BundleManifest) and m.entries[0].key == k.hexdigest
    with pytest.raises(ValueError):
        m.created = 2.0
    assert next(BundleTier(tmp_path).iter_meta()) == e


def test_usage_record_is_validated_and_a_malformed_one_starts_over(tmp_path, caplog):
    (tmp_path / usage.USAGE_FILE).write_text(json.dumps({"hits": 3, "last_used": ["x"]}))
    with caplog.at_level(logging.WARNING, logger="kernel_cache.store.usage"):
        assert usage.read_usage(tmp_path) == usage.UsageRecord()
    assert "field last_used" in caplog.text and usage.USAGE_FILE in caplog.text
    assert usage.record(tmp_path, hits=["k"], misses=2, now=7.0)
    doc = json.loads((tmp_path / usage.USAGE_FILE).read_text())
    assert doc == {"since": 7.0, "hits": 1, "misses": 2, "last_used": {"k": 7.0}}
    assert usage.record(tmp_path, hits=["j"], forget=["k"], now=9.0)
    r = usage.read_usage(tmp_path)
    assert (r.since, r.hits, r.misses, r.last_used) == (7.0, 2, 2, {"j": 9.0})


# -- no caller tests which tier it holds -------------------------------------------------------

TIER_CLASSES = {"Tier", "DiskTier", "RedisTier", "S3Tier", "BundleTier"}
TIER_NAMES = {"t", "r", "remote", "rtier", "src", "source"}


def tier_type_tests(source: str) -> list[str]:
    """``isinstance`` calls on a tier class, and comparisons of a tier's
    ``name``/``location``, in ``source`` (Python code), as ``line: text``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("isinstance", "type"):
            names = {n.id for a in node.args[1:] for n in ast.walk(a) if isinstance(n, ast.Name)}
            names |= {n.attr for a in node.args[1:] for n in ast.walk(a) if hasattr(n, "attr")}
            if names & TIER_CLASSES:
                out.append(f"{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                if isinstance(side, ast.Attribute) and side.attr in ("name", "location"):
                    base = ast.unparse(side.value)
                    if "tier" in base.lower() or base in TIER_NAMES:
                        out.append(f"{node.lineno}: {ast.unparse(node)}")
    return out


def test_the_checker_finds_the_old_forms():
    old = (
        "bundle = any(t.name == 'bundle' and t.location == e.where for t in tiers)\n"
        "if isinstance(tier, DiskTier):\n    pass\n"
        "ok = found.tier.name != 'redis'\n"
        "fine = target.name == NATIVE if cpu else path.name == 'x'\n"
    )
    assert sorted(h.split(":")[0] for h in tier_type_tests(old)) == ["1", "1", "2", "4"]
    assert tier_type_tests("if isinstance(x, (int, str)):\n    pass\nn = p.name == 'a'\n") == []


def test_the_runtime_and_warmup_never_test_which_tier_they_hold():
    files = sorted((ROOT / "kernel_cache" / "runtime").rglob("*.py"))
    files += sorted((ROOT / "warmup").rglob("*.py"))
    assert len(files) > 10
    hits = {
        str(f.relative_to(ROOT)): found for f in files if (found := tier_type_tests(f.read_text()))
    }
    assert hits == {}


def test_no_tier_has_a_promote_into_attribute():
    """Where a hit is copied is the lookup's policy (Source.promote_into)."""
    assert not hasattr(DiskTier, "promote_into") and not hasattr(RedisTier, "promote_into")
    assert not hasattr(BundleTier, "promote_into")


def test_an_entry_nested_too_deep_to_write_back_is_a_bundle_error(tmp_path):
    """An extra field nested 300 deep parses (json allows about 1000 levels) and
    validates, but pydantic writes back at most 255: the bundle is refused with
    a BundleError naming the entry, not a ValueError out of engine start."""
    b = tmp_path / "b"
    (b / "artifacts").mkdir(parents=True)
    entry = {"key": "k" * 64, "sha256": "0" * 64, "size": 1, "variant": "batched_decode:1:2:4"}
    entry.update(components={}, file=f"artifacts/{'0' * 64}.pt2")
    doc = {"bundle_format": "kc-bundle-1", "entries": [entry]}
    (b / MANIFEST).write_text(json.dumps(doc))
    assert next(BundleTier(b).iter_meta())["key"] == "k" * 64  # well formed: read
    deep = "[" * 300 + "]" * 300
    (b / MANIFEST).write_text(json.dumps(doc)[: -len("}]}")] + f', "zz": {deep}}}]}}')
    with pytest.raises(BundleError, match=r"entries\.0 cannot be read back.*nested too deep"):
        BundleTier(b)
