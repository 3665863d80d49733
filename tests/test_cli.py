"""``trie-decode build`` from an entries file: every tokenization option gives the trie the Python builder gives,
and bad input is a named error (exit status 1) or a usage error (exit status 2)."""

from __future__ import annotations

import pytest

from trie_decode import TokenTrie
from trie_decode.cli import main

NAMES = ["France", "Germany", "Côte d'Ivoire", "Japan"]


def _build(tmp_path, *flags, entries=None, suffix=".txt"):
    src = tmp_path / f"entries{suffix}"
    src.write_text(entries if entries is not None else "\n".join(NAMES) + "\n", encoding="utf-8")
    out = tmp_path / "out.trie"
    code = main(["build", str(src), "-o", str(out), *flags])
    return code, out


@pytest.mark.parametrize("flags, kwargs", [
    ([], {}),
    (["--leading-space"], dict(leading_space=True)),
    (["--both-spaces"], dict(leading_space=[True, False])),
    (["--context", "The answer is"], dict(context="The answer is")),
    (["--context", "The answer is", "--context", "Answer:\n"], dict(context=["The answer is", "Answer:\n"])),
    (["--leading-space", "--normalize", "NFD"], dict(leading_space=True, normalize="NFD")),
])
def test_build_equals_the_python_builder(tmp_path, tokenizer, smollm2_dir, flags, kwargs):
    code, out = _build(tmp_path, "--tokenizer", smollm2_dir, *flags)
    assert code == 0
    built = TokenTrie.load(out)
    ref = TokenTrie.from_strings(NAMES, tokenizer, **kwargs)
    assert built.sequences() == ref.sequences()
    assert [built.entry(i).name for i in range(built.num_entries)] == [ref.entry(i).name for i in range(ref.num_entries)]
    assert built.options == ref.options and built.fingerprint == ref.fingerprint


def test_jsonl_keys_are_shared_by_every_form(tmp_path, smollm2_dir):
    lines = '{"id": "FR", "text": "France"}\n{"id": "DE", "text": "Germany"}\n'
    code, out = _build(tmp_path, "--tokenizer", smollm2_dir, "--both-spaces", entries=lines, suffix=".jsonl")
    trie = TokenTrie.load(out)
    assert code == 0 and trie.num_entries == 4
    assert sorted(trie.entry(i).key for i in range(4)) == ["DE", "DE", "FR", "FR"]


def test_bad_entries_are_named_errors(tmp_path, smollm2_dir, capsys):
    code, _ = _build(tmp_path, "--tokenizer", smollm2_dir, entries='{"text": "a"}\nnot json\n', suffix=".jsonl")
    assert code == 1 and "entries.jsonl:2: invalid JSON" in capsys.readouterr().err
    code, _ = _build(tmp_path, "--tokenizer", smollm2_dir, "--context", "The answer is ")
    assert code == 1 and "ends with" in capsys.readouterr().err.lower()  # a context that merges with the entries


@pytest.mark.parametrize("flags", [["--prefix-dict", "x.json", "--vocab-size", "10", "--context", "a"],
                                   ["--prefix-dict", "x.json", "--vocab-size", "10", "--both-spaces"]])
def test_entry_options_with_another_source_are_usage_errors(tmp_path, flags):
    with pytest.raises(SystemExit) as exc:
        main(["build", "-o", str(tmp_path / "o"), *flags])
    assert exc.value.code == 2
