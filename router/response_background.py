"""The Responses API's background mode (router/openai_responses.py): a request with `background: true` is answered
at once with its response as it starts (status in_progress, stored), and generated on in this router; its stored
response is replaced by the whole one when it ends (completed, incomplete, failed) or is cancelled, and GET
/v1/responses/{id} reads it meanwhile. Its client going away changes nothing: it runs until it ends or
`POST /v1/responses/{id}/cancel` stops it, on the router that runs it."""

from __future__ import annotations

import asyncio
import logging

from router.api import GenerationError
from router.openai_errors import ApiError
from router.response_items import ResponseWriter, output_of
from router.response_store import Responses

log = logging.getLogger(__name__)

CANCELLED = "cancelled by POST /v1/responses/{id}/cancel"


class Background:
    """The background responses this router runs, by id."""

    def __init__(self, responses: Responses):
        self.responses = responses
        self.running: dict[str, tuple[asyncio.Task, object]] = {}  # id -> (its task, its generation)

    async def start(self, writer: ResponseWriter, reply, generation) -> dict:
        """Store the response as it starts, run the rest in a task of its own, and answer the start."""
        started = writer.json("in_progress", [])
        await self.responses.keep(started, writer.context)
        task = asyncio.create_task(self._run(writer, reply, generation), name=f"background {writer.id}")
        self.running[writer.id] = (task, generation)
        task.add_done_callback(lambda _: self.running.pop(writer.id, None))
        return started

    async def _run(self, writer: ResponseWriter, reply, generation) -> None:
        """Until the generation ends, then its response stored: as it finished, else stopped (cancelled, failed) with
        its output so far, the last item incomplete."""
        stopped, extra = None, {}
        try:
            await generation.complete()
        except asyncio.CancelledError:
            stopped = "cancelled"
        except GenerationError as err:
            failure = ApiError.of(err)
            stopped, extra = "failed", {"error": {"code": failure.code or "server_error", "message": failure.message}}
        except Exception:  # a bug must not leave the response in progress forever
            log.exception("background response %s failed", writer.id)
            stopped, extra = "failed", {"error": {"code": "server_error", "message": "internal error in the router; see its log"}}
        items = output_of(reply, generation, "incomplete" if stopped else None)
        await writer.finished(generation, items, stopped, **extra)

    async def cancel(self, response_id: str) -> dict:
        """POST /v1/responses/{id}/cancel: a running background response stopped (status cancelled, its output so far
        kept); one that has ended, as it ended."""
        entry = self.running.get(response_id)
        if entry is None:
            stored = (await self.responses.get(response_id)).response
            if not stored.get("background"):
                raise ApiError(400, f"response_id: {response_id!r} was not created with background: true; only those can be cancelled")
            if stored["status"] == "in_progress":
                why = "it runs on another router replica, which alone can stop it: send the cancel there"
                raise ApiError(409, f"response_id: {response_id!r} cannot be cancelled here: {why}", code="conflict")
            return stored
        task, generation = entry
        generation.cancel(CANCELLED.format(id=response_id))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return (await self.responses.get(response_id)).response
