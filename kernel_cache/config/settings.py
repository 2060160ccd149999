"""Every ``KERNEL_CACHE_*`` environment variable, in one pydantic-settings model.

:class:`Settings` has one field per variable (its name is ``KERNEL_CACHE_`` +
the field's name in capitals), with its type, default, unit and meaning; the
table of variables in docs/settings.md is generated from it (:func:`markdown_table`,
``python -m warmup.schemas``).

Values are read when asked for, never frozen at import: :func:`get` reads one
variable (the modules that use a variable call it per call or per engine
start), :func:`read` validates them all. Both take an optional ``environ``
mapping instead of :data:`os.environ`. An unset, empty or blank variable takes
its default. A value that does not validate raises :class:`SettingError` (a
:class:`~kernel_cache.errors.ConfigError`) naming the variable, the value
(never a signing key's), what is expected and the fix. Booleans accept
``1/true/yes/on`` and ``0/false/no/off`` (any case) and nothing else: a
misspelt ``ture`` is an error, not "off".

``Settings`` (a ``pydantic_settings.BaseSettings`` with ``env_prefix
KERNEL_CACHE_``) is made on first use: ``Settings()`` reads :data:`os.environ`
through pydantic-settings' environment source (about 6 ms a call). The fields
themselves live on the plain pydantic model :class:`SettingsFields` (its
base), and :func:`get` validates one picked-out variable with that field's
type, constraints and parsers (a cached ``TypeAdapter``, about a microsecond):
that is what lets it take ``environ``, and engine start never imports
pydantic-settings.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    SecretStr,
    TypeAdapter,
    ValidationError,
)

from kernel_cache.config.parsers import (  # noqa: F401 - callers use them as settings.<name>
    binary_units,
    check_redis_url,
    check_remote_url,
    check_s3_url,
    parse_bool,
    parse_int_list,
    redact_url,
)
from kernel_cache.errors import ConfigError

PREFIX = "KERNEL_CACHE_"


class SettingError(ConfigError):
    """A ``KERNEL_CACHE_*`` variable holds a value its field does not accept.
    ``variable`` is its name, ``value`` what it held."""

    def __init__(self, message: str, variable: str = "", value: str | None = None):
        super().__init__(message)
        self.variable = variable
        self.value = value


def parse_size(text: str, name: str = "SIZE") -> int:
    """Bytes from ``"500M"``, ``"1.5GiB"``, ``"1048576"`` (units are powers of 1024),
    read as ``KERNEL_CACHE_MAX_SIZE`` is (a flag such as ``--max-size``).

    Raises:
        ConfigError: not a size (names ``name``, the value and the form).
    """
    try:
        value = _adapter("max_size").validate_python(text)
    except ValidationError:
        value = None
    if value is None:
        raise ConfigError(
            f"{name}={text!r} is not a size; expected bytes or a number with K, M, G or T "
            "(powers of 1024), e.g. 500M or 2G"
        )
    return value


def _f(default, description: str, *, type: str, unit: str = "", expected: str, example: str,
       shown_default: str | None = None, **kw) -> Any:  # fmt: skip
    """A field with the settings table's columns in ``json_schema_extra``."""
    extra = {"type": type, "unit": unit, "expected": expected, "example": example}
    if shown_default is not None:
        extra["shown_default"] = shown_default
    return Field(default, description=description, json_schema_extra=extra, **kw)


#: the longest any timeout, lock TTL or wait may be (about 31 years): ``inf`` or
#: ``1e300`` seconds overflow a socket's or lock's timeout (``OverflowError``).
_MAX_SECONDS = 1e9
_SECONDS_POS = "a number of seconds > 0 and <= 1e9"
_SECONDS = {"le": _MAX_SECONDS, "allow_inf_nan": False}
_BOOL = "1 or 0 (true/false, yes/no, on/off; unset means 0)"
_BUCKETS = "a comma-separated list of positive integers"


