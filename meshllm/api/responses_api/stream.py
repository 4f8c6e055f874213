"""A response streamed as the Responses API's typed server-sent events (`event: TYPE` and
`data: {..., "sequence_number": n}`): response.created and response.in_progress, then per
output item its added, delta and done events, then response.completed (response.incomplete
when max_output_tokens cut it short). No `[DONE]` line: the Responses stream has none.

As with chat streams, the stream opens only once the first event has arrived, so an error
before any output keeps its HTTP status; after that a failure ends the stream with
response.failed, whose response carries the error. A client that leaves cancels the sequence.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from meshllm.api.generation import ClientDisconnected, Generation
from meshllm.api.metrics import MetricsObserver
from meshllm.api.responses_api.reply import ResponseRun
from meshllm.api.responses_api.store import ResponseStore
from meshllm.api.streaming import Item, started
from meshllm.errors import MeshError

log = logging.getLogger(__name__)


async def open_response_stream(generation: Generation, run: ResponseRun, store: ResponseStore,
                               metrics: MetricsObserver) -> StreamingResponse:
    body = _stream(generation, await started(generation), run, store, metrics)
    return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class _Sequence:
    def __init__(self):
        self.number = 0

    def sse(self, event: dict) -> str:
        event = {**event, "sequence_number": self.number}
        self.number += 1
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


async def _stream(generation: Generation, events: AsyncIterator[Item], run: ResponseRun, store: ResponseStore,
                  metrics: MetricsObserver) -> AsyncIterator[str]:
    seq = _Sequence()
    try:
        opening = run.response()
        yield seq.sse({"type": "response.created", "response": opening})
        yield seq.sse({"type": "response.in_progress", "response": opening})
        async for _, event in events:
            for e in run.feed(event):
                yield seq.sse(e)
        response = run.response()
        run.keep(store, response)
        yield seq.sse({"type": f"response.{response['status']}", "response": response})
    except MeshError as e:
        metrics.api_errors.labels(code=e.code).inc()
        log.warning("response stream %s ended with an error: [%s] %s", run.id, e.code, e)
        yield seq.sse({"type": "response.failed", "response": run.response(error=e)})
    except ClientDisconnected:
        log.debug("response stream %s: client disconnected", run.id)
    finally:
        generation.cancel()
