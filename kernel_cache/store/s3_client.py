"""The object-store client under the object-store tier
(:class:`~kernel_cache.store.s3.S3Tier`): which store a URL names, how each
call is made and bounded, and the create-once write.

The client is obstore (an optional extra: ``pip install 'kernel-cache[s3]'``),
imported only when a URL is set. An S3 endpoint and credentials come from the
standard ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``
and ``AWS_REGION`` variables (:func:`endpoint_from_env`); GCS and Azure read
their own (``GOOGLE_*``, ``AZURE_*``) through obstore's ``from_url``; a
``file://`` directory is obstore's ``LocalStore``, read here without blocking
(:func:`~kernel_cache.store.s3_objects.read_file`).

Failure. Every call runs with obstore's ``connect_timeout`` and
``read_timeout`` of ``KERNEL_CACHE_S3_TIMEOUT`` seconds (default 2) and no
retries, through :meth:`~kernel_cache.store.remote_base.RemoteTier._run`: the
first failure logs one warning naming the URL and marks the tier down for
``retry_s`` seconds, during which every call is a miss at once.
``fail_open=False`` (``kernel-cache verify --s3-url``) raises
:class:`~kernel_cache.store.remote_base.RemoteUnavailableError` instead.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import ClassVar

from kernel_cache.errors import ConfigError
from kernel_cache.store.base import PutOutcome, PutResult
from kernel_cache.store.remote_base import RemoteSettings, RemoteTier, RemoteUnavailableError
from kernel_cache.store.s3_objects import ObjectTooLargeError, open_file, read_file


def endpoint_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``, else None (AWS S3).

    Raises:
        ConfigError: the value is not an ``http://`` or ``https://`` URL with a
            host (obstore would panic on the first request, e.g. on
            ``minio.internal:9000`` without a scheme); names the variable,
            the value and the fix.
    """
    from urllib.parse import urlsplit

    environ = os.environ if environ is None else environ
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        value = environ.get(name)
        if not value:
            continue
        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018 - raises ValueError: not a number in 0..65535
            ok = parts.scheme in ("http", "https") and bool(parts.hostname)
            ok = ok and not parts.netloc.endswith(":") and not any(c.isspace() for c in value)
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(
                f"{name}={value!r} is not an S3 endpoint URL: it must be http:// or "
                f"https:// followed by a host and an optional port; fix: set it like "
                f"{name}=https://s3.internal:9000, or unset it for AWS S3"
            )
        return value
    return None


