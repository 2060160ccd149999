"""Load new artifacts once in a fresh child process before they are published.

Why: an AOTInductor package is native code. One built by a C++ toolchain that
does not match the engine process's C++ runtime can crash that process on load.
Seen on a CUDA image whose ``CXX=/opt/gcc/bin/g++`` (a wrapper script around
gcc 13.3.0) links libstdc++ statically into the package's ``wrapper.so``: a
torch process already has the shared libstdc++, and loading the package died
with SIGSEGV in ``parse_device_str`` -> ``std::regex``
(``benchmarks/gpu_run.sh`` reproduces it with a 10-line ``std::regex`` object).
The compile workers cannot show this reliably (they have loaded the compile
stack and other libraries), so each new artifact is loaded once in a process
that has only what an engine has (``kernel_cache.runtime.package.load_package``, no
Dynamo or Inductor) before it is published. An artifact whose load kills that
process or is rejected is reported and never published.

Two ways to run the check:

- :class:`LoadChecker`: one check process kept running by a compile worker,
  fed one artifact at a time as soon as it is built (``--serve``: paths on
  standard input); after a crash the next artifact gets a new process. Warmup
  uses it, so a new artifact is published seconds after its compile, while the
  worker still holds the key's lock (:mod:`warmup.builder.worker`).
- :func:`check_loadable`: a list of artifacts, one process per batch.

Protocol: each artifact is a file in a private staging directory; a request is
a JSON line ``{"index", "variant", "path"}``. The child prints one JSON line per
event (``start`` with the libstdc++ it loaded, ``loading``, ``ok``,
``rejected``) and flushes after each, so a crash is pinned to the artifact being
loaded.

Run as ``python -m warmup.builder.loadcheck --device cpu|cuda (LIST.json | --serve)`` (the child).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

#: Seconds a child may take for one batch (process start, imports, CUDA init,
#: then about 0.02 s per package measured on an H200) before it is killed.
CHECK_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Staged:
    """One new artifact waiting for the check: its variant string and bytes."""

    variant: str
    data: bytes


def loaded_libstdcxx() -> str:
    """The libstdc++ files this process has mapped (``/proc/self/maps``), real paths
    joined by ", ", or ''."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return ""
    found = re.findall(r"(/\S*libstdc\+\+\.so[.\d]*)", maps)
    return ", ".join(dict.fromkeys(os.path.realpath(f) for f in found))


def _signal_name(rc: int) -> str:
    if rc < 0:
        try:
            return signal.Signals(-rc).name
        except ValueError:
            return f"signal {-rc}"
    return f"exit status {rc}"


def crash_advice(signame: str, child_lib: str) -> str:
    """The report for an artifact whose load killed a fresh process: what built it,
    what the process loads, why that can crash, and the fix."""
    from kernel_cache.plan.keys import cxx_toolchain

    t = cxx_toolchain()
    built = (
        f"built by {t['path'] or 'an unknown C++ compiler'} ({t['compiler']}, build "
        f"{t['build']}, libstdc++ {t['libstdcxx']}"
        + (f" from {t['libstdcxx_path']}" if t["libstdcxx_path"] else "")
        + ")"
    )
    loads = (
        f"a fresh process loads {child_lib}" if child_lib else "the process's libstdc++ is unknown"
    )
    system = "/usr/bin/g++"
    other = system if Path(system).exists() and t["path"] != system else "the system's g++"
    process_lib = child_lib.split(", ")[0] if child_lib else "the runtime's libstdc++.so.6"
    if t["libstdcxx"] == "static":
        why = (
            "The compiler links libstdc++ statically into the package, while the engine "
            "process already has the shared libstdc++ (torch loads it): two C++ runtimes "
            "in one process crash (seen on a CUDA image in std::regex)."
        )
        preload = process_lib
    elif t["libstdcxx_path"] and child_lib and t["libstdcxx_path"] not in child_lib:
        why = "The compiler links another libstdc++ than the engine process loads."
        preload = t["libstdcxx_path"]
    else:
        why = (
            "The compiler links the libstdc++ the process loads, so another difference of "
            "this compiler build is the likely cause."
        )
        preload = process_lib
    return (
        f"loading it killed a fresh process ({signame}); it was not published. It was {built}; "
        f"{loads}. {why} Fix: warm up with the compiler that links the runtime's shared "
        f"libstdc++ (e.g. CXX={other} kernel-cache warmup ...), or start every engine "
        f"process with LD_PRELOAD={preload}"
    )


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def check_loadable(
    staged: list[Staged], device: str, *, timeout: float = CHECK_TIMEOUT_S
) -> tuple[list[dict], dict]:
    """Load each staged artifact once in fresh child processes (one per batch;
    a new one only after a crash).

    Returns:
        ``(results, info)``: one dict per staged artifact, in order, with
        ``variant``, ``ok`` (bool) and, when not ok, ``error`` (what happened and
        the fix); ``info`` has ``children`` (processes started), ``libstdcxx``
        (what the first child loaded) and ``seconds``.
    """
    t0 = time.perf_counter()
    results: list[dict | None] = [None] * len(staged)
    info = {"children": 0, "libstdcxx": "", "seconds": 0.0}
    with tempfile.TemporaryDirectory(prefix="kernel_cache-check-") as tmp:
        todo = []
        for i, s in enumerate(staged):
            path = Path(tmp) / f"{i}.pt2"
            path.write_bytes(s.data)
            todo.append({"index": i, "variant": s.variant, "path": str(path)})
        while todo:
            listing = Path(tmp) / f"batch{info['children']}.json"
            listing.write_text(json.dumps(todo))
            info["children"] += 1
            out, err, rc, timed_out = _run_child(listing, device, timeout)
            events = _events(out)
            child_lib = next((e.get("libstdcxx", "") for e in events if e["event"] == "start"), "")
            info["libstdcxx"] = info["libstdcxx"] or child_lib
            loading = _record(events, staged, results)
            if rc == 0:
                break
            if loading is None:
                # The child died outside a load (import error, CUDA init): nothing after
                # this point can be trusted, so nothing left is published.
                tail = " | ".join(err.strip().splitlines()[-3:])
                why = "timed out" if timed_out else _signal_name(rc)
                for it in todo:
                    if results[it["index"]] is None:
                        results[it["index"]] = {
                            "variant": it["variant"],
                            "ok": False,
                            "error": f"the load check process failed ({why}): {tail}",
                        }
                break
            signame = f"timed out after {timeout:.0f} s" if timed_out else _signal_name(rc)
            results[loading] = {
                "variant": staged[loading].variant,
                "ok": False,
                "error": crash_advice(signame, child_lib),
                "signal": signame,
            }
            todo = [it for it in todo if results[it["index"]] is None]
    info["seconds"] = round(time.perf_counter() - t0, 3)
    return [r for r in results if r is not None], info


