# %% [markdown]
# # Generative recommendation: a catalog, exclusions of seen items, a distinct top-10
#
# A recommender that *generates* its answer writes an item's title (or its semantic id) token by token. The trie
# keeps every beam on items that exist, and three things a recommender needs come on top of it:
#
# - **exclusions**: a user's already-seen items are denied per request (`deny=`), over one shared catalog trie,
#   with no rebuild;
# - **a distinct top-k with scores**: `rank` returns k different items with their log-probabilities;
# - **distinct lists**: one generation that lists items never repeats one (`distinct=True`).
#
# The catalog is deterministic: the 249 countries of `pycountry`, keyed by ISO 3166 alpha-3 codes, as travel
# destinations. The last section builds a catalog of *semantic ids* (TIGER-style codes, one token per level) with
# `catalog_from_codes`. The model is SmolLM2-135M-Instruct on the CPU.
#
# Run as a script: `python examples/generative_retrieval.py`.

# %%
import tempfile
import time
from pathlib import Path

import numpy as np
import pycountry
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from trie_decode import TokenTrie
from trie_decode.catalogs import catalog_from_codes, item_entries
from trie_decode.integrations.smollm2 import smollm2_path
from trie_decode.integrations.transformers import TrieLogitsProcessor, rank

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()
path = smollm2_path()
tokenizer = AutoTokenizer.from_pretrained(path)
tokenizer.padding_side = "left"
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

# %% [markdown]
# ## The catalog and its trie file
#
# Each item is a title (the country's common name) and a key (its alpha-3 code). The trie is saved and
# memory-mapped back, as a serving process would load it; filters and results speak in keys. The title catalog
# leaves out "Virgin Islands, U.S.": the end token below is `"."`, where generation stops, so a title that holds one
# before its end could never be written whole (`generate` refuses a trie that holds one).

# %%
countries = sorted(pycountry.countries, key=lambda c: c.alpha_3)
titles = [getattr(c, "common_name", c.name) for c in countries]
keys = [c.alpha_3 for c in countries]
title_of = dict(zip(keys, titles))
listed = [k for k in keys if "." not in title_of[k]]

trie_file = Path(tempfile.mkdtemp()) / "countries.trie.safetensors"
TokenTrie.from_strings([title_of[k] for k in listed], tokenizer, leading_space=True, keys=listed).save(trie_file)
catalog = TokenTrie.load(trie_file, tokenizer=tokenizer)  # memory-mapped; checks CRCs, structure and the tokenizer
print(f"{len(listed)} items, e.g. {listed[0]}: {title_of[listed[0]]}; {catalog}")

# %% [markdown]
# ## A distinct top-10 with scores, without the items each user has seen
#
# `rank(model, inputs, trie, k, deny=...)` runs constrained beam search and returns, per prompt, k distinct items
# sorted by the model's log-probability of the title followed by the end token (`"."`, which the model writes
# after an answer). `deny` takes keys: one list for every prompt, or one list per prompt as here. A denied item's
# subtree is pruned from the mask at every step, so the beams go to other items instead of being wasted on seen
# ones and filtered afterwards.

# %%
USERS = [
    ("I loved my holidays in France, Italy and Spain. Which country should I visit next?", ["FRA", "ITA", "ESP"]),
    ("I have been to Japan, Thailand and Vietnam. Which country should I visit next?", ["JPN", "THA", "VNM"]),
]


def prompt(question: str, lead: str = "You should visit") -> str:
    chat = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) + lead


period = tokenizer.convert_tokens_to_ids(".")
inputs = tokenizer([prompt(q) for q, _ in USERS], return_tensors="pt", padding=True)
options = dict(tokenizer=tokenizer, end_token_id=period, pad_token_id=tokenizer.pad_token_id)


def show(results) -> None:
    for i, r in enumerate(results, 1):
        print(f"  {i:2}. {r.entry.key}  {r.entry.name:<24} log p = {r.log_prob:6.2f}")


t0 = time.perf_counter()
unfiltered = rank(model, inputs, catalog, 10, **options)
filtered = rank(model, inputs, catalog, 10, deny=[seen for _, seen in USERS], **options)
print(f"two top-10 rankings of {len(USERS)} users in {time.perf_counter() - t0:.1f} s\n")
for (question, seen), plain, ranked in zip(USERS, unfiltered, filtered):
    again = [r.entry.key for r in plain if r.entry.key in seen]
    print(question)
    print(f"without a filter, {len(again)} of the 10 are already seen: {' '.join(again)}")
    keys_ranked = [r.entry.key for r in ranked]
    print(f"with deny={seen}: {len(set(keys_ranked))} distinct items, "
          f"{len(set(keys_ranked) & set(seen))} seen")
    show(ranked)
    print()

