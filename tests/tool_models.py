"""Tiny seeded models whose tokenizer writes JSON, for the tool and structured-output tests.

`make_tool_pair(root, template)` saves a target and a draft (a noisy copy of it) in HF format with a
character-level tokenizer over printable ASCII (so `{"name": ...}` is writable one character a
token) and the given chat template. `TOOLS_TEMPLATE` renders tools, calls and tool results the
Hermes/Qwen way (`<tool_call>{json}</tool_call>`); `PLAIN_TEMPLATE` knows nothing of tools.
The tools and the Open WebUI-shaped request the tests send are here too.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHARS = ["<eos>"] + [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # 97 symbols

TOOLS_TEMPLATE = (
    "{%- if tools %}<|system|>\nfunctions:\n{%- for tool in tools %}\n{{ tool.function | tojson }}{%- endfor %}\n"
    'call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>\n{% endif %}'
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|assistant|>\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}</tool_call>{%- endfor %}\n"
    "{%- elif m.role == 'tool' %}<|tool|>\n{{ m.content }}\n"
    "{%- else %}<|{{ m.role }}|>\n{{ m.content }}\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
PLAIN_TEMPLATE = (
    "{%- for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city for the next days.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["paris", "rome", "oslo"]},
                "days": {"type": "integer", "enum": [1, 2, 3]},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}

# The names of Open WebUI's builtin tools as its requests list them (36 with every feature on); the
# descriptions and parameters are shaped like its own (one string query or id), not copied.
WEBUI_TOOL_NAMES = [
    "search_web",
    "fetch_url",
    "get_current_timestamp",
    "calculate_timestamp",
    "search_memories",
    "add_memory",
    "replace_memory_content",
    "delete_memory",
    "list_memories",
    "search_notes",
    "view_note",
    "write_note",
    "replace_note_content",
    "search_chats",
    "view_chat",
    "list_knowledge_bases",
    "search_knowledge_bases",
    "query_knowledge_bases",
    "search_knowledge_files",
    "query_knowledge_files",
    "view_knowledge_file",
    "generate_image",
    "edit_image",
    "execute_code",
    "search_channels",
    "search_channel_messages",
    "view_channel_message",
    "view_channel_thread",
    "list_skills",
    "view_skill",
    "search_files",
    "view_file",
    "list_files",
    "list_models",
    "get_user_info",
    "list_tasks",
]


def webui_request() -> dict:
    """A first chat request shaped like Open WebUI's with builtin tools on: 36 function tools, a
    streamed reply, no tool_choice, no max_tokens."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": f"{name.replace('_', ' ')} for the user",
                "parameters": {
                    "type": "object",
                    "properties": {"query": {"type": "string", "description": "what to use"}},
                    "required": ["query"],
                },
            },
        }
        for name in WEBUI_TOOL_NAMES
    ]
    return {"model": "tools", "stream": True, "tools": tools, "messages": [{"role": "user", "content": "hi there"}]}


def make_tokenizer(template: str) -> PreTrainedTokenizerFast:
    """One token per character, byte-level (GPT-2's byte alphabet: " " is "\u0120", "\n" is "\u010a"),
    so the grammar engine can read every token's bytes."""
    byte_char = {" ": "\u0120", "\n": "\u010a"}
    vocab = {byte_char.get(c, c): i for i, c in enumerate(CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")
    fast.chat_template = template
    return fast


def make_tool_pair(root: Path, template: str) -> tuple[Path, Path]:
    """(target, draft) under `root`: a 2-layer seeded Llama and its copy with 30% weight noise."""
    cfg = LlamaConfig(
        vocab_size=len(CHARS),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    tok = make_tokenizer(template)
    torch.manual_seed(7)
    target = LlamaForCausalLM(cfg)
    draft = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p, q in zip(target.parameters(), draft.parameters()):
            p.mul_(3.0)  # peakier distributions, as tests/conftest.py's models
            q.copy_(p + 0.3 * p.std() * torch.randn_like(p))
    paths = root / "target", root / "draft"
    for model, path in zip((target, draft), paths):
        model.save_pretrained(path, safe_serialization=True)
        tok.save_pretrained(path)
    return paths