def _run_child(listing: Path, device: str, timeout: float) -> tuple[str, str, int, bool]:
    """Run one check child over ``listing``: ``(stdout, stderr, returncode,
    timed_out)``; a child past ``timeout`` seconds is killed (returncode -9)."""
    cmd = [sys.executable, "-m", "warmup.builder.loadcheck", "--device", device, str(listing)]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=_child_env()
        )
        return proc.stdout, proc.stderr, proc.returncode, False
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        return out, err, -9, True


def _events(out: str) -> list[dict]:
    """The child's JSON event lines (``{"event": ...}``) in order; other lines skipped."""
    events = []
    for line in out.splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict) and "event" in ev:
            events.append(ev)
    return events


def _record(events: list[dict], staged: list[Staged], results: list) -> int | None:
    """Fill ``results`` from a child's ``ok`` / ``rejected`` events; the index
    it was loading when its output ended (None if it ended between loads)."""
    loading = None
    for ev in events:
        if ev["event"] == "loading":
            loading = ev["index"]
        elif ev["event"] == "ok":
            results[ev["index"]] = {"variant": staged[ev["index"]].variant, "ok": True}
            loading = None
        elif ev["event"] == "rejected":
            results[ev["index"]] = {
                "variant": staged[ev["index"]].variant,
                "ok": False,
                "error": str(ev.get("error", "rejected by the loader")),
            }
            loading = None
    return loading


