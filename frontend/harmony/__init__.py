"""The harmony format of gpt-oss through openai-harmony, the format's own implementation:
prompts rendered with it (prompt.py), outputs parsed per channel as they stream (parser.py)."""

NAME = "harmony"  # the reasoning and tool-call parsers' name for it (--reasoning-parser, --tool-call-parser)