def _before(parse):
    """A validator that parses a string (an environment value) with ``parse``."""
    return BeforeValidator(lambda v: parse(v) if isinstance(v, str) else v)


def _split_paths(text: str) -> tuple[Path, ...]:
    return tuple(dict.fromkeys(Path(p) for p in text.split(os.pathsep) if p.strip()))


def _split_comma_paths(text: str) -> tuple[Path, ...]:
    return tuple(dict.fromkeys(Path(p.strip()) for p in text.split(",") if p.strip()))


#: The most threads ``KERNEL_CACHE_NUM_THREADS`` sets: far above any CPU count;
#: 99999 made the first CPU kernel call crash (SIGSEGV, in OpenMP's thread start).
THREADS_MAX = 4096


def _threads(text: str) -> str | int:
    t = text.strip().lower()
    if t in ("auto", "keep"):
        return t
    try:
        n = int(t)
    except ValueError:
        raise ValueError(f"{text!r} is not auto, keep or an integer") from None
    if n < 1:
        raise ValueError(f"{n} threads: must be at least 1")
    if n > THREADS_MAX:
        raise ValueError(f"{n} threads: must be at most {THREADS_MAX}")
    return n


Bool = Annotated[bool, _before(parse_bool)]
Threads = Annotated[str | int, _before(_threads)]
BucketList = Annotated[tuple[int, ...] | None, _before(parse_int_list)]
PathList = Annotated[tuple[Path, ...], _before(_split_paths)]
CommaPathList = Annotated[tuple[Path, ...], _before(_split_comma_paths)]
Size = Annotated[
    ByteSize | None,
    BeforeValidator(binary_units),
    AfterValidator(lambda v: v if v is None else int(v)),
]
RedisUrl = Annotated[str | None, AfterValidator(lambda v: v if v is None else check_redis_url(v))]
RemoteUrl = Annotated[str | None, AfterValidator(lambda v: v if v is None else check_remote_url(v))]


#: The most compile workers ``KERNEL_CACHE_JOBS`` and ``--jobs`` accept.
JOBS_MAX = 1024
#: The largest ``KERNEL_CACHE_REMOTE_LIST_MAX``: a listing's keys are held in memory.
LIST_MAX_MAX = 100_000_000


