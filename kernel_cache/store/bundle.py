"""Relocatable, read-only bundles: exactly one plan's artifacts, for a container image.

A bundle is a directory; every path in it is relative, so it can be moved,
copied into an image layer or mounted read-only anywhere::

    <bundle>/manifest.json
    <bundle>/artifacts/<sha256 of the bytes>.pt2    # one file per artifact

``manifest.json`` (JSON, never pickle)::

    {"bundle_format": "kc-bundle-1", "created": <unix seconds>,
     "plan": {"config": {<EngineConfig fields>}, "fingerprint": "<16 hex>",
              "variants": ["paged_attention:1:1:1", ...]},
     "tools": {"kernel_cache": "0.1.0", "torch": "2.13.0+cpu", "python": "3.11",
               "cxx": "gcc 12.2.0", "platform": "Linux-...-x86_64"},
     "entries": [{<the entry's whole metadata record as built: "variant", "key",
                   "components": {name: value}, "sha256", "size" (bytes), "kernel",
                   "compile_seconds", "created", "format", for a CPU artifact
                   "cpu_target" and "cpu_features", "signature" when signed, ...>,
                  "file": "artifacts/<sha256>.pt2"}, ...]}

``kernel-cache export`` writes one (:func:`export_bundle`); engine start and
``verify`` read them through :class:`BundleTier` from ``--bundle DIR`` and
``$KERNEL_CACHE_BUNDLE`` (:func:`bundle_paths`) before the local cache;
``kernel-cache import`` copies one into a local cache (:func:`import_bundle`).
A :class:`BundleTier` writes nothing, anywhere: it reads the manifest and the
files, and :func:`kernel_cache.store.disk_tier.verify_entry` checks each file's size and
sha256 before its code is loaded, and the signature over each whole record
(:mod:`kernel_cache.trust.signing`; no key set: refused, unless the insecure opt-out).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from kernel_cache.config import settings
from kernel_cache.errors import BundleError, CorruptEntryError, describe_errors
from kernel_cache.store.disk_tier import (
    Entry,
    EntryMeta,
    PutOutcome,
    PutResult,
    Tier,
)
from kernel_cache.store.locks import remove_dead_process_dirs

BUNDLE_FORMAT = "kc-bundle-1"
MANIFEST = "manifest.json"
#: The largest ``manifest.json`` read (bytes): about 1 KB per entry, so far above
#: any plan; a larger file is refused rather than read into memory.
MANIFEST_LIMIT = 64 << 20


def read_regular(path: Path, size: int | None, *, limit: int | None = None) -> bytes:
    """The bytes of ``path``, which must be a regular file (a link to one is
    followed) of exactly ``size`` bytes when ``size`` is given, at most ``limit``
    bytes otherwise. Opened non-blocking, so a FIFO or device planted in a
    bundle is refused at once instead of hanging or filling memory.

    Raises:
        OSError: it cannot be opened or read.
        ValueError: not a regular file, or another size (the message says which).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file (a FIFO, device or directory is never read)")
        if size is not None and st.st_size != size:
            raise ValueError(f"{st.st_size} bytes on disk, the manifest records {size}")
        if limit is not None and st.st_size > limit:
            raise ValueError(f"{st.st_size} bytes, above the {limit}-byte limit")
        data = f.read(st.st_size + 1)
    if len(data) != st.st_size:
        raise ValueError(f"changed while read ({len(data)} bytes read, {st.st_size} on disk)")
    return data


ENV_BUNDLE = settings.var("bundle")

_FILE_RE = re.compile(r"artifacts/([0-9a-f]{64})\.pt2")


def bundle_paths(explicit=None, environ=None) -> list[Path]:
    """Bundle directories in lookup order: ``explicit`` (``--bundle``, in the
    order given), then ``$KERNEL_CACHE_BUNDLE`` (``os.pathsep``-separated);
    empty items are skipped and duplicates dropped."""
    items = [Path(p) for p in (explicit or []) if str(p)]
    return list(dict.fromkeys([*items, *settings.get("bundle", environ)]))


