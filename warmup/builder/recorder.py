"""The files a kernel's code came from: :class:`RunRecorder` records, while a
kernel's factory and ``torch.export`` run in a compile worker, the file of every
Python function called, as a :class:`~kernel_cache.plan.traced.Manifest` the
entry's key and record carry. The build half of the traced files is
:mod:`kernel_cache.plan.traced_build` (what each file is recorded as), the check
at engine start :mod:`kernel_cache.plan.traced`; this module uses only their
public names. docs/keys.md says what is recorded and what is not seen.
"""

from __future__ import annotations

import _lsprof
import _thread
import sys
import threading
from types import CodeType

from kernel_cache.errors import CompileError
from kernel_cache.plan import traced_build as traced_files
from kernel_cache.plan.traced import Manifest
from kernel_cache.plan.traced_build import manifest_of

# -- the files a kernel's code came from ---------------------------------------------

#: Per kernel import path: the source files (outside the standard library,
#: torch and the installed distributions) whose import ran inside one of its
#: :class:`RunRecorder` in this process. A module's body runs once per process,
#: so a later window would not see it run (a module-level constant read at trace
#: time); it is added to later windows: of the same kernel, and of every engine
#: kernel (not a built-in one), since two engine kernels may share a module
#: loaded by a computed name (``importlib.import_module``) and the second one's
#: window sees no code of it run. The cost is over-invalidation: an edit to such
#: a file rebuilds the other engine kernel's variants too.
_IMPORTED: dict[str, set[str]] = {}
#: Files whose code ran outside imports in a window of this process, by kernel
#: import path, added to later windows as :data:`_IMPORTED` is: a trace may
#: reuse what an earlier one computed without running its code again (a
#: ``functools.cache`` of a library function, a module-level memo), and the
#: later entry depends on that code as much as the first.
_RAN: dict[str, set[str]] = {}
#: The code objects of the engine's and the project's source files
#: (:func:`_own_source`) that ran in a window of this process, by file: the
#: manifest checks them against the file it hashes
#: (:func:`kernel_cache.plan.traced_build.manifest_of`).
_CODES: dict[str, dict[int, object]] = {}


def _find_and_load_code():
    """The code object of the import system's ``_find_and_load`` (every import
    of a module not yet in ``sys.modules`` runs it)."""
    import importlib._bootstrap

    return importlib._bootstrap._find_and_load.__code__


#: ``co_flags`` a function's code has (CO_OPTIMIZED, CO_NEWLOCALS) and a module's,
#: a class body's or exec'd code has not.
_FUNCTION_FLAGS = 0x1 | 0x2
#: Frames looked through for the engine's own above code run under a file's name.
_CALLER_DEPTH = 64


_own_source = traced_files.is_own_source


#: The open :class:`RunRecorder` s, innermost last (one at a time in a compile;
#: windows of two threads open at once are refused).
_OPEN: list = []
#: The innermost open window, which :func:`_dispatch` records into; None outside one.
_WINDOW = None
#: That window's :attr:`RunRecorder.seen` (empty outside one).
_SEEN: set[int] = set()
#: The window whose C profiler (``_lsprof``) records its thread now; None while
#: none does (outside windows, and while a window nested in it is open).
_PROFILING = None
#: Whether :func:`_audit` is installed (once per process: audit hooks stay).
_AUDITING = False
#: The idents of the threads in which the recorder itself is setting profile
#: hooks (:meth:`RunRecorder.__enter__`, :meth:`RunRecorder.__exit__`): :func:`_audit`
#: does not count those changes as replacements. A set, each thread adding and
#: removing its own ident, so that one thread's window closing does not unmark
#: another's opening.
_OWN_CHANGE: set[int] = set()
#: ``threading``'s profile hook when the first of the open windows opened, put
#: back when the last one closes (windows closed out of order included).
_THREADS_BEFORE = None


