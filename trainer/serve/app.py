"""The OpenAI-compatible HTTP API over a :class:`~trainer.serve.worker.Worker`.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (the target's chat template), streamed as
server-sent events with ``"stream": true``; ``GET /v1/models``, ``/health`` and ``/metrics``. Bad input gets
a 4xx in OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``; a client that disconnects
cancels its request, which leaves the batch before the next step. ``top_k`` is accepted as an extension.
Every request ends: a failure of the engine while prefilling or stepping it is a 500 in the same shape (streamed:
an error event, then ``[DONE]``), a stopped engine thread a 503. Generation stops at the chat template's
end-of-turn token and the target's end-of-text tokens (:func:`trainer.data.render.stop_token_ids`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import PreTrainedTokenizerBase

from trainer.data.render import end_of_text_ids, stop_token_ids
from trainer.decoding.batch import BatchRequest
from trainer.decoding.verify import Sampling
from trainer.errors import UserError
from trainer.serve.worker import Identity, Worker, new_request_id, seeded_generator

LOG = logging.getLogger("trainer.serve")


@dataclass(frozen=True)
class Limits:
    # Longest prompt plus max_tokens, in tokens (the target's context).
    context: int
    # Largest max_tokens a request may ask for.
    max_tokens: int


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(message: str, param: str | None, code: str | None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Sampled(BaseModel):
    """Fields both endpoints share; unknown OpenAI fields are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    seed: int | None = None
    stop: str | list[str] | None = None
    user: str | None = None


class CompletionBody(Sampled):
    prompt: str | list[int]


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: str


class ChatBody(Sampled):
    messages: list[Message] = Field(min_length=1)


