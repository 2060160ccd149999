"""The traced files of an entry: what its code came from beyond its key's
static sources, as recorded when it was built (:class:`Manifest`), and their
check against the files here at engine start (:func:`current`,
:func:`changes`).

A key's ``sources`` component is found by reading imports
(:func:`kernel_cache.plan.sources.source_files`); code that a kernel reaches another
way (a module loaded by a computed name, a helper module read through an
attribute) is not in it. So warmup also records, for each artifact, the files
whose Python code ran while the kernel was built and exported
(:mod:`kernel_cache.plan.traced_build`), and engine start checks that record
against the files on disk (:func:`changes`); an entry whose files differ here
is looked up under a key derived from their state (:func:`derive_key`). How each
file is recorded (ignored, by distribution, by sha256) is
:mod:`kernel_cache.plan.file_origin`. The design (keys derived from a changed
record, what is not covered) is in docs/keys.md.

A recorded path is found as import finds it (:func:`find_file`), never run:
nothing here imports torch or a module being checked, and hashes and versions
are cached per process.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kernel_cache.errors import shown
from kernel_cache.plan.file_origin import MISSING, dist_version, file_sha256

#: How many manifest mismatches a lookup follows through derived keys
#: (docs/keys.md): each level is an artifact compiled under another state of
#: the files its parent recorded.
MAX_DERIVED = 8


#: Bounds of a recorded manifest (a record is a writer's text: one over them is
#: corrupt, and nothing it names is read). A build records tens to a few
#: hundred files, each path relative to its import root and well under 200
#: characters; at these bounds a record still fits
#: :data:`kernel_cache.store.entry.META_MAX_BYTES`.
MAX_TRACED_FILES = 2048
MAX_PATH_CHARS = 256
MAX_DISTS = 1024
MAX_DIST_CHARS = 128


def shown_short(text: object) -> str:
    """Record text quoted for a message (:func:`kernel_cache.errors.shown`, 80 characters)."""
    return shown(text, 80)


def check_path(path: str) -> str:
    """``path`` if it is a recorded file path this module may look up: relative
    (no leading ``/``, no drive or backslash), no ``.``, ``..`` or empty part,
    no NUL or other control character, at most :data:`MAX_PATH_CHARS`.

    Raises:
        ValueError: naming the path (quoted) and the rule it breaks.
    """
    if not path or len(path) > MAX_PATH_CHARS:
        raise ValueError(f"path {shown(path, 80)} must have 1 to {MAX_PATH_CHARS} characters")
    if any(not c.isprintable() for c in path) or "\\" in path or ":" in path:
        raise ValueError(f"path {shown(path, 80)} has a control character, \\ or :")
    if path.startswith("/") or any(p in ("", ".", "..") for p in path.split("/")):
        raise ValueError(
            f"path {shown(path, 80)} must be relative to an import root, without . or .."
        )
    return path


class Manifest(BaseModel):
    """What an artifact's code came from beyond its key's static sources.

    ``files``: ``{path relative to its import root: sha256 hex (64)}``;
    ``dists``: ``{distribution name: version}``. Also the state of those same
    items here, when a key is derived (:func:`derive_key`); then a value may be
    :data:`MISSING`. Bounded (:data:`MAX_TRACED_FILES`, :data:`MAX_PATH_CHARS`,
    :data:`MAX_DISTS`, :data:`MAX_DIST_CHARS`) and every path checked by
    :func:`check_path`: validation raises ``ValidationError`` otherwise.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    files: dict[str, str] = Field(default_factory=dict, max_length=MAX_TRACED_FILES)
    dists: dict[str, str] = Field(default_factory=dict, max_length=MAX_DISTS)

    @field_validator("files")
    @classmethod
    def _files(cls, v: dict[str, str]) -> dict[str, str]:
        for path, digest in v.items():
            check_path(path)
            if digest != MISSING and (
                len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest)
            ):
                raise ValueError(f"{shown_short(path)}: {shown_short(digest)} is not a sha256")
        return v

    @field_validator("dists")
    @classmethod
    def _dists(cls, v: dict[str, str]) -> dict[str, str]:
        for name, version in v.items():
            if not 0 < len(name) <= MAX_DIST_CHARS or len(version) > MAX_DIST_CHARS:
                raise ValueError(
                    f"distribution {shown_short(name)} {shown_short(version)}: name and "
                    f"version must have at most {MAX_DIST_CHARS} characters"
                )
        return v

    def record(self) -> dict:
        return {
            "files": dict(sorted(self.files.items())),
            "dists": dict(sorted(self.dists.items())),
        }


