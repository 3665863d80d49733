# %% [markdown]
# # Action spans: free text, a constrained action name, free text
#
# An agent-style completion writes a thought (free text), then `Action:` followed by the name of a tool, then the
# tool's input (free text). Only the tool name is constrained, to the names that exist: the constraint waits for
# the trigger `Action:`, holds while the name is written, and releases the row when the name is complete
# (`on_complete="release"`). If the model writes `Action:` again, the next name is constrained again.
#
# Run as a script: `python examples/action_spans.py`.

# %%
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from trie_decode import TokenTrie
from trie_decode.integrations.smollm2 import smollm2_path
from trie_decode.integrations.transformers import TrieLogitsProcessor

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()
path = smollm2_path()
tokenizer = AutoTokenizer.from_pretrained(path)
tokenizer.padding_side = "left"
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

# %% [markdown]
# ## Tools, trigger and trie
#
# The trigger is matched on token ids, so it must be the ids the model writes: at the start of a line `"Action:"`
# is `["Action", ":"]` (after a space it would be `[" Action", ":"]`). A trigger given as text is tokenized
# without special tokens; print it to check. The names follow `"Action:"` after a space, hence
# `leading_space=True`.

# %%
TOOLS = [
    "get_weather", "search_flights", "book_hotel", "send_email", "convert_currency", "set_alarm",
    "play_music", "translate_text", "calculator", "search_web", "create_calendar_event", "get_stock_price",
]
trie = TokenTrie.from_strings(TOOLS, tokenizer, leading_space=True)
trigger = tokenizer("Action:", add_special_tokens=False)["input_ids"]
print("trigger ids:", trigger, [tokenizer.decode([t]) for t in trigger])
print("tokens of ' convert_currency':", [tokenizer.decode([t]) for t in trie.lookup(
    tokenizer(" convert_currency", add_special_tokens=False)["input_ids"]).tokens])

# %% [markdown]
# ## Generation
#
# A one-shot completion prompt shows the format. Everything except the action name is the model's own free text.

# %%
FEW_SHOT = f"""Tools: {", ".join(TOOLS)}

Question: What's the weather like in Paris?
Thought: I need the current weather in Paris.
Action: get_weather
Action Input: Paris
Observation: 18 degrees, sunny.

Question: {{question}}
Thought:"""

QUESTIONS = [
    "How many yen is 50 dollars?",
    "Find me a flight from Rome to Oslo.",
    "What is Apple's share price today?",
    "Translate 'good morning' into Spanish.",
]
processor = TrieLogitsProcessor(trie, tokenizer, trigger="Action:", on_complete="release")
inputs = tokenizer([FEW_SHOT.format(question=q) for q in QUESTIONS], return_tensors="pt", padding=True)
out = model.generate(
    **inputs, logits_processor=[processor], max_new_tokens=40, do_sample=False, pad_token_id=tokenizer.pad_token_id
)
prompt_len = inputs["input_ids"].shape[1]
for question, row, actions in zip(QUESTIONS, out, processor.match_all(out)):
    text = tokenizer.decode(row[prompt_len:], skip_special_tokens=True).split("\nObservation")[0].split("\n\n")[0]
    print(f"Question: {question}\nThought:{text}")
    print(f"    -> actions: {[a.name for a in actions]}\n")

# %% [markdown]
# ## What the constraint allows, step by step
#
# Free text before the trigger and after the name is untouched; inside the span only the tools' tokens (and,
# at a complete name, anything, since the span is released) are allowed. `TrieConstraint` is the core object the
# processor uses; its `allowed` mask shows it on one row.

# %%
from trie_decode import TrieConstraint

constraint = TrieConstraint(trie, processor.rules, "cpu")  # processor.rules: SpanRules(end, "release", trigger)
state = constraint.start(1)
history: list[int] = []
for piece in ["Thought: I will convert.\n", "Action:", " convert", "_currency", "\nAction Input"]:
    for token in tokenizer(piece, add_special_tokens=False)["input_ids"]:
        history.append(token)
        # tails: the row's last tokens, the new one included, so the constraint can see the trigger complete.
        state = constraint.advance(state, torch.tensor([token]), tails=torch.tensor([history[-len(trigger) :]]))
    allowed = int(constraint.allowed(state)[0].sum())
    print(f"after {piece!r:<28} allowed next tokens: {allowed:>6} of {len(tokenizer)}")
