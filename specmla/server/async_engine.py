"""One engine loop for many clients: `LLMEngine.step()` runs in a background thread; HTTP handlers
submit requests and receive their progress through asyncio queues.

Everything that touches the engine (adding, stepping, aborting) happens on the engine thread, so
the engine itself needs no locks. A client that goes away is aborted at once and its pages freed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from specmla.engine.engine import LLMEngine
from specmla.engine.sequence import Sequence
from specmla.sampling_params import SamplingParams

log = logging.getLogger("specmla.server")


@dataclass
class Update:
    """What a client receives: new text / token ids since the last update, and the end."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    status: int | None = None  # the HTTP status of an error, where it is not the default (400 / 500)
    logprobs: list | None = None  # the engine's entries for `token_ids` when the request asked for logprobs
    seq: Sequence | None = None


@dataclass
class _Request:
    rid: int
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    seq: Sequence | None = None
    sent_text: int = 0
    sent_tokens: int = 0
    done: bool = False


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_finish=None, on_step=None):
        self.engine = engine
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._active: dict[int, _Request] = {}
        self._ids = itertools.count()
        self._stop = False
        self._failing: tuple[str, int] | None = None  # set by fail_all: (message, status) for every request
        self._on_finish = on_finish  # callback(seq, finish_reason) on the engine thread (metrics)
        self._on_step = on_step
        self._thread = threading.Thread(target=self._run, name="specmla-engine", daemon=True)
        self._thread.start()

    # ---- client side (event loop) ------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams):
        """Async iterator of `Update`s for one request; cancelling it aborts the request. Updates that queued up
        while the client's event loop was busy come merged into one (an error always on its own), so a loop that
        falls behind the engine writes fewer, larger chunks instead of falling further behind."""
        req = _Request(next(self._ids), prompt_ids, params, asyncio.get_running_loop(), asyncio.Queue())
        self._submit(("add", req))
        try:
            while True:
                update = await req.out.get()
                while not update.finished and not req.out.empty():
                    nxt = req.out.get_nowait()
                    if nxt.error:
                        yield update
                        update = nxt
                        break
                    update = _merged(update, nxt)
                yield update
                if update.finished:
                    return
        finally:
            if not req.done:
                self._submit(("abort", req))

    def fail_all(self, message: str, status: int = 503) -> None:
        """End every request in flight (and any that arrives later) with an error: the server's
        shutdown deadline has passed."""
        self._submit(("fail_all", (message, status)))

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _submit(self, cmd) -> None:
        self._cmds.put(cmd)
        self._wake.set()

    # ---- engine thread -----------------------------------------------------------------------------
    def _push(self, req: _Request, update: Update, batch: dict | None = None) -> None:
        """Hand `update` to its client; with `batch` ({event loop: [(queue, update)]}), collect it for `_deliver`."""
        if update.finished:
            req.done = True
            self._active.pop(req.rid, None)
        if batch is None:
            req.loop.call_soon_threadsafe(req.out.put_nowait, update)
        else:
            batch.setdefault(req.loop, []).append((req.out, update))

    @staticmethod
    def _deliver(batch: dict) -> None:
        """One wake-up of each client event loop per step (not one per request: each is a write to the loop's
        self-pipe, under the interpreter lock the engine thread steps with)."""
        for loop, items in batch.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, req = self._cmds.get_nowait()
            except queue.Empty:
                return
            if kind == "fail_all":
                self._failing = req
                for r in list(self._active.values()):
                    self._fail(r, *req)
            elif kind == "add" and self._failing:
                self._fail(req, *self._failing)
            elif kind == "add":
                try:
                    req.seq = self.engine.add_request(req.prompt, req.params)
                    self._active[req.rid] = req
                except ValueError as e:
                    self._push(req, Update(finished=True, finish_reason="error", error=str(e)))
            elif kind == "abort" and req.rid in self._active:
                self._active.pop(req.rid)
                req.done = True
                self.engine.abort(req.seq)
                if self._on_finish:
                    self._on_finish(req.seq, "abort")

    def _fail(self, req: _Request, message: str, status: int) -> None:
        if req.seq is not None:
            self.engine.abort(req.seq)
            if self._on_finish:
                self._on_finish(req.seq, "abort")
        self._push(req, Update(finished=True, finish_reason="abort", error=message, status=status))

    def _publish(self) -> None:
        batch: dict = {}
        for req in list(self._active.values()):
            s = req.seq
            holdback = 0 if s.is_finished else max((len(x) for x in s.params.stop), default=1) - 1
            safe = max(req.sent_text, len(s.text) - holdback)
            n_tok = len(s.output_ids)
            if safe == req.sent_text and n_tok == req.sent_tokens and not s.is_finished:
                continue
            update = Update(
                text=s.text[req.sent_text : safe], token_ids=s.output_ids[req.sent_tokens :],
                finished=s.is_finished, finish_reason=s.finish_reason, prompt_tokens=len(s.prompt_ids),
                completion_tokens=n_tok, seq=s,
                logprobs=s.logprobs[req.sent_tokens : n_tok] if s.params.logprobs is not None else None,
            )
            if s.is_finished and s.finish_reason == "error":
                update.error, update.text = s.text, ""
                if s.error_reason == "step_error":  # the engine failed it in a step: a server error
                    update.error, update.status = "internal error while generating", 500
            req.sent_text, req.sent_tokens = safe, n_tok
            if s.is_finished and self._on_finish:
                self._on_finish(s, s.finish_reason)
            self._push(req, update, batch)
        self._deliver(batch)

    def _run(self) -> None:
        while not self._stop:
            self._drain_commands()
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                self.engine.step()
            except Exception:  # a broken step fails the requests in flight, not the server; its text goes to the log
                log.exception("engine step failed")
                for req in list(self._active.values()):
                    self.engine.abort(req.seq)
                    if self._on_finish:
                        self._on_finish(req.seq, "error")
                    self._push(req, Update(finished=True, finish_reason="abort",
                                           error="internal error while generating"))
                continue
            if self._on_step:
                self._on_step()
            self._publish()
        for req in list(self._active.values()):
            self._push(req, Update(finished=True, finish_reason="abort", error="server shutting down"))


def _merged(a: Update, b: Update) -> Update:
    """Update a followed by b, as one."""
    logprobs = None if a.logprobs is None and b.logprobs is None else (a.logprobs or []) + (b.logprobs or [])
    return Update(text=a.text + b.text, token_ids=a.token_ids + b.token_ids, finished=b.finished,
                  finish_reason=b.finish_reason, prompt_tokens=b.prompt_tokens, completion_tokens=b.completion_tokens,
                  status=b.status, logprobs=logprobs, seq=b.seq)


def _put_all(items: list) -> None:
    for out, update in items:
        out.put_nowait(update)


def now() -> int:
    return int(time.time())
