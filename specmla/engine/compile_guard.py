"""The late-compile guard: after warm-up, a Triton compile or a CUDA-graph capture is work a live request waits for.

`LLM` warms up every kernel specialisation and graph its engine can reach before it returns (`engine.warmup`), then
arms this guard. Armed, the guard notices two events: Triton loading a specmla kernel specialisation it has not run
in this process (an in-memory cache miss: a compile, or a load from Triton's disk cache) and a graph capture by one
of the engine's graph holders. What it does is the mode:

- "warn" (the default): log one warning per kernel or graph kind, naming it (the request still runs);
- "raise": raise `LateCompileError` (tests, and `SPECMLA_COMPILE_GUARD=raise` in production to find gaps);
- "off": nothing.

The mode comes from the environment variable SPECMLA_COMPILE_GUARD when `arm` is called; `strict()` arms it in
"raise" mode for a block (tests). Work inside `warming()` (a warm-up in progress, in any engine of the process) is
always allowed. Only kernels defined under the `specmla` package count: a user's own Triton code is not ours to
police.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading

log = logging.getLogger("specmla.engine")

MODES = ("warn", "raise", "off")
ENV = "SPECMLA_COMPILE_GUARD"


class LateCompileError(RuntimeError):
    """A kernel compiled or a graph was captured after warm-up (the guard armed in "raise" mode)."""


_lock = threading.Lock()
_state = {"mode": "off", "warming": 0, "installed": False, "warned": set()}
events: list[str] = []  # what the armed guard has seen (kept in every mode but "off"): tests and benchmarks read it


def env_mode() -> str:
    mode = os.environ.get(ENV, "warn").strip().lower() or "warn"
    if mode not in MODES:
        raise ValueError(f"{ENV}={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def arm(mode: str | None = None) -> None:
    """Arm the guard for the process (mode None: the environment's, default "warn")."""
    mode = env_mode() if mode is None else mode
    if mode not in MODES:
        raise ValueError(f"guard mode {mode!r}: expected one of {', '.join(MODES)}")
    _install_triton_hook()
    _state["mode"] = mode


def mode() -> str:
    return _state["mode"]


@contextlib.contextmanager
def warming():
    """A block of warm-up work: compiles and captures inside it are expected."""
    with _lock:
        _state["warming"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["warming"] -= 1


@contextlib.contextmanager
def strict():
    """Arm in "raise" mode for the block (then back to the previous mode); `events` starts empty."""
    previous = _state["mode"]
    events.clear()
    arm("raise")
    try:
        yield events
    finally:
        _state["mode"] = previous


def note(what: str, key: str | None = None) -> None:
    """Report a compile or capture (`what` says which); a no-op unless armed and outside `warming()`."""
    m = _state["mode"]
    if m == "off" or _state["warming"]:
        return
    events.append(what)
    if m == "raise":
        raise LateCompileError(f"{what} after warm-up: a live request waited for it (the warm-up misses this "
                               "specialisation)")
    key = key or what
    if key not in _state["warned"]:
        _state["warned"].add(key)
        log.warning("%s after warm-up: a live request waited for it (set %s=raise to fail on it instead)", what, ENV)


def _on_triton_compile(src) -> None:
    """Called with the source (`ASTSource`) of every Triton compile once installed (a load from Triton's disk cache
    included); notes the specmla kernels."""
    fn = getattr(src, "fn", None)
    module = getattr(fn, "module", None) or getattr(getattr(fn, "fn", None), "__module__", "") or ""
    if module.split(".")[0] == "specmla":
        name = getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", "?")
        note(f"Triton compile of {module}.{name}", key=f"{module}.{name}")


def _install_triton_hook() -> None:
    """Wrap Triton's `compile`: the package function that a kernel binds when it is first launched, and the copy
    every specmla kernel already launched holds. (Triton's own jit cache hooks serialise every constexpr first,
    which fails on Gluon's layout constexprs.)"""
    with _lock:
        if _state["installed"]:
            return
        _state["installed"] = True
    try:
        import triton.compiler
        from triton.runtime.jit import JITFunction
    except ImportError:  # no Triton: nothing compiles
        return
    original = triton.compiler.compile

    def compile(src, *args, **kwargs):
        _on_triton_compile(src)
        return original(src, *args, **kwargs)

    triton.compiler.compile = compile
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] != "specmla" or module is None:
            continue
        for fn in list(vars(module).values()):
            if isinstance(fn, JITFunction) and "compile" in vars(fn):
                fn.compile = compile