class SettingsFields(BaseModel):
    """The fields of :class:`Settings`, as a plain pydantic model: :func:`get`
    validates with them without importing pydantic-settings (about 20-40 ms of
    imports an engine start need not pay)."""

    model_config = ConfigDict(frozen=True, extra="ignore", defer_build=True)

    # -- where things are -----------------------------------------------------------
    dir: Path | None = _f(
        None, "the local cache directory (the --cache-dir flag wins)",
        type="path", expected="a directory path", example="/var/cache/kernel_cache",
        shown_default="$XDG_CACHE_HOME/kernel_cache, else ~/.cache/kernel_cache",
    )  # fmt: skip
    bundle: PathList = _f(
        (), "bundle directories searched before the local cache, after --bundle",
        type=f"paths ({os.pathsep!r}-separated)", expected="directory paths",
        example="/opt/models/kc-bundle", shown_default="none",
    )  # fmt: skip
    tuning: str | None = _f(
        None, "launch-config table overriding the bundled one: a path to a JSON file "
        "or the JSON text itself (starting with {)",
        type="path or JSON", expected="a launch table file or inline JSON",
        example="/etc/kc/tuning.json", shown_default="none (bundled table, then defaults)",
    )  # fmt: skip
    # -- plan -------------------------------------------------------------------------
    kv_buckets: BucketList = _f(
        None, "KV buckets replacing the computed ladder (flags win)",
        type="int list", unit="tokens", expected=_BUCKETS, example="128,256,512",
        shown_default="computed ladder",
    )  # fmt: skip
    query_buckets: BucketList = _f(
        None, "prefill query buckets (flags win)",
        type="int list", unit="tokens", expected=_BUCKETS, example="16,64,256",
        shown_default="computed ladder",
    )  # fmt: skip
    num_seqs_buckets: BucketList = _f(
        None, "decode-batch buckets (flags win)",
        type="int list", unit="sequences", expected=_BUCKETS, example="1,2,4,8",
        shown_default="computed ladder",
    )  # fmt: skip
    # -- local cache --------------------------------------------------------------------
    db_timeout: float = _f(
        60.0, "longest wait for the cache index (SQLite) locked by other processes",
        type="float", unit="s", expected=_SECONDS_POS, example="60", gt=0, **_SECONDS,
    )  # fmt: skip
    lock_timeout: float = _f(
        900.0, "longest wait of a warmup for another process compiling the same key",
        type="float", unit="s", expected="a number of seconds >= 0 and <= 1e9", example="900",
        ge=0, **_SECONDS,
    )  # fmt: skip
    max_size: Size = _f(
        None, "size limit of the cache: warmup and gc remove least recently used "
        "entries of other plans above it (--max-size wins)",
        type="size", unit="bytes", expected="bytes or a number with K, M, G or T "
        "(powers of 1024)", example="2G", shown_default="no limit",
    )  # fmt: skip
    insecure_allow_shared_dir: Bool = _f(
        False, "skip the ownership and permission checks of the cache directory and "
        "its files (a shared or group directory; checksums still apply)",
        type="bool", expected=_BOOL, example="1",
    )  # fmt: skip
    keep_scratch: Bool = _f(
        False, "keep warmup's compile scratch directory (Inductor sources, objects) "
        "for debugging; its path is logged",
        type="bool", expected=_BOOL, example="1",
    )  # fmt: skip
    jobs: int | None = _f(
        None, "compile worker processes of warmup and tune (--jobs wins); a machine that "
        "runs several warmups at once, such as a test suite, sets 1",
        type="int", expected=f"an integer >= 1 and <= {JOBS_MAX}", example="1",
        shown_default="min(2, CPUs)", ge=1, le=JOBS_MAX,
    )  # fmt: skip
    pch_dir: Path | None = _f(
        None, "where compile workers keep the C++ precompiled headers and the wrapper's "
        "runtime interface (aoti-interface/) they build once per compiler, torch and flags, "
        "and the stride analysis's results (index-strides.json), and reuse them in later "
        "warmups; only its owner may write it",
        type="path", expected="a directory path", example="/var/cache/kc-pch",
        shown_default="<cache dir>/pch",
    )  # fmt: skip
    num_threads: Threads = _f(
        "auto", "CPU threads of a serving process, set by load_plan for a CPU plan: auto "
        "lowers torch's count to the CPUs the process may use (affinity, cgroup CPU quota) "
        "unless OMP_NUM_THREADS is set; N sets N; keep leaves torch's count alone",
        type="auto | keep | int", expected=f"auto, keep or an integer >= 1 and <= {THREADS_MAX}",
        example="1",
        shown_default="auto",
    )  # fmt: skip
    # -- sharded warmup -------------------------------------------------------------------
    shards: int | None = _f(
        None, "the number of warmup shards for --shard auto, whose index is a Kubernetes "
        "Indexed Job's JOB_COMPLETION_INDEX; set it to the Job's completions (--shards wins)",
        type="int", expected="an integer >= 1", example="4", shown_default="none", ge=1,
    )  # fmt: skip
    # -- signing ------------------------------------------------------------------------
    signing_key: SecretStr | None = _f(
        None, "retired (the HMAC secret): set, it is an error saying how to migrate "
        "(kernel-cache keygen, then _SIGNING_KEY_FILE and _TRUSTED_KEYS)",
        type="retired", expected="unset", example="(unset)", shown_default="unset",
    )  # fmt: skip
    signing_key_file: Path | None = _f(
        None, "builders only: the Ed25519 private key (PEM PKCS#8, chmod 600, from "
        "kernel-cache keygen) that signs every entry published to Redis, S3 or a bundle",
        type="path", expected="a readable file path", example="/etc/kc/signing.key",
        shown_default="none (unsigned)",
    )  # fmt: skip
    trusted_keys: CommaPathList = _f(
        (), "Ed25519 public keys (PEM, from kernel-cache keygen) whose signatures entries "
        "from Redis, S3 and bundles must carry; several let a fleet rotate keys",
        type="paths (','-separated)", expected="public key file paths",
        example="/etc/kc/signing.pub,/etc/kc/old.pub",
        shown_default="none (a shared tier then refuses to start)",
    )  # fmt: skip
    require_signed: Bool = _f(
        False, "refuse to start without a key to check signatures (_TRUSTED_KEYS or "
        "_SIGNING_KEY_FILE; --require-signed)",
        type="bool", expected=_BOOL, example="1",
    )  # fmt: skip
    insecure_allow_unsigned: Bool = _f(
        False, "load and publish unsigned entries of shared tiers (Redis, S3, bundles) when "
        "no key is set: anyone who can write the shared store can then run code on every "
        "engine (--insecure-allow-unsigned); unset, a shared tier needs _TRUSTED_KEYS or "
        "_SIGNING_KEY_FILE",
        type="bool", expected=_BOOL, example="1",
    )  # fmt: skip
    require_publish: Bool = _f(
        False, "builders: warmup and export exit non-zero unless every entry reached the "
        "shared tier, signed (--require-publish; for a CI step that must publish)",
        type="bool", expected=_BOOL, example="1",
    )  # fmt: skip
    # -- Redis --------------------------------------------------------------------------
    redis_url: RedisUrl = _f(
        None, "shared Redis tier (--redis-url wins)",
        type="URL", expected="redis://HOST:PORT/DB, rediss://... or unix://PATH",
        example="redis://10.0.0.5:6379/0", shown_default="none (local only)",
    )  # fmt: skip
    redis_timeout: float = _f(
        2.0, "socket connect and read timeout of every Redis call (--redis-timeout wins)",
        type="float", unit="s", expected=_SECONDS_POS, example="2", gt=0, **_SECONDS,
    )  # fmt: skip
    redis_ttl: int | None = _f(
        None, "expiry of a Redis entry (--redis-ttl wins)",
        type="int", unit="s", expected="an integer number of seconds >= 1 "
        "(an entry TTL must be >= 1 second; unset: no expiry)", example="604800",
        shown_default="no expiry", ge=1,
    )  # fmt: skip
    redis_lock_ttl: float = _f(
        30.0, "expiry of a Redis build lock, renewed every third of it while compiling",
        type="float", unit="s", expected=_SECONDS_POS, example="30", gt=0, **_SECONDS,
    )  # fmt: skip
    redis_lock_wait: float = _f(
        900.0, "longest wait for a live Redis build-lock holder before compiling anyway",
        type="float", unit="s", expected=_SECONDS_POS, example="900", gt=0, **_SECONDS,
    )  # fmt: skip
    redis_max_object: Size = _f(
        256 << 20, "largest Redis value an engine or builder reads (an entry's artifact "
        "bytes): a larger one is refused from its length (HSTRLEN), before it is read",
        type="size", unit="bytes", expected="bytes or a number with K, M, G or T "
        "(powers of 1024)", example="512M", shown_default="256M",
    )  # fmt: skip
    # -- object store (S3, GCS, Azure, a shared directory) --------------------------------
    remote_url: RemoteUrl = _f(
        None, "shared object-store tier (--remote-url wins): s3://, gs://, az:// or file:// "
        "(a directory on a shared filesystem); credentials from the store's standard "
        "variables (AWS_*, GOOGLE_*, AZURE_*); see docs/shared-storage.md",
        type="URL", expected="s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, az://CONTAINER/PREFIX "
        "or file:///DIRECTORY", example="s3://kernel-cache/fleet-a",
        shown_default="none (local only)",
    )  # fmt: skip
    s3_url: RemoteUrl = _f(
        None, "the older name of KERNEL_CACHE_REMOTE_URL (--s3-url), still read; set one "
        "of the two (both set to different URLs is an error)",
        type="URL", expected="as KERNEL_CACHE_REMOTE_URL", example="s3://kernel-cache/fleet-a",
        shown_default="none (local only)",
    )  # fmt: skip
    s3_timeout: float = _f(
        2.0, "connect and read timeout of every S3 call, no retries (--s3-timeout wins)",
        type="float", unit="s", expected=_SECONDS_POS, example="2", gt=0, **_SECONDS,
    )  # fmt: skip
    s3_max_object: Size = _f(
        256 << 20, "largest S3 object an engine or builder reads (an entry or a manifest): "
        "a larger one is refused from its size header, before its body is read",
        type="size", unit="bytes", expected="bytes or a number with K, M, G or T "
        "(powers of 1024)", example="512M", shown_default="256M",
    )  # fmt: skip
    s3_lock_ttl: float = _f(
        30.0, "expiry of an S3 build lease, renewed every third of it while compiling",
        type="float", unit="s", expected=_SECONDS_POS, example="30", gt=0, **_SECONDS,
    )  # fmt: skip
    s3_lock_wait: float = _f(
        900.0, "longest wait for a live S3 build-lease holder before compiling anyway",
        type="float", unit="s", expected=_SECONDS_POS, example="900", gt=0, **_SECONDS,
    )  # fmt: skip
    # -- both shared tiers ----------------------------------------------------------------
    remote_list_max: int = _f(
        100_000, "most entries a listing of a shared tier (Redis, object store, shared "
        "directory) takes, for explain's nearest entries, and gc-remote's listing of each "
        "prefix: past it the listing stops with an "
        "error naming this variable. It bounds the listing's requests: Redis SCAN calls "
        "(COUNT 1000) walk at most four times this many keys of the database (the cache "
        "keeps three per entry); an object store's "
        "LIST pages (1000 names) or a directory's names stop after this many, names that "
        "are not entry keys included",
        type="int", unit="entries", expected=f"an integer >= 1 and <= {LIST_MAX_MAX}",
        example="500000", ge=1, le=LIST_MAX_MAX,
    )  # fmt: skip


