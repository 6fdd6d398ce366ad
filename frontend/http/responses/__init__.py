"""OpenAI's Responses API (/v1/responses), stateless or stored, over the machinery chat
completions use (prompt, tools, constraints, sample parsers, runner):

    routes.py    the routes: create, retrieve, delete, cancel
    request.py   the body, and what it may not ask for
    items.py     input and output items <-> chat messages
    sampling.py  tools, tool_choice, text.format and sampling -> ToolUse and SamplingParams
    output.py    a sample's events -> output items and stream events; the Response object
    run.py       one response run whole, streamed or in the background
    store.py     stored responses: bounded, in this frontend process's memory
"""
