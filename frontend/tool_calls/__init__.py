"""Tool calling for the HTTP APIs, torch-free:

    tools.py      a request's tools and tool choice, checked (both APIs map onto these)
    prompt.py     the tools in the prompt: through the chat template, or as Hermes text
    grammar.py    the grammar that forces calls (tool_choice required, or a named tool)
    hermes.py     the parser that finds <tool_call> blocks in the output, while it streams
    json_scan.py  the incremental JSON check the parser streams arguments with
"""
