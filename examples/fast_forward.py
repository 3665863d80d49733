# %% [markdown]
# # Fast-forward: forced tokens cost no forward pass
#
# Inside a trie most steps have no choice: once a name's prefix is unique, its remaining tokens are forced.
# `fast_forward_generate` makes one real decision per step, appends the forced run, and feeds it all through one
# forward pass. Here the entity-linking task (7,911 language names) runs both ways: the outputs are identical,
# the forward passes are not.
#
# Run as a script: `python examples/fast_forward.py` (the plot is saved next to the system's temp files).

# %%
import tempfile
import time
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import pycountry
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from trie_decode import TokenTrie
from trie_decode.integrations.fast_forward import fast_forward_generate
from trie_decode.integrations.smollm2 import smollm2_path
from trie_decode.integrations.transformers import TrieLogitsProcessor

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()
path = smollm2_path()
tokenizer = AutoTokenizer.from_pretrained(path)
tokenizer.padding_side = "left"
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

# Without the 12 names that hold "." (the end token below; see the entity-linking example).
languages = sorted((lang for lang in pycountry.languages if "." not in lang.name), key=lambda lang: lang.alpha_3)
trie = TokenTrie.from_strings(
    [lang.name for lang in languages], tokenizer, leading_space=True, keys=[lang.alpha_3 for lang in languages]
)
print(trie, f"forced token share: {trie.stats()['forced_token_share']:.0%}")

# %% [markdown]
# ## Step by step vs fast-forward, one question at a time
#
# Long names make the difference visible: ISO names such as "Middle English (1100-1500)" continue well past what
# the model would choose to write, and every token after the last branching point is forced. The end token is
# `"."` (see the entity-linking example); the forced run of a leaf entry includes it.

# %%
QUESTIONS = [
    "Which language is spoken in Germany?",
    "Which language did the ancient Romans speak?",
    "Which sign language is used in Greece?",
    "Which sign language is used in Brazil?",
    "Which language do people speak in Iran?",
]


def prompt(question: str) -> str:
    chat = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) + "The answer is"


period = tokenizer.convert_tokens_to_ids(".")
options = dict(max_new_tokens=32, do_sample=False, eos_token_id=period, pad_token_id=tokenizer.pad_token_id)
rows = []
for question in QUESTIONS:
    inputs = tokenizer([prompt(question)], return_tensors="pt")
    n = inputs["input_ids"].shape[1]
    processor = TrieLogitsProcessor(trie, tokenizer, end_token_id=period)
    t0 = time.perf_counter()
    step = model.generate(**inputs, logits_processor=[processor], **options)
    t_step = time.perf_counter() - t0
    t0 = time.perf_counter()
    fast = fast_forward_generate(
        model, **inputs, trie=trie, tokenizer=tokenizer, end_token_id=period, return_dict_in_generate=True, **options
    )
    t_fast = time.perf_counter() - t0
    s = fast.stats
    same = step[0].tolist() == fast.sequences[0].tolist()
    answer = tokenizer.decode(fast.sequences[0, n:], skip_special_tokens=True).strip()
    # Step by step: one forward pass per generated token (the prefill serves the first one).
    rows.append((answer, step.shape[1] - n, s.forward_passes, s.skip_ratio))
    print(
        f"{answer!r:<34} tokens {s.tokens_emitted:>2}  forward passes: step-by-step {step.shape[1] - n:>2}, "
        f"fast-forward {s.forward_passes:>2}  skip ratio {s.skip_ratio:4.0%}  "
        f"time {t_step:.2f}s vs {t_fast:.2f}s  identical: {same}"
    )

# %% [markdown]
# ## A batch
#
# Rows emit different numbers of tokens per step (ragged blocks); a batch costs the largest number of decisions
# of any row. `FastForwardStats.step_by_step_passes` is what token-by-token decoding would have taken.

# %%
inputs = tokenizer([prompt(q) for q in QUESTIONS], return_tensors="pt", padding=True)
# Without return_dict_in_generate the result is the sequences tensor, with the stats attached as `.stats`.
sequences = fast_forward_generate(model, **inputs, trie=trie, tokenizer=tokenizer, end_token_id=period, **options)
print({k: v for k, v in sequences.stats.as_dict().items() if k != "seconds"})

# %% [markdown]
# ## The skip ratio per answer

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
labels = [r[0] for r in rows]
ax1.barh(labels, [r[3] for r in rows], color="tab:green")
ax1.set_xlim(0, 1)
ax1.set_xlabel("skip ratio (forced tokens / tokens)")
ax1.invert_yaxis()
y = range(len(rows))
ax2.barh([i - 0.2 for i in y], [r[1] for r in rows], height=0.4, label="step by step")
ax2.barh([i + 0.2 for i in y], [r[2] for r in rows], height=0.4, label="fast-forward")
ax2.set_yticks(list(y), [""] * len(rows))
ax2.invert_yaxis()
ax2.set_xlabel("forward passes")
ax2.legend(loc="lower right")
fig.tight_layout()
png = Path(tempfile.gettempdir()) / "trie_decode_fast_forward.png"
fig.savefig(png, dpi=80)
print(f"plot saved to {png} (backend {matplotlib.get_backend()})")
