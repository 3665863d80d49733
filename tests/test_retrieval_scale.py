"""Generative retrieval at the widths its users run: 512 beams over a semantic-id catalog, and a distinct top-100
from ``rank``, on the tiny random model (what the model says does not matter; what the constraint lets through
does)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trie_decode.catalogs import catalog_from_codes

END = 2
OFFSET = 1000  # level l's code c is token OFFSET + 16 * l + c


@pytest.fixture(scope="module")
def catalog(tiny_llama):
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(5000, 3))
    keys = [f"item{i}" for i in range(len(codes))]
    return catalog_from_codes(codes, vocab_size=tiny_llama.config.vocab_size, codebook_size=16, token_offset=OFFSET,
                              keys=keys)


@pytest.mark.slow
def test_512_beams_are_all_members_and_distinct(tiny_llama, catalog):
    """num_beams=512 for two prompts: all 1,024 returned beams are catalog entries (no beam dead-ends or leaves the
    trie) and each prompt's 512 are distinct entries (the catalog holds more than 512)."""
    from trie_decode.integrations.transformers import TrieLogitsProcessor

    assert catalog.num_entries > 1024
    proc = TrieLogitsProcessor(catalog, end_token_id=END)
    inputs = {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 10]]), "attention_mask": torch.ones(2, 3, dtype=torch.long)}
    out = tiny_llama.generate(**inputs, logits_processor=[proc], max_new_tokens=catalog.max_depth + 1, num_beams=512,
                              num_return_sequences=512, do_sample=False, pad_token_id=END, eos_token_id=END)
    found = proc.match(out)
    assert all(e is not None for e in found)
    for p in range(2):
        assert len({e.index for e in found[512 * p : 512 * (p + 1)]}) == 512


@pytest.mark.slow
def test_rank_gives_a_distinct_top_100_with_the_models_log_probs(tiny_llama, catalog):
    """rank(k=100): 100 distinct entries, best first, each with the model's summed raw log-probability of its tokens
    and the end token (checked by rescoring a few in one forward pass), and every item key of a shared id."""
    from trie_decode.integrations.transformers import rank

    inputs = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    ranked = rank(tiny_llama, inputs, catalog, 100, end_token_id=END, num_beams=128)[0]
    assert len(ranked) == 100 and len({r.entry.index for r in ranked}) == 100
    scores = [r.log_prob for r in ranked]
    assert scores == sorted(scores, reverse=True)
    for r in (ranked[0], ranked[50], ranked[99]):
        ids = torch.tensor([[5, 6, 7, *r.entry.tokens, END]])
        logp = torch.log_softmax(tiny_llama(input_ids=ids).logits[0, 2:-1].float(), dim=-1)
        expect = logp[torch.arange(ids.shape[1] - 3), ids[0, 3:]].sum().item()
        assert abs(r.log_prob - expect) < 1e-3, (r.log_prob, expect)
        assert set(r.entry.item_keys) >= {r.entry.key}