class BundleEntry(EntryMeta):
    """One entry of a bundle manifest: an :class:`EntryMeta` record plus the
    ``file`` holding its bytes (``artifacts/<sha256>.pt2``, checked on read by
    :meth:`BundleTier.get`); ``variant`` and ``components`` are required here."""

    variant: str
    components: dict[str, str]
    file: str


class BundleManifest(BaseModel):
    """A bundle's ``manifest.json`` (see the module docstring).

    ``plan``, ``tools`` and ``created`` are informational and kept as written.
    """

    model_config = ConfigDict(frozen=True, extra="allow", defer_build=True)

    bundle_format: Literal["kc-bundle-1"]
    created: int | float | None = None
    plan: dict | None = None
    tools: dict | None = None
    entries: tuple[BundleEntry, ...]

    @model_validator(mode="after")
    def _one_entry_per_key(self) -> BundleManifest:
        seen: set[str] = set()
        for n, e in enumerate(self.entries):
            if e.key in seen:
                raise ValueError(f"entries.{n}: key {e.key[:16]}... is listed twice")
            seen.add(e.key)
        return self


def read_manifest(directory: str | os.PathLike) -> BundleManifest:
    """Read and check a bundle's ``manifest.json``.

    Raises:
        BundleError: the directory or manifest is missing, the manifest is not
            JSON, has another ``bundle_format``, or a field is missing or of
            the wrong type (names the manifest and the field, e.g. ``entries.3.size``).
    """
    d = Path(directory)
    path = d / MANIFEST
    if not d.is_dir():
        raise BundleError(
            f"bundle {str(d)!r} is not a directory; give the directory kernel-cache export "
            f"wrote (to --bundle, ${ENV_BUNDLE} or kernel-cache import DIR)"
        )
    try:
        doc = json.loads(read_regular(path, None, limit=MANIFEST_LIMIT))
    except ValueError as e:
        if isinstance(e, json.JSONDecodeError):
            raise BundleError(f"bundle manifest {str(path)!r} is not JSON: {e}") from None
        raise BundleError(f"bundle manifest {str(path)!r}: {e}") from None
    except RecursionError:  # "[[[[...": json raises it, not ValueError
        raise BundleError(f"bundle manifest {str(path)!r} is not JSON: nested too deep") from None
    except FileNotFoundError:
        raise BundleError(
            f"bundle {str(d)!r} has no {MANIFEST}: not a kernel-cache bundle; "
            "write one with: kernel-cache export [ENGINE OPTIONS] --out DIR"
        ) from None
    except OSError as e:
        raise BundleError(f"bundle manifest {str(path)!r} cannot be read: {e}") from None
    if not isinstance(doc, dict) or doc.get("bundle_format") != BUNDLE_FORMAT:
        got = doc.get("bundle_format") if isinstance(doc, dict) else None
        raise BundleError(
            f"bundle manifest {str(path)!r}: bundle_format {got!r}, this kernel-cache reads "
            f"{BUNDLE_FORMAT!r}; export the bundle again with this version"
        )
    try:
        manifest = BundleManifest.model_validate(doc)
    except ValidationError as e:
        raise BundleError(
            f"bundle manifest {str(path)!r}: {describe_errors(e)}; export the bundle again"
        ) from None
    for n, e in enumerate(manifest.entries):
        try:  # pydantic writes back at most 255 levels: a deeper extra field raises here
            e.record()
        except ValueError as err:
            raise BundleError(
                f"bundle manifest {str(path)!r}: entries.{n} cannot be read back ({err}: "
                "nested too deep); export the bundle again"
            ) from None
    return manifest