# -- the check at engine start ----------------------------------------------------


def _fresh_spec(name: str):
    """The spec of top-level module ``name`` as a process that has not imported
    it finds it (:data:`sys.meta_path`, ignoring :data:`sys.modules`: a package
    imported here may have edited its ``__path__``); None if not found."""
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        spec = find(name, None)
        if spec is not None:
            return spec
    return None


def _search(rel: str) -> str | None:
    top, _, rest = rel.partition("/")
    name = top[:-3] if not rest and top.endswith(".py") else top
    try:
        spec = _fresh_spec(name) if name.isidentifier() else None
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        if rest and spec.submodule_search_locations:
            for loc in spec.submodule_search_locations:
                cand = os.path.join(loc, rest)
                if os.path.isfile(cand):
                    return cand
        elif not rest and spec.origin and os.path.basename(spec.origin) == top:
            return spec.origin
    for entry in sys.path:
        cand = os.path.join(entry or os.getcwd(), rel)
        if os.path.isfile(cand):
            return cand
    return None


#: ``{(recorded path, sys.path): file found}``: where each recorded path was found.
_FOUND: dict[tuple, str | None] = {}


def find_file(rel: str) -> Path | None:
    """The file a recorded path names here, found as import finds it: the top-level
    module (``userkern2``, ``nc_outside_helper`` for ``nc_outside_helper.py``)
    along ``sys.path`` (:func:`importlib.util.find_spec`, which executes
    nothing), then the rest of the path inside its package folder(s); else the
    first ``sys.path`` entry holding the path. None if not found."""
    found = find_path(rel)
    return None if found is None else Path(found)


def find_path(rel: str, fresh: bool = False) -> str | None:
    """:func:`find_file` as a string, remembered per process and ``sys.path``;
    ``fresh``: search again rather than take what was remembered."""
    key = (rel, tuple(sys.path))
    if fresh or key not in _FOUND:
        _FOUND[key] = _search(rel)
    return _FOUND[key]


def _state(rel: str) -> str:
    """The sha256 of the file ``rel`` names here, or :data:`MISSING`."""
    for fresh in (False, True):  # a remembered file that is gone: search again
        path = find_path(rel, fresh)
        if path is None:
            continue
        try:
            return file_sha256(path)
        except OSError:
            continue
    return MISSING


def current(manifest: Manifest) -> Manifest:
    """The state here of exactly the items ``manifest`` lists: each file's
    sha256 (:data:`MISSING` if not found), each distribution's version. Where
    a file is found is remembered and its hash cached (by inode, size and
    modification time), so a check costs a ``stat`` per file after the first."""
    return Manifest(
        files={rel: _state(rel) for rel in manifest.files},
        dists={d: dist_version(d) for d in manifest.dists},
    )


def _short(v: str) -> str:
    return v if v == MISSING else v[:16]


def changes(stored: Manifest, here: Manifest) -> list[str]:
    """What differs between a recorded manifest and the state here
    (:func:`current`), one line per item: ``"userkern2/dyn_helper.py changed
    (sha256 1a2b... stored, 9f8e... here)"``, ``"nc_helper.py not found on
    sys.path"``, ``"distribution numpy 2.1.0 stored, 2.2.0 here"``."""
    out = []
    for rel, old in sorted(stored.files.items()):
        new = here.files.get(rel, MISSING)
        if new == old:
            continue
        if new == MISSING:
            out.append(f"{rel} not found on sys.path (sha256 {_short(old)} stored)")
        else:
            out.append(f"{rel} changed (sha256 {_short(old)} stored, {_short(new)} here)")
    for name, old in sorted(stored.dists.items()):
        new = here.dists.get(name, MISSING)
        if new != old:
            shown = "not installed" if new == MISSING else new
            out.append(f"distribution {name} {old} stored, {shown} here")
    return out


def derive_key(parent: str, state: Manifest) -> str:
    """The key (sha256 hex) of an artifact compiled where the items recorded
    by the entry at ``parent`` are in ``state`` (:func:`current`)."""
    body = json.dumps(state.record(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"kc-derived\n{parent}\n{body}".encode()).hexdigest()


def chain_key(base: str, states) -> str:
    """``base`` followed through :func:`derive_key` for each state of ``states``."""
    key = base
    for s in states:
        key = derive_key(key, s if isinstance(s, Manifest) else Manifest.model_validate(s))
    return key
