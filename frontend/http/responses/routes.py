"""The Responses API's routes:

    POST   /v1/responses              create: whole, streamed, or in the background
    GET    /v1/responses/{id}         a stored response (a background one: how far it is)
    DELETE /v1/responses/{id}         forget it (a background one still running is cancelled)
    POST   /v1/responses/{id}/cancel  stop a background response: status "cancelled"

A request becomes a prompt as a chat completion does: the conversation (previous_response_id's
items, then this input) as chat messages behind `instructions`, with the tools, through the
chat template; it is admitted before the response starts, so a bad one gets a real 400.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from common.errors import InvalidRequest
from frontend.http.context import HttpContext, parse_body
from frontend.http.responses.items import chat_messages, load_item_images, parse_input
from frontend.http.responses.request import ResponsesRequest
from frontend.http.responses.run import Run
from frontend.http.responses.sampling import responses_params, responses_template_kwargs, responses_tool_use
from frontend.http.responses.store import ResponseStore


def add_responses_routes(app: FastAPI, ctx: HttpContext) -> None:
    store = ResponseStore(ctx.options.response_store_size, ctx.options.response_ttl_s)  # one per frontend process

    @app.post("/v1/responses")
    async def create(request: Request):
        return await create_response(ctx, store, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str):
        return store.get(response_id).body

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str):
        store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str):
        stored = store.get(response_id)
        if not stored.body["background"]:
            raise InvalidRequest(f"response_id: only background responses can be cancelled; {response_id!r} "
                                 "was not created with background=true")
        if stored.running:  # a finished one stays as it ended
            stored.task.cancel()  # its run aborts the engine request
            stored.body = {**stored.body, "status": "cancelled"}
        return stored.body


async def create_response(ctx: HttpContext, store: ResponseStore, request: Request):
    req = await parse_body(request, ResponsesRequest)
    req.check()
    if req.background and store.size == 0:
        raise InvalidRequest("background: this server keeps no responses (--response-store-size 0)")
    lora_name = ctx.resolve_model(req.model)
    processor = ctx.llm.require_ready()
    earlier = store.conversation(req.previous_response_id)
    conversation = earlier + await load_item_images(parse_input(req.input, earlier), ctx.media.load,
                                                    lambda count: processor.check_images(count, "input"))
    tools = responses_tool_use(req)
    messages, template_tools = processor.chat_with_tools(chat_messages(conversation, req.instructions), tools)
    prompt, images = await processor.chat_prompt_async(messages, add_generation_prompt=True, tools=template_tools,
                                                       chat_template_kwargs=responses_template_kwargs(req))
    params = responses_params(req, tools, processor, ctx.parser_names(tools)[0], prompt)
    run = Run(ctx, store, req, tools, conversation, ctx.llm.admit(prompt, params, lora_name=lora_name, images=images))
    if req.background:
        return JSONResponse(run.background())
    if req.stream:
        return StreamingResponse(ctx.counted(run.stream()), media_type="text/event-stream")
    return JSONResponse(await run.whole(request))
