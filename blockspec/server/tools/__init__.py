"""Tool calling for the chat endpoint: the request's `tools` and `tool_choice` (request.py), the
way each chat-template family renders tools and writes calls (formats.py; GLM's in glm.py,
Qwen3-Coder's in qwen_xml.py, both through arguments.py; gpt-oss's harmony in harmony.py), and the parsers that turn the generated text back into OpenAI
`tool_calls` (calls.py), whole or streamed (parsers.py).

A forced call (`tool_choice` "required" or a named function) is generated under a grammar built
from the tools' JSON-schema parameters (engine/grammar.py), so its arguments always parse and
match the schema. docs/SERVING.md documents the formats, the generic one included.
"""

from blockspec.server.tools.calls import ToolCall
from blockspec.server.tools.formats import FAMILIES, detect_family, forced_format, keeps_special_tokens, render_prompt
from blockspec.server.tools.parsers import ToolStream, parse_calls
from blockspec.server.tools.request import Tool, ToolRequest, parse_tools

__all__ = ["FAMILIES", "Tool", "ToolCall", "ToolRequest", "ToolStream", "detect_family", "forced_format",
           "keeps_special_tokens", "parse_calls", "parse_tools", "render_prompt"]
