"""Tool calling for the HTTP APIs, torch-free:

    tools.py        a request's tools and tool choice, checked (both APIs map onto these)
    prompt.py       the tools in the prompt: through the chat template, or as Hermes text
    grammar.py      the grammar that forces calls (tool_choice required, or a named tool)
    parsers.py      the tool-call parsers by family (--tool-call-parser), and `auto`'s choice
    stream.py       what they share: text around the calls, calls announced and streamed
    hermes.py       <tool_call>{"name": ..., "arguments": ...}</tool_call>
    llama3_json.py  {"name": ..., "parameters": ...}, maybe after <|python_tag|>
    mistral.py      [TOOL_CALLS][{...}] and [TOOL_CALLS]name[ARGS]{...}
    qwen3_coder.py  <tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>
    pythonic.py     [get_weather(city="Paris"), get_time()]
    json_call.py    a call as a JSON object, read as it streams (hermes, llama3_json, mistral)
    json_scan.py    the incremental JSON check the JSON formats stream arguments with
"""
