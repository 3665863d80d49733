# %% [markdown]
# # Catalog-valued fields inside JSON: entity extraction and tool calls
#
# A grammar engine decides the *shape* of the answer (a JSON object); trie_decode decides the *values* of the fields
# that must come from a catalog. Each `Span` says where a value starts (the text `after`), the values, and the text
# that ends one (`end`, the closing quote). Spans are matched on text, however the model tokenizes the JSON around
# them, and the masks of the two processors intersect: every output is valid JSON and every constrained field is an
# entry of its catalog.
#
# Run as a script: `python examples/json_fields.py`.

# %%
import itertools
import json

import pycountry
import torch
import xgrammar as xgr
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging
from xgrammar.contrib.hf import LogitsProcessor as XGrammarProcessor

from trie_decode import Span
from trie_decode.integrations.smollm2 import smollm2_path
from trie_decode.integrations.transformers import TrieLogitsProcessor

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()
path = smollm2_path()
tokenizer = AutoTokenizer.from_pretrained(path)
tokenizer.padding_side = "left"
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.config.vocab_size))


def ask(questions, schema, spans, max_new_tokens=40):
    """Greedy answers, shaped by the JSON schema (XGrammar) with catalog-valued fields (the spans)."""
    grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) for q in questions]
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    procs = [XGrammarProcessor(grammar), TrieLogitsProcessor(tokenizer=tokenizer, spans=spans)]
    out = model.generate(**enc, logits_processor=procs, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    return [json.loads(t) for t in tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)]


# %% [markdown]
# ## Entity extraction: a city and a country, each from its own catalog
#
# The country must be one of the 249 ISO 3166 names; the city one of a list of capitals. Without the spans the
# model may answer `"Paris, France"` in the city field, or a country name that is not in the catalog.

# %%
countries = sorted(c.name for c in pycountry.countries)
cities = ["Paris", "Rome", "Berlin", "Madrid", "Tokyo", "Lima", "Cairo", "Ottawa", "Canberra", "Lisbon", "Vienna",
          "Athens", "Dublin", "Oslo", "Nairobi", "Seoul", "Hanoi", "Bogotá", "Quito", "Kyiv"]
schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
          "required": ["city", "country"], "additionalProperties": False}
spans = [Span(cities, after='"city": "'), Span(countries, after='"country": "')]
questions = [f'Where is {p}? Answer in JSON with the keys "city" and "country".'
             for p in ["the Eiffel Tower", "the Brandenburg Gate", "the Acropolis", "Machu Picchu"]]
for q, answer in zip(questions, ask(questions, schema, spans)):
    print(f"{q[:40]:40} -> {answer}  in catalogs: {answer['city'] in cities and answer['country'] in countries}")

# %% [markdown]
# ## Tool calls: one name out of 10,000
#
# An agent picks a tool by name. With ten thousand tools, listing them in the prompt or in a grammar's enum is out
# of reach (XGrammar compiles a 100k-way choice in tens of seconds); a span over a trie of the names costs what a
# trie step costs. The tool names here are verb_object pairs; `arguments` stays free JSON.

# %%
verbs = ["get", "set", "list", "create", "delete", "update", "search", "send", "book", "cancel", "translate",
         "convert", "summarize", "schedule", "fetch", "check", "open", "close", "start", "stop", "play", "pause",
         "compute", "validate", "export"]
snake = lambda name: name.lower().replace(" ", "_").replace("-", "_")  # noqa: E731
plain = [l for l in pycountry.languages if l.name.isascii() and "(" not in l.name and "'" not in l.name]
major = sorted({snake(l.name) for l in plain if hasattr(l, "alpha_2")})  # the ISO 639-1 languages first
objects = (major + sorted({snake(l.name) for l in plain} - set(major)))[:400]
tools = [f"{v}_to_{o}" if v == "translate" else f"{v}_{o}" for v, o in itertools.product(verbs, objects)]
print(len(tools), "tool names, e.g.", tools[:3], tools[-1])
tool_schema = {"type": "object", "properties": {"name": {"type": "string"}, "arguments": {"type": "object"}},
               "required": ["name", "arguments"], "additionalProperties": False}
ask_tool = ('{} Reply with a JSON tool call with the keys "name" and "arguments"; tool names look like '
            '"translate_to_french" or "convert_english".')
tool_questions = [ask_tool.format('Translate "good morning" into Spanish.'), ask_tool.format('Translate "thank you" into German.')]
for q, call in zip(tool_questions, ask(tool_questions, tool_schema, [Span(tools, after='"name": "')], 48)):
    print(f"{q[:40]:40} -> {call}  known tool: {call['name'] in tools}")
