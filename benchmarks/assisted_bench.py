"""TrieLogitsProcessor under transformers' assisted decoding (prompt lookup), beside plain greedy decoding.

Why this exists: prompt lookup drafts the next tokens from the prompt, which suits extraction (the entries are in
the text); the processor then sees prefixes that rewind to the accepted tokens (docs/transformers.md, "Assisted
decoding"). This measures the path users run, ``model.generate`` with the processor, both ways, and the time spent
inside the processor: SmolLM2, greedy, a list of the countries a text names (``on_complete="repeat"``), 60 tokens.
Greedy assisted decoding must write the same tokens; the script checks it.

Run: ``python -m benchmarks.assisted_bench [--lookup 10] [--repeats 3]`` (about half a minute). Prints the medians.
"""
import statistics
import time

import torch

TEXT = ("The delegation visited United Kingdom of Great Britain and Northern Ireland, then Bosnia and Herzegovina, "
        "then Saint Vincent and the Grenadines, then Trinidad and Tobago, and finally Central African Republic.")


def main(lookup: int = 10, repeats: int = 3) -> None:
    import pycountry
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trie_decode import TokenTrie
    from trie_decode.integrations.smollm2 import smollm2_path
    from trie_decode.integrations.transformers import TrieLogitsProcessor

    tok = AutoTokenizer.from_pretrained(smollm2_path())
    model = AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.float32).eval()
    trie = TokenTrie.from_strings(sorted({c.name for c in pycountry.countries}), tok, leading_space=True)
    inputs = tok(f"Text: {TEXT}\nEvery country in the text, separated by commas:", return_tensors="pt")
    class Timed(TrieLogitsProcessor):
        """Sums the seconds spent in its calls (one frame more between it and its caller: still recognized)."""

        seconds = 0.0

        def __call__(self, input_ids, scores):
            t = time.perf_counter()
            out = super().__call__(input_ids, scores)
            self.seconds += time.perf_counter() - t
            return out

        __call__.__signature__ = TrieLogitsProcessor.__call__.__signature__

    ways = {"greedy": {}, f"prompt lookup {lookup}": {"prompt_lookup_num_tokens": lookup}}
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    outputs = {}
    for _ in range(repeats):
        for name, extra in ways.items():
            processor = Timed(trie, tok, on_complete="repeat", separator=",")
            t = time.perf_counter()
            out = model.generate(**inputs, logits_processor=[processor], max_new_tokens=60, do_sample=False, **extra)
            runs[name].append((time.perf_counter() - t, processor.seconds))
            outputs[name] = out[0, inputs["input_ids"].shape[1]:].tolist()
    for name, timed in runs.items():
        total, inside = statistics.median(t for t, _ in timed), statistics.median(s for _, s in timed)
        print(f"{name}: {total * 1e3:.0f} ms for {len(outputs[name])} tokens, {inside * 1e3:.1f} ms inside the processor")
    print(f"same tokens: {len({str(v) for v in outputs.values()}) == 1}")

if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lookup", type=int, default=10, help="prompt_lookup_num_tokens")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each way (the median is printed)")
    args = parser.parse_args()
    main(args.lookup, args.repeats)
