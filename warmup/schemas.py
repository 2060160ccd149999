"""The project's JSON formats as pydantic models, and the documents generated from them.

:data:`MODELS` lists every model of a JSON file or report this project reads or
writes, as ``"module:Class"`` import strings (the single list of them).

``python -m warmup.schemas`` writes ``docs/schemas/<name>.schema.json`` for each
model (``<name>`` is :func:`schema_name`) and regenerates the table of
``KERNEL_CACHE_*`` variables in ``docs/settings.md``
(:func:`kernel_cache.config.settings.markdown_table`).
``tests/warmup/test_schemas.py`` and ``tests/config/test_settings.py`` fail when a model changed
and these files were not regenerated.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_DIR = ROOT / "docs" / "schemas"

#: The JSON formats of this branch: launch tables, the warmup report (and its
#: rows), the verify report.
MODELS: tuple[str, ...] = (
    "kernel_cache.plan.tables:LaunchTableDoc",
    "warmup.builder.report:WarmupReport",
    "warmup.check.verify:VerifyReport",
    "warmup.check.rebuild:RebuildReport",
    "kernel_cache.store.entry:EntryMeta",
    "kernel_cache.store.bundle:BundleManifest",
    "kernel_cache.store.usage:UsageRecord",
    "kernel_cache.store.imports_memo:ImportsMemo",
    "kernel_cache.store.s3_objects:S3Manifest",
    "kernel_cache.store.s3_lease:S3LeaseDoc",
    "kernel_cache.trust.signing:EntrySignature",
)


def load(spec: str):
    """The class an import string ``"module:Class"`` names."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def schema_name(spec: str) -> str:
    """``"warmup.builder.report:WarmupReport"`` -> ``"warmup-report"``."""
    name = spec.partition(":")[2]
    return re.sub(r"(?<!^)(?=[A-Z][a-z])", "-", name).lower().removesuffix("-doc")


def schema_text(spec: str) -> str:
    """The JSON Schema of the model ``spec`` names (validation mode), as written to docs."""
    schema = load(spec).model_json_schema()
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def validate_file(spec: str, path: str | Path):
    """Read the JSON file ``path`` as the model ``spec`` names (a saved report,
    a launch table) and return the frozen model.

    Raises:
        ConfigError: the file cannot be read, is not JSON, or does not validate
            (naming the file, the field's location, the value and the problem).
    """
    from pydantic import ValidationError

    from kernel_cache.errors import ConfigError, validation_message

    model = load(spec)
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    try:
        return model.model_validate(doc)
    except ValidationError as e:
        raise ConfigError(validation_message(str(path), e, model)) from None


def generate(out_dir: Path = SCHEMA_DIR, specs=MODELS) -> list[Path]:
    """Write ``<out_dir>/<name>.schema.json`` for each of ``specs``; the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for spec in specs:
        path = out_dir / f"{schema_name(spec)}.schema.json"
        text = schema_text(spec)
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
        written.append(path)
    return written


def main() -> int:
    from kernel_cache.config import settings

    for path in generate():
        print(path.relative_to(ROOT))
    changed = settings.update_table(ROOT / "docs" / "settings.md")
    print(f"docs/settings.md table of variables: {'updated' if changed else 'up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
