# %% [markdown]
# # vLLM offline batch: one engine, a different trie per request
#
# `LLM(..., logits_processors=[TrieLogitsProcessor])` loads the trie processor into the engine; each request then
# names its own constraint in `SamplingParams(extra_args=...)`: a trie file (memory-mapped once per path), an
# inline list of strings or of token-id lists (built once per content), or nothing (unconstrained).
# `trie_args` builds and checks that dict.
#
# Trie files are opened only inside the directories named by `TRIE_DECODE_ALLOWED_DIRS` (or registered by name
# with `TRIE_DECODE_NAMED_TRIES`): closed by default, as for `vllm serve` (see docs/vllm.md, "Security"). Set it
# before creating the `LLM`: the engine's process inherits it.
#
# vLLM starts worker processes, so engine code sits under `if __name__ == "__main__":` (a notebook's
# `__name__` is `"__main__"` too). On a 2-core CPU the engine takes one to two minutes to start.
#
# Run as a script: `python examples/vllm_offline.py`.

# %%
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU: plenty for this example
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep the output readable

import pycountry
from transformers import AutoTokenizer

from trie_decode import TokenTrie
from trie_decode.integrations.smollm2 import smollm2_path

path = smollm2_path()
tokenizer = AutoTokenizer.from_pretrained(path)

# A trie file, built once offline (or with `trie-decode build`), then named by path in requests. Under the
# `__main__` guard: vLLM's worker processes import this module again, and must not build (or allow) another one.
if __name__ == "__main__":
    languages = sorted({lang.name for lang in pycountry.languages})
    trie_file = Path(tempfile.mkdtemp()) / "languages.trie.safetensors"
    TokenTrie.from_strings(languages, tokenizer, leading_space=True).save(trie_file)
    os.environ["TRIE_DECODE_ALLOWED_DIRS"] = str(trie_file.parent)  # requests may name the trie files in this folder
    print(f"{trie_file.name}: {len(languages)} languages")


def prompt(question: str, prefill: str = "The answer is") -> str:
    chat = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) + prefill


# %% [markdown]
# ## The engine
#
# Small settings for a CPU: float32, a short context, eager mode.

# %%
if __name__ == "__main__":
    from vllm import LLM

    from trie_decode.integrations.vllm import TrieLogitsProcessor

    t0 = time.perf_counter()
    llm = LLM(
        path,
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=8,
        enforce_eager=True,
        seed=0,
        logits_processors=[TrieLogitsProcessor],
    )
    print(f"engine ready in {time.perf_counter() - t0:.0f} s")

# %% [markdown]
# ## One batch, four kinds of request
#
# The engine's end token is the tokenizer's EOS; a constrained output ends with it when the entry is complete.

# %%
if __name__ == "__main__":
    from vllm import SamplingParams

    from trie_decode.integrations.vllm import trie_args

    colors = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]
    digits = [tokenizer(" " + d, add_special_tokens=False)["input_ids"] for d in ["one", "two", "three", "four"]]
    requests = [
        ("Which language is spoken in Germany?", trie_args(trie_file)),  # a trie file
        ("Which language is spoken in Mexico?", trie_args(trie_file)),
        ("What color is a ripe banana?", trie_args(colors, leading_space=True)),  # inline strings
        ("How many legs does a bird have?", trie_args(digits)),  # inline token ids
        ("Say hello to the reader in one sentence.", None),  # unconstrained
    ]
    params = [SamplingParams(max_tokens=24, temperature=0.0, extra_args=extra) for _, extra in requests]
    t0 = time.perf_counter()
    prompts = [prompt(q) if extra else prompt(q, prefill="") for q, extra in requests]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    print(f"{len(requests)} requests in {time.perf_counter() - t0:.1f} s\n")
    for (question, extra), out in zip(requests, outputs):
        kind = "unconstrained" if extra is None else f"trie={str(extra['trie'])[:30]}"
        ended = out.outputs[0].token_ids[-1] == tokenizer.eos_token_id
        print(f"{question:<40} {out.outputs[0].text[:40]!r:<28} ends with EOS: {ended!s:<5}  ({kind})")

# %% [markdown]
# ## A bad request is refused before it reaches the batch
#
# Offline, `LLM.generate` raises; the engine keeps serving the next requests. A file outside the allowed folders
# gets the same refusal whether it exists or not.

# %%
if __name__ == "__main__":
    for bad in (str(trie_file) + ".missing", "/etc/passwd"):
        try:
            llm.generate([prompt("Hi")], SamplingParams(max_tokens=4, extra_args={"trie": bad}))
        except Exception as exc:  # noqa: BLE001 - vLLM wraps the processor's TrieRequestError
            print(f"refused: {type(exc).__name__}: {str(exc)[:160]}")
    again = llm.generate([prompt("Which language is spoken in France?")],
                         SamplingParams(max_tokens=24, temperature=0.0, extra_args=trie_args(trie_file)), use_tqdm=False)
    print("next request:", repr(again[0].outputs[0].text))