def _audit(event: str, args: tuple) -> None:
    """The audit hook (``sys.addaudithook``) of the run recorders, for two events.

    ``sys.setprofile``, raised by every change of a thread's profile hook
    (``sys.setprofile``, ``threading.setprofile_all_threads``, C code's
    ``PyEval_SetProfile``, a C profiler's ``enable``/``disable`` before Python
    3.12) in the thread that makes it: one made in the thread of open windows,
    other than by the recorder itself, marks them replaced
    (:attr:`RunRecorder._replaced`), whether or not the hook is put back before
    they close; code that runs meanwhile under another hook goes unrecorded.

    ``exec``, for a window recording with the C profiler: every ``exec``/``eval``
    of code, imports' module code included, with the frame that called it: the
    profiler keeps which function called which, not frames, so
    :meth:`RunRecorder._exec_run` checks them here.

    Other events, other threads and times outside a window return at once."""
    if event == "exec":
        window = _PROFILING
        if window is not None and _thread.get_ident() == window._thread:
            code = args[0]
            if isinstance(code, CodeType) and not code.co_flags & _FUNCTION_FLAGS:
                window._exec_run(code, sys._getframe(1))
    elif event == "sys.setprofile" and _OPEN:
        ident = _thread.get_ident()
        if ident not in _OWN_CHANGE:
            for window in _OPEN:
                if window._opener == ident:
                    window._replaced = True


def _set_window() -> None:
    """Point :data:`_WINDOW` and :data:`_SEEN` at the innermost open window."""
    global _WINDOW, _SEEN
    _WINDOW = _OPEN[-1] if _OPEN else None
    _SEEN = _WINDOW.seen if _WINDOW is not None else set()


def _dispatch(frame, event, arg, _id=id) -> None:
    """The profile function of every :class:`RunRecorder` (``sys.setprofile``):
    records into the window open now; outside one it does nothing.

    Python calls it for every call and return, C calls included (about 15
    million events in the export of one variant of the tiny plan), so the common
    cases cost one or two set lookups here and no further call: a function
    already seen outside an import, and, inside an import, one already seen
    inside an import (``_id``: ``id`` bound once, not looked up per call)."""
    if event == "call":
        cid = _id(frame.f_code)
        if cid not in _SEEN:
            window = _WINDOW
            if window is not None and not (window._depth and cid in window.seen_in_import):
                window._call(frame.f_code, frame)
    elif event == "return":
        window = _WINDOW
        if window is not None and frame.f_code is window._import:
            window._depth -= 1


class _WindowProfiler(_lsprof.Profiler):
    """The C profiler (``_lsprof``, what ``cProfile`` runs on) of a
    :class:`RunRecorder` in the thread that opened it: it keeps each function's
    code and the functions it called, with no Python call per event."""

    def __init__(self, window):
        super().__init__(builtins=False)
        self.window = window

    def __call__(self, frame, event, arg) -> None:
        """Python calls the profiler only where code put it back with
        ``sys.setprofile`` after replacing it (``saved = sys.getprofile()`` ...
        ``sys.setprofile(saved)``), which makes it a Python profile function,
        or where the profile function that replaced it calls it in turn: what
        ran meanwhile went unrecorded, so its window is refused
        (:attr:`RunRecorder._lost`). Put back, the C profiler takes the hook
        again while its window records in this thread; elsewhere none is left."""
        if sys.getprofile() is not self:
            return  # called by the profile function that replaced it, which the window sees
        window = self.window
        window._lost = "then put back"
        if _PROFILING is window and _thread.get_ident() == window._thread:
            self.enable(subcalls=True, builtins=False)
        else:
            sys.setprofile(None)

    def disable(self) -> None:
        """Disabled by other code than its window's (which calls
        ``_lsprof.Profiler.disable``), the profiler may be enabled again before
        the window closes: what ran in between went unrecorded, so its window
        is refused."""
        self.window._lost = "disabled, perhaps enabled again"
        _lsprof.Profiler.disable(self)

    def clear(self) -> None:
        """What the profiler recorded, cleared: its window is refused."""
        self.window._lost = "its record cleared"
        _lsprof.Profiler.clear(self)


