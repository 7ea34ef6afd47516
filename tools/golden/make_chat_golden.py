#!/usr/bin/env python3
"""Chat template fixtures for tests/test_chat.cpp (tests/golden/chat/).

Renders conversations with HF `tokenizer.apply_chat_template` using the real Qwen3 tokenizer
(../shared/assets/qwen3-tokenizer, never copied into the repository) and records, per case, the
rendered text, the token ids and the assistant-token mask:

* qwen3.jsonl: the Qwen3 template of tokenizer_config.json. It has no {% generation %} blocks, so
  HF cannot return an assistant mask; the mask follows titan's documented ChatML rule (the text
  after each "<|im_start|>assistant\\n" header through its "<|im_end|>"), mapped to tokens the
  way HF's return_assistant_tokens_mask maps spans (char_to_token of the first and last char).
* tagged.jsonl: tests/golden/chat/tagged_template.jinja, a ChatML template with {% generation %}
  blocks; the mask is HF's own return_assistant_tokens_mask. The script also checks that on
  these conversations HF's mask equals the ChatML rule, i.e. the rule is what the generation
  blocks of a TRL-style training template mark.
* jinja.jsonl: small templates exercising the Jinja subset (whitespace control, trim_blocks /
  lstrip_blocks, filters, tests, slicing, methods), rendered by HF's own Jinja environment.

Run from the repository root: python3 tools/golden/make_chat_golden.py
"""
import json
import os
import re
import sys

import transformers
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import _compile_jinja_template

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ASSETS = os.path.join(ROOT, "..", "shared", "assets", "qwen3-tokenizer")
OUT = os.path.join(ROOT, "tests", "golden", "chat")

S = "You are a helpful assistant."


def u(c):
    return {"role": "user", "content": c}


def a(c, **kw):
    return {"role": "assistant", "content": c, **kw}


def s(c):
    return {"role": "system", "content": c}


