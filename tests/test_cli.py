"""``trie-decode build`` from an entries file: every tokenization option gives the trie the Python builder gives,
and bad input is a named error (exit status 1) or a usage error (exit status 2)."""

from __future__ import annotations

import os

import numpy as np
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


# ------------------------------------------------------------------ advice names the command line's flags


def test_context_errors_recommend_flags_and_on_unstable_raw_builds(tmp_path, tokenizer, smollm2_dir, capsys):
    entries = "-hello\nFrance\n"
    code, _ = _build(tmp_path, "--tokenizer", smollm2_dir, "--context", '"country": "', entries=entries)
    err = capsys.readouterr().err
    assert code == 1 and "--on-unstable raw" in err and "on_unstable=" not in err
    code, _ = _build(tmp_path, "--tokenizer", smollm2_dir, "--context", "The answer is ")
    err = capsys.readouterr().err
    assert code == 1 and "--context 'The answer is' or --leading-space" in err and "leading_space=" not in err
    code, out = _build(tmp_path, "--tokenizer", smollm2_dir, "--context", '"country": "', "--on-unstable", "raw",
                       entries=entries)
    ref = TokenTrie.from_strings(["-hello", "France"], tokenizer, context='"country": "', on_unstable="raw")
    assert code == 0 and TokenTrie.load(out).sequences() == ref.sequences()
    assert TokenTrie.load(out).options == ref.options


# ------------------------------------------------------------------ input and output errors: one line, status 1


def _error(capsys):
    err = capsys.readouterr().err
    assert err.startswith("trie-decode build: error: ") and "Traceback" not in err and err.count("\n") == 1, err
    return err


def test_unreadable_inputs_and_outputs_are_named_errors(tmp_path, smollm2_dir, capsys):
    (tmp_path / "bad.txt").write_bytes(b"France\n\xff\xfe bad\n")
    (tmp_path / "ok.txt").write_text("France\n")
    ok, out = str(tmp_path / "ok.txt"), str(tmp_path / "o.trie")
    assert main(["build", str(tmp_path / "bad.txt"), "--tokenizer", smollm2_dir, "-o", out]) == 1
    assert "bad.txt:2: not UTF-8 text (byte 0xff" in _error(capsys)
    missing = str(tmp_path / "nonexistent")
    assert main(["build", ok, "--tokenizer", missing, "-o", out]) == 1
    assert f"--tokenizer {missing}: no such folder" in _error(capsys)
    (tmp_path / "d.json").write_text('{"start_token_id": 1, "end_token_id": 2, "prefix_dict": {"1": [3]}}')
    assert main(["build", "--prefix-dict", str(tmp_path / "d.json"), "--tokenizer", missing, "-o", out]) == 1
    assert f"--tokenizer {missing}: no such folder" in _error(capsys)
    (tmp_path / "empty_dir").mkdir()
    assert main(["build", ok, "--tokenizer", str(tmp_path / "empty_dir"), "-o", out]) == 1
    assert "cannot load a tokenizer" in _error(capsys)
    assert main(["build", ok, "--tokenizer", smollm2_dir, "-o", str(tmp_path / "no" / "o.trie")]) == 1
    assert "the folder" in _error(capsys)
    assert main(["build", ok, "--tokenizer", smollm2_dir, "-o", str(tmp_path)]) == 1
    assert "it is a folder" in _error(capsys)
    np.save(tmp_path / "codes.npy", np.array([[0, 1], [1, 0]]))
    assert main(["build", "--codes", str(tmp_path / "codes.npy"), "--codebook-size", "2", "--vocab-size", "8",
                 "--keys", str(tmp_path / "missing.txt"), "-o", out]) == 1
    assert "keys file not found" in _error(capsys)


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_keys_or_entries_file_that_is_not_a_regular_file_is_named(tmp_path, capsys, kind):
    # A FIFO given as --keys blocked `trie-decode build` forever (the codes and entries files were checked).
    odd = tmp_path / "odd"
    os.mkfifo(odd) if kind == "fifo" else odd.mkdir()
    said = "is not a regular file" if kind == "fifo" else "is a folder, not a file"
    np.save(tmp_path / "codes.npy", np.array([[0, 1], [1, 0]]))
    out = str(tmp_path / "o.trie")
    assert main(["build", "--codes", str(tmp_path / "codes.npy"), "--codebook-size", "2", "--vocab-size", "8",
                 "--keys", str(odd), "-o", out]) == 1
    assert f"keys file {odd} {said}" in _error(capsys)
    assert main(["build", str(odd), "--tokenizer", "unused", "-o", out]) == 1
    assert f"entries file {odd} {said}" in _error(capsys)


@pytest.mark.parametrize("source", [["{long}", "--tokenizer", "unused"],
                                    ["--codes", "{long}", "--codebook-size", "2", "--vocab-size", "8"],
                                    ["--prefix-dict", "{long}", "--vocab-size", "8"],
                                    ["--codes", "{codes}", "--codebook-size", "2", "--vocab-size", "8", "-o", "{long}"]],
                         ids=["entries", "codes", "prefix-dict", "output"])
