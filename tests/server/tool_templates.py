"""Chat templates of the tool-call families the repository has no real tokenizer for (GLM-4.5/4.6,
GLM-4.7, gpt-oss, Qwen3-Coder / Qwen3.5 / Qwen3.6), reduced to what matters to tool calling: each writes the tool list, a call fed
back and a tool result the way the family's published template does (byte for byte in the call
and result), so the parsers are tested on what the real templates and models write. Also a tiny
tokenizer that carries one of them, with the family's markers as tokens."""

from __future__ import annotations

from conftest import build_tiny_tokenizer

GLM45 = (
    "[gMASK]<sop>"
    "{%- if tools -%}<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n"
    "<tools>\n{% for tool in tools %}{{ tool | tojson(ensure_ascii=False) }}\n{% endfor %}</tools>\n\n"
    "For each function call, output the function name and arguments within the following XML format:\n"
    "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n...\n</tool_call>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<|user|>\n{{ m.content }}"
    "{%- elif m.role == 'system' -%}<|system|>\n{{ m.content }}"
    "{%- elif m.role == 'assistant' -%}<|assistant|>\n<think></think>"
    "{%- if m.content %}{{ '\\n' + m.content }}{% endif -%}"
    "{%- for tc in m.tool_calls or [] -%}{%- set tc = tc.function if tc.function else tc -%}"
    "{{ '\\n<tool_call>' + tc.name + '\\n' }}"
    "{%- for k, v in tc.arguments.items() -%}{{ '<arg_key>' + k + '</arg_key>\\n<arg_value>' }}"
    "{{- v | tojson(ensure_ascii=False) if v is not string else v }}{{ '</arg_value>\\n' }}{%- endfor -%}</tool_call>"
    "{%- endfor -%}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|observation|>{% endif -%}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)

GLM47 = (
    "[gMASK]<sop>"
    "{%- if tools -%}<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n"
    "<tools>\n{% for tool in tools %}{{ tool | tojson(ensure_ascii=False) }}\n{% endfor %}</tools>\n\n"
    "For each function call, output the function name and arguments within the following XML format:\n"
    "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>...</tool_call>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<|user|>{{ m.content }}"
    "{%- elif m.role == 'system' -%}<|system|>{{ m.content }}"
    "{%- elif m.role == 'assistant' -%}<|assistant|><think></think>"
    "{%- if m.content %}{{ m.content }}{% endif -%}"
    "{%- for tc in m.tool_calls or [] -%}{%- set tc = tc.function if tc.function else tc -%}"
    "{{ '<tool_call>' + tc.name }}"
    "{%- for k, v in tc.arguments.items() %}<arg_key>{{ k }}</arg_key>"
    "<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>{% endfor %}</tool_call>"
    "{%- endfor -%}"
    "{%- elif m.role == 'tool' -%}<|observation|><tool_response>{{ m.content }}</tool_response>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|><think>{%- endif -%}"
)

HARMONY = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nReasoning: medium\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "{%- if tools %}{{ \"\\nCalls to these tools must go to the commentary channel: 'functions'.\" }}{% endif %}<|end|>"
    "{%- if tools %}<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace functions {\n\n"
    "{% for t in tools %}// {{ t.function.description }}\n"
    "type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;\n\n"
    "{% endfor %}} // namespace functions<|end|>{% endif %}"
    "{%- set last = namespace(name=none) -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and m.tool_calls -%}"
    "{%- set tc = m.tool_calls[0].function -%}"
    "{%- if m.content %}<|start|>assistant<|channel|>analysis<|message|>{{ m.content }}<|end|>{% endif -%}"
    "<|start|>assistant to=functions.{{ tc.name }}<|channel|>commentary json<|message|>"
    "{{ tc.arguments | tojson }}<|call|>"
    "{%- set last.name = tc.name -%}"
    "{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' -%}"
    "{%- if last.name is none %}{{ raise_exception('a tool message needs an assistant tool call before it') }}"
    "{% endif -%}"
    "<|start|>functions.{{ last.name }} to=assistant<|channel|>commentary<|message|>{{ m.content | tojson }}<|end|>"
    "{%- elif m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif -%}"
)

QWEN3_XML = (
    "{%- if tools %}<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>"
    "{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n\n"
    "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "</function>\n</tool_call><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + (m.content or '') }}"
    "{%- for tc in m.tool_calls or [] %}{%- set tc = tc.function if tc.function else tc %}"
    "{%- if loop.first %}{{- '\\n\\n' if m.content else '' }}{% else %}{{- '\\n' }}{% endif %}"
    "{{- '<tool_call>\\n<function=' + tc.name + '>\\n' }}"
    "{%- for k, v in tc.arguments | items %}{{- '<parameter=' + k + '>\\n' }}"
    "{{- v | tojson if v is mapping or (v is sequence and v is not string) else v | string }}"
    "{{- '\\n</parameter>\\n' }}{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{% endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{% endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TEMPLATES = {"glm45": GLM45, "glm47": GLM47, "harmony": HARMONY, "qwen3_xml": QWEN3_XML}
GLM_TAGS = ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
            "<tool_response>", "</tool_response>"]
GLM_SPECIAL = ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
HARMONY_SPECIAL = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"]
# The family's end-of-turn tokens (generation_config's eos_token_id).
EOS = {"glm45": ["<|user|>", "<|observation|>"], "glm47": ["<|user|>", "<|observation|>"],
       "harmony": ["<|return|>", "<|call|>"], "qwen3_xml": ["<|im_end|>"]}


def family_tokenizer(family: str):
    """The tiny byte-level tokenizer (tests/conftest.py) with the family's chat template and its
    markers as tokens: GLM's and Qwen's tags as plain added tokens and GLM's turn markers as
    special ones (as their tokenizers have them), harmony's markers as special tokens (as
    gpt-oss's has them)."""
    tok = build_tiny_tokenizer()
    if family == "harmony":
        tok.add_special_tokens({"additional_special_tokens": HARMONY_SPECIAL})
    elif family == "qwen3_xml":
        tok.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    else:
        tok.add_special_tokens({"additional_special_tokens": GLM_SPECIAL})
        tok.add_tokens(GLM_TAGS)
    tok.chat_template = TEMPLATES[family]
    return tok