def _start_profiler(window) -> _WindowProfiler | None:
    """A :class:`_WindowProfiler` of ``window`` recording this thread, or None
    where it cannot be this thread's profile hook: from Python 3.12 ``_lsprof``
    runs on ``sys.monitoring``, so ``sys.getprofile()`` does not show it (a
    replacement of the hook could not be told from it) and enabling it while
    another profiler runs raises ValueError. The window then records with
    :func:`_dispatch`."""
    profiler = _WindowProfiler(window)
    try:
        profiler.enable(subcalls=True, builtins=False)
    except ValueError:
        return None
    if sys.getprofile() is not profiler:
        _lsprof.Profiler.disable(profiler)
        return None
    return profiler


def _reach(start, callees: dict, stop: set) -> set[int]:
    """The ids reached from ids ``start`` along ``callees``, entering none of ``stop``."""
    seen: set[int] = set()
    todo = [c for c in start if c not in stop]
    while todo:
        c = todo.pop()
        if c not in seen:
            seen.add(c)
            todo.extend(n for n in callees.get(c, ()) if n not in seen and n not in stop)
    return seen


class RunRecorder:
    """A context in which every Python function called (the factory's import,
    the factory, ``torch.export``), in this thread and in threads started
    inside it, has its file recorded.

    Code run by an import (finders, module and class bodies) is told apart by
    the import system's ``_find_and_load`` frame: of it only files classified
    :data:`~kernel_cache.plan.file_origin.OTHER` and site files no distribution
    lists are kept (the engine's modules, whose module-level values a trace
    may read: :func:`_own_source`), also for every later window
    of the same kernel import path ``kernel`` and, for an engine kernel, of
    every engine kernel (:data:`_IMPORTED`); a distribution counts only where its
    code ran outside an import (so the setuptools and editable-install import
    hooks, and the libraries torch's export stack imports on first use, do not).

    In the thread that opens it, where no other profiler runs there and where
    the C profiler is the thread's profile hook (before Python 3.12:
    :func:`_start_profiler`), the window records with Python's C profiler
    (:class:`_WindowProfiler`), which
    keeps each function's code and the functions it called with no Python call
    per event; who called whom then stands in for the stack
    (:meth:`_from_profile`, which errs towards recording more), and an audit
    hook sees each ``exec``/``eval`` with its frames (:func:`_audit`). Threads
    started inside a window get ``threading.setprofile`` with one module-level
    function (:func:`_dispatch`) that records into the open window: a thread
    started in an earlier window keeps that function, so its code is recorded
    in the window open when it runs. A window nested in another of the same
    thread, or opened under another profile hook, records with that function
    too. The previous hooks are restored on exit, ``threading``'s when the last
    open window closes. Measured on the tiny plan's
    three variants in one process (Python 3.11, the project's 2-core CPU, idle,
    CPU seconds of ``export_variant``): 1.4-2.2 s untraced, 2.8-4.1 s under
    the C profiler against 4.5-6.8 s under the Python profile function, whose
    every one of the export's 15 million call, return and C-call events is a
    Python call; the first export of a process 3.8 s against 10.7 s.

    Refused with :class:`~kernel_cache.errors.CompileError` on exit, since the
    record would be incomplete: the profile hook of the window's thread was
    replaced during the window (``torch.profiler`` with ``with_stack``, a tool
    that sets ``sys.setprofile``, cProfile before Python 3.12), put back or not
    (:func:`_audit` sees each change), or by a window opened in it that is
    still open; a window of another thread was open at the same time
    (threads' code is recorded into the window opened last, whichever
    kernel's code started them), or the engine's code ran code compiled from a string
    (``exec``/``eval`` of text with no file name), whose source no file holds,
    or module code under a file's name that is not that file's (checked for
    every file, the standard library's, torch's and distributions' included).
    A replacement that put the C profiler back is refused too (the profiler
    is then called as a Python profile function: :meth:`_WindowProfiler.__call__`),
    and so is code that disables the profiler it finds (and enables it again)
    or clears its record. From Python 3.12 cProfile runs on ``sys.monitoring``
    and leaves the profile hook alone: the window records on, and is not refused.
    Not seen: a thread started before the process's first window (Python
    before 3.12 cannot hook a running thread), a replacement of the hook of
    a thread started in a window, one of ``threading``'s hook
    (``threading.setprofile``) put back before the window closed, and one made
    from another thread (``threading.setprofile_all_threads`` called there: the
    audit event comes from the calling thread) and put back before it closed.
    """

    def __init__(self, kernel: str):
        self.kernel = kernel
        self.files: set[str] = set()  # code that ran outside imports
        self.imported: set[str] = set()  # code that ran inside imports
        self.codes: dict[int, object] = {}  # every code object that ran, by id
        self.seen: set[int] = set()  # ids of functions that ran outside imports
        self.seen_in_import: set[int] = set()  # ids of functions that ran inside imports
        self.from_text: list[str] = []  # "file:line" of the engine's exec/eval of text
        self.module_runs: list[tuple] = []  # (file name, code, "file:line") exec'd by it
        self._own: dict[str, bool] = {}  # _own_source by file name, for this window
        self._depth = 0
        self._import = _find_and_load_code()
        self._profiler = None  # the C profiler of the window's own thread, if it has one
        self._thread = None  # that thread's ident
        self._base = None  # the frame the window was opened from
        self._exec_inside: dict[int, int] = {}  # runs by exec inside imports, by code id
        self._exec_outside: dict[int, int] = {}  # ... and outside them
        self._lost = ""  # how other code made its C profiler miss calls (_WindowProfiler)
        self._replaced = False  # its thread's profile hook was set by other code (_audit)
        self._opener = None  # the ident of the thread that opened it
        self._outer = None  # the window of that thread it was opened in, if any
        self._concurrent = False  # a window of another thread was open at the same time

    def _call(self, code, frame) -> None:
        """A call of ``code`` that :func:`_dispatch` has not ruled out: the first
        of a function outside imports and the first inside imports, every call
        of the import system's ``_find_and_load``, and every run of module or
        class-body code (checked by :meth:`_module_run` each time)."""
        self.codes[id(code)] = code
        if code is self._import:
            self._depth += 1
            return
        if self._depth:
            self.imported.add(code.co_filename)
        else:
            self.files.add(code.co_filename)
        if not code.co_flags & _FUNCTION_FLAGS:  # module or class body: exec'd code
            self._module_run(code, frame.f_back)
        elif self._depth:  # recorded in imported: later calls inside imports change nothing
            self.seen_in_import.add(id(code))
        else:  # recorded in files: later calls change nothing (an import's call of it
            # is not added to imported, which the manifest only adds to files)
            self.seen.add(id(code))

    def _module_run(self, code, caller) -> None:
        """Code that is not a function's (a module's or a class body: what
        ``exec``/``eval`` run, whatever its ``co_name``) started. Text with no file
        name is kept in :attr:`from_text` when the engine's own code started it
        directly (the standard library's and torch's generated code, dataclass
        methods say, is theirs). Code under a file's name is kept in
        :attr:`module_runs`, to be checked against that file, when an engine
        frame is found above it before the import system's (``runpy``,
        ``code.InteractiveInterpreter`` and the like run it for the engine; the
        import system runs modules' own code)."""
        name = code.co_filename
        if not name or name.startswith("<"):
            if caller is not None and _own_source(caller.f_code.co_filename):
                self.from_text.append(f"{caller.f_code.co_filename}:{caller.f_lineno}")
            return
        frame = caller
        for _ in range(_CALLER_DEPTH):
            if frame is None:
                return
            filename = frame.f_code.co_filename
            if filename.startswith("<frozen importlib"):
                return
            if self._own_file(filename):
                self.module_runs.append((name, code, f"{filename}:{frame.f_lineno}"))
                return
            frame = frame.f_back

    def _exec_run(self, code, caller) -> None:
        """Module code ``code`` that ``exec``/``eval`` is about to run for the code
        of frame ``caller``, in the thread the C profiler records (:func:`_audit`):
        what :meth:`_call` does for such code, with the import depth read from
        the frames between ``caller`` and the one the window was opened from."""
        frame, inside, base = caller, False, self._base
        while frame is not None and frame is not base:
            if frame.f_code is self._import:
                inside = True
                break
            frame = frame.f_back
        if inside:
            self._exec_inside[id(code)] = self._exec_inside.get(id(code), 0) + 1
            self.imported.add(code.co_filename)
        else:
            self._exec_outside[id(code)] = self._exec_outside.get(id(code), 0) + 1
            self.files.add(code.co_filename)
        self.codes[id(code)] = code
        self._module_run(code, caller)

    def _own_file(self, filename: str) -> bool:
        """:func:`_own_source` of ``filename``, kept for the window."""
        own = self._own.get(filename)
        if own is None:
            own = self._own[filename] = _own_source(filename)
        return own

    def _from_profile(self, stats) -> None:
        """Add what the C profiler saw (``stats``: ``_lsprof`` entries, each a
        function's code with the functions it called) to the record. The
        profiler keeps which function called which, not the stack, so a call is
        taken to be inside an import when the import system's
        ``_find_and_load`` reaches it, and outside one when a function the
        window's frame called reaches it without passing through
        ``_find_and_load`` or through module code whose every run was an
        ``exec`` inside an import (told by :meth:`_exec_run`): a function both
        reach counts as both, as it does when it runs both ways. Module code
        that ran other than by ``exec`` (class bodies, module code called as a
        function) is checked as :meth:`_module_run` checks it, with the callers
        the profile names in place of the frames above it."""
        codes: dict[int, object] = {}
        runs: dict[int, int] = {}
        callees: dict[int, list[int]] = {}
        callers: dict[int, list[int]] = {}
        called: dict[int, int] = {}
        for entry in stats:
            code = entry.code
            if not isinstance(code, CodeType):
                continue
            codes[id(code)] = code
            runs[id(code)] = entry.callcount
            out = callees.setdefault(id(code), [])
            for sub in entry.calls or ():
                if isinstance(sub.code, CodeType):
                    out.append(id(sub.code))
                    callers.setdefault(id(sub.code), []).append(id(code))
                    called[id(sub.code)] = called.get(id(sub.code), 0) + sub.callcount
        # called by the window's frame: more calls than its callers made
        roots = {c for c, n in runs.items() if n > called.get(c, 0)}
        imports = {c for c, code in codes.items() if code is self._import}
        inside_execs, outside_execs = self._exec_inside, self._exec_outside
        only_imports = {
            c for c, n in inside_execs.items() if c not in outside_execs and runs.get(c, 0) <= n
        }
        outside = _reach(roots, callees, stop=imports | only_imports)
        inside = _reach({c for i in imports for c in callees.get(i, ())}, callees, stop=set())
        self.files.update(codes[c].co_filename for c in outside)
        self.imported.update(codes[c].co_filename for c in inside)
        self.codes.update(codes)
        for c, code in codes.items():
            if code.co_flags & _FUNCTION_FLAGS:
                continue
            if runs[c] <= inside_execs.get(c, 0) + outside_execs.get(c, 0):
                continue  # every run an exec, checked by _exec_run
            if c in outside or c in inside:
                self._profiled_module_run(c, roots, callers, codes)

    def _profiled_module_run(self, c: int, roots: set, callers: dict, codes: dict) -> None:
        """:meth:`_module_run` for module code ``codes[c]`` that ran other than by
        ``exec`` (a class body, or module code called as a function), from the
        callers the profile names (``roots``: the functions the window's frame
        called, which has them as its callers): code from text is refused where
        a direct caller is the engine's; code under a file's name is checked
        where the engine's code is among its callers, their callers and so on,
        up to :data:`_CALLER_DEPTH` levels, before the import system's."""
        code = codes[c]
        name = code.co_filename
        text = not name or name.startswith("<")
        base = (self._base.f_code.co_filename, self._base.f_lineno, None)

        def above(c):  # the callers of c, with the window's frame where it called c
            ups = [(codes[u].co_filename, codes[u].co_firstlineno, u) for u in callers.get(c, ())]
            return ups + [base] if c in roots else ups

        level = above(c)
        seen: set = {c}
        for _ in range(1 if text else _CALLER_DEPTH):
            upper = []
            for filename, line, up in level:
                if filename.startswith("<frozen importlib"):
                    continue
                if self._own_file(filename):
                    if text:
                        self.from_text.append(f"{filename}:{line}")
                    else:
                        self.module_runs.append((name, code, f"{filename}:{line}"))
                    return
                if up is None or up in seen:
                    continue
                seen.add(up)
                upper += above(up)
            if not upper:
                return
            level = upper

    def _check_module_runs(self) -> None:
        """Module code the engine ran under a file's name must be that file's (the
        bytes imported, else those on disk), whatever the file is: a standard
        library, torch or distribution file is recorded by its version, not
        hashed, so code compiled from other text under its name would go unseen."""
        for name, code, where in self.module_runs:
            if not traced_files.code_is_files(code, name):
                raise CompileError(
                    f"kernel {self.kernel}: its code ran module code under the name {name} "
                    f"(at {where}) that is not that file's contents: the entry would "
                    "record that file, not the code that ran; compile a file's text "
                    "under its own path"
                )

    def _how_lost(self, hook, ours) -> str:
        """How the window's hook was replaced while it was open, found as it closes
        (``hook``: the thread's profile hook now; ``ours``: the window's), or ""
        where it records still and was never replaced."""
        if self._lost:
            return self._lost
        later = _OPEN[_OPEN.index(self) + 1 :]
        if any(w._opener == self._opener for w in later):
            return "by a run recorder opened in it and still open"
        if hook is not ours:
            return f"now {hook!r}"
        threads = threading.getprofile()
        if threads is not _dispatch:
            return f"threading's now {threads!r}"
        return "then put back" if self._replaced else ""

    def _refuse_replaced(self, lost: str) -> None:
        """Raise :class:`CompileError` where the window's hook was replaced while
        it was open (``lost``: how, :meth:`_how_lost`): its record is incomplete."""
        if lost:
            raise CompileError(
                f"kernel {self.kernel}: the profile hook that records the files the "
                f"kernel's code runs was replaced while it was traced ({lost}: a "
                "profiler such as cProfile or torch.profiler(with_stack=True), or a tool "
                "that calls sys.setprofile), so the record of the files it ran is "
                "incomplete and the build is refused; build the kernel without it"
            )

    def _refuse_incomplete(self) -> None:
        """Raise :class:`CompileError` where the window's record cannot be trusted
        for another reason than a replaced hook (class docstring): a window of
        another thread open at the same time, module code that is not its
        file's, code compiled from text with no file name."""
        if self._concurrent:
            raise CompileError(
                f"kernel {self.kernel}: a run recorder of another thread was open while it "
                "was traced: code that threads run is recorded into the window opened "
                "last, so either record may lack files its kernel's code ran and the "
                "build is refused; trace one kernel at a time in a process"
            )
        self._check_module_runs()
        if self.from_text:
            raise CompileError(
                f"kernel {self.kernel}: its code ran code compiled from text with no file "
                f"name (exec or eval of a string, at {', '.join(sorted(set(self.from_text)))}),"
                " whose source no file holds, so the cache key cannot cover it; run it from "
                "its file (import it, or exec(compile(text, path, 'exec')) with the path it "
                "was read from, which is hashed)"
            )

    def __enter__(self) -> RunRecorder:
        global _PROFILING, _AUDITING, _THREADS_BEFORE

        if not _AUDITING:
            sys.addaudithook(_audit)
            _AUDITING = True
        hook = sys.getprofile()
        self._saved = hook
        self._base = sys._getframe(1)
        if not _OPEN:
            _THREADS_BEFORE = threading.getprofile()
        self._opener = _thread.get_ident()
        self._outer = next((w for w in reversed(_OPEN) if w._opener == self._opener), None)
        if any(w._opener != self._opener for w in _OPEN):
            for w in [*_OPEN, self]:
                w._concurrent = True
        _OPEN.append(self)
        _set_window()
        _OWN_CHANGE.add(self._opener)
        try:
            threading.setprofile(_dispatch)
            if hook is None and _PROFILING is None:
                self._profiler = _start_profiler(self)
            if self._profiler is not None:
                self._thread = self._opener
                _PROFILING = self
            else:
                if isinstance(hook, _WindowProfiler) and hook.window is _PROFILING:
                    _PROFILING = None  # a window of this thread: paused while this one is open
                sys.setprofile(_dispatch)
        finally:
            _OWN_CHANGE.discard(self._opener)
        return self

    def __exit__(self, *exc) -> None:
        global _PROFILING

        hook = sys.getprofile()
        lost = self._how_lost(hook, _dispatch if self._profiler is None else self._profiler)
        me = _thread.get_ident()
        _OWN_CHANGE.add(me)
        try:
            if self._profiler is not None:
                _lsprof.Profiler.disable(self._profiler)
                if _PROFILING is self:
                    _PROFILING = None
            _OPEN.remove(self)
            _set_window()
            saved = self._saved
            if isinstance(saved, _WindowProfiler):  # the window this one was opened in
                if saved.window in _OPEN:
                    saved.enable(subcalls=True, builtins=False)
                    _PROFILING = saved.window
                else:  # closed before this one: nothing records now
                    sys.setprofile(None)
            elif saved is _dispatch and self._outer is not None and self._outer not in _OPEN:
                # the window this one was opened in, recording with the profile
                # function, closed before this one: nothing records now
                sys.setprofile(None)
            elif isinstance(saved, _lsprof.Profiler):
                # cProfile's: sys.setprofile would make it a Python profile function,
                # which it cannot be; enable() with no options keeps the ones it had
                saved.enable()
            else:
                sys.setprofile(saved)
        finally:
            _OWN_CHANGE.discard(me)
        # threads started while another window is open still record into it
        threading.setprofile(_dispatch if _OPEN else _THREADS_BEFORE)
        self._saved = self._outer = None  # an outer window and its profiler among them
        try:
            if exc[0] is None:
                # before the profile is read: a C profiler that lost the hook
                # mid-call keeps calls that never returned to it, which its
                # entries do not list
                self._refuse_replaced(lost)
            if self._profiler is not None:
                self._from_profile(self._profiler.getstats())
        finally:
            self._profiler = self._base = None
        if exc[0] is None:
            self._refuse_incomplete()
        own = {f for f in self.imported if _own_source(f)}
        _IMPORTED.setdefault(self.kernel, set()).update(own)
        _RAN.setdefault(self.kernel, set()).update(self.files)
        mine = {f for f in {c.co_filename for c in self.codes.values()} if _own_source(f)}
        for code in self.codes.values():
            if code.co_filename in mine:
                _CODES.setdefault(code.co_filename, {})[id(code)] = code
        self.codes, self.seen, self.seen_in_import = {}, set(), set()

    def manifest(self) -> Manifest:
        """The recorded files, with the source files imported in this or an
        earlier window of this process (:data:`_IMPORTED`), as a
        :class:`~kernel_cache.plan.traced.Manifest`."""
        from kernel_cache.kernels.slots import builtin_paths

        builtins = builtin_paths()
        if self.kernel in builtins:
            imported = _IMPORTED.get(self.kernel, set()) | _RAN.get(self.kernel, set())
        else:
            earlier = [f for d in (_IMPORTED, _RAN) for k, f in d.items() if k not in builtins]
            imported = set().union(*earlier)
        files = self.files | imported
        return manifest_of(files, ran={f: list(_CODES[f].values()) for f in files if f in _CODES})
