#!/usr/bin/env python3
"""Renders conversations with a tokenizer_config.json's chat_template the way Hugging Face
transformers' apply_chat_template does (transformers/utils/chat_template_utils.py): Jinja2's
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True) with the loopcontrols
extension, a `tojson` filter that keeps non-ASCII (ensure_ascii=False) and `raise_exception`.

Usage: render_reference.py TOKENIZER_CONFIG CASES_JSON
CASES_JSON is a list of {"messages": [...], "add_generation_prompt": bool,
"enable_thinking": bool (optional), "tools": [...] (optional)}; prints a JSON list of rendered
strings. Objects keep the key order of CASES_JSON, as transformers keeps that of the dicts it
is given."""
import json
import sys

from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def raise_exception(message):
    raise TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def main():
    with open(sys.argv[1], encoding="utf-8") as f:
        template = json.load(f)["chat_template"]
    with open(sys.argv[2], encoding="utf-8") as f:
        cases = json.load(f)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    compiled = env.from_string(template)
    out = []
    for case in cases:
        kwargs = {"messages": case["messages"],
                  "add_generation_prompt": case.get("add_generation_prompt", True)}
        if "enable_thinking" in case:
            kwargs["enable_thinking"] = case["enable_thinking"]
        if "tools" in case:
            kwargs["tools"] = case["tools"]
        out.append(compiled.render(**kwargs))
    json.dump(out, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
