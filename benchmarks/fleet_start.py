"""Fleet start: N engine processes start together, each with an empty local cache,
and load a plan from S3 (SeaweedFS), Redis or a local bundle.

    python benchmarks/fleet_start.py [ENGINE OPTIONS] [--engines 1,8,32]
        [--sources s3,redis,bundle] [--repeats R] [--signed] [--cache-dir DIR] [--out FILE]

Setup (not timed): the builder cache (``--cache-dir``, default the benchmarks'
shared cache) is warmed with ``kernel-cache warmup`` (it compiles only what is
missing: the first time, about 70-100 s for the default plan on 2 cores), then
published the way a fleet publishes it: ``kernel-cache warmup --s3-url`` into a
private SeaweedFS server (``tests/s3_server.py``; it also writes the plan
manifest), ``kernel-cache warmup --redis-url`` into a private ``redis-server``
(``tests/redis_server.py``), ``kernel-cache export`` into a bundle directory.
With ``--signed`` a fresh key pair signs what is published and the engines
check it with the public key (``KERNEL_CACHE_TRUSTED_KEYS``).

Each run starts N engine processes (``_common.start_together``: each imports
the runtime and torch, says ready, and all go at once). An engine is a plain
``load_plan(config)`` with the environment a fleet node has: an empty
``KERNEL_CACHE_DIR`` of its own (not even created), its own ``TMPDIR``,
``OMP_NUM_THREADS`` (``--threads``, default 1), and ``KERNEL_CACHE_S3_URL`` +
``AWS_*``, or ``KERNEL_CACHE_REDIS_URL``, or ``KERNEL_CACHE_BUNDLE``. Time to
ready is seconds from "go" to ``load_plan`` returning with every variant loaded
(``time.perf_counter`` in the engine); imports are before "go" and reported
apart (``import_s``).

Counted outside the engines, per run, then divided by N:

- S3: the server's own Prometheus counters, ``SeaweedFS_s3_request_total``
  (requests, by action) and ``SeaweedFS_s3_bucket_traffic_sent_bytes_total``
  (body bytes sent), read before and after the run.
- Redis: ``INFO commandstats`` (calls by command; the benchmark's own INFO
  calls left out) and ``INFO stats`` ``total_net_output_bytes``, before and
  after, less the size of the INFO reply that took the first reading.
- every source: the engine process's ``/proc/self/io`` ``rchar`` and
  ``wchar`` deltas from "go" to ready (bytes through read()/write(): the bundle
  files an engine reads; sockets' recv()/send() are not in them), and the bytes
  each engine's local cache holds afterwards (the write-through of S3 and Redis
  hits; 0 for a bundle).

Reported per source and N: time to ready (median, p99 by nearest rank, min-max
over the N engines of all repeats), and the ratio of the largest N to N=1 of
the median and of the p99. Runs go source by source, N by N in the order given;
the servers and the bundle stay warm between runs (the bundle's files sit in
the page cache after the first run, as an image's would after its first pod).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests/ (the private servers' helpers)

from _common import (  # noqa: E402
    DEFAULT_CACHE,
    OUT_DIR,
    engine_ready,
    header,
    machine,
    nearest_rank,
    print_table,
    start_together,
    summary,
    write_json,
)

SOURCES = ("s3", "redis", "bundle")
S3_PREFIX = "fleet-start"


def _proc_io() -> dict:
    """This process's ``/proc/self/io`` counters (bytes through read()/write() and
    the syscall counts); empty where there is no such file."""
    try:
        text = Path("/proc/self/io").read_text()
    except OSError:
        return {}
    return {k: int(v) for k, v in (line.split(": ") for line in text.splitlines())}


def engine_main(spec_json: str) -> int:
    """One engine (``--engine SPEC``): import, ready, wait for go, ``load_plan``."""
    from kernel_cache import load_plan

    ready = engine_ready(spec_json)
    if ready is None:
        return 1
    _, cfg, import_s = ready
    io0 = _proc_io()
    t0 = time.perf_counter()
    rt = load_plan(cfg)  # every tier from the environment, as an engine does
    start_s = time.perf_counter() - t0
    io1 = _proc_io()
    stats = rt.stats()
    doc = {
        "start_s": round(start_s, 4),
        "import_s": round(import_s, 3),
        "loads": stats["loads"],
        "compiles": stats["compiles"],
        "sources": stats["sources"],
        **{f"{k}_delta": io1[k] - io0[k] for k in ("rchar", "wchar", "syscr") if k in io1},
    }
    print(json.dumps(doc), flush=True)
    return 0


# -- server-side counters -------------------------------------------------------------


def s3_counters(metrics_url: str) -> dict:
    """``{"requests": {action: n}, "sent_bytes": n}`` from SeaweedFS's metrics."""
    with urllib.request.urlopen(metrics_url, timeout=10) as r:
        text = r.read().decode()
    requests: dict[str, int] = {}
    for m in re.finditer(r"^SeaweedFS_s3_request_total\{([^}]*)\} (\S+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        action = labels.get("type") or labels.get("action") or "?"
        requests[action] = requests.get(action, 0) + int(float(m.group(2)))
    sent = sum(
        float(m.group(1))
        for m in re.finditer(
            r"^SeaweedFS_s3_bucket_traffic_sent_bytes_total\{[^}]*\} (\S+)$", text, re.M
        )
    )
    return {"requests": requests, "sent_bytes": int(sent)}


def redis_counters(client) -> dict:
    """``{"requests": {command: calls}, "sent_bytes": total_net_output_bytes}``."""
    cmds = client.info("commandstats")
    sent = client.info("stats")["total_net_output_bytes"]
    requests = {k.removeprefix("cmdstat_"): v["calls"] for k, v in cmds.items()}
    return {"requests": requests, "sent_bytes": int(sent)}


def _delta(before: dict, after: dict, skip=()) -> dict:
    req = {
        k: after["requests"].get(k, 0) - before["requests"].get(k, 0)
        for k in after["requests"]
        if k not in skip
    }
    return {
        "requests": {k: v for k, v in sorted(req.items()) if v},
        "sent_bytes": after["sent_bytes"] - before["sent_bytes"],
    }


# -- setup --------------------------------------------------------------------------------


def _cli(args: list[str], env: dict, what: str) -> dict:
    """``kernel-cache ARGS --json`` in a fresh process; its JSON report.

    Raises:
        SystemExit: it failed (names ``what`` and its stderr tail).
    """
    cmd = [sys.executable, "-m", "warmup.cli.main", *args, "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed (exit {proc.returncode}): {cmd}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def _clean_env() -> dict:
    """This environment without any kernel-cache or AWS setting."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KERNEL_CACHE_", "AWS_")) and k != "TMPDIR"
    }


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file()) if d.exists() else 0


class Sources:
    """The published plan in each source and how an engine reaches it."""

    def __init__(self, args, engine_args: list[str], work: Path):
        self.args, self.work = args, work
        self.engine_args = engine_args
        self.base = _clean_env()
        if not args.signed:  # shared tiers need keys unless this explicit opt-out
            self.base["KERNEL_CACHE_INSECURE_ALLOW_UNSIGNED"] = "1"
        self.builder = {**self.base}
        self.trust: dict[str, str] = {}
        self.s3 = self.redis = None
        self.publish: dict[str, dict] = {}
        if args.signed:
            keys = work / "keys"
            _cli(["keygen", str(keys)], self.base, "keygen")
            self.builder["KERNEL_CACHE_SIGNING_KEY_FILE"] = str(keys / "signing.key")
            self.trust = {
                "KERNEL_CACHE_TRUSTED_KEYS": str(keys / "signing.pub"),
                "KERNEL_CACHE_REQUIRE_SIGNED": "1",
            }
        self.cache = args.cache_dir
        warm = [*engine_args, "--cache-dir", self.cache, "--jobs", str(args.jobs), "-q"]
        rep = _cli(["warmup", *warm], self.builder, "warming the builder cache")
        self.warmup = {k: rep[k] for k in ("variants", "compiled", "cached", "seconds")}

    def start(self, source: str) -> None:
        """Start the server of ``source`` (none for a bundle) and publish the plan."""
        pub = [*self.engine_args, "--cache-dir", self.cache, "-q"]
        timeout = self.args.remote_timeout
        if source in ("s3", "redis") and timeout is not None:  # the publish gets it too
            pub += [f"--{source}-timeout", str(timeout)]
        if source == "s3":
            from tests.s3_server import BUCKET, S3Server

            self.s3 = S3Server()
            self.s3_url = f"s3://{BUCKET}/{S3_PREFIX}"
            env = {**self.builder, **self.s3.env()}
            rep = _cli(["warmup", *pub, "--s3-url", self.s3_url], env, "publishing to S3")
        elif source == "redis":
            from tests.redis_server import RedisServer

            self.redis = RedisServer()
            rep = _cli(["warmup", *pub, "--redis-url", self.redis.url], self.builder, "Redis")
        else:
            self.bundle = self.work / "bundle"
            rep = _cli(
                ["export", *self.engine_args, "--cache-dir", self.cache, "--out", str(self.bundle)],
                self.builder,
                "export",
            )
            rep["bundle_bytes"] = _dir_bytes(self.bundle)
        if rep.get("remote_error"):  # the engines would measure a partial plan
            raise RuntimeError(f"publishing to {source} failed: {rep['remote_error']}")
        keep = ("compiled", "uploaded", "remote_error", "files", "bytes", "bundle_bytes")
        self.publish[source] = {k: rep[k] for k in keep if k in rep}

    def stop(self, source: str) -> None:
        if source == "s3" and self.s3 is not None:
            self.s3.stop()
            self.s3 = None
        if source == "redis" and self.redis is not None:
            self.redis.stop()
            self.redis = None

    def engine_env(self, source: str, home: Path, threads: int, timeout: float | None) -> dict:
        tmp = home / "tmp"
        tmp.mkdir(parents=True)
        env = {
            **self.base,
            **self.trust,
            "KERNEL_CACHE_DIR": str(home / "cache"),  # empty: not even created
            "TMPDIR": str(tmp),
            "OMP_NUM_THREADS": str(threads),
        }
        if source in ("s3", "redis") and timeout is not None:
            env[f"KERNEL_CACHE_{source.upper()}_TIMEOUT"] = str(timeout)
        if source == "s3":
            env.update(self.s3.env(), KERNEL_CACHE_S3_URL=self.s3_url)
        elif source == "redis":
            env["KERNEL_CACHE_REDIS_URL"] = self.redis.url
        else:
            env["KERNEL_CACHE_BUNDLE"] = str(self.bundle)
        return env

    def counters(self, source: str):
        if source == "s3":
            return s3_counters(self.s3.metrics_url)
        if source == "redis":
            return redis_counters(self._redis_client())
        return None

    def _redis_client(self):
        import redis

        if getattr(self, "_client", None) is None or self._client_url != self.redis.url:
            self._client = redis.Redis.from_url(self.redis.url)
            self._client_url = self.redis.url
        return self._client


def one_run(src: Sources, source: str, n: int, cfg_json: str, run_dir: Path, args) -> dict:
    """N engines start together from ``source``; their results and the server's counts."""
    homes = [run_dir / f"engine{i}" for i in range(n)]
    envs = [src.engine_env(source, h, args.threads, args.remote_timeout) for h in homes]
    cmds = [
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "--engine",
            json.dumps({"config": cfg_json, "launched": time.time()}),
        ]
        for _ in range(n)
    ]
    info_reply = 0
    before = src.counters(source)
    if source == "redis":  # the reply to the INFO that took `before` lands in the next reading
        again = src.counters(source)
        info_reply = again["sent_bytes"] - before["sent_bytes"]
        before = again
    results = start_together(cmds, envs, run_dir, args.timeout)
    after = src.counters(source)
    server = None
    if before is not None:
        server = _delta(before, after, skip=("info",))
        server["sent_bytes"] -= info_reply
    for r, h in zip(results, homes, strict=True):
        r["local_cache_bytes"] = _dir_bytes(h / "cache")
    return {"results": results, "server": server}


def summarize(source: str, n: int, runs: list[dict], variants: int) -> dict:
    per = [r for run in runs for r in run["results"]]
    starts = [r["start_s"] for r in per]
    total = n * len(runs)
    servers = [run["server"] for run in runs if run["server"] is not None]
    doc = {
        "source": source,
        "engines": n,
        "repeats": len(runs),
        "ready_s": {**summary(starts), "p99": nearest_rank(starts, 99)},
        "import_s": summary(r["import_s"] for r in per),
        "all_loaded": all(r["loads"] == variants for r in per),
        "compiles": sum(r["compiles"] for r in per),
        "rchar_per_engine": summary(r.get("rchar_delta", 0) for r in per),
        "wchar_per_engine": summary(r.get("wchar_delta", 0) for r in per),
        "local_cache_bytes_per_engine": summary(r["local_cache_bytes"] for r in per),
        "sources_seen": sorted({k for r in per for k in r["sources"]}),
    }
    if servers:
        reqs: dict[str, int] = {}
        for s in servers:
            for k, v in s["requests"].items():
                reqs[k] = reqs.get(k, 0) + v
        doc["server"] = {
            "requests_per_engine": round(sum(reqs.values()) / total, 2),
            "requests_by_kind_per_engine": {k: round(v / total, 2) for k, v in reqs.items()},
            "sent_bytes_per_engine": round(sum(s["sent_bytes"] for s in servers) / total),
        }
    doc["per_engine"] = per
    return doc


def _mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.2f}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--engine"]:
        return engine_main(argv[1])
    from warmup.cli.main import config_from_args, engine_options

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_options(p)
    p.add_argument(
        "--engines", default="1,8,32", help="engine counts, comma-separated (default 1,8,32)"
    )
    p.add_argument(
        "--sources", default=",".join(SOURCES), help="of s3, redis, bundle (default all three)"
    )
    p.add_argument("--repeats", type=int, default=1, help="runs per source and N (default 1)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each engine")
    p.add_argument("--signed", action="store_true", help="publish signed, engines check")
    p.add_argument(
        "--remote-timeout",
        type=float,
        default=None,
        help="KERNEL_CACHE_S3_TIMEOUT / _REDIS_TIMEOUT of the engines (default: unset, 2 s)",
    )
    p.add_argument("--cache-dir", default=str(DEFAULT_CACHE), help="the builder's cache")
    p.add_argument("--jobs", type=int, default=1, help="warmup workers if it must compile")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--out", default=str(OUT_DIR / "fleet_start.json"))
    args = p.parse_args(argv)
    try:
        counts = [int(x) for x in args.engines.split(",") if x.strip()]
    except ValueError:
        p.error(f"--engines {args.engines!r}: expected integers >= 1 separated by commas")
    if not counts or min(counts) < 1:
        p.error(f"--engines {args.engines!r}: expected integers >= 1 separated by commas")
    sources = [s.strip() for s in args.sources.split(",") if s.strip()]
    bad = sorted(set(sources) - set(SOURCES))
    if bad or not sources:
        p.error(f"--sources {args.sources!r}: {bad or 'none'}; choose from {', '.join(SOURCES)}")
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: must be >= 1")

    from kernel_cache.config.engine import config_to_cli
    from kernel_cache.plan.buckets import Bucketer

    cfg = config_from_args(args)
    variants = len(Bucketer(cfg).variants)
    engine_args = shlex.split(config_to_cli(cfg))
    doc = header("fleet_start", argv)
    doc["machine"] = machine()
    doc["config"] = {
        "engine": cfg.model_dump(mode="json"),
        "variants": variants,
        "engines": counts,
        "sources": sources,
        "repeats": args.repeats,
        "threads": args.threads,
        "signed": args.signed,
        "remote_timeout": args.remote_timeout,
    }
    results = []
    work = Path(tempfile.mkdtemp(prefix="kernel_cache-fleet-start-"))
    try:
        src = Sources(args, engine_args, work)
        doc["config"]["builder_warmup"] = src.warmup
        for source in sources:
            src.start(source)
            try:
                for n in counts:
                    runs = []
                    for r in range(args.repeats):
                        run_dir = work / f"{source}-{n}-{r}"
                        run_dir.mkdir()
                        runs.append(one_run(src, source, n, cfg.model_dump_json(), run_dir, args))
                        shutil.rmtree(run_dir, ignore_errors=True)
                    results.append(summarize(source, n, runs, variants))
                    s = results[-1]["ready_s"]
                    print(
                        f"{source} N={n}: ready median {s['median']:.3f} s, p99 {s['p99']:.3f} s",
                        file=sys.stderr,
                        flush=True,
                    )
            finally:
                src.stop(source)
        doc["config"]["publish"] = src.publish
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lo, hi = min(counts), max(counts)
    ratios = {}
    for source in sources:
        a = next(r for r in results if r["source"] == source and r["engines"] == lo)
        b = next(r for r in results if r["source"] == source and r["engines"] == hi)
        ratios[source] = {
            "engines": [hi, lo],
            "median": round(b["ready_s"]["median"] / a["ready_s"]["median"], 3),
            "p99": round(b["ready_s"]["p99"] / a["ready_s"]["p99"], 3),
        }
    doc["results"] = {"runs": results, "ratio_largest_to_smallest": ratios}
    rows = []
    for r in results:
        s = r["ready_s"]
        srv = r.get("server", {})
        rows.append(
            [
                r["source"],
                r["engines"],
                f"{s['median']:.3f}",
                f"{s['p99']:.3f}",
                f"{s['min']:.3f}-{s['max']:.3f}",
                srv.get("requests_per_engine", "-"),
                _mib(srv.get("sent_bytes_per_engine")),
                _mib(r["rchar_per_engine"]["median"]),
                _mib(r["local_cache_bytes_per_engine"]["median"]),
                f"{r['compiles']}, {'all' if r['all_loaded'] else 'NOT all'} loaded",
            ]
        )
    print_table(
        f"Fleet start, {variants} variants, empty local caches (load at start "
        f"{doc['machine']['loadavg_at_start']})",
        [
            "source",
            "N",
            "ready s median",
            "p99",
            "min-max",
            "server requests/engine",
            "server MiB sent/engine",
            "read() MiB/engine",
            "local MiB/engine",
            "compiles, loaded",
        ],
        rows,
    )
    for source, r in ratios.items():
        print(
            f"{source}: {r['engines'][0]} engines vs {r['engines'][1]}: median x{r['median']}, "
            f"p99 x{r['p99']}"
        )
    out = write_json(args.out, doc)
    print(f"JSON: {out}")
    ok = all(r["all_loaded"] and r["compiles"] == 0 for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