def test_a_path_stat_refuses_is_a_named_error_not_a_traceback(tmp_path, capsys, source):
    # Path.is_file() and is_dir() raise OSError for a name too long (ENAMETOOLONG) or a folder without search
    # permission; that was a traceback out of `trie-decode build`.
    np.save(tmp_path / "codes.npy", np.array([[0, 1], [1, 0]]))
    long = str(tmp_path / ("x" * 300))
    args = [a.format(long=long, codes=tmp_path / "codes.npy") for a in source]
    out = [] if "-o" in args else ["-o", str(tmp_path / "o.trie")]
    assert main(["build", *args, *out]) == 1
    assert "File name too long" in _error(capsys)


def test_an_empty_source_path_is_that_source(tmp_path, capsys):
    # An empty path is a path too: it was taken for no source at all (TypeError: Path(None), a traceback), then read
    # as the current folder ("codes file . is a folder"): it is a usage error naming the empty path.
    for flags in (["--codes", "", "--codebook-size", "2"], ["--prefix-dict", ""]):
        with pytest.raises(SystemExit) as exc:
            main(["build", *flags, "--vocab-size", "8", "-o", str(tmp_path / "o")])
        assert exc.value.code == 2
        assert f"error: the {flags[0]} file is an empty path: give a file" in capsys.readouterr().err


# ------------------------------------------------------------------ options of another kind of source: status 2


@pytest.mark.parametrize("flags, message", [
    (["--codes", "c.npy", "--codebook-size", "2", "--vocab-size", "8", "--leading-space"],
     "--leading-space only applies to an entries file"),
    (["--codes", "c.npy", "--codebook-size", "2", "--vocab-size", "8", "--strict"],
     "--strict only applies to --prefix-dict"),
    (["--codes", "c.npy", "--codebook-size", "2", "--vocab-size", "8", "--context", "x"],
     "--context only applies to an entries file"),
    (["--codes", "c.npy", "--codebook-size", "2", "--vocab-size", "8", "--tokenizer", "t"],
     "--tokenizer only applies to an entries file or --prefix-dict"),
    (["names.txt", "--tokenizer", "t", "--token-offset", "5"], "--token-offset only applies to --codes"),
    (["names.txt", "--tokenizer", "t", "--vocab-size", "5"], "--vocab-size only applies to --prefix-dict or --codes"),
    (["--prefix-dict", "d.json", "--vocab-size", "9", "--on-unstable", "raw"],
     "--on-unstable only applies to an entries file"),
    (["--codes", "c.npy", "--codebook-size", "2", "--vocab-size", "-1"],
     "--vocab-size must be an integer in [1, 2**31], got -1"),
    (["--prefix-dict", "d.json", "--vocab-size", "-1"], "--vocab-size must be an integer in [1, 2**31], got -1"),
    (["--codes", "c.npy", "--codebook-size", "0", "--vocab-size", "8"], "--codebook-size must be a positive integer"),
    (["--codes", "c.npy", "--codebook-size", "2", "--vocab-size", "8", "--token-offset", "-1"],
     "--token-offset must be a token id in [0, 8), got -1"),
    # Past the vocabulary it was refused by catalog_from_codes, under its Python name: "token_offset must be ...".
    (["--codes", "c.npy", "--codebook-size", "2", "--vocab-size", "8", "--token-offset", "8"],
     "--token-offset must be a token id in [0, 8), got 8"),
])
def test_options_of_another_source_and_bad_values_are_usage_errors(tmp_path, flags, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["build", "-o", str(tmp_path / "o"), *flags])
    assert exc.value.code == 2 and message in capsys.readouterr().err


# ------------------------------------------------------------------ entries files: ids and byte-order marks


@pytest.mark.parametrize("line, shown", [('{"id": null, "text": "blue"}', "null"),
                                         ('{"id": ["x"], "text": "blue"}', '["x"]'),
                                         ('{"id": true, "text": "blue"}', "true")])
def test_a_jsonl_id_that_is_not_a_string_or_a_number_is_refused(tmp_path, smollm2_dir, capsys, line, shown):
    lines = '{"id": "A1", "text": "red"}\n' + line + "\n"
    code, out = _build(tmp_path, "--tokenizer", smollm2_dir, entries=lines, suffix=".jsonl")
    assert code == 1 and f"entries.jsonl:2: 'id' is {shown}" in _error(capsys) and not out.exists()


@pytest.mark.parametrize("line, message", [
    ('{"id": "\\ud800", "text": "blue"}', "a key '\\ud800' holds the lone surrogate '\\ud800' at index 0"),
    ('{"id": "B2", "text": "bl\\udc00ue"}', "entry 1 'bl\\udc00ue' holds the lone surrogate '\\udc00' at index 2"),
])
def test_a_jsonl_lone_surrogate_escape_is_a_named_error_not_a_traceback(tmp_path, smollm2_dir, capsys, line, message):
    # Valid JSON, but not UTF-8 text: the key table could not encode it, and the tokenizer failed deep inside.
    lines = '{"id": "A1", "text": "red"}\n' + line + "\n"
    code, out = _build(tmp_path, "--tokenizer", smollm2_dir, entries=lines, suffix=".jsonl")
    assert code == 1 and message in _error(capsys) and not out.exists()