def _settings_class():
    from pydantic_settings import BaseSettings, SettingsConfigDict

    class Settings(BaseSettings, SettingsFields):
        """The ``KERNEL_CACHE_*`` variables (see the module docstring); ``Settings()``
        reads :data:`os.environ` with pydantic-settings' environment source.

        Raises:
            SettingError: a variable that does not validate.
        """

        model_config = SettingsConfigDict(
            env_prefix=PREFIX,
            case_sensitive=False,
            env_ignore_empty=True,
            enable_decoding=False,  # lists are comma- or pathsep-separated, not JSON
            extra="ignore",
            frozen=True,
        )

        def __init__(self, **values):
            try:
                super().__init__(**values)
            except ValidationError as e:
                name = str(e.errors()[0]["loc"][0])
                raw = {**_pick(os.environ, VARIABLES), **values}
                raise _error(name, e, raw.get(name)) from None

    Settings.__module__ = __name__
    return Settings


def __getattr__(name: str):
    """``Settings``, the pydantic-settings class, made on first use."""
    if name == "Settings":
        cls = globals()["Settings"] = _settings_class()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_FIELDS = SettingsFields.model_fields

#: ``{field name: variable name}`` for every field.
VARIABLES: dict[str, str] = {name: PREFIX + name.upper() for name in _FIELDS}