class BundleTier(Tier):
    """A read-only tier over a bundle directory (see the module docstring).

    ``get`` reads ``artifacts/<sha256>.pt2`` and returns it with the manifest's
    record as metadata; the caller verifies it (size, sha256) before loading.
    A ``file`` field that is not ``artifacts/<sha256>.pt2`` of its own sha256
    (a path outside the bundle, a renamed file) makes the entry corrupt.
    ``put`` answers ``read-only`` and ``delete`` raises :class:`BundleError`: a
    bundle is never written.

    Raises (constructor): BundleError, from :func:`read_manifest`.
    """

    name = "bundle"
    trusted = False  # entries need a valid signature (or the insecure opt-out)
    repair = "export"

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.location = str(self.directory)
        self.manifest = read_manifest(self.directory)
        self._entries = {e.key: e.record() for e in self.manifest.entries}

    def get_meta(self, key: str) -> dict | None:
        e = self._entries.get(key)
        return dict(e) if e is not None else None

    def get(self, key: str) -> Entry | None:
        meta = self.get_meta(key)
        if meta is None:
            return None
        m = _FILE_RE.fullmatch(str(meta["file"]))
        if not m or m.group(1) != meta["sha256"]:
            raise CorruptEntryError(
                key,
                f"manifest names file {meta['file']!r}, expected artifacts/<its sha256>.pt2",
                self.location,
            )
        try:
            data = read_regular(self.directory / meta["file"], int(meta["size"]))
        except OSError as e:
            raise CorruptEntryError(
                key, f"cannot read {meta['file']}: {e.strerror or e}", self.location
            ) from None
        except ValueError as e:
            raise CorruptEntryError(key, f"{meta['file']}: {e}", self.location) from None
        return Entry(key=key, meta=meta, data=data, where=self.location)

    def put(self, key: str, data: bytes, meta: dict) -> PutResult:
        """Never writes: ``read-only``, with how to get a writable copy."""
        why = (
            f"bundle {self.location!r} is read-only; copy it into a local cache with "
            f"kernel-cache import {self.location}"
        )
        return PutResult(PutOutcome.READ_ONLY, self.location, why)

    def delete(self, key: str) -> None:
        raise BundleError(f"bundle {self.location!r} is read-only; entries cannot be deleted")

    def iter_meta(self) -> Iterator[dict]:
        for e in self.manifest.entries:
            yield e.record()


def tool_versions() -> dict:
    """The tools that built a bundle (informational; the key components decide)."""
    from kernel_cache import __version__
    from kernel_cache.plan.keys import cxx_compiler_id, torch_version

    return {
        "kernel_cache": __version__,
        "torch": torch_version(),
        "python": sys.version.split()[0],
        "cxx": cxx_compiler_id(),
        "platform": platform.platform(),
    }


