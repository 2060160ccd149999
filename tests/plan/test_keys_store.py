import getpass
import json
import os
import socket
from pathlib import Path

import pytest

from kernel_cache.errors import CorruptEntryError
from kernel_cache.plan.buckets import Bucketer
from kernel_cache.plan.keys import COMPONENTS, EXCLUDED, build_key, diff_components
from kernel_cache.store.disk_tier import DiskTier, Entry, make_meta, verify_entry


def test_key_is_ordered_named_components(tiny_config):
    v = Bucketer(tiny_config).variants[0]
    k = build_key(tiny_config, v)
    assert tuple(n for n, _ in k.components) == COMPONENTS
    assert k.hexdigest == build_key(tiny_config, v).hexdigest
    assert set(k.component_digests()) == set(COMPONENTS)


def test_what_is_excluded_does_not_change_the_key(tiny_config, monkeypatch, tmp_path):
    """EXCLUDED's items, changed one at a time: the engine limits (they only choose
    which variants exist), the device index, HOME and the working directory."""
    assert any("max_model_len" in item for item in EXCLUDED)
    v = Bucketer(tiny_config).variants[0]
    base = build_key(tiny_config, v).hexdigest
    bigger = tiny_config.model_copy(update={"max_model_len": 64, "max_num_seqs": 8})
    assert build_key(bigger, v).hexdigest == base
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert build_key(tiny_config, v).hexdigest == base


def test_key_holds_no_path_user_or_host(tiny_config):
    k = build_key(tiny_config, Bucketer(tiny_config).variants[0])
    text = json.dumps(k.as_dict())
    for secret in (str(Path.home()), getpass.getuser(), socket.gethostname(), os.getcwd()):
        assert secret not in text, secret


def test_each_component_changes_the_key(tiny_config):
    v = Bucketer(tiny_config).variants[0]
    base = build_key(tiny_config, v)
    for name in COMPONENTS:
        other = build_key(tiny_config, v, overrides={name: "something else"})
        assert other.hexdigest != base.hexdigest, name
        assert diff_components(base.as_dict(), other.as_dict())[0].startswith(f"{name}: ")


def test_variants_have_distinct_keys(tiny_config):
    keys = {build_key(tiny_config, v).hexdigest for v in Bucketer(tiny_config).variants}
    assert len(keys) == len(Bucketer(tiny_config).variants)


def test_key_ignores_limits_that_only_pick_variants(tiny_config):
    v = Bucketer(tiny_config).variants[0]
    bigger = tiny_config.model_copy(update={"max_num_seqs": 64, "max_model_len": 4096})
    assert build_key(tiny_config, v).hexdigest == build_key(bigger, v).hexdigest


def _entry(tiny_config, data=b"x" * 100_000):
    key = build_key(tiny_config, Bucketer(tiny_config).variants[0])
    return key, data, make_meta(key, "v", data, 1.0)


def test_disk_tier_roundtrip_and_json_metadata(tmp_path, tiny_config):
    key, data, meta = _entry(tiny_config)
    tier = DiskTier(tmp_path)
    tier.put(key.hexdigest, data, meta)
    e = tier.get(key.hexdigest)
    verify_entry(e)
    assert e.data == data and e.meta["components"] == key.as_dict()
    raw = tier.cache.get("meta/" + key.hexdigest)
    assert json.loads(raw)["sha256"] == meta["sha256"]  # JSON bytes, not pickle
    assert [m["key"] for m in tier.iter_meta()] == [key.hexdigest]
    tier.delete(key.hexdigest)
    assert tier.get(key.hexdigest) is None


@pytest.mark.parametrize("damage", ["flip", "truncate", "wrong_key"])
def test_verify_entry_detects_damage(tiny_config, damage):
    key, data, meta = _entry(tiny_config)
    if damage == "flip":
        data = data[:10] + bytes([data[10] ^ 1]) + data[11:]
    elif damage == "truncate":
        data = data[:-1]
    else:
        meta = {**meta, "key": "0" * 64}
    with pytest.raises(CorruptEntryError):
        verify_entry(Entry(key=key.hexdigest, meta=meta, data=data))


def test_garbage_metadata_is_corrupt(tmp_path, tiny_config):
    key, data, meta = _entry(tiny_config)
    tier = DiskTier(tmp_path)
    tier.put(key.hexdigest, data, meta)
    tier.cache.set("meta/" + key.hexdigest, b"\x00garbage")
    with pytest.raises(CorruptEntryError, match="not JSON"):
        tier.get(key.hexdigest)
