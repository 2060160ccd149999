"""The settings model of every KERNEL_CACHE_* variable, and its table in docs/settings.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kernel_cache.config import settings
from kernel_cache.config.settings import VARIABLES, SettingError, Settings
from kernel_cache.errors import ConfigError, KernelCacheError

SETTINGS_DOC = Path(__file__).resolve().parents[2] / "docs" / "settings.md"

#: field -> (a good value, what it reads as, a value the model refuses or None)
#: None: any text is a valid value of the field; its consumer checks it (FREE_FORM).
CASES = {
    "dir": ("/srv/kc", Path("/srv/kc"), None),
    "bundle": ("/a::/b:/a", (Path("/a"), Path("/b")), None),
    "tuning": ("/etc/kc/tuning.json", "/etc/kc/tuning.json", None),
    "kv_buckets": ("128, 256,512", (128, 256, 512), "128,12a"),
    "query_buckets": ("16,64", (16, 64), "16,-4"),
    "num_seqs_buckets": ("1,2,4", (1, 2, 4), "0,4"),
    "db_timeout": ("2.5", 2.5, "-1"),
    "lock_timeout": ("0", 0.0, "soon"),
    "max_size": ("1.5K", 1536, "2X"),
    "insecure_allow_shared_dir": ("Yes", True, "ture"),
    "keep_scratch": ("on", True, "2"),
    "jobs": ("3", 3, "0"),
    "pch_dir": ("/var/cache/kc-pch", Path("/var/cache/kc-pch"), None),
    "shards": ("4", 4, "0"),
    "signing_key": ("k" * 32, "k" * 32, None),
    "signing_key_file": ("/run/secrets/k", Path("/run/secrets/k"), None),
    "trusted_keys": (" /a.pub, /b.pub,,/a.pub", (Path("/a.pub"), Path("/b.pub")), None),
    "require_signed": ("FALSE", False, "maybe"),
    "insecure_allow_unsigned": ("yes", True, "sure"),
    "require_publish": ("0", False, "please"),
    "redis_url": ("redis://10.0.0.5:6379/0", "redis://10.0.0.5:6379/0", "http://10.0.0.5"),
    "redis_timeout": ("0.5", 0.5, "0"),
    "redis_ttl": ("3600", 3600, "1.5"),
    "redis_lock_ttl": ("30", 30.0, "nan"),
    "redis_lock_wait": ("60", 60.0, "-2"),
    "remote_url": ("file:///mnt/shared/kc", "file:///mnt/shared/kc", "file://host/x"),
    "s3_url": ("s3://kernel-cache/fleet-a", "s3://kernel-cache/fleet-a", "http://x/y"),
    "s3_timeout": ("0.5", 0.5, "0"),
    "s3_lock_ttl": ("30", 30.0, "nan"),
    "s3_lock_wait": ("60", 60.0, "-2"),
    "s3_max_object": ("512M", 512 << 20, "lots"),
    "redis_max_object": ("512M", 512 << 20, "lots"),
    "num_threads": ("4", 4, "0"),
    "remote_list_max": ("5000", 5000, "0"),
}


def _plain(value):
    return value.get_secret_value() if hasattr(value, "get_secret_value") else value


def test_every_field_has_a_case():
    assert set(CASES) == set(Settings.model_fields)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_good_value_reads_as_its_type(name, monkeypatch):
    raw, want, _ = CASES[name]
    assert _plain(settings.get(name, {VARIABLES[name]: raw})) == want
    monkeypatch.setenv(VARIABLES[name], raw)  # read per call from os.environ
    assert _plain(settings.get(name)) == want
    assert _plain(getattr(settings.read(), name)) == want
    assert _plain(getattr(Settings(), name)) == want  # pydantic-settings' own env source


@pytest.mark.parametrize("name", sorted(n for n, c in CASES.items() if c[2] is not None))
def test_a_bad_value_is_a_config_error_naming_variable_and_value(name, monkeypatch):
    bad = CASES[name][2]
    variable = VARIABLES[name]
    for read in (
        lambda: settings.get(name, {variable: bad}),
        lambda: settings.read({variable: bad}),
    ):
        with pytest.raises(ConfigError) as e:
            read()
        assert isinstance(e.value, SettingError) and e.value.variable == variable
        msg = str(e.value)
        assert msg.startswith(f"{variable}={bad!r}: ")
        assert "expected " in msg and "fix: " in msg
    monkeypatch.setenv(variable, bad)
    with pytest.raises(SettingError, match=re.escape(f"{variable}={bad!r}")):
        Settings()


SECONDS = sorted(n for n, f in Settings.model_fields.items() if f.annotation is float)


@pytest.mark.parametrize("name", SECONDS)
@pytest.mark.parametrize("bad", ["inf", "nan", "1e300", "1e400"])
def test_a_number_of_seconds_is_finite_and_bounded(name, bad):
    """``inf`` or ``1e300`` seconds passed and then broke in a socket or lock call
    (KERNEL_CACHE_REDIS_TIMEOUT=inf: OverflowError traceback from warmup)."""
    with pytest.raises(SettingError, match=re.escape(f"{VARIABLES[name]}={bad!r}")):
        settings.get(name, {VARIABLES[name]: bad})


@pytest.mark.parametrize("name", sorted(CASES))
def test_unset_empty_or_blank_is_the_default(name):
    default = Settings.model_fields[name].default
    for environ in ({}, {VARIABLES[name]: ""}, {VARIABLES[name]: "  "}):
        assert settings.get(name, environ) == default


def test_a_misspelt_boolean_is_an_error_for_every_boolean():
    bools = [n for n, f in Settings.model_fields.items() if "bool" in str(f.annotation).lower()]
    assert len(bools) == 5
    for name in bools:
        for good, want in (("1", True), ("off", False), (" TRUE ", True)):
            assert settings.get(name, {VARIABLES[name]: good}) is want
        with pytest.raises(SettingError, match=f"{VARIABLES[name]}='tru'"):
            settings.get(name, {VARIABLES[name]: "tru"})


def test_secrets_are_not_echoed_in_errors():
    with pytest.raises(SettingError) as e:
        settings.get("redis_url", {VARIABLES["redis_url"]: "http://user:hunter2@h/0"})
    assert "hunter2" not in str(e.value)
    s = settings.read({VARIABLES["signing_key"]: "hunter2" * 4})
    assert "hunter2" not in repr(s)


def test_unrelated_variables_are_ignored():
    s = settings.read({"KERNEL_CACHE_TEST_FAULT": "enospc@x", "KERNEL_CACHE_NOPE": "1"})
    assert s == Settings.model_construct()


# -- free-form fields: their consumers name the variable and the value ----------------


def test_free_form_values_are_checked_where_used(tmp_path, monkeypatch):
    from kernel_cache.plan.launch import Resolver
    from kernel_cache.store.bundle import read_manifest
    from kernel_cache.trust.keys import SigningKeyError, load_signer, load_trusted_keys

    missing = str(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match=f"KERNEL_CACHE_TUNING={re.escape(missing)}"):
        Resolver({"KERNEL_CACHE_TUNING": missing})
    with pytest.raises(SigningKeyError, match="KERNEL_CACHE_SIGNING_KEY is set, but HMAC"):
        load_signer({"KERNEL_CACHE_SIGNING_KEY": "short"})
    with pytest.raises(SigningKeyError, match=f"KERNEL_CACHE_SIGNING_KEY_FILE={missing}"):
        load_signer({"KERNEL_CACHE_SIGNING_KEY_FILE": missing})
    with pytest.raises(SigningKeyError, match=f"KERNEL_CACHE_TRUSTED_KEYS={missing}"):
        load_trusted_keys({"KERNEL_CACHE_TRUSTED_KEYS": missing})
    with pytest.raises(SigningKeyError, match="KERNEL_CACHE_REQUIRE_SIGNED='maybe'"):
        load_trusted_keys({"KERNEL_CACHE_REQUIRE_SIGNED": "maybe"})
    with pytest.raises(KernelCacheError, match=r"KERNEL_CACHE_BUNDLE"):
        read_manifest(settings.get("bundle", {"KERNEL_CACHE_BUNDLE": missing})[0])
    a_file = tmp_path / "file"
    a_file.write_text("")
    monkeypatch.setenv("KERNEL_CACHE_DIR", str(a_file))
    from warmup.cli.options import cache_dir_of

    class Args:
        cache_dir = None

    with pytest.raises(KernelCacheError, match=r"\$KERNEL_CACHE_DIR.*not a directory"):
        cache_dir_of(Args())


def test_engine_start_names_a_cache_dir_that_is_a_file(tmp_path, monkeypatch):
    """Engine start with $KERNEL_CACHE_DIR (or cache_dir) pointing at a file says
    so, as the command line does, rather than "17 variants are not cached"."""
    from kernel_cache.runtime.load import default_lookup

    a_file = tmp_path / "file"
    a_file.write_text("")
    monkeypatch.setenv("KERNEL_CACHE_DIR", str(a_file))
    with pytest.raises(ConfigError, match=r"\$KERNEL_CACHE_DIR.*not a directory"):
        default_lookup()
    monkeypatch.delenv("KERNEL_CACHE_DIR")
    with pytest.raises(ConfigError, match=r"cache_dir.*not a directory"):
        default_lookup(a_file / "below")


# -- the table in docs/settings.md ------------------------------------------------------


def _doc_table() -> str:
    text = SETTINGS_DOC.read_text()
    start = text.index(settings.TABLE_START) + len(settings.TABLE_START)
    return text[start : text.index(settings.TABLE_END)].strip()


def test_doc_table_is_the_generated_one():
    """Regenerate with ``python -m warmup.schemas`` when this fails."""
    assert _doc_table() == settings.markdown_table()


def test_doc_table_rows_are_the_model_variables():
    rows = re.findall(r"^\| `(KERNEL_CACHE_[A-Z0-9_]+)` \|", _doc_table(), re.M)
    assert sorted(rows) == sorted(VARIABLES.values())


def test_the_settings_have_no_test_hook():
    """Fault injection lives in the test suite (tests/hooks/kc_testhooks.py), not
    in the settings: no field or module name of settings.py is a test hook."""
    assert not [v for v in VARIABLES.values() if v.startswith("KERNEL_CACHE_TEST_")]
    assert not [n for n in vars(settings) if "test" in n.lower() and not n.startswith("__")]


def test_every_variable_named_in_the_code_is_in_the_model():
    """A variable read by kernel_cache/ or warmup/ that the model does not know fails here."""
    root = Path(__file__).resolve().parents[2]
    named = set()
    for folder in ("kernel_cache", "warmup"):
        for path in (root / folder).rglob("*.py"):
            named |= set(
                re.findall(r"KERNEL_CACHE_[A-Z][A-Z0-9_]*[A-Z](?![A-Z0-9_*])", path.read_text())
            )
    assert named - set(VARIABLES.values()) == set()


def test_the_table_follows_the_model():
    """One more field in the model is one more row, so the docs/settings.md check
    fails until the table is regenerated."""

    class More(Settings):
        new_knob: int = settings._f(3, "a knob", type="int", expected="an int", example="4")

    rows = settings.markdown_table(More).splitlines()
    assert len(rows) == len(settings.markdown_table().splitlines()) + 1
    assert "| `KERNEL_CACHE_NEW_KNOB` | int | 3 | a knob |" in rows