def _make_read_only(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for f in filenames:
            os.chmod(os.path.join(dirpath, f), 0o444)
    for dirpath, _, _ in sorted(os.walk(root), key=lambda w: -len(w[0])):
        os.chmod(dirpath, 0o555)


def export_bundle(
    config, out: str | os.PathLike, tiers: list[Tier], *, require_publish: bool | None = None
) -> dict:
    """Write a bundle of exactly ``config``'s plan, read from ``tiers``.

    Every variant is found with the engine-start lookup
    (:class:`kernel_cache.store.lookup.Lookup`) and verified. The bundle is written
    to a temporary sibling of ``out`` and renamed into place, then made
    read-only (files 0444, directories 0555), so ``out`` is complete or absent.
    The temporary directory of an export that was killed before its rename is
    removed by the next export to ``out``.

    Returns: ``{"out", "variants", "files", "bytes", "fingerprint", "signed_by"}``
    (``signed_by``: the key id that signed every entry now, or None: entries
    keep the signatures they were built with).

    Raises:
        BundleError: a variant is missing or corrupt (lists them and the warmup
            command), an entry would be refused by the trusted keys set here
            (unsigned, or signed by a key not trusted, and no private key to sign
            it now), or ``out`` exists and is not an empty directory.
        SigningKeyError: a key setting is wrong; no key is set at all (the bundle
            would be unsigned, which engines refuse) and not
            ``KERNEL_CACHE_INSECURE_ALLOW_UNSIGNED``; or ``require_publish``
            (default ``KERNEL_CACHE_REQUIRE_PUBLISH``) and no private key.
    """
    from kernel_cache.config import settings
    from kernel_cache.plan.plan import Plan
    from kernel_cache.trust.keys import (
        ENV_SIGNING_KEY_FILE,
        SigningKeyError,
        load_signer,
        shared_keyring,
    )

    signer = load_signer()
    keyring = shared_keyring([f"the bundle {out}"])
    if require_publish is None:
        require_publish = settings.get("require_publish")
    if require_publish and signer is None:
        raise SigningKeyError(
            f"--require-publish / {settings.var('require_publish')}: no private key "
            f"({ENV_SIGNING_KEY_FILE}) to sign the bundle {out}; set it to the builder's "
            "DIR/signing.key (kernel-cache keygen DIR)"
        )
    out = Path(out)
    _refuse_existing(out)
    plan = Plan.build(config, log_launch=False)
    found = _find_plan(plan, tiers)
    entries = [_manifest_entry(v, hit, signer) for v, hit in found]
    if keyring is not None:
        _refuse_untrusted(found, entries, keyring)
    tmp = _make_temp_dir(out)
    try:
        total = _write_artifacts(found, tmp)
        manifest = _manifest(config, plan, entries)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        _move_into_place(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise BundleError(f"cannot write the bundle to {str(out)!r}: {e}") from None
    _make_read_only(out)
    return {
        "out": str(out),
        "variants": len(entries),
        "files": len({e["sha256"] for e in entries}),
        "bytes": total,
        "fingerprint": plan.fingerprint(),
        "signed_by": signer.key_id if signer is not None else None,
    }


def _write_artifacts(found: list, tmp: Path) -> int:
    """Write each distinct artifact of ``found`` (``[(variant, Found)]`` from
    :func:`_find_plan`) once, as ``tmp/artifacts/<sha256>.pt2``; returns the
    bytes of the files written.

    Raises:
        OSError: a file cannot be written (the caller removes ``tmp``).
    """
    total = 0
    for _, hit in found:
        path = tmp / f"artifacts/{hit.entry.meta['sha256']}.pt2"
        if not path.exists():
            path.write_bytes(hit.entry.data)
            total += len(hit.entry.data)
    return total


def _manifest_entry(variant, hit, signer) -> dict:
    """The manifest record of ``variant``'s artifact (``hit``, a lookup's Found):
    the entry's whole metadata record (every field, so a signature over it
    still holds; ``variant`` filled in if an old record lacks it) plus ``file``,
    signed now when ``signer`` (a :class:`kernel_cache.trust.keys.Signer`)
    is given, else with the signature it was built with, if any."""
    from kernel_cache.trust.signing import sign_meta

    m = hit.entry.meta
    record = {k: v for k, v in m.items() if k not in ("file", "imported_from")}
    record.setdefault("variant", str(variant))
    entry = sign_meta(record, hit.entry.data, signer)
    entry["file"] = f"artifacts/{m['sha256']}.pt2"
    return entry


def _refuse_untrusted(found: list, entries: list[dict], keyring) -> None:
    """Raises BundleError: an entry the trusted keys set here would refuse (engines
    refuse it too), listing each with the reason and how to sign it."""
    from kernel_cache.trust.keys import ENV_SIGNING_KEY_FILE
    from kernel_cache.trust.signing import SignatureError, check_signature

    bad = []
    for (v, hit), entry in zip(found, entries, strict=True):
        try:
            check_signature(hit.entry.key, entry, hit.entry.data, keyring)
        except SignatureError as e:
            bad.append(f"{v} ({e.reason})")
    if bad:
        raise BundleError(
            f"refusing to export {len(bad)} entries the trusted keys refuse: "
            f"{'; '.join(bad)}. Export from a builder holding the private key "
            f"({ENV_SIGNING_KEY_FILE}): it signs every entry now"
        )


def _manifest(config, plan, entries: list[dict]) -> dict:
    """The ``manifest.json`` document (see the module docstring) of ``plan`` (a
    :class:`~kernel_cache.plan.plan.Plan` of ``config``) with ``entries``."""
    return {
        "bundle_format": BUNDLE_FORMAT,
        "created": time.time(),
        "plan": {
            "config": config.model_dump(mode="json"),
            "fingerprint": plan.fingerprint(),
            "variants": [str(v) for v in plan.variants],
        },
        "tools": tool_versions(),
        "entries": entries,
    }


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished bundle ``tmp`` to ``out``, which is absent or an empty
    directory (checked by :func:`_refuse_existing`).

    Raises:
        OSError: the rename fails (the caller removes ``tmp``).
    """
    if out.exists():
        out.rmdir()  # empty (checked before the bundle was written)
    os.rename(tmp, out)


def _refuse_existing(out: Path) -> None:
    """Raises BundleError: ``out`` exists and is not an empty directory."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BundleError(
            f"--out {str(out)!r} exists and is not an empty directory; "
            "choose a new directory (a bundle is never overwritten in place)"
        )


def _find_plan(plan, tiers: list[Tier]) -> list:
    """``[(variant, Found)]`` for every item of ``plan`` (a
    :class:`~kernel_cache.plan.plan.Plan`), looked up in ``tiers`` as engine start does.

    Raises:
        BundleError: variants are missing or corrupt (lists them and the warmup command).
    """
    from kernel_cache.config.engine import config_to_cli
    from kernel_cache.store.lookup import Lookup

    lookup = Lookup(tiers)
    found, missing, corrupt = [], [], []
    for item in plan:
        try:
            hit = lookup.find(item.key)
        except CorruptEntryError as e:
            corrupt.append(f"{item.variant} ({e.reason})")
            continue
        if hit is None:
            missing.append(str(item.variant))
        else:
            found.append((item.variant, hit))
    if missing or corrupt:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing: {', '.join(missing)}")
        if corrupt:
            parts.append(f"{len(corrupt)} corrupt: {', '.join(corrupt)}")
        raise BundleError(
            f"refusing to export an incomplete plan ({len(plan)} variants; "
            f"{'; '.join(parts)}); warm it first: kernel-cache warmup "
            f"{config_to_cli(plan.config)}"
        )
    return found


def _make_temp_dir(out: Path) -> Path:
    """A fresh ``.<name>.tmp-<pid>/artifacts`` beside ``out``; returns the
    temporary bundle directory.

    Raises:
        BundleError: it cannot be created (names ``--out``).
    """
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temp_dirs(out)
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / "artifacts").mkdir(parents=True)
    except OSError as e:
        raise BundleError(
            f"--out {str(out)!r}: cannot create the bundle directory beside it ({e}); "
            "choose a writable location"
        ) from None
    return tmp


