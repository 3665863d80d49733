# %% [markdown]
# # Generative retrieval: rank catalogue items by beam search
#
# A catalogue of items, each with an id, is retrieved *generatively*: the model writes an item's title, the trie
# keeps it on titles that exist, and beam search returns the top-k items with their log-probabilities
# (`rank`). The catalogue is deterministic: the 5,046 subdivisions (states, provinces, regions, ...) of every
# country in `pycountry`, keyed by their ISO 3166-2 codes (`"US-CA"`: hierarchical ids, much like the semantic
# ids of recommender systems). The trie is saved to a file and memory-mapped back, as a serving process would do.
#
# Run as a script: `python examples/generative_retrieval.py`.

# %%
import tempfile
import time
from pathlib import Path

import pycountry
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from trie_decode import TokenTrie
from trie_decode.integrations.smollm2 import smollm2_path
from trie_decode.integrations.transformers import TrieLogitsProcessor, rank

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()
path = smollm2_path()
tokenizer = AutoTokenizer.from_pretrained(path)
tokenizer.padding_side = "left"
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

# %% [markdown]
# ## The catalogue and its trie file

# %%
items = sorted(pycountry.subdivisions, key=lambda s: s.code)
print(f"{len(items)} items, e.g. " + ", ".join(f"{s.code}: {s.name}" for s in items[:3]))

trie_file = Path(tempfile.mkdtemp()) / "catalogue.trie.safetensors"
TokenTrie.from_strings([s.name for s in items], tokenizer, leading_space=True, keys=[s.code for s in items]).save(trie_file)
t0 = time.perf_counter()
trie = TokenTrie.load(trie_file, tokenizer=tokenizer)  # memory-mapped; checks CRCs, structure and the tokenizer
# Items with the same title are one entry (the first item's key is kept): 155 names occur in two countries.
print(f"{trie.stats()['duplicates_merged']} duplicate titles merged")
print(f"loaded {trie_file.name} ({trie_file.stat().st_size:,} bytes) in {1e3 * (time.perf_counter() - t0):.1f} ms: {trie}")

# %% [markdown]
# ## Top-k with `rank`
#
# `rank(model, inputs, trie, k)` runs constrained beam search with k beams and returns, per prompt, distinct
# entries sorted by the model's log-probability of the entry's tokens followed by the end token. As in the
# entity-linking example the end token is `"."`, which the model writes after an answer.

# %%
QUERIES = [
    "Which US state is Los Angeles in?",
    "In which Canadian province is Toronto?",
    "In which Australian state is Melbourne?",
    "In which US state is Miami?",
]
# Titles are ISO names, often in the local language ("Bayern", "Catalunya"): a 135M model that thinks "Bavaria"
# cannot reach them. Retrieval by title works as well as the titles match the model's own wording.


def prompt(question: str) -> str:
    chat = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) + "The answer is"


period = tokenizer.convert_tokens_to_ids(".")
inputs = tokenizer([prompt(q) for q in QUERIES], return_tensors="pt", padding=True)
t0 = time.perf_counter()
ranked = rank(model, inputs, trie, 5, tokenizer=tokenizer, end_token_id=period, pad_token_id=tokenizer.pad_token_id)
print(f"top-5 for {len(QUERIES)} queries in {time.perf_counter() - t0:.1f} s\n")
for query, results in zip(QUERIES, ranked):
    print(query)
    for r in results:
        print(f"    {r.entry.key:<8} {r.entry.name:<28} log p = {r.log_prob:7.2f}")

# %% [markdown]
# ## The same with `generate`
#
# `rank` is a thin wrapper: `TrieLogitsProcessor` works with `num_beams`/`num_return_sequences` directly, and
# `processor.match` maps each returned sequence to its item. Beams of one prompt are distinct token sequences,
# so they are distinct items. (The order can differ from `rank`'s: `generate`'s default `length_penalty=1.0`
# divides scores by length, `rank` sets it to 0 to compare whole-sequence log-probabilities.)

# %%
processor = TrieLogitsProcessor(trie, tokenizer, end_token_id=period)
one = tokenizer([prompt(QUERIES[0])], return_tensors="pt")
out = model.generate(
    **one,
    logits_processor=[processor],
    num_beams=3,
    num_return_sequences=3,
    do_sample=False,
    max_new_tokens=trie.max_depth + 1,
    eos_token_id=period,
    pad_token_id=tokenizer.pad_token_id,
)
print([(e.key, e.name) for e in processor.match(out)])