class Detokenizer:
    """Incremental text of a growing token list; holds back an unfinished UTF-8 character."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = 0

    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def push(self, ids: list[int]) -> str:
        self.ids += ids
        text = self.text()
        if text.endswith("\ufffd"):
            return ""
        delta, self.sent = text[self.sent :], len(text)
        return delta


# Seconds between checks that the engine thread is still alive while a request waits for its tokens.
LIVENESS_SECONDS = 1.0


def stop_ids_of(tokenizer: PreTrainedTokenizerBase, eos_token_id: int | list[int] | None) -> frozenset[int]:
    """What every request stops at: the chat template's end-of-turn token and the end-of-text tokens of the
    tokenizer and of the target's generation config (``eos_token_id``); without a chat template, or with one whose
    end of turn is not a single token, the latter (a server says so in its log and serves on)."""
    if tokenizer.chat_template:
        try:
            return frozenset(stop_token_ids(tokenizer, eos_token_id))
        except UserError as e:
            LOG.warning("chat requests stop at end-of-text tokens only: %s", e)
    return frozenset(end_of_text_ids(tokenizer, eos_token_id))


def build_app(worker: Worker, tokenizer: PreTrainedTokenizerBase, model_name: str, limits: Limits) -> FastAPI:
    app = FastAPI(title="trainer serve")
    created = int(time.time())
    generation_config = getattr(worker.engine.target, "generation_config", None)
    stop_ids = stop_ids_of(tokenizer, getattr(generation_config, "eos_token_id", None))

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        kind = "server_error" if e.status >= 500 else "invalid_request_error"
        return JSONResponse(error_body(e.message, e.param, e.code, kind), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})"
            return JSONResponse(error_body(message, None, "invalid_json"), status_code=400)
        if not where:
            message = "the request body must be a JSON object (Content-Type: application/json)"
            return JSONResponse(error_body(message, None, "invalid_json"), status_code=400)
        message = f"{where}: {first.get('msg')}"
        return JSONResponse(error_body(message, where, "invalid_value"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(e.detail), None, None), status_code=e.status_code)

    @app.get("/health")
    async def health() -> dict:
        alive = worker.thread.is_alive()
        return {"status": "ok" if alive else "engine stopped", "batch": len(worker.engine.rows)}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(worker.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "trainer"}],
        }

    def prepare(body: Sampled, prompt_ids: list[int]) -> tuple[BatchRequest, list[str]]:
        if body.model != model_name:
            raise ApiError(404, f"model {body.model!r} does not exist; this server serves {model_name!r}", "model",
                           "model_not_found")  # fmt: skip
        if not prompt_ids:
            raise ApiError(400, "the prompt is empty", "prompt", "invalid_value")
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = min(16, limits.max_tokens) if asked is None else asked
        if max_tokens <= 0 or max_tokens > limits.max_tokens:
            raise ApiError(400, f"max_tokens must be in [1, {limits.max_tokens}], got {max_tokens}", "max_tokens",
                           "invalid_value")  # fmt: skip
        if len(prompt_ids) + max_tokens > limits.context:
            raise ApiError(
                400,
                f"the prompt has {len(prompt_ids)} tokens and max_tokens is {max_tokens}: more than this model's "
                f"context of {limits.context} tokens",
                "prompt",
                "context_length_exceeded",
            )
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if body.stop is not None and not (0 < len(stops) <= 4 and all(stops)):
            raise ApiError(400, "stop is a non-empty string or a list of 1 to 4 of them", "stop", "invalid_value")
        vocab = worker.engine.target.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ApiError(400, f"prompt token ids must lie in [0, {vocab})", "prompt", "invalid_value")
        request = BatchRequest(
            torch.tensor(prompt_ids),
            max_tokens,
            Sampling(body.temperature, body.top_p, body.top_k),
            seeded_generator(body.seed),
            stop_ids,
        )
        return request, stops

    async def run(request: BatchRequest, identity: Identity) -> AsyncIterator[tuple[list[int], bool]]:
        """Submit; yield each step's tokens; the request is cancelled when the consumer stops early. The engine
        ends every request it takes (with an error when it fails); should its thread die, the wait ends too."""
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        request.on_tokens = lambda tokens, done: loop.call_soon_threadsafe(queue.put_nowait, (tokens, done))
        worker.submit(request, identity)
        # One pending get at a time, kept across liveness checks: cancelling a get could drop a queued item.
        getter: asyncio.Future | None = None
        try:
            while True:
                getter = getter or asyncio.ensure_future(queue.get())
                ready, _ = await asyncio.wait({getter}, timeout=LIVENESS_SECONDS)
                if not ready:
                    if not worker.thread.is_alive():
                        raise ApiError(503, "the engine thread has stopped", None, "engine_stopped")
                    continue
                tokens, done = getter.result()
                getter = None
                yield tokens, done
                if done:
                    return
        finally:
            if getter is not None:
                getter.cancel()
            request.cancelled = True

    async def complete(body: Sampled, prompt_ids: list[int], chat: bool):
        request, stops = prepare(body, prompt_ids)
        rid = new_request_id("chatcmpl" if chat else "cmpl")
        identity = Identity(rid, body.user)
        kind = "chat.completion" if chat else "text_completion"

        def choice(text: str, finish: str | None, delta: bool) -> dict:
            if not chat:
                return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            key = "delta" if delta else "message"
            return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": finish}

        async def pieces() -> AsyncIterator[tuple[str, str | None]]:
            """Text deltas, then a final ("", finish_reason); stop strings end the request early."""
            detok = Detokenizer(tokenizer)
            held = ""
            async for tokens, done in run(request, identity):
                held += detok.push(tokens)
                cut = min((i for i in (held.find(s) for s in stops) if i >= 0), default=-1)
                if cut >= 0:
                    request.cancelled = True
                    yield held[:cut], None
                    yield "", "stop"
                    return
                # Keep back what could still begin a stop string.
                keep = max((len(s) - 1 for s in stops), default=0)
                if done:
                    yield held, None
                    reason = "length" if request.finish_reason == "length" else "stop"
                    if request.finish_reason == "error":
                        raise ApiError(500, request.error or "the engine failed", None, "engine_error")
                    yield "", reason
                    return
                ready = len(held) - keep
                if ready > 0:
                    yield held[:ready], None
                    held = held[ready:]

        usage_prompt = len(prompt_ids)
        if not body.stream:
            text, finish = "", None
            async for piece, reason in pieces():
                text += piece
                finish = reason or finish
            usage = {"prompt_tokens": usage_prompt, "completion_tokens": len(request.tokens),
                     "total_tokens": usage_prompt + len(request.tokens)}  # fmt: skip
            return {"id": rid, "object": kind, "created": int(time.time()), "model": model_name,
                    "choices": [choice(text, finish, False)], "usage": usage}  # fmt: skip

        chunk_kind = "chat.completion.chunk" if chat else "text_completion"

        async def events() -> AsyncIterator[str]:
            try:
                async for piece, reason in pieces():
                    if piece or reason:
                        chunk = {"id": rid, "object": chunk_kind, "created": int(time.time()), "model": model_name,
                                 "choices": [choice(piece, reason, True)]}  # fmt: skip
                        yield f"data: {json.dumps(chunk)}\n\n"
            except ApiError as e:
                yield f"data: {json.dumps(error_body(e.message, e.param, e.code, 'server_error'))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        ids = (
            body.prompt
            if isinstance(body.prompt, list)
            else tokenizer(body.prompt, add_special_tokens=False)["input_ids"]
        )
        return await complete(body, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody):
        messages = [m.model_dump() for m in body.messages]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        return await complete(body, list(ids), chat=True)

    return app