class ObjectStoreClient(RemoteTier):
    """What the object-store tier sends: its store (made from its settings on
    first use), the bounded reads of an object, the create-once write. Not a
    tier by itself: :class:`~kernel_cache.store.s3.S3Tier` adds the entries.

    Args:
        settings: a :class:`~kernel_cache.store.s3.S3Settings` (``url``,
            ``scheme``, ``bucket``, ``prefix``, ``directory``, ``timeout_s``,
            ``max_object_bytes``).
        fail_open, warn: as :class:`~kernel_cache.store.remote_base.RemoteTier`.
    """

    LABEL = "S3"
    CHECK = "check the URL, AWS_ENDPOINT_URL and the credentials, and that the store is reachable"
    #: per URL scheme: (label in messages, the fix named when a call fails)
    KINDS: ClassVar[dict[str, tuple[str, str]]] = {
        "s3": (LABEL, CHECK),
        "gs": ("GCS", "check the URL, the GOOGLE_* credentials and that the store is reachable"),
        "file": (
            "shared directory",
            "check that the directory exists and is writable on this host (a mounted "
            "shared filesystem)",
        ),
    }
    _AZURE = (
        "Azure Blob",
        "check the URL, the AZURE_* credentials and that the store is reachable",
    )

    def __init__(self, settings: RemoteSettings, *, fail_open: bool = True, warn=True):
        super().__init__(settings, fail_open=fail_open, warn=warn)
        self.LABEL, self.CHECK = self.KINDS.get(settings.scheme, self._AZURE)
        self._store = None

    @property
    def store(self):
        """The obstore store of the URL (made on first use; nothing is sent yet).

        Raises:
            RemoteUnavailableError: obstore is not installed, or a ``file://``
                directory does not exist (names it and the fix).
        """
        if self._store is None:
            try:
                from obstore.store import LocalStore, S3Store, from_url
            except ImportError:
                raise RemoteUnavailableError(
                    f"an object-store URL is set ({self.location}) but the obstore package "
                    "is not installed; install it with: pip install 'kernel-cache[s3]'"
                ) from None
            # fixed-point: obstore cannot parse Python's "1e-05s" for small timeouts
            t = f"{self.settings.timeout_s:.9f}s"
            if self.settings.scheme == "file":
                directory = self.settings.directory
                if not os.path.isdir(directory):
                    raise RemoteUnavailableError(
                        f"the shared directory {directory} of {self.location} does not exist "
                        "or is not a directory; create it on the shared filesystem "
                        f"(mkdir -p {directory}) and check that it is mounted on this host"
                    )
                self._store = LocalStore(directory)
                return self._store
            if self.settings.scheme != "s3":
                self._store = from_url(
                    self.settings.url,
                    client_options={"connect_timeout": t, "read_timeout": t},
                    retry_config={"max_retries": 0},
                )
                return self._store
            endpoint = endpoint_from_env()
            config = {"endpoint": endpoint} if endpoint else {}
            if not os.environ.get("AWS_REGION") and not os.environ.get("AWS_DEFAULT_REGION"):
                config["region"] = "us-east-1"
            self._store = S3Store(
                self.settings.bucket,
                prefix=self.settings.prefix or None,
                config=config,
                client_options={
                    "connect_timeout": t,
                    "read_timeout": t,
                    "allow_http": bool(endpoint and endpoint.startswith("http://")),
                },
                retry_config={"max_retries": 0},
            )
        return self._store

    def _call(self, fn):
        import obstore

        return fn(obstore, self.store)

    def _is_client_error(self, e: BaseException) -> bool:
        try:
            from obstore.exceptions import BaseError
        except ImportError:
            return False
        return isinstance(e, BaseError)

    def _read_file(self, path: str, length: int | None = None, limit: int | None = None):
        """``file://`` only: :func:`~kernel_cache.store.s3_objects.read_file` of
        ``path`` in the directory, ``limit`` defaulting to ``max_object_bytes``."""
        limit = self.settings.max_object_bytes if limit is None else limit
        return read_file(self.settings.directory, path, length, limit)

    def _open(self, ob, store, path: str, limit: int):
        """``(size, chunks)`` of the object ``path``: a streamed GET whose size
        (response headers) is checked first, or in a ``file://`` directory the
        file's size and its reads in chunks (:func:`~kernel_cache.store.s3_objects.open_file`);
        None if absent; or the error (:class:`ObjectTooLargeError` over
        ``limit``, :class:`NotAFileError`) with its body unread."""
        from obstore.exceptions import NotFoundError

        if self.settings.scheme == "file":
            store  # noqa: B018 - refuses a missing directory, naming it
            return open_file(self.settings.directory, path, limit)
        try:
            got = ob.get(store, path)
        except (NotFoundError, FileNotFoundError):
            return None
        size = int(got.meta["size"])
        if size > limit:
            return ObjectTooLargeError(path, size, limit)
        return size, got.stream(min_chunk_size=1 << 16)

    def _get_bytes(self, path: str, limit: int | None = None) -> bytes | None:
        """The object's bytes, None if absent (or on a fail-open failure).

        Raises:
            ObjectTooLargeError: the object's size (from the response headers,
                before the body is read) is over ``limit`` (default
                ``max_object_bytes``).
        """
        limit = self.settings.max_object_bytes if limit is None else limit

        def op(ob, store):
            got = self._open(ob, store, path, limit)
            return b"".join(got[1]) if isinstance(got, tuple) else got

        out = self._run(f"GET {path}", op)
        if isinstance(out, ObjectTooLargeError):
            raise out
        return out

    def _create(self, path: str, body: bytes) -> PutResult:
        """PUT ``path`` with ``If-None-Match: *``: ``stored``, ``present`` (an
        object is there: it is kept) or ``failed``."""
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        local = self.settings.scheme == "file"

        def op(ob, store):
            # a shared directory: skip the create when the object is there (a FUSE
            # mount of SeaweedFS loses sight of an object after a failed link(2) onto it);
            # a link to nothing in its place is no object (the tier writes no links):
            # removed, else it would keep the object out for good
            if local:
                full = os.path.join(self.settings.directory, path)
                if os.path.exists(full):
                    return PutOutcome.PRESENT
                if os.path.islink(full):
                    with contextlib.suppress(FileNotFoundError):  # another builder's unlink
                        os.unlink(full)
            try:
                ob.put(store, path, body, mode="create", use_multipart=False)
                return PutOutcome.STORED
            except (AlreadyExistsError, PreconditionError):
                return PutOutcome.PRESENT

        outcome = self._run(f"PUT {path}", op)
        if outcome is None:
            why = f"{self.LABEL} at {self.location} is unavailable: {self.error}"
            return PutResult(PutOutcome.FAILED, self.location, why)
        why = f"{path} exists (create-once: kept)" if outcome is PutOutcome.PRESENT else ""
        return PutResult(outcome, self.location, why)

    def close(self) -> None:
        """Forget the store (a later call makes it again)."""
        self._store = None
