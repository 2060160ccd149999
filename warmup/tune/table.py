"""The table ``kernel-cache tune`` writes (bundled format,
:mod:`kernel_cache.plan.launch`): its entries, its text (one line per entry),
the checked and atomic write to ``--out``, and the text summary."""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

from kernel_cache.config.engine import EngineConfig, config_to_cli
from kernel_cache.errors import ConfigError
from kernel_cache.plan.buckets import PAGED_ATTENTION, KernelVariant
from kernel_cache.plan.tables import TABLE_FORMAT, arch_family, parse_table
from warmup.tune.candidates import RULE


def fmt_cfg(cfg: dict) -> str:
    if "num_kv_splits" not in cfg:  # the prefill tiles
        return " ".join(f"{k}={v}" for k, v in sorted(cfg.items()))
    return f"splits={cfg['num_kv_splits']} chunk={cfg['blocks_per_chunk']}"


def _row(r: dict) -> str:
    d, k = r["default_ms"], r["kept_ms"]
    src = " (cached)" if r.get("from_cache") else ""
    return (
        f"  {r['variant']:<24} default {d[0]:8.3f} ms [{d[1]:.3f}-{d[2]:.3f}]  kept "
        f"{fmt_cfg(r['config']):<20} {k[0]:8.3f} ms [{k[1]:.3f}-{k[2]:.3f}]  "
        f"x{r['speedup']:.3f}{src}"
    )


def table_entry(config: EngineConfig, variant: KernelVariant, result: dict) -> dict:
    """One tuned variant's table entry: its lookup key (with ``query_len`` for
    prefill), the kept config and the measurements."""
    measured = {k: result[k] for k in ("speedup", "paired_ratio_median", "default_ms")}
    keep = ("config", "median_ms", "min_ms", "max_ms", "ratio_median", "ratio_q25", "ok")
    measured |= {
        "kept_ms": result["kept_ms"],
        "inner": result["inner"],
        "candidates": [{k: c[k] for k in keep} for c in result["candidates"]],
    }
    entry = {
        "kernel": variant.kernel,
        "head_dim": config.head_dim,
        "num_queries_per_kv": config.num_queries_per_kv,
        "num_kv_heads": config.num_kv_heads,
        "num_seqs": variant.num_seqs,
        "num_blocks": variant.num_blocks,
    }
    if variant.kernel == PAGED_ATTENTION:
        entry["query_len"] = variant.query_len
    return entry | {"config": result["config"], "measured": measured}


def make_table(
    config: EngineConfig, env: dict, variants: list[KernelVariant], results: list[dict], settings
) -> dict:
    """The table document (bundled format) for the tuned variants."""
    import torch

    return {
        "format": TABLE_FORMAT,
        "device_arch": arch_family(env["device_arch"]),
        "about": {
            "tool": "kernel-cache tune",
            "engine": config_to_cli(config),
            "model": config.model,
            "dtype": config.dtype,
            "block_size": config.block_size,
            "device": env["device"],
            "device_arch": env["device_arch"],
            "torch": torch.__version__,
            "cxx": env["cxx"],
            "cpus": os.cpu_count(),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "settings": settings.model_dump(mode="json"),
            "timing": "warm; per round every candidate once in shuffled order; a sample is "
            "the mean of `inner` back-to-back calls; ms are per call (median, min, max over "
            "rounds); ratios are default/candidate within a round",
            "rule": RULE,
        },
        "entries": [table_entry(config, v, r) for v, r in zip(variants, results, strict=True)],
    }


def format_table(doc: dict) -> str:
    """JSON text with one line per entry (readable, and diffs name the entry)."""
    head = {k: v for k, v in doc.items() if k != "entries"}
    lines = ["{"]
    for k, v in head.items():
        lines.append(f" {json.dumps(k)}: {json.dumps(v, sort_keys=True)},")
    lines.append(' "entries": [')
    rows = [json.dumps(e) for e in doc.get("entries", [])]
    lines += [f"  {r}," for r in rows[:-1]] + [f"  {r}" for r in rows[-1:]]
    lines += [" ]", "}"]
    return "\n".join(lines) + "\n"


def _out_error(out: Path, e: OSError) -> ConfigError:
    return ConfigError(
        f"--out {str(out)!r}: cannot write the table there ({e.strerror or e}); "
        "give a writable file path whose parent is a directory (or can be created)"
    )


def check_out(out: str | Path) -> Path:
    """Check before any compile that the table can be written to ``out``: its
    parent directory exists or can be created, ``out`` is not a directory and a
    file can be created beside it.

    Raises:
        ConfigError: naming ``--out``, the path and the fix.
    """
    out = Path(out)
    if out.is_dir():
        raise ConfigError(f"--out {str(out)!r}: is a directory; give the table's file path")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = out.with_name(f".{out.name}.{os.getpid()}.probe")
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise _out_error(out, e) from None
    return out


def write_table(doc: dict, out: str | Path) -> Path:
    """Write the table atomically (a temporary file beside it, then rename).

    Raises:
        ConfigError: ``out`` cannot be written (the temporary file is removed),
            or ``doc`` is not a valid table (:class:`~kernel_cache.plan.tables.LaunchTableDoc`).
    """
    parse_table(doc, f"--out {str(out)!r} (the tuned table)")
    out = check_out(out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(format_table(doc))
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _out_error(out, e) from None
    return out


def print_summary(report: dict, out: Path, file=sys.stdout) -> None:
    print(
        f"tune: {report['variants']} variants ({report['measured']} measured, "
        f"{report['from_cache']} from the tuning cache), {report['compiled']} candidates "
        f"compiled, {report['seconds']:.1f} s -> {out}",
        file=file,
    )
    for r in report["results"]:
        print(_row(r), file=file)