def default(name: str) -> Any:
    """The default of field ``name`` (what an unset variable reads as)."""
    return _FIELDS[name].default


def var(name: str) -> str:
    """The variable of field ``name``: ``"db_timeout"`` -> ``"KERNEL_CACHE_DB_TIMEOUT"``."""
    return VARIABLES[name]


@functools.cache
def _adapter(name: str) -> TypeAdapter:
    """A validator of field ``name`` alone (its type, constraints and parsers):
    validating the whole ``Settings`` runs pydantic-settings' sources, about
    6 ms, where this takes microseconds."""
    return TypeAdapter(_FIELDS[name].rebuild_annotation())


def _error(name: str, e: ValidationError, value) -> SettingError:
    """The :class:`SettingError` of field ``name`` holding ``value``."""
    variable = VARIABLES[name]
    extra = _FIELDS[name].json_schema_extra or {}
    if name == "signing_key":
        shown = "'***'"
    elif name == "redis_url" and isinstance(value, str):
        shown = repr(redact_url(value))
    else:
        shown = repr(value)
    problem = str(e.errors(include_url=False)[0]["msg"]).removeprefix("Value error, ")
    msg = (
        f"{variable}={shown}: {problem}; expected {extra.get('expected', 'a valid value')}; "
        f"fix: set it like {variable}={extra.get('example', '...')}, or unset it for the default"
    )
    return SettingError(msg, variable, value)


