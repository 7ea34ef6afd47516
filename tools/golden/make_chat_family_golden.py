#!/usr/bin/env python3
"""Fixtures for the chat templates of the Qwen families (tests/golden/chat/families.jsonl).

The templates in tests/golden/chat/templates/ are the published ones: Qwen2.5-Instruct, Qwen3 as
revised later (content may be a non-string), Qwen3-Instruct-2507, Qwen3-Thinking-2507 (the
revised Qwen3 template whose generation prompt opens the think block; no enable_thinking), QwQ-32B
and Qwen3-Coder (tool calls in XML, written with {% macro %}); the first Qwen3 revision is the tokenizer_config.json of
../shared/assets/qwen3-tokenizer (qwen3.jsonl, make_chat_golden.py). Every template renders the
conversations of make_chat_golden.py (system, multi-turn, reasoning, tool calls and results,
unicode) plus tool-schema cases with HF `tokenizer.apply_chat_template` and the real Qwen3
tokenizer; per case the text, the ids and the ChatML assistant mask (make_chat_golden.chatml_mask)
are recorded. Cases that HF itself refuses to render are left out (counted in the output).

Run from the repository root: python3 tools/golden/make_chat_family_golden.py
"""
import json
import os
import sys

import transformers
from transformers import AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_chat_golden import ASSETS, CONVERSATIONS, OPTIONS, OUT, chatml_mask, kwargs_of, record  # noqa: E402

TEMPLATES = ["qwen2_5", "qwen3_revised", "qwen3_instruct_2507", "qwen3_thinking_2507", "qwq", "qwen3_coder"]

# Tool schemas with what the templates treat specially: descriptions with surrounding spaces, enums,
# required lists, nested objects, keys with '-', '$' and spaces, a return schema.
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "  Current weather for a city.  ",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. Zürich"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Unit"},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "opts": {"type": "object", "properties": {"wind": {"type": "boolean"}}, "x-extra key": "v",
                     "$ref-like": 3}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Web search",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"},
                                                         "n": {"type": ["integer", "null"]}},
                       "required": ["q", "n"]},
        "return": {"type": "array", "items": {"type": "string"}}}},
]


def u(c):
    return {"role": "user", "content": c}


def a(c, **kw):
    return {"role": "assistant", "content": c, **kw}


def call(name, args):
    return {"type": "function", "function": {"name": name, "arguments": args}}


TOOL_CONVERSATIONS = [
    [u("Weather in Zürich?"), a("", tool_calls=[call("get_weather", {"city": "Zürich", "unit": "celsius"})]),
     {"role": "tool", "content": "{\"temp\": 21}"}, a("21 °C.")],
    [{"role": "system", "content": "Use tools."}, u("Find cats"),
     a("Searching.", tool_calls=[call("search", {"q": "cats", "n": 3}), call("search", {"q": "dogs", "n": None})]),
     {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"}, a("Done.")],
    [u("q"), a("<think>\nplan\n</think>\n\n", tool_calls=[call("get_weather", {"city": "Oslo", "days": 2,
                                                                                 "opts": {"wind": True}})]),
     {"role": "tool", "content": "cold"}, u("thanks"), a("You're welcome.")],
    [u("Only a question.")],
]


def render_cases(tok, name, template):
    cases, refused = [], 0
    items = [(conv, None) for conv in CONVERSATIONS] + [(conv, TOOLS) for conv in TOOL_CONVERSATIONS]
    items += [(CONVERSATIONS[1], TOOLS), (CONVERSATIONS[37], TOOLS)]
    for i, (conv, tools) in enumerate(items):
        for agp, think in ([OPTIONS[i % len(OPTIONS)]] if i >= 3 else OPTIONS[:3]):
            kw = kwargs_of(agp, think)
            try:
                text = tok.apply_chat_template(conv, chat_template=template, tools=tools, tokenize=False, **kw)
            except Exception:  # HF refuses it (e.g. a template's raise_exception): not a fixture
                refused += 1
                continue
            ids, mask = chatml_mask(tok, text)
            r = record(conv, agp, think, text, ids, mask)
            r["template"] = name
            if tools is not None:
                r["tools"] = tools
            cases.append(r)
    return cases, refused


def main():
    tok = AutoTokenizer.from_pretrained(ASSETS)
    out = []
    for name in TEMPLATES:
        template = open(os.path.join(OUT, "templates", name + ".jinja"), encoding="utf-8").read()
        cases, refused = render_cases(tok, name, template)
        assert len(cases) >= 30, f"{name}: only {len(cases)} cases"
        print(f"{name}: {len(cases)} cases ({refused} refused by HF)")
        out += cases
    path = os.path.join(OUT, "families.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for c in out:
            f.write(json.dumps(c, ensure_ascii=False) + "\n")
    print(f"{path}: {len(out)} cases, {os.path.getsize(path)} bytes; transformers {transformers.__version__}")


if __name__ == "__main__":
    sys.exit(main())
