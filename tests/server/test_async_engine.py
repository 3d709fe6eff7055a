"""AsyncEngine, the bridge between the engine thread and the clients' event loop: updates that queue up while the
loop is busy reach the client merged, never past an error; the merged stream is exactly the engine's output."""

import asyncio
import time

from specmla import LLM, SamplingParams
from specmla.server.async_engine import AsyncEngine, Update


class _IdleEngine:
    """An engine with nothing to step: the test feeds the request's queue itself."""

    def add_request(self, prompt, params):
        return object()

    def has_unfinished(self):
        return False

    def abort(self, seq):
        return True


def test_queued_updates_merge_but_an_error_stays_its_own():
    ae = AsyncEngine(_IdleEngine())

    async def main():
        stream = ae.generate([1, 2, 3], SamplingParams(max_tokens=8))
        first = asyncio.ensure_future(stream.__anext__())
        deadline = time.time() + 10
        while not ae._active and time.time() < deadline:
            await asyncio.sleep(0.01)
        (req,) = ae._active.values()
        for i, t in enumerate("abc"):
            req.out.put_nowait(Update(text=t, token_ids=[i], prompt_tokens=3, completion_tokens=i + 1,
                                      logprobs=[{"t": i}]))
        req.out.put_nowait(Update(finished=True, finish_reason="abort", error="boom"))
        got = [await first]
        async for u in stream:
            got.append(u)
        ae.shutdown()  # while the loop is open: its "shutting down" update for the fed request lands there
        return got

    got = asyncio.run(main())
    assert [(u.text, u.token_ids, u.completion_tokens, u.finished) for u in got] == [
        ("abc", [0, 1, 2], 3, False), ("", [], 0, True)]
    assert got[0].logprobs == [{"t": 0}, {"t": 1}, {"t": 2}] and got[1].error == "boom"


def test_a_busy_event_loop_gets_fewer_larger_updates_with_the_same_text(tiny_model_dir):
    """The loop sleeps (blocked, as under many streams) while the engine thread decodes: the client then gets
    several tokens an update, and the concatenation equals LLM.generate's text and tokens."""
    llm = LLM(tiny_model_dir, device="cpu")
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = llm.generate([[5, 6, 7, 8]], params)[0]
    ae = AsyncEngine(llm.engine)

    async def main():
        updates = []
        async for u in ae.generate([5, 6, 7, 8], params):
            updates.append(u)
            time.sleep(0.05)  # the loop blocked: the engine thread runs ahead
        return updates

    updates = asyncio.run(main())
    ae.shutdown()
    assert "".join(u.text for u in updates) == want.text
    assert [t for u in updates for t in u.token_ids] == want.token_ids
    assert updates[-1].finished and updates[-1].completion_tokens == 24
    assert max(len(u.token_ids) for u in updates) > 1 and len(updates) < 24
