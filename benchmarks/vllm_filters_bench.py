"""vLLM's V1 logits processor with per-request filters, when the batch's filtered requests change (issue 22).

Why this exists: the processor builds the filters of a batch's rows together (one ``RowFilters``), so a request
joining or leaving rebuilds every row's filter. A static filter's per-node flags are kept on its trie, keyed by the
filter's content (``trie_decode.filters``); this measures what such a step costs. 16 requests over a 1M-item
semantic-id catalog (a trie file), each denying its own 10k entries; per step ``apply`` on (16, V) float32 logits,
with the batch unchanged, then after one request was replaced by a new one (another 10k-entry deny list).

Run: ``python -m benchmarks.vllm_filters_bench [--requests 64]`` (needs vLLM; about a minute). Prints the medians of 40 steps each.
"""
import os
import statistics
import tempfile
import time
from types import SimpleNamespace

import numpy as np
import torch

ENTRIES, DENIED, STEPS = 1_000_000, 10_000, 40


def main(batch: int = 16) -> None:
    folder = tempfile.mkdtemp()
    os.environ["TRIE_DECODE_ALLOWED_DIRS"] = folder  # read by the processor's access policy when it is made
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from trie_decode.catalogs import catalog_from_codes
    from trie_decode.integrations.smollm2 import smollm2_path
    from trie_decode.integrations.vllm import TrieLogitsProcessor

    torch.set_num_threads(1)
    vocab = len(AutoTokenizer.from_pretrained(smollm2_path()))
    rng = np.random.default_rng(0)
    first = (rng.zipf(1.2, size=ENTRIES) - 1) % 256
    codes = np.column_stack([first] + [rng.integers(0, 256, size=ENTRIES) for _ in range(3)])
    trie = catalog_from_codes(codes, vocab_size=vocab, codebook_size=256, token_offset=1000)
    path = os.path.join(folder, "catalog.safetensors")
    trie.save(path)
    model = SimpleNamespace(tokenizer=smollm2_path(), tokenizer_revision=None, trust_remote_code=False,
                            get_vocab_size=lambda: vocab)
    proc = TrieLogitsProcessor(SimpleNamespace(model_config=model, scheduler_config=SimpleNamespace(max_num_seqs=max(32, batch))),
                               torch.device("cpu"), False)

    def request() -> SamplingParams:
        deny = rng.choice(trie.num_entries, size=DENIED, replace=False).tolist()
        return SamplingParams(extra_args={"trie": path, "deny": deny})

    proc.update_state(BatchUpdate(batch_size=batch, removed=[], moved=[],
                                  added=[(i, request(), [1], []) for i in range(batch)]))
    logits = torch.zeros(batch, vocab)
    assert len(proc._table.rows) == batch and not torch.isfinite(proc.apply(logits.clone())).all()
    steady, changed = [], []
    for step in range(STEPS):
        x = logits.clone()
        t = time.perf_counter()
        proc.apply(x)
        steady.append(time.perf_counter() - t)
        # a new request in a finished one's slot (vLLM fills the slot: the index is not also in ``removed``)
        proc.update_state(BatchUpdate(batch_size=batch, removed=[], moved=[], added=[(step % batch, request(), [1], [])]))
        x = logits.clone()
        t = time.perf_counter()
        proc.apply(x)
        changed.append(time.perf_counter() - t)
    print(f"apply, {batch} requests denying {DENIED} of {trie.num_entries} entries each: batch unchanged "
          f"{statistics.median(steady) * 1e3:.2f} ms; after one request was replaced {statistics.median(changed) * 1e3:.2f} ms")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16, help="requests in the batch, each with its own filter")
    main(parser.parse_args().requests)