# Conversations: system or not, multi-turn, <think> inside content, reasoning_content,
# unicode, empty content, leading/trailing whitespace, tool turns.
CONVERSATIONS = [
    [u("Hello!"), a("Hi! How can I help?")],
    [s(S), u("What is 2+2?"), a("4")],
    [s(S), u("Name a color."), a("Blue."), u("Another one?"), a("Green.")],
    [u("Think first."), a("<think>\nThe user wants thinking.\n</think>\n\nDone thinking.")],
    [u("q"), a("<think>short</think>answer")],
    [u("q1"), a("<think>\nr1\n</think>\n\na1"), u("q2"), a("<think>\nr2\n</think>\n\na2")],
    [u("q"), a("The answer.", reasoning_content="Some reasoning.")],
    [u("q1"), a("a1", reasoning_content="r1"), u("q2"), a("a2", reasoning_content="r2")],
    [u("q"), a("a", reasoning_content=None)],
    [u("q"), a("a", reasoning_content="")],
    [u("Grüße aus Köln! 你好，世界 🌍"), a("Hallo! 你好 👋 — ça va? Ωμέγα")],
    [u(""), a("")],
    [s(""), u("x"), a("y")],
    [u("  leading spaces"), a("  answer with leading spaces")],
    [u("newlines\n\n"), a("\n\nanswer after newlines\n")],
    [u("tabs\tand\ttabs"), a("\tindented\n\tcode")],
    [u("Write code."), a("```python\ndef f(x):\n    return x * 2\n```")],
    [u("JSON?"), a('{"key": "value", "n": [1, 2, 3]}')],
    [s("Be terse."), u("Hi"), a("Hi."), u("Bye"), a("Bye."), u("Again"), a("Again.")],
    [u("Only a user turn.")],
    [s(S), u("System then user.")],
    [u("q"), a("a"), u("follow-up")],
    [u("<|im_start|> literal special tokens <|im_end|> in text"), a("ok <|endoftext|>")],
    [u("Numbers 12345 and 3.14159"), a("Sum: 12348.14159")],
    [u("Multiple\nlines\nhere"), a("Line one.\nLine two.\nLine three.")],
    [u("q"), a("</think>only closing tag")],
    [u("q"), a("<think>\n\n</think>\n\nempty think")],
    [u("q"), a("pre <think>mid</think> post")],
    [s(S), u("q1"), a("<think>old reasoning</think>a1"), u("q2"), a("a2")],
    [u("Emoji only 😀😃😄"), a("🙂")],
    [u("Arabic مرحبا"), a("مرحبا بك")],
    [u("Japanese こんにちは"), a("こんにちは、元気ですか？")],
    [u("Combining e\u0301 accents"), a("Cafe\u0301 na\u0308ive")],
    [u("Long " + "word " * 60), a("Short.")],
    [u("q"), a("x" * 100)],
    [s("A\nmulti-line\nsystem prompt"), u("q"), a("a")],
    [u("q"), a("a"), {"role": "system", "content": "Mid-conversation system."}, u("q2"), a("a2")],
    [u("Call a tool."), a("", tool_calls=[{"type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]),
     {"role": "tool", "content": "12:00"}, a("It is 12:00 UTC.")],
    [u("Two tools."), a("Checking.", tool_calls=[
        {"type": "function", "function": {"name": "a", "arguments": "{\"x\": 1}"}},
        {"type": "function", "function": {"name": "b", "arguments": {"y": [1, 2], "z": "é"}}}]),
     {"role": "tool", "content": "r1"}, {"role": "tool", "content": "r2"}, a("Done.")],
    [u("<tool_response>\nfake\n</tool_response>"), a("a")],
    [u("q"), a("a", reasoning_content="r\n\n")],
    [u("q"), a("\n\na", reasoning_content="\nr\n")],
    [u("Trailing whitespace   "), a("Trailing   ")],
    [u("CRLF\r\nline"), a("reply\r\n")],
    [u("Quotes ' and \" and \\ backslash"), a("Escapes \\n are literal")],
    [u("q"), a("answer one"), u("q"), a("answer two"), u("q"), a("answer three"), u("q"), a("answer four")],
    [s(S), u("<think>user writes think tags</think>"), a("assistant reply")],
    [u("Zero-width\u200bspace and nbsp\u00a0here"), a("ok\u00a0ok")],
    [u("Math: ∑ x² = ∞"), a("∫ f(x) dx ≈ 0")],
    [u("q"), a("<think>\nmulti\nline\nreasoning\n</think>\n\nfinal")],
]

# Options per case: (add_generation_prompt, enable_thinking); cycled over the conversations, plus
# a few cases rendered with every option.
OPTIONS = [(False, None), (True, None), (False, False), (True, False), (False, True), (True, True)]


def chatml_mask(tok, text):
    enc = tok(text, add_special_tokens=False)
    n = len(enc["input_ids"])
    mask = [0] * n
    start_tag, end_tag = "<|im_start|>assistant\n", "<|im_end|>"
    pos = text.find(start_tag)
    while pos != -1:
        b = pos + len(start_tag)
        c = text.find(end_tag, b)
        if c == -1:
            break
        e = c + len(end_tag)
        if e > b:
            # As HF's return_assistant_tokens_mask maps a generation span to tokens.
            t0 = enc.char_to_token(0, b)
            t1 = enc.char_to_token(0, e - 1)
            for t in range(t0, t1 + 1):
                mask[t] = 1
        pos = text.find(start_tag, e)
    return enc["input_ids"], mask


def kwargs_of(agp, think):
    kw = {"add_generation_prompt": agp}
    if think is not None:
        kw["enable_thinking"] = think
    return kw


def record(messages, agp, think, text, ids, mask):
    r = {"messages": messages, "add_generation_prompt": agp}
    if think is not None:
        r["enable_thinking"] = think
    r.update({"text": text, "ids": ids, "mask": "".join(map(str, mask))})
    return r


TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "Current time in a zone.",
                                          "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                                         "required": ["tz"]}}}]


def qwen3_cases(tok):
    cases = []
    # Tool schemas in the system turn (with and without a system message).
    for i in (1, 37):
        conv = CONVERSATIONS[i]
        text = tok.apply_chat_template(conv, tools=TOOLS, tokenize=False)
        ids, mask = chatml_mask(tok, text)
        r = record(conv, False, None, text, ids, mask)
        r["tools"] = TOOLS
        cases.append(r)
    for i, conv in enumerate(CONVERSATIONS):
        opts = OPTIONS if i < 3 else [OPTIONS[i % len(OPTIONS)]]
        for agp, think in opts:
            kw = kwargs_of(agp, think)
            text = tok.apply_chat_template(conv, tokenize=False, **kw)
            ids_hf = tok.apply_chat_template(conv, tokenize=True, return_dict=True, **kw)["input_ids"]
            ids, mask = chatml_mask(tok, text)
            assert ids == list(ids_hf), f"case {i}: tokenize=True differs from encoding the text"
            cases.append(record(conv, agp, think, text, ids, mask))
    return cases


def tagged_cases(tok, template):
    cases = []
    for i, conv in enumerate(CONVERSATIONS):
        if any(m["role"] == "tool" or "tool_calls" in m for m in conv):
            continue
        agp = i % 2 == 1
        out = tok.apply_chat_template(conv, chat_template=template, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True, add_generation_prompt=agp)
        text = tok.apply_chat_template(conv, chat_template=template, tokenize=False, add_generation_prompt=agp)
        ids, rule_mask = chatml_mask(tok, text)
        assert list(out["input_ids"]) == ids, f"tagged case {i}: ids differ"
        hf_mask = list(out["assistant_masks"])
        assert hf_mask == rule_mask, f"tagged case {i}: HF's generation mask differs from the ChatML rule"
        cases.append(record(conv, agp, None, text, ids, hf_mask))
    return cases


# Small templates for the Jinja subset: (template, context).
JINJA_CASES = [
    ("Hello {{ name }}!", {"name": "world"}),
    ("{% if x %}yes{% else %}no{% endif %}", {"x": 0}),
    ("{% if x > 2 %}big{% elif x > 1 %}mid{% else %}small{% endif %}", {"x": 2}),
    ("{% for i in items %}{{ loop.index }}:{{ i }}{% if not loop.last %}, {% endif %}{% endfor %}", {"items": ["a", "b", "c"]}),
    ("{% for i in items %}{{ loop.index0 }}{{ loop.first }}{{ loop.revindex }}{{ loop.length }}|{% endfor %}", {"items": [1, 2]}),
    ("  {% if true %}\n    indented\n  {% endif %}\nafter", {}),
    ("line1\n{%- if true -%}\n   x   \n{%- endif %}\nline3", {}),
    ("{{- ' a ' -}}  {{ 'b' }}  {#- comment -#}  c", {}),
    ("{# comment #}\n{% set x = 3 %}\n{{ x * 2 }} {{ x / 2 }} {{ x // 2 }} {{ x % 2 }} {{ -x }}", {}),
    ("{% set ns = namespace(n=0) %}{% for i in range(5) %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}", {}),
    ("{% set v = 1 %}{% for i in [1] %}{% set v = 2 %}{% endfor %}{{ v }}", {}),
    ("{{ xs[::-1] }} {{ xs[1:] }} {{ xs[:-1] }} {{ xs[-1] }} {{ s[1:3] }} {{ s[::-1] }}", {"xs": [1, 2, 3], "s": "héllo"}),
    ("{{ s.strip() }}|{{ s.lstrip() }}|{{ s.rstrip() }}|{{ t.strip('\\n') }}|{{ t.lstrip('\\nx') }}", {"s": "  pad  ", "t": "\nx\nbody\n\n"}),
    ("{{ s.split('</think>')[-1].lstrip('\\n') }}|{{ s.split('</think>')[0] }}|{{ 'a b  c'.split() }}|{{ 'a,b'.split(',', 1) }}", {"s": "<think>r</think>\n\nanswer"}),
    ("{{ s.startswith('ab') }} {{ s.endswith('yz') }} {{ 'x' in s }} {{ 'q' not in s }} {{ s.upper() }} {{ s.replace('b', 'B') }}", {"s": "abxyz"}),
    ("{{ d | tojson }} {{ l | tojson }} {{ d | tojson(indent=2) }}", {"d": {"b": 1, "a": [True, None, 1.5, "é\"\n"]}, "l": [1, "x"]}),
    ("{{ xs | length }} {{ s | length }} {{ ' t ' | trim }} {{ xs | first }} {{ xs | last }} {{ xs | join('-') }}", {"xs": [3, 4, 5], "s": "日本語"}),
    ("{{ missing | default('dflt') }} {{ missing is defined }} {{ x is none }} {{ y is string }} {{ z is number }} {{ b is false }}", {"x": None, "y": "s", "z": 1.5, "b": False}),
    ("{{ 'a' ~ 1 ~ none }} {{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 7 // -2 }} {{ -7 % 3 }} {{ 1.0 }} {{ 2.5e-7 }} {{ 1 == 1.0 }}", {}),
    ("{{ 'yes' if a and not b else 'no' }} {{ a or b }} {{ b or 'fallback' }} {{ x if x else 'none' }}", {"a": True, "b": False, "x": ""}),
    ("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %} {{ d.get('a') }} {{ d.get('z', 9) }} {{ d['b'] }}", {"d": {"a": 1, "b": 2}}),
    ("{% for x in xs if x > 1 %}{{ x }}{% else %}empty{% endfor %}|{% for x in [] %}{{ x }}{% else %}empty{% endfor %}", {"xs": [1, 2, 3]}),
    ("{% for x in xs %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %}", {"xs": [1, 2, 3, 4, 5]}),
    ("{{ messages[0].content }} {{ messages[0]['role'] }} {{ messages | length - 1 }} {{ messages[5] is defined }}", {"messages": [{"role": "user", "content": "hi"}]}),
    ("{%- for m in messages %}\n{{- m.role }}: {{ m.content }}\n{% endfor -%}\nend", {"messages": [{"role": "a", "content": "1"}, {"role": "b", "content": "2"}]}),
    ("{% if x is defined and x is not none %}set{% endif %}{% if not(x is string) %}ns{% endif %}", {"x": 3}),
    ("{{ [1, 2] + [3] }} {{ {'k': 'v'} }} {{ 'ab' * 3 }} {{ none }} {{ true }} {{ 3 > 2 > 1 }}", {}),
    ("{% set x = 'a' %}{% if x in ['a', 'b'] %}{{ x | upper }}{% endif %}{{ 'Hi' | lower }}", {}),
    ("A\n{% for i in range(2) %}\n  {{ i }}\n{% endfor %}\nB", {}),
    ("{{ \"dq 'sq'\" }} {{ 'sq \"dq\"' }} {{ 'a' 'b' }}", {}),
    # Macros (defaults, keywords, the template's variables, recursion), call blocks, block set.
    ("{% macro tag(name, body='-', close=true) %}<{{ name }}>{{ body }}{% if close %}</{{ name }}>{% endif %}"
     "{% endmacro %}{{ tag('a') }}|{{ tag('b', 'x') }}|{{ tag('c', close=false) }}|{{ tag(body='y', name='d') }}",
     {}),
    ("{%- macro greet(who) -%}\n  Hi {{ who }} from {{ site }}{{ missing }}!\n{%- endmacro %}\n{{ greet('you') }}"
     "{{ greet('me') | upper }}{{ greet('x') | length }}", {"site": "here"}),
    ("{% macro fact(n) %}{% if n <= 1 %}1{% else %}{{ n }}*{{ fact(n - 1) }}{% endif %}{% endmacro %}{{ fact(4) }}",
     {}),
    ("{% macro wrap(cls) %}<div class={{ cls }}>{{ caller() }}</div>{% endmacro %}"
     "{% call wrap('box') %}inside {{ v }}{% endcall %}", {"v": 7}),
    ("{% macro each(xs) %}{% for x in xs %}[{{ caller(x, loop.index) }}]{% endfor %}{% endmacro %}"
     "{% set sep = ':' %}{% call(item, i) each(['a', 'b']) %}{{ i }}{{ sep }}{{ item }}{% endcall %}", {}),
    ("{% set block %}\n  text {{ 1 + 1 }}\n{% endset %}[{{ block }}]{% set ns = namespace(a=1) %}"
     "{% macro bump() %}{% set ns.a = ns.a + 1 %}{% endmacro %}{{ bump() }}{{ bump() }}{{ ns.a }}", {}),
    ("{% macro m(a, b=a ~ '!') %}{{ a }}{{ b }}{% endmacro %}{{ m('x') }}{{ m('y', b='z') }}{% set m2 = m %}"
     "{{ m2('w') }}{{ m is defined }}", {}),
]


def jinja_cases():
    cases = []
    for tmpl, ctx in JINJA_CASES:
        compiled = _compile_jinja_template(tmpl)
        cases.append({"template": tmpl, "context": ctx, "text": compiled.render(**ctx)})
    return cases


def write(name, cases):
    path = os.path.join(OUT, name)
    with open(path, "w", encoding="utf-8") as f:
        for c in cases:
            f.write(json.dumps(c, ensure_ascii=False) + "\n")
    print(f"{path}: {len(cases)} cases, {os.path.getsize(path)} bytes")


def main():
    os.makedirs(OUT, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(ASSETS)
    template = open(os.path.join(OUT, "tagged_template.jinja"), encoding="utf-8").read()
    write("qwen3.jsonl", qwen3_cases(tok))
    write("tagged.jsonl", tagged_cases(tok, template))
    write("jinja.jsonl", jinja_cases())
    print(f"transformers {transformers.__version__}, special tokens map {tok.special_tokens_map}")


if __name__ == "__main__":
    sys.exit(main())
