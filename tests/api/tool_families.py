"""Tiny random models whose tokenizers carry each tool-calling template family.

The templates are written here in the shape of the families' published templates (Qwen2.5's
Hermes-style `<tool_call>` blocks, Llama 3.1's JSON calls with the ipython role, Mistral
v0.3's `[AVAILABLE_TOOLS]` / `[TOOL_CALLS]` / `[TOOL_RESULTS]` with 9-character call ids,
GPT-OSS's harmony messages on channels, GLM-4.5's `<arg_key>`/`<arg_value>` tags, Qwen3-Coder's
`<function=...>`/`<parameter=...>` ones), except MiniMax-M2's, which is its published template
itself (templates/minimax_m2.jinja: as llama.cpp's models/templates ships it, from MiniMax's
model repository); the tokenizer is byte-level BPE over the 256 bytes plus each family's special
tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from meshllm.model.token_bytes import gpt2_byte_alphabet

HERMES_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- elif message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}{%- set tc = tool_call.function %}
{{- '\n<tool_call>\n{"name": "' + tc.name + '", "arguments": ' + (tc.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

LLAMA3_TEMPLATE = r"""
{{- bos_token }}
{%- if tools %}
{{- '<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n\nYou have access to the following functions. To call a function, respond with JSON for a function call in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.\n\n' }}
{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\n\n' }}{%- endfor %}
{{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{%- set tc = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "' + tc.name + '", "parameters": ' + (tc.arguments | tojson) + '}<|eot_id|>' }}
{%- elif message.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""

MISTRAL_TEMPLATE = r"""
{{- bos_token }}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if tools and loop.index0 == ns.last_user %}{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}
{{- '[INST] ' + message.content + '[/INST]' }}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '[TOOL_CALLS] [' }}
{%- for tc in message.tool_calls %}
{%- if tc.id is not string or tc.id | length != 9 %}{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{%- endif %}
{{- '{"name": "' + tc.function.name + '", "arguments": ' + (tc.function.arguments | tojson) + ', "id": "' + tc.id + '"}' }}
{%- if not loop.last %}{{- ', ' }}{%- endif %}
{%- endfor %}
{{- ']' + eos_token }}
{%- elif message.role == 'assistant' %}
{{- ' ' + message.content + eos_token }}
{%- elif message.role == 'tool' %}
{{- '[TOOL_RESULTS] {"content": ' + (message.content | tojson) + ', "call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
{%- endif %}
{%- endfor %}
"""

# Mistral's newer call form (Devstral, Magistral, Ministral 3; Mistral Small 3.2 adds ids): each
# call `[TOOL_CALLS]NAME[ARGS]{arguments}`, the rest Mistral v0.3's turns
_MISTRAL_CALLS = MISTRAL_TEMPLATE[MISTRAL_TEMPLATE.index("{{- '[TOOL_CALLS] ['"):MISTRAL_TEMPLATE.index("{{- ']' + eos_token }}")]
MISTRAL_ARGS_TEMPLATE = MISTRAL_TEMPLATE.replace(_MISTRAL_CALLS, r"""{%- for tc in message.tool_calls %}
{%- if tc.id is not string or tc.id | length != 9 %}{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{%- endif %}
{{- '[TOOL_CALLS]' + tc.function.name + '[ARGS]' + (tc.function.arguments | tojson) }}
{%- endfor %}
""").replace("{{- ']' + eos_token }}", "{{- eos_token }}", 1)
assert "[ARGS]" in MISTRAL_ARGS_TEMPLATE and '"arguments": ' not in MISTRAL_ARGS_TEMPLATE  # the call form replaced

# OpenAI's harmony (GPT-OSS), in the shape of its published template: tools as a TypeScript-like
# namespace in a developer message, a call as a message to functions.NAME on the commentary
# channel, a result as a message from it; the reply opens at <|start|>assistant.
HARMONY_TEMPLATE = r"""
{%- set ns = namespace(last_call=none, dev='') %}
{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nReasoning: medium\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>' }}
{%- if messages[0].role in ('system', 'developer') %}{%- set ns.dev = messages[0].content %}{%- endif %}
{%- if ns.dev or tools %}
{{- '<|start|>developer<|message|>' }}
{%- if ns.dev %}{{- '# Instructions\n\n' + ns.dev + '\n\n' }}{%- endif %}
{%- if tools %}
{{- '# Tools\n\n## functions\n\nnamespace functions {\n' }}
{%- for tool in tools %}{%- set f = tool.function %}
{{- '\n// ' + f.description + '\ntype ' + f.name + ' = (_: ' + (f.parameters | tojson) + ') => any;\n' }}
{%- endfor %}
{{- '\n} // namespace functions' }}
{%- endif %}
{{- '<|end|>' }}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}
{{- '<|start|>user<|message|>' + m.content + '<|end|>' }}
{%- elif m.role == 'assistant' and m.tool_calls %}
{%- set tc = m.tool_calls[0].function %}{%- set ns.last_call = tc.name %}
{{- '<|start|>assistant to=functions.' + tc.name + '<|channel|>commentary json<|message|>' + (tc.arguments | tojson) + '<|call|>' }}
{%- elif m.role == 'assistant' %}
{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}
{%- elif m.role == 'tool' %}
{{- '<|start|>functions.' + ns.last_call + ' to=assistant<|channel|>commentary<|message|>' + (m.content | tojson) + '<|end|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}
"""

GLM_TEMPLATE = r"""[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}
<arg_key>{arg-key-1}</arg_key>
<arg_value>{arg-value-1}</arg_value>
...
</tool_call>
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}<|user|>
{{ m.content }}
{%- elif m.role == 'system' -%}<|system|>
{{ m.content }}
{%- elif m.role == 'assistant' -%}<|assistant|>
{%- if m.content %}
{{ m.content }}{% endif %}
{%- for tc in m.tool_calls or [] %}{% set f = tc.function %}
<tool_call>{{ f.name }}
{% for k, v in f.arguments.items() %}<arg_key>{{ k }}</arg_key>
<arg_value>{{ v | tojson if v is not string else v }}</arg_value>
{% endfor %}</tool_call>{% endfor %}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|observation|>{% endif %}
<tool_response>
{{ m.content }}
</tool_response>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}
"""

# Qwen3-Coder's: Qwen's ChatML turns, with its own tool listing and call form in place of Hermes'
_HERMES_TOOLS = HERMES_TEMPLATE[HERMES_TEMPLATE.index("{%- if tools %}"):HERMES_TEMPLATE.index("{%- elif")]
_HERMES_CALL = next(line for line in HERMES_TEMPLATE.splitlines() if '"arguments": ' in line)
QWEN3_CODER_TEMPLATE = HERMES_TEMPLATE.replace(_HERMES_TOOLS, r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- "You have access to the following functions:\n\n<tools>" }}
{%- for tool in tools %}
{{- "\n<function>\n<name>" + tool.function.name + "</name>\n<parameters>" + (tool.function.parameters | tojson) }}
{{- "</parameters>\n</function>" }}
{%- endfor %}
{{- "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format:\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call><|im_end|>\n" }}
""").replace(_HERMES_CALL, r"""{{- '\n<tool_call>\n<function=' + tc.name + '>\n' }}
{%- for k, v in tc.arguments.items() %}
{{- '<parameter=' + k + '>\n' + (v if v is string else v | tojson) + '\n</parameter>\n' }}
{%- endfor %}
{{- '</function>\n</tool_call>' }}""")
assert "You have access" in QWEN3_CODER_TEMPLATE and '"arguments"' not in QWEN3_CODER_TEMPLATE  # both replaced

# MiniMax-M2's: its reply opens inside a <think> block the prompt left open
MINIMAX_TEMPLATE = (Path(__file__).parent / "templates" / "minimax_m2.jinja").read_text()

# family -> (transformers variant, template, special tokens (first is BOS or None), eos, plain added tokens)
FAMILIES = {
    "hermes": ("qwen2", HERMES_TEMPLATE, [None, "<|im_start|>", "<|im_end|>"], "<|im_end|>",
               ["<tool_call>", "</tool_call>"]),
    "llama3": ("llama3", LLAMA3_TEMPLATE, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                                           "<|eot_id|>", "<|python_tag|>"], "<|eot_id|>", []),
    "mistral": ("mistral", MISTRAL_TEMPLATE, ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                              "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], "</s>", []),
    "mistral_args": ("mistral", MISTRAL_ARGS_TEMPLATE, ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]",
                                                         "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                                                         "[/TOOL_RESULTS]"], "</s>", []),
    "harmony": ("gpt-oss", HARMONY_TEMPLATE, [None, "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                                              "<|constrain|>", "<|return|>", "<|call|>"], "<|return|>", []),
    "glm": ("glm4-moe", GLM_TEMPLATE, [None, "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                                       "<|observation|>"], "<|user|>",
            ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]),
    "qwen3_coder": ("qwen3-moe", QWEN3_CODER_TEMPLATE, [None, "<|im_start|>", "<|im_end|>"], "<|im_end|>",
                    ["<tool_call>", "</tool_call>"]),
    "minimax": ("minimax-m2", MINIMAX_TEMPLATE, [None, "]~!b[", "]~b]", "[e~["], "[e~[",
                ["<minimax:tool_call>", "</minimax:tool_call>", "<think>", "</think>"]),
}
# A harmony reply ends at <|call|> too (GPT-OSS's generation_config lists both); GLM's at <|observation|>
_MORE_EOS = {"harmony": ["<|call|>"], "glm": ["<|observation|>"]}
VOCAB_SIZE = 272  # 256 bytes + added tokens, rounded up


def _tokenizer(specials: list[str], plain: list[str]) -> Tokenizer:
    vocab = {char: byte for byte, char in gpt2_byte_alphabet().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    return tokenizer


def tiny_family_model(tiny_model_dir, family: str, seed: int) -> Path:
    """A random-weight model folder whose tokenizer and chat template speak `family`."""
    variant, template, specials, eos, plain = FAMILIES[family]
    bos = specials[0]
    specials = [t for t in specials if t is not None]
    tokenizer = _tokenizer(specials, plain)
    assert tokenizer.get_vocab_size() <= VOCAB_SIZE
    eos_ids = [tokenizer.token_to_id(t) for t in [eos, *_MORE_EOS.get(family, [])]]
    folder = tiny_model_dir(variant, seed=seed, vocab_size=VOCAB_SIZE, num_hidden_layers=2,
                            max_position_embeddings=2048, bos_token_id=tokenizer.token_to_id(bos) if bos else None,
                            eos_token_id=eos_ids[0] if len(eos_ids) == 1 else eos_ids)
    out = folder.parent / f"{folder.name}-{family}"
    if not out.exists():
        shutil.copytree(folder, out)
        tokenizer.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps({
            "chat_template": template, "bos_token": bos, "eos_token": eos}))
    return out


def with_template(source: Path, folder: Path, template: str) -> Path:
    """A copy of model folder `source` in `folder` whose tokenizer carries `template` instead."""
    for f in source.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return folder