def _remove_stale_temp_dirs(out: Path) -> None:
    """Remove the ``.<name>.tmp-<pid>`` siblings of ``out`` left by an export
    that was killed before its rename (its process no longer runs); one whose
    export still runs is left alone (:func:`remove_dead_process_dirs`)."""
    remove_dead_process_dirs(out.parent, re.escape(f".{out.name}.tmp-") + r"(\d+)")


def import_bundle(bundle: str | os.PathLike, disk) -> dict:
    """Copy every entry of a bundle into a local cache tier (``disk``), verified.

    Entries already there are skipped. Returns ``{"imported", "present", "bytes"}``.

    Raises:
        BundleError: from :func:`read_manifest`.
        CorruptEntryError: a file fails its sha256 or size check, or its
            signature (nothing of it is copied; entries copied before it stay,
            each whole).
        SigningKeyError: no key to check signatures is set, and not
            ``KERNEL_CACHE_INSECURE_ALLOW_UNSIGNED``.
    """
    from kernel_cache.store.disk_tier import verify_entry
    from kernel_cache.trust.keys import shared_keyring
    from kernel_cache.trust.signing import check_untrusted

    tier = BundleTier(bundle)
    keyring = shared_keyring([tier.location])
    imported = present = nbytes = 0
    for meta in tier.iter_meta():
        key = meta["key"]
        if disk.contains(key):
            present += 1
            continue
        entry = tier.get(key)
        digest = verify_entry(entry)
        check_untrusted(entry, keyring, digest=digest)  # the local cache is trusted: check first
        record = {k: v for k, v in meta.items() if k != "file"}
        record["imported_from"] = tier.location
        disk.put(key, entry.data, record)
        imported += 1
        nbytes += len(entry.data)
    return {"imported": imported, "present": present, "bytes": nbytes}