def test_a_jsonl_number_id_is_its_text(tmp_path, smollm2_dir):
    code, out = _build(tmp_path, "--tokenizer", smollm2_dir, entries='{"id": 7, "text": "red"}\n', suffix=".jsonl")
    assert code == 0 and TokenTrie.load(out).entry(0).key == "7"


def test_a_codes_file_that_is_not_npy_is_named_without_numpy_pickle_advice(tmp_path, capsys):
    """A text or .npz file given as --codes was read by numpy as a pickle, and the error advised loading it
    "unsafely using the allow_pickle= keyword", an option the command line does not have (nor should)."""
    (tmp_path / "codes.txt").write_text("0 1\n1 0\n")
    np.savez(tmp_path / "codes.npz", codes=np.array([[0, 1], [1, 0]]))
    for name in ("codes.txt", "codes.npz"):
        assert main(["build", "--codes", str(tmp_path / name), "--codebook-size", "2", "--vocab-size", "8",
                     "-o", str(tmp_path / "c.trie")]) == 1
        error = _error(capsys)
        assert f"{name} is not a .npy file: save the codes (an integer array, items x levels) with numpy.save" in error
        assert "pickle" not in error


def test_a_keys_file_is_split_at_line_ends_only(tmp_path, capsys):
    """A key holding U+2028 or a form feed is one key (str.splitlines made 4 keys of 3 lines, refused)."""
    np.save(tmp_path / "codes.npy", np.array([[0, 1], [1, 0], [1, 1]]))
    (tmp_path / "keys.txt").write_bytes("\ufeffa\u2028b\r\nc\x0cd\ne".encode())
    out = tmp_path / "k.trie"
    assert main(["build", "--codes", str(tmp_path / "codes.npy"), "--codebook-size", "2", "--vocab-size", "8",
                 "--keys", str(tmp_path / "keys.txt"), "-o", str(out)]) == 0
    assert [TokenTrie.load(out).entry(i).key for i in range(3)] == ["a\u2028b", "c\x0cd", "e"]


@pytest.mark.parametrize("suffix, entries", [(".txt", "France\nJapan\n"),
                                             (".jsonl", '{"text": "France"}\n{"text": "Japan"}\n')])
def test_a_byte_order_mark_is_skipped(tmp_path, smollm2_dir, suffix, entries):
    src = tmp_path / f"entries{suffix}"
    src.write_bytes(b"\xef\xbb\xbf" + entries.encode())
    out = tmp_path / "out.trie"
    assert main(["build", str(src), "--tokenizer", smollm2_dir, "-o", str(out)]) == 0
    assert TokenTrie.load(out).names() == ["France", "Japan"]


# ------------------------------------------------------------------ the output is never one of the inputs


@pytest.mark.parametrize("source", ["entries", "prefix_dict", "codes", "keys", "link"])
def test_an_output_that_is_an_input_is_a_usage_error(tmp_path, capsys, monkeypatch, source):
    # Was: the trie was written over the input file.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.txt").write_text("France\n", encoding="utf-8")
    (tmp_path / "keys.txt").write_text("a\n", encoding="utf-8")
    (tmp_path / "d.json").write_text("{}", encoding="utf-8")
    np.save(tmp_path / "c.npy", np.array([[1, 2]]))
    (tmp_path / "link.txt").symlink_to("in.txt")
    codes = ["--codes", "c.npy", "--codebook-size", "4", "--vocab-size", "9"]
    argv, what, output = {
        "entries": (["in.txt", "--tokenizer", "t"], "entries file in.txt", "./in.txt"),
        "prefix_dict": (["--prefix-dict", "d.json", "--vocab-size", "9"], "--prefix-dict file d.json",
                        str(tmp_path / "d.json")),
        "codes": (codes, "--codes file c.npy", "c.npy"),
        "keys": ([*codes, "--keys", "keys.txt"], "--keys file keys.txt", "keys.txt"),
        "link": (["in.txt", "--tokenizer", "t"], "entries file in.txt", "link.txt"),
    }[source]
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(SystemExit) as exc:
        main(["build", *argv, "-o", output])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"-o {output} is the {what}: the trie would overwrite it" in err, err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_on_unstable_without_context_is_a_usage_error_naming_context(tmp_path, capsys):
    # Was: --on-unstable raw built the trie and was ignored (it only says what a context does).
    with pytest.raises(SystemExit) as exc:
        main(["build", "names.txt", "--tokenizer", "t", "--leading-space", "--on-unstable", "raw", "-o",
              str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--on-unstable raw only applies with a context" in err
    assert "add --context TEXT" in err and "context=" not in err
