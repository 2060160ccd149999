"""Fleet load test: M engine processes start together against one Redis.

Each engine process has an empty local cache. It imports the runtime, reports
ready, waits for the common "go", then starts the way a fleet node does:
``warmup`` against Redis in its own process (``jobs=0``: fetch what Redis holds,
compile under the cross-machine build lock what nobody has published), then
``load_plan``. The script reports, over the M engines, how many variants were
compiled in total (the plan size when Redis started cold, 0 when warm: each
variant compiled once in the fleet), whether every engine loaded the whole plan,
and the start-time percentiles (seconds from "go" to the plan loaded; Python and
torch import time is reported apart, as ``import_s``).

    python benchmarks/fleet_load.py --engines 16 --cold      # default plan, cold Redis
    python benchmarks/fleet_load.py --engines 16             # now warm

Without ``--redis-url`` it starts a private ``redis-server`` on a free loopback
port (and stops it), so two runs in a row use two empty servers: give the URL of
one you started to see warm starts. ``--cold`` deletes the plan's entries (and
their locks) from Redis first. Percentiles are nearest-rank over the M engines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _common import engine_ready, nearest_rank, start_together  # noqa: E402


def engine_main(spec_json: str) -> int:
    """One engine process (``--engine SPEC``): import, ready, wait for go, start."""
    from kernel_cache import load_plan
    from kernel_cache.store.disk_tier import DiskTier
    from kernel_cache.store.redis import RedisSettings, RedisTier
    from warmup.builder.planner import warmup

    ready = engine_ready(spec_json)
    if ready is None:
        return 1
    spec, cfg, import_s = ready
    t0 = time.perf_counter()
    settings = RedisSettings(url=spec["redis_url"])
    report = warmup(cfg, spec["cache_dir"], jobs=0, progress=False, remote=settings)
    rt = load_plan(cfg, tiers=[DiskTier(spec["cache_dir"]), RedisTier(settings)])
    start_s = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "start_s": round(start_s, 3),
                "import_s": round(import_s, 3),
                "compiled": report["compiled"],
                "fetched": report["fetched"],
                "loads": rt.stats()["loads"],
                "variants": report["variants"],
                "remote_error": report["remote_error"],
                "failed": report["failed"],
            }
        ),
        flush=True,
    )
    return 0


def run(args) -> dict:
    from kernel_cache.plan.buckets import Bucketer
    from kernel_cache.plan.keys import build_key
    from kernel_cache.store.redis import RedisTier
    from warmup.cli.main import config_from_args

    cfg = config_from_args(args)
    plan = Bucketer(cfg).variants
    server = None
    url = args.redis_url
    if not url:
        from tests.redis_server import RedisServer

        server = RedisServer()
        url = server.url
    tmp = tempfile.TemporaryDirectory(prefix="kernel_cache-fleet-")
    try:
        tier = RedisTier(url, fail_open=False)
        keys = [build_key(cfg, v).hexdigest for v in plan]
        if args.cold:
            for k in keys:
                tier.delete(k)
                tier.client.delete(tier._name("lock", k))
        expected = sum(not tier.contains(k) for k in keys)
        cmds = []
        for i in range(args.engines):
            spec = {
                "config": cfg.model_dump_json(),
                "cache_dir": str(Path(tmp.name) / f"engine{i}"),
                "redis_url": url,
                "launched": time.time(),
            }
            cmds.append([sys.executable, __file__, "--engine", json.dumps(spec)])
        # engines that warm themselves publish unsigned entries: the explicit
        # insecure opt-out, unless the caller set keys (docs/trust.md, Signed artifacts)
        env = dict(os.environ)
        if not (env.get("KERNEL_CACHE_SIGNING_KEY_FILE") or env.get("KERNEL_CACHE_TRUSTED_KEYS")):
            env.setdefault("KERNEL_CACHE_INSECURE_ALLOW_UNSIGNED", "1")
        envs = [env] * args.engines
        results = start_together(cmds, envs, tmp.name, args.timeout)
    finally:
        tmp.cleanup()
        if server is not None:
            server.stop()
    starts = [r["start_s"] for r in results]
    return {
        "engines": args.engines,
        "variants": len(plan),
        "redis": "private redis-server" if server else url,
        "expected_compiles": expected,
        "total_compiles": sum(r["compiled"] for r in results),
        "all_loaded": all(r["loads"] == len(plan) and not r["failed"] for r in results),
        "start_s": {
            "min": min(starts),
            "p50": nearest_rank(starts, 50),
            "p90": nearest_rank(starts, 90),
            "p99": nearest_rank(starts, 99),
            "max": max(starts),
        },
        "import_s_median": statistics.median(r["import_s"] for r in results),
        "per_engine": results,
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--engine"]:
        return engine_main(argv[1])
    from warmup.cli.main import engine_options

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_options(p)
    p.add_argument("--engines", type=int, default=16, help="engine processes (default 16)")
    p.add_argument("--redis-url", default=None, help="default: a private redis-server")
    p.add_argument("--cold", action="store_true", help="delete the plan's entries from Redis")
    p.add_argument("--timeout", type=float, default=1800, help="seconds for the whole run")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.engines < 1:
        p.error(f"--engines {args.engines}: must be >= 1")
    doc = run(args)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        s = doc["start_s"]
        print(
            f"{doc['engines']} engines, plan of {doc['variants']} variants: "
            f"{doc['total_compiles']} compiles in the fleet (expected {doc['expected_compiles']}), "
            f"all loaded: {doc['all_loaded']}; start s p50 {s['p50']:.2f} p90 {s['p90']:.2f} "
            f"p99 {s['p99']:.2f} (min {s['min']:.2f}, max {s['max']:.2f}); "
            f"import s median {doc['import_s_median']:.2f}"
        )
    ok = doc["all_loaded"] and doc["total_compiles"] == doc["expected_compiles"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
