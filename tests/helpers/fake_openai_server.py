"""A fake OpenAI-compatible streaming server with injected delays, for measuring a benchmark client:
`python fake_openai_server.py PORT TTFT_S ITL_S`. Each completion streams max_tokens one-token chunks, the first
TTFT_S after the request, then one every ITL_S, and the usage last."""

import asyncio
import json
import sys

import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse


def app(ttft: float, itl: float) -> FastAPI:
    api = FastAPI()

    @api.get("/health")
    def health():
        return {"status": "ok"}

    @api.get("/v1/models")
    def models():
        return {"data": [{"id": "fake"}]}

    @api.post("/v1/completions")
    async def completions(body: dict):
        n = body["max_tokens"]
        prompt = body["prompt"]
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())

        async def events():
            await asyncio.sleep(ttft)
            for i in range(n):
                if i:
                    await asyncio.sleep(itl)
                yield f"data: {json.dumps({'choices': [{'text': f' t{i}'}]})}\n\n"
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return api


if __name__ == "__main__":
    port, ttft, itl = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    uvicorn.run(app(ttft, itl), host="127.0.0.1", port=port, log_level="error")