def die_with_parent(parent: int) -> None:
    """On Linux, have the kernel SIGKILL this process when process ``parent``
    dies (``prctl(PR_SET_PDEATHSIG)``), so no compile or check outlives a killed
    warmup; elsewhere nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


class LoadChecker:
    """A check process kept running for one compile worker (see the module docstring).

    Args:
        device: ``"cpu"`` or ``"cuda"``.
        timeout: seconds one artifact may take, process start included
            (:data:`CHECK_TIMEOUT_S`); past it the process is killed and the
            artifact reported as not loadable.

    Not thread-safe; one per process. :meth:`close` ends the child.
    """

    def __init__(self, device: str, *, timeout: float = CHECK_TIMEOUT_S):
        self.device = device
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self.libstdcxx = ""
        self.started = 0
        self._tmp = tempfile.TemporaryDirectory(prefix="kernel_cache-check-")
        self._n = 0
        self._buf = b""

    def _start(self) -> None:
        cmd = [sys.executable, "-m", "warmup.builder.loadcheck", "--device", self.device, "--serve"]
        # stderr goes to a file: a pipe nobody reads would block a chatty child.
        self._err = Path(self._tmp.name) / f"stderr{self.started}.txt"
        with open(self._err, "wb") as err:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=_child_env(),
            )
        self._buf = b""
        self.started += 1

    def _read_event(self, deadline: float) -> dict | None:
        """The next JSON event line of the child, or None at EOF or the deadline.
        Reads the pipe's file descriptor directly (``os.read``): a buffered
        reader could hold a line that ``select`` no longer sees."""
        import select

        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            line, sep, rest = self._buf.partition(b"\n")
            if sep:
                self._buf = rest
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if isinstance(ev, dict) and "event" in ev:
                    return ev
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buf += chunk

    def _fail(self, why: str, crashed_in_load: bool) -> dict:
        proc, self.proc = self.proc, None
        try:  # at EOF the child is exiting: reap it to read how it ended
            proc.wait(timeout=10)
            timed_out = False
        except subprocess.TimeoutExpired:  # no answer by the deadline: it hangs
            proc.kill()
            proc.wait()
            timed_out = True
        try:
            err = self._err.read_text(errors="replace")
        except OSError:
            err = ""
        if crashed_in_load:
            signame = (
                f"timed out after {self.timeout:.0f} s"
                if timed_out
                else _signal_name(proc.returncode)
            )
            return {"ok": False, "error": crash_advice(signame, self.libstdcxx), "signal": signame}
        tail = " | ".join(err.strip().splitlines()[-3:]) or "no output"
        status = "still running" if timed_out else _signal_name(proc.returncode)
        return {
            "ok": False,
            "error": f"the load check process failed before loading it ({why}; {status}): {tail}",
            "retry": True,
        }

    def check(self, variant: str, data: bytes) -> dict:
        """Load ``data`` (a ``.pt2`` package of ``variant``) once in the check process.

        A check process that dies before it loads the artifact (killed, failed to
        start) says nothing about the artifact: a new one is started and the
        artifact checked once more.

        Returns:
            ``{"ok": True}``, or ``{"ok": False, "error": what happened and the fix}``
            (``"signal"`` too when the load killed the process).
        """
        verdict = self._check_once(variant, data)
        if verdict.pop("retry", False):
            verdict = self._check_once(variant, data)
            verdict.pop("retry", None)
        return verdict

    def _check_once(self, variant: str, data: bytes) -> dict:
        deadline = time.monotonic() + self.timeout
        if self.proc is None or self.proc.poll() is not None:
            self._start()
            ev = self._read_event(deadline)
            if ev is None or ev["event"] != "start":
                return self._fail("no start", crashed_in_load=False)
            self.libstdcxx = self.libstdcxx or ev.get("libstdcxx", "")
        self._n += 1
        path = Path(self._tmp.name) / f"{self._n}.pt2"
        path.write_bytes(data)
        try:
            req = {"index": self._n, "variant": variant, "path": str(path)}
            assert self.proc is not None and self.proc.stdin is not None
            try:
                self.proc.stdin.write(json.dumps(req) + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                return self._fail("its input closed", crashed_in_load=False)
            loading = False
            while True:
                ev = self._read_event(deadline)
                if ev is None:
                    return self._fail("no answer", crashed_in_load=loading)
                if ev["event"] == "loading":
                    loading = True
                elif ev["event"] == "ok":
                    return {"ok": True}
                elif ev["event"] == "rejected":
                    return {"ok": False, "error": str(ev.get("error", "rejected by the loader"))}
        finally:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        if self.proc is not None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        self._tmp.cleanup()


def _child_main(argv=None) -> int:
    p = argparse.ArgumentParser(description="load artifacts once (kernel-cache warmup's check)")
    p.add_argument("--device", required=True)
    p.add_argument("--serve", action="store_true", help="read one JSON request per input line")
    p.add_argument("listing", nargs="?")
    args = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the warmup process decides on Ctrl-C
    die_with_parent(os.getppid())

    def emit(**ev):
        sys.stdout.write(json.dumps(ev) + "\n")
        sys.stdout.flush()

    import torch  # as in an engine process: torch (and its libstdc++) loaded first

    from kernel_cache.errors import CorruptEntryError, TorchAPIDriftError
    from kernel_cache.runtime.package import load_package

    if args.device == "cuda":
        torch.cuda.init()
    emit(event="start", pid=os.getpid(), libstdcxx=loaded_libstdcxx())
    if args.serve:
        requests = (json.loads(line) for line in sys.stdin if line.strip())
    else:
        requests = iter(json.loads(Path(args.listing).read_text()))
    for it in requests:
        emit(event="loading", index=it["index"])
        try:
            load_package(Path(it["path"]).read_bytes(), args.device, "warmup check")
        except CorruptEntryError as e:
            emit(event="rejected", index=it["index"], error=e.reason)
            continue
        except TorchAPIDriftError as e:  # not the artifact's fault; it is not published
            emit(event="rejected", index=it["index"], error=str(e))
            continue
        emit(event="ok", index=it["index"])
    return 0


if __name__ == "__main__":
    sys.exit(_child_main())
