"""The pydantic models of the JSON formats, and their schemas in docs/schemas."""

from __future__ import annotations

import json
import time

import pytest
from pydantic import ValidationError

from kernel_cache.errors import ConfigError
from warmup import schemas


@pytest.mark.parametrize("spec", schemas.MODELS)
def test_schema_files_are_the_generated_ones(spec):
    """Regenerate with ``python -m warmup.schemas`` when this fails."""
    path = schemas.SCHEMA_DIR / f"{schemas.schema_name(spec)}.schema.json"
    assert path.is_file(), f"{path} missing: run python -m warmup.schemas"
    assert path.read_text() == schemas.schema_text(spec)


def test_no_stale_schema_files():
    want = {f"{schemas.schema_name(s)}.schema.json" for s in schemas.MODELS}
    have = {p.name for p in schemas.SCHEMA_DIR.glob("*.schema.json")}
    assert have == want


def test_generate_writes_what_the_check_compares(tmp_path):
    written = schemas.generate(tmp_path)
    assert [p.name for p in written] == [
        f"{schemas.schema_name(s)}.schema.json" for s in schemas.MODELS
    ]
    for spec, path in zip(schemas.MODELS, written, strict=True):
        assert json.loads(path.read_text())["title"] == spec.partition(":")[2]


def test_store_formats_describe_the_files_the_store_writes(tmp_path):
    """Entry metadata and the usage record as the disk tier writes them pass
    their models (read back from the files, through validate_file)."""
    from kernel_cache.config.engine import make_config
    from kernel_cache.plan.buckets import Bucketer
    from kernel_cache.plan.keys import build_key
    from kernel_cache.store import usage
    from kernel_cache.store.disk_tier import DiskTier, make_meta

    cfg = make_config("llama-3.2-1b")
    v = Bucketer(cfg).variants[0]
    key = build_key(cfg, v)
    meta = make_meta(key, str(v), b"artifact", 1.5)
    tier = DiskTier(tmp_path / "c")
    try:
        assert tier.put(key.hexdigest, b"artifact", meta).stored
        stored = tier.get_meta(key.hexdigest)
    finally:
        tier.close()
    (tmp_path / "meta.json").write_text(json.dumps(stored))
    doc = schemas.validate_file("kernel_cache.store.entry:EntryMeta", tmp_path / "meta.json")
    assert doc.key == key.hexdigest and doc.variant == str(v)
    assert usage.record(tmp_path / "c", hits=[key.hexdigest]) is True
    rec = schemas.validate_file("kernel_cache.store.usage:UsageRecord", tmp_path / "c/usage.json")
    assert set(rec.last_used) == {key.hexdigest}


@pytest.mark.parametrize("spec", schemas.MODELS)
def test_models_are_frozen(spec):
    model = schemas.load(spec)
    assert model.model_config.get("frozen") is True
    # Entry metadata and manifests carry fields of newer writers (kept, not
    # refused); every other format refuses an unknown field.
    extra = "forbid" if not spec.startswith("kernel_cache.store.") else ("allow", "ignore")
    assert model.model_config.get("extra") in ((extra,) if isinstance(extra, str) else extra)


def test_a_bad_file_names_the_file_field_and_problem(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"entries": [{"kernel": "batched_decode", "head_dim": "8"}]}))
    with pytest.raises(ConfigError) as e:
        schemas.validate_file("kernel_cache.plan.tables:LaunchTableDoc", path)
    msg = str(e.value)
    assert f"{path}: entries[0].head_dim='8': Input should be a valid integer" in msg
    assert f"{path}: entries[0].num_blocks: required field missing" in msg
    assert not isinstance(e.value, ValidationError)
    path.write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        schemas.validate_file("warmup.builder.report:WarmupReport", path)


def test_bundled_launch_tables_validate():
    from kernel_cache.plan.launch import BUNDLED_DIR

    files = sorted(BUNDLED_DIR.glob("*.json"))
    assert files
    for f in files:
        table = schemas.validate_file("kernel_cache.plan.tables:LaunchTableDoc", f)
        assert table.entries and table.device_arch
        with pytest.raises(ValidationError):
            table.entries[0].num_blocks = 1  # frozen


def test_the_warmup_report_is_its_model(tiny_config, tmp_path):
    """The report ``warmup`` builds validates (and a wrong row does not)."""
    from kernel_cache.plan.plan import Plan
    from warmup.builder.report import Status, VariantResult, VariantRow, WarmupReport, make_report

    plan = Plan.build(tiny_config)
    items = list(plan)
    v = plan.variants
    rows = [VariantResult(str(v[0]), Status.FAILED, error="boom", timings={"total_s": 1.0})]
    rows += [VariantResult(str(x), Status.CACHED) for x in v[1:]]
    out = make_report(tiny_config, tmp_path, plan, items, rows, time.perf_counter(), None, {}, 0)
    report = WarmupReport.model_validate(json.loads(json.dumps(out)))
    assert report.failed[0].error == "boom" and report.repair
    assert [r.status for r in report.results][:2] == [Status.FAILED, Status.CACHED]
    assert set(VariantRow.model_fields) == set(VariantResult.__dataclass_fields__)
    with pytest.raises(ValidationError, match="results.0.status"):
        WarmupReport.model_validate({**out, "results": [{"variant": "x", "status": "done"}]})


def test_the_verify_report_is_its_model(tiny_config, tmp_path):
    from warmup.check.verify import VerifyReport, verify_plan

    out = verify_plan(tiny_config, tmp_path / "empty")
    report = VerifyReport.model_validate(json.loads(json.dumps(out)))
    assert not report.ok and report.repair and len(report.missing) == report.variants