def _validate(name: str, value):
    try:
        return _adapter(name).validate_python(value)
    except ValidationError as e:
        raise _error(name, e, value) from None


def _pick(environ: Mapping[str, str], names) -> dict[str, str]:
    out = {}
    for name in names:
        raw = environ.get(VARIABLES[name])
        if raw is not None and raw.strip():
            out[name] = raw
    return out


def read(environ: Mapping[str, str] | None = None) -> SettingsFields:
    """All variables of ``environ`` (default :data:`os.environ`), validated.

    Raises:
        SettingError: the first variable that does not validate.
    """
    raw = _pick(os.environ if environ is None else environ, VARIABLES)
    cls = globals().get("Settings") or __getattr__("Settings")
    return cls.model_construct(**{name: _validate(name, v) for name, v in raw.items()})


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of field ``name`` (e.g. ``"db_timeout"``) from ``environ``
    (default :data:`os.environ`); only that variable is validated.

    Raises:
        SettingError: that variable does not validate.
        KeyError: ``name`` is not a field.
    """
    raw = _pick(os.environ if environ is None else environ, (name,))
    if not raw:
        return _FIELDS[name].default
    return _validate(name, raw[name])


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the variable of field ``name`` is set to something not blank."""
    return bool(_pick(os.environ if environ is None else environ, (name,)))


# -- the table in docs/settings.md -----------------------------------------------------

TABLE_START = "<!-- settings-table:start (generated: python -m warmup.schemas) -->"
TABLE_END = "<!-- settings-table:end -->"


def _default_text(f) -> str:
    extra = f.json_schema_extra or {}
    if "shown_default" in extra:
        return extra["shown_default"]
    d = f.default
    if isinstance(d, bool):
        return "0"
    if isinstance(d, float) and d.is_integer():
        d = int(d)
    return f"{d} {extra.get('unit', '')}".strip()


def markdown_table(model: type[BaseModel] = SettingsFields) -> str:
    """The table of docs/settings.md: one row per field of ``model``."""
    rows = ["| Variable | Type | Default | Meaning |", "|---|---|---|---|"]
    for name, f in model.model_fields.items():
        extra = f.json_schema_extra or {}
        typ = extra["type"] + (f" ({extra['unit']})" if extra.get("unit") else "")
        rows.append(f"| `{PREFIX}{name.upper()}` | {typ} | {_default_text(f)} | {f.description} |")
    return "\n".join(rows)


def update_table(path: str | os.PathLike) -> bool:
    """Replace the table between :data:`TABLE_START` and :data:`TABLE_END` in
    ``path``; True if the file changed.

    Raises:
        ConfigError: the markers are missing.
    """
    p = Path(path)
    text = p.read_text()
    start, end = text.find(TABLE_START), text.find(TABLE_END)
    if start < 0 or end < start:
        raise ConfigError(f"{p}: no {TABLE_START!r} ... {TABLE_END!r} section to replace")
    new = text[: start + len(TABLE_START)] + "\n" + markdown_table() + "\n" + text[end:]
    if new != text:
        p.write_text(new)
    return new != text