# %% [markdown]
# ## A list in one generation: `distinct=True`
#
# With `on_complete="repeat"` the trie admits a list of items separated by `","`. Greedy decoding of a list soon
# loops; `distinct=True` removes each item a row has written from the rest of its list (and `deny` still
# applies). A distinct list has a fixed capacity (64 items by default); a full list ends with the end token: it
# never forgets an item to make room, so it never repeats one.

# %%
question, seen = USERS[0]
one = tokenizer([prompt(question.replace("Which country", "Which countries"), "Countries for you:")],
                return_tensors="pt")
comma = tokenizer.convert_tokens_to_ids(",")
for distinct in (False, True):
    processor = TrieLogitsProcessor(catalog, tokenizer, end_token_id=period, on_complete="repeat", separator=[comma],
                                    distinct=distinct, deny=seen)
    out = model.generate(**one, logits_processor=[processor], max_new_tokens=30, do_sample=False,
                         eos_token_id=period, pad_token_id=tokenizer.pad_token_id)
    listed = [e.key for e in processor.match_all(out)[0]]
    print(f"distinct={distinct}: {len(listed)} items, {len(set(listed))} distinct: {', '.join(listed)}")

# %% [markdown]
# ## Semantic ids: a catalog of codes
#
# Recommenders such as TIGER and OneRec give each item a short code, one integer per level, learned so that
# similar items share prefixes, and train the model to write codes. Here the codes come from residual k-means over
# the items' title embeddings (3 levels x 16 codes, a cheap stand-in for an RQ-VAE); level l's code c becomes a
# new special token `<l_c>`. `catalog_from_codes` builds the trie from the (items, levels) code array in one sort
# (10M items x 4 levels in about a second). Items that share a whole code (collisions) are one entry: its
# `key` is the first item's, and `entry.item_keys` lists them all. A filter by any of those keys applies to the
# entry: generation cannot tell the items of one code apart, so denying a seen item denies its code, and with it
# the other items that share the code.
#
# The model was not trained on these codes (their embeddings are only the mean of their items' titles), so the
# order below says little. What holds for any model: every result is a code of the catalog, each lists all its
# items, and no result holds a seen item.

# %%
embeddings = model.get_input_embeddings().weight.detach().numpy()
item_embeddings = np.stack([embeddings[tokenizer.encode(" " + t)].mean(0) for t in titles])
vectors = item_embeddings / np.linalg.norm(item_embeddings, axis=1, keepdims=True)


def kmeans(x: np.ndarray, k: int, iterations: int = 25) -> tuple[np.ndarray, np.ndarray]:
    centers = x[np.linspace(0, len(x) - 1, k).astype(int)].copy()  # deterministic start
    for _ in range(iterations):
        assign = ((x[:, None] - centers[None]) ** 2).sum(-1).argmin(1)
        for j in np.unique(assign):
            centers[j] = x[assign == j].mean(0)
    return assign, centers


LEVELS, CODES = 3, 16
codes, residual = np.zeros((len(keys), LEVELS), dtype=np.int64), vectors - vectors.mean(0)
for level in range(LEVELS):
    codes[:, level], centers = kmeans(residual, CODES)
    residual = residual - centers[codes[:, level]]

code_tokens = [f"<{level}_{c}>" for level in range(LEVELS) for c in range(CODES)]
tokenizer.add_tokens(code_tokens, special_tokens=True)
first_code = tokenizer.convert_tokens_to_ids(code_tokens[0])
model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
with torch.no_grad():  # each code token's embedding: the mean title embedding of its items (tied to the output)
    table = model.get_input_embeddings().weight
    for level in range(LEVELS):
        for c in range(CODES):
            members = item_embeddings[codes[:, level] == c]
            mean = members.mean(0) if len(members) else item_embeddings.mean(0)
            table[first_code + level * CODES + c] = torch.from_numpy(mean)

ids = catalog_from_codes(codes, vocab_size=len(tokenizer), codebook_size=CODES, token_offset=first_code, keys=keys)
shared = max(range(ids.num_entries), key=lambda e: len(ids.entry(e).item_keys))
print(f"{len(keys)} items -> {ids.num_entries} distinct codes ({ids.num_duplicates} items share a code); e.g. "
      f"{tokenizer.decode(ids.entry(shared).tokens)} -> {', '.join(ids.entry(shared).item_keys)}")

question, seen = USERS[0]
entry_of_item = item_entries(ids)
denied = sorted({k for s in seen for k in ids.entry(int(entry_of_item[keys.index(s)])).item_keys})
semantic = rank(model, tokenizer([prompt(question, "")], return_tensors="pt"), ids, 5, num_beams=8, deny=seen,
                end_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)[0]
print(f"deny={seen} also denies the items that share their codes: {', '.join(denied)}")
for r in semantic:
    print(f"  {tokenizer.decode(r.entry.tokens)}  log p = {r.log_prob:6.2f}  items: {', '.join(r.entry.item_keys)}")
print(f"seen items among the results: {sum(k in seen for r in semantic for k in r.entry.item_keys)}")
