"""The ``trie-decode`` command line: build a trie file from a list, inspect one, run the benchmarks.

Why this exists: tries are usually built offline from a catalogue (names, ids) and shipped as a file to the
serving side (``vllm serve`` loads them by path). ``build`` and ``info`` make that a one-liner; ``bench`` runs the
benchmark suites of a source checkout (they are not part of the installed package: :func:`checkout_root`).

    trie-decode build names.txt --tokenizer MODEL_DIR -o names.trie.safetensors
    trie-decode build items.jsonl --tokenizer MODEL_DIR -o items.trie.safetensors   # {"id": ..., "text": ...}
    trie-decode build --prefix-dict tree.json --vocab-size 152064 -o tree.trie.safetensors   # RTP-LLM prefix dict
    trie-decode build --codes ids.npy --codebook-size 256 --token-offset 49152 --vocab-size 50176 -o items.trie.safetensors
    trie-decode info names.trie.safetensors
    trie-decode bench --suite step --quick
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from .errors import ConstraintConfigError, DescriptorError, TokenizerNotFoundError, TrieDecodeError, TrieFileError
from .fileio import check_writable, text_lines
from .options import (FLAGS, NORMAL_FORMS, ON_UNSTABLE_MODES, check_on_unstable_context, check_positive,
                      check_vocab_size, token_id)
from .tokenizers import ContextError

__all__ = ["main", "read_entries", "checkout_root"]


def _read_text(path: Path, what: str) -> str:
    """The text of the input file ``path`` (``what`` it is, for the message): UTF-8, a byte-order mark at its start
    skipped (as Python's ``utf-8-sig`` does).

    Raises:
        DescriptorError: the file is missing, a folder or unreadable, or not UTF-8 (the line is named).
    """
    _check_file(path, what)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DescriptorError(f"cannot read the {what} {path}: {exc.strerror or exc}") from exc
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise DescriptorError(f"{path}:{line}: not UTF-8 text (byte {raw[exc.start]:#04x}: {exc.reason}); save the "
                              "file as UTF-8") from exc


def _check_file(path: Path, what: str) -> None:
    """Raise :class:`DescriptorError` unless ``path`` is a regular file (a FIFO would block the read), naming
    ``what`` it is; what ``stat`` refuses (a name too long, a folder that cannot be searched) is named too."""
    try:
        if path.is_file():
            return
        if path.is_dir():
            raise DescriptorError(f"{what} {path} is a folder, not a file")
        if path.exists():
            raise DescriptorError(f"{what} {path} is not a regular file (a pipe or a device would block the read)")
    except OSError as exc:
        raise DescriptorError(f"cannot read the {what} {path}: {exc.strerror or exc}") from exc
    raise DescriptorError(f"{what} not found: {path}")


class _NumberText(str):
    """A JSON number with a fraction or an exponent, as written (``float`` would make the key of ``1e2`` "100.0")."""


def read_entries(path: Path) -> tuple[list[str], Optional[list[str]]]:
    """Read entries: ``.jsonl`` lines with ``text`` (and optional ``id``), or plain text, one entry per line.

    The file is UTF-8 (a byte-order mark at its start is skipped, in either kind). A JSONL ``id`` is a string or a
    number (its text is the key); ``null`` or any other value is refused, as is an ``id`` on some lines only.

    Raises:
        DescriptorError: a missing or non-UTF-8 file; a JSONL line that is not an object with a string ``text``, or
            whose ``id`` is not a string or a number (the line number is named).
    """
    texts: list[str] = []
    keys: list[str] = []
    jsonl = path.suffix.lower() in (".jsonl", ".ndjson")
    for lineno, line in enumerate(text_lines(_read_text(path, "entries file")), 1):
        if not line.strip():
            continue
        if not jsonl:
            texts.append(line)
            continue
        try:
            obj = json.loads(line, parse_float=_NumberText)
        except json.JSONDecodeError as exc:
            raise DescriptorError(f"{path}:{lineno}: invalid JSON ({exc.msg})") from exc
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str) or isinstance(obj["text"], _NumberText):
            raise DescriptorError(f"{path}:{lineno}: expected an object with a string field 'text'")
        texts.append(obj["text"])
        if "id" in obj:
            key = obj["id"]
            if isinstance(key, bool) or not isinstance(key, (str, int, float)):
                raise DescriptorError(f"{path}:{lineno}: 'id' is {json.dumps(key)[:40]}; an id is a string or a "
                                      "number (leave 'id' out on every line for entries without keys)")
            keys.append(str(key))
    if jsonl and keys and len(keys) != len(texts):
        raise DescriptorError(f"{path}: 'id' is present on {len(keys)} of {len(texts)} lines; give it on all or none")
    return texts, (keys if keys else None)


def _load_tokenizer(name: str) -> Any:
    """``--tokenizer``: a Hugging Face tokenizer folder or name (:func:`.hub.load_tokenizer`: a name found nowhere
    fails at once, as :class:`TokenizerNotFoundError`), or :class:`DescriptorError` naming it."""
    from .hub import load_tokenizer

    try:
        import transformers  # noqa: F401  an optional dependency: the core install has no tokenizer to load
    except ImportError as exc:
        raise DescriptorError(f"--tokenizer {name}: loading a tokenizer needs transformers, which is not installed "
                              "(pip install 'trie-decode[transformers]')") from exc
    try:
        return load_tokenizer(name, what="--tokenizer")
    except TokenizerNotFoundError:
        raise
    except (OSError, ValueError) as exc:  # transformers' "not found", "not a valid model identifier", bad files
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DescriptorError(f"--tokenizer {name}: cannot load a tokenizer ({first})") from exc


def _cmd_build_prefix_dict(args: argparse.Namespace) -> int:
    """``build --prefix-dict``: an RTP-LLM prefix dict (tree_decode_config JSON) to a trie file."""
    from .descriptors import read_json, trie_from_prefix_dict

    path = Path(args.prefix_dict)
    payload = read_json(path, "prefix dict")  # a missing or bad file is named before the tokenizer loads (~6 s)
    t0 = time.perf_counter()
    vocab_size, fingerprint = args.vocab_size, ""
    if args.tokenizer:
        from .tokenizers import tokenizer_fingerprint, tokenizer_vocab_size

        tokenizer = _load_tokenizer(args.tokenizer)
        fingerprint = tokenizer_fingerprint(tokenizer)
        vocab_size = vocab_size or tokenizer_vocab_size(tokenizer)
    t1 = time.perf_counter()
    trie = trie_from_prefix_dict(payload, vocab_size, strict=args.strict, fingerprint=fingerprint)
    t2 = time.perf_counter()
    trie.save(args.output)
    t3 = time.perf_counter()
    stats = trie.stats()
    mode = "strict" if args.strict else "read as RTP-LLM reads it"
    print(
        f"built {args.output} from the RTP-LLM prefix dict {path.name} ({mode}): {stats['entries']:,} entries, "
        f"{stats['nodes']:,} nodes, root fanout {stats['root_fanout']:,}, end token {trie.options['end_token_id']}"
    )
    if trie.options.get("end_at_start"):
        end = trie.options["end_token_id"]
        print(f"note: the end token may follow the start token directly (stored as the one-token entry [{end}])")
    load = f"tokenizer load {t1 - t0:.2f}s, " if args.tokenizer else ""
    print(f"time: {load}build {t2 - t1:.2f}s, save {t3 - t2:.2f}s")
    return 0


#: How every .npy file starts (numpy's format: the magic string then the format version).
_NPY_MAGIC = b"\x93NUMPY"


def _cmd_build_codes(args: argparse.Namespace) -> int:
    """``build --codes``: a semantic-id catalog (an .npy array of codes, items x levels) to a trie file."""
    import numpy as np

    from .catalogs import catalog_from_codes

    path = Path(args.codes)
    _check_file(path, "codes file")
    with open(path, "rb") as f:
        magic = f.read(len(_NPY_MAGIC))
    if magic != _NPY_MAGIC:  # numpy would read it as a pickle, and advise loading it "unsafely" (allow_pickle=)
        raise DescriptorError(f"{path} is not a .npy file: save the codes (an integer array, items x levels) with "
                              "numpy.save")
    try:
        codes = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as exc:
        raise DescriptorError(f"{path} is not a .npy array of integer codes ({exc})") from exc
    keys = None
    if args.keys:
        keys = text_lines(_read_text(Path(args.keys), "keys file"))
        if len(keys) != len(codes):
            raise DescriptorError(f"--keys {args.keys} has {len(keys):,} lines for {len(codes):,} rows of codes: give "
                                  "one key per item, in the codes' order")
    t0 = time.perf_counter()
    offset = 0 if args.token_offset is None else args.token_offset
    trie = catalog_from_codes(np.asarray(codes), vocab_size=args.vocab_size, codebook_size=args.codebook_size,
                              token_offset=offset, keys=keys)
    t1 = time.perf_counter()
    trie.save(args.output)
    t2 = time.perf_counter()
    dup = trie.num_duplicates
    print(f"built {args.output} from {len(codes):,} items x {codes.shape[1]} levels: {trie.num_entries:,} distinct ids "
          f"({dup:,} item{' shares' if dup == 1 else 's share'} an id), {trie.num_nodes:,} nodes")
    print(f"time: build {t1 - t0:.2f}s, save {t2 - t1:.2f}s")
    return 0


def _cmd_build(args: argparse.Namespace) -> int:
    # The source _check_build_args found given: an empty path ("") is given, and falsy.
    if args.prefix_dict is not None:
        return _cmd_build_prefix_dict(args)
    if args.codes is not None:
        return _cmd_build_codes(args)
    from .trie import TokenTrie

    path = Path(args.entries)
    texts, keys = read_entries(path)
    for i, text in enumerate(texts):
        if text == "":
            raise DescriptorError(f"{path}: entry {i} is empty")
    t0 = time.perf_counter()
    tokenizer = _load_tokenizer(args.tokenizer)
    t1 = time.perf_counter()
    spaces = [True, False] if args.both_spaces else (True if args.leading_space else None)
    if len(texts) >= 200_000:
        print(f"tokenizing {len(texts):,} entries ...", file=sys.stderr)
    context = args.context[0] if args.context and len(args.context) == 1 else args.context
    trie = TokenTrie.from_strings(texts, tokenizer, leading_space=spaces, context=context, keys=keys,
                                  normalize=args.normalize, on_unstable=args.on_unstable or "raise")
    t2 = time.perf_counter()
    trie.save(args.output)
    t3 = time.perf_counter()
    stats = trie.stats()
    forms = f", {trie.options['forms']} forms each" if trie.options.get("forms") else ""
    print(
        f"built {args.output}: {stats['entries']:,} entries{forms} ({stats['duplicates_merged']:,} duplicates merged), "
        f"{stats['nodes']:,} nodes, {stats['bytes_per_node']} bytes/node"
    )
    print(f"time: tokenizer load {t1 - t0:.2f}s, tokenize and build {t2 - t1:.2f}s, save {t3 - t2:.2f}s")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    from .trie import TokenTrie

    trie = TokenTrie.load(args.file, verify=not args.no_verify)
    try:
        return _print_info(args, trie)
    except (ValueError, IndexError) as exc:  # only unchecked arrays (--no-verify) get this far broken
        if not args.no_verify or isinstance(exc, TrieDecodeError):
            raise
        first = (str(exc).strip().splitlines() or [""])[0].rstrip(".")
        raise TrieFileError(f"{args.file} cannot be described: {type(exc).__name__}: {first[:200]}; it is corrupt, "
                              "or not what its header says: run without --no-verify to check it") from exc


def _print_info(args: argparse.Namespace, trie: Any) -> int:
    stats = trie.stats()
    stats["file_bytes"] = Path(args.file).stat().st_size
    stats["options"] = trie.options
    shown = [trie.entry(i) for i in range(min(args.show, trie.num_entries))]
    if args.json:
        if args.show:
            stats["first_entries"] = [{"index": e.index, "name": e.name, "key": e.key, "tokens": list(e.tokens)}
                                      for e in shown]
        print(json.dumps(stats, indent=2))
        return 0
    print(f"{args.file}")
    for key in ("entries", "duplicates_merged", "nodes", "max_depth", "bytes", "bytes_per_node", "file_bytes",
                "root_fanout", "max_fanout", "forced_token_share", "vocab_size", "fingerprint"):
        print(f"  {key:<20} {stats[key]}")
    print("  fanout histogram     " + ", ".join(f"{k}: {v:,}" for k, v in stats["fanout_histogram"].items()))
    print(f"  options              {json.dumps(trie.options)}")
    for e in shown:
        print(f"  [{e.index}] {e.name!r} key={e.key!r} tokens={list(e.tokens)}")
    return 0


def checkout_root() -> Optional[Path]:
    """The source checkout this package runs from (an editable install), or None when it was installed from a wheel.

    The benchmarks and the model fixtures are not shipped: they live in the checkout's ``benchmarks/`` and
    ``model_fixtures/`` folders, beside ``trie_decode/``.
    """
    root = Path(__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() and (root / "benchmarks" / "suites.py").is_file() else None


def _cmd_bench(argv: Sequence[str]) -> int:
    root = checkout_root()
    if root is None:
        print(
            "trie-decode bench: the benchmarks run from a source checkout; they are not part of the installed package "
            f"({Path(__file__).resolve().parent}). Clone the repository, run `make venv` there, then "
            "`.venv/bin/trie-decode bench ...` (or `python -m benchmarks ...` from the checkout's root).",
            file=sys.stderr,
        )
        return 2
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import benchmarks

    if Path(benchmarks.__file__).resolve().parent != root / "benchmarks":
        print(f"trie-decode bench: `import benchmarks` found {benchmarks.__file__}, not the checkout's "
              f"{root / 'benchmarks'}; run it from another folder", file=sys.stderr)
        return 2
    return int(benchmarks.main(list(argv)) or 0)


#: The options of ``build`` that each kind of source takes (by their ``args`` names); any other is a usage error.
_SOURCE_OPTIONS = {
    "entries": ("tokenizer", "leading_space", "both_spaces", "context", "normalize", "on_unstable"),
    "prefix_dict": ("tokenizer", "vocab_size", "strict"),
    "codes": ("vocab_size", "codebook_size", "token_offset", "keys"),
}
_SOURCE_NAMES = {"entries": "an entries file", "prefix_dict": "--prefix-dict", "codes": "--codes"}
#: The input files of ``build`` (by their ``args`` names), as named when ``-o`` would overwrite one.
_INPUT_FILES = {"entries": "entries file", "prefix_dict": "--prefix-dict file", "codes": "--codes file",
                "keys": "--keys file"}


def _check_output_is_no_input(build: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A usage error when ``-o`` names one of the input files (the same file, by any path: a symbolic or hard link
    too): the trie would overwrite it."""
    for option, what in _INPUT_FILES.items():
        source = getattr(args, option)
        if not source:
            continue
        try:
            same = os.path.samefile(source, args.output)
        except (OSError, ValueError):  # one of them does not exist (nothing to overwrite), or cannot be looked at
            continue
        if same:
            build.error(f"-o {args.output} is the {what} {source}: the trie would overwrite it; give another "
                        "output file")
    folder = args.tokenizer
    if folder and os.path.isdir(folder) and os.path.lexists(args.output):  # its tokenizer.json, ...
        try:
            same = os.path.samefile(os.path.dirname(os.path.abspath(args.output)), folder)
        except OSError:
            same = False
        if same:
            build.error(f"-o {args.output} is a file of the --tokenizer folder {folder}: the trie would overwrite "
                        "it; give another output file")


def _check_build_args(build: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors of ``build`` (argparse exits with status 2 and the message)."""
    given = [source for source in _SOURCE_OPTIONS if getattr(args, source) is not None]
    if len(given) != 1:
        build.error("give exactly one of: an entries file, --prefix-dict FILE, --codes FILE")
    source = given[0]
    for option, what in {**_INPUT_FILES, "output": "-o file"}.items():
        if getattr(args, option) == "":  # as a path it is the current folder: "entries file . is a folder"
            build.error(f"the {what} is an empty path: give a file")
    for option in dict.fromkeys(o for options in _SOURCE_OPTIONS.values() for o in options):
        value = getattr(args, option)
        if value is not None and value is not False and option not in _SOURCE_OPTIONS[source]:
            takers = " or ".join(_SOURCE_NAMES[s] for s, options in _SOURCE_OPTIONS.items() if option in options)
            build.error(f"{FLAGS(option)} only applies to {takers}")
    if source == "codes" and (args.vocab_size is None or args.codebook_size is None):
        build.error("--codes needs --vocab-size and --codebook-size (and usually --token-offset)")
    if source == "prefix_dict" and args.vocab_size is None and not args.tokenizer:
        build.error("--prefix-dict needs --vocab-size (the model's logits width) or --tokenizer")
    if source == "entries" and not args.tokenizer:
        build.error("--tokenizer is required to build from an entries file")
    _check_output_is_no_input(build, args)
    try:  # the rules of options.py, spelled as flags
        if args.vocab_size is not None:
            check_vocab_size(args.vocab_size, FLAGS)
        if args.codebook_size is not None:
            check_positive(args.codebook_size, "codebook_size", FLAGS)
        if args.token_offset is not None:
            token_id(args.token_offset, "token_offset", FLAGS, below=args.vocab_size)
        if args.on_unstable is not None:
            check_on_unstable_context(args.on_unstable, bool(args.context), FLAGS)
    except ConstraintConfigError as exc:
        build.error(str(exc))


def _count(text: str) -> int:
    """An integer >= 0 (``info --show``), else argparse's usage error naming the flag."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return _cmd_bench(argv[1:])
    parser = argparse.ArgumentParser(prog="trie-decode", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser(
        "build", help="build a trie file from entries (txt: one per line; jsonl: id/text), an RTP-LLM prefix dict "
                      "(--prefix-dict) or a semantic-id catalog (--codes)"
    )
    build.add_argument(
        "entries", nargs="?", help="a .jsonl (or .ndjson) file ({'id':..., 'text':...}), or any other file: plain "
                                   "text, one entry per line"
    )
    build.add_argument("--tokenizer", help="a Hugging Face tokenizer folder or name (required with entries; with "
                                            "--prefix-dict: the width and fingerprint)")
    build.add_argument("-o", "--output", required=True, help="the trie file to write (.safetensors)")
    build.add_argument("--leading-space", action="store_true", help='tokenize " " + entry (the form after a space)')
    build.add_argument("--both-spaces", action="store_true",
                       help="store both forms of every entry (after a space and at the start of a line)")
    build.add_argument("--context", action="append", metavar="TEXT",
                       help="the text the entries follow (the end of the prompt): store the ids the model writes there "
                            "(repeatable: one form per context)")
    build.add_argument("--normalize", choices=NORMAL_FORMS,
                       help="Unicode-normalize entries before tokenizing (NFC for Qwen); recorded in the file")
    build.add_argument("--on-unstable", choices=ON_UNSTABLE_MODES,
                       help="with --context: an entry that merges with the context's last token is an error (raise, "
                            "the default) or keeps its own tokens there (raw); recorded in the file")
    build.add_argument(
        "--prefix-dict", metavar="FILE", help="build from an RTP-LLM prefix dict (tree_decode_config JSON)"
    )
    build.add_argument("--vocab-size", type=int, help="with --prefix-dict (default: the --tokenizer's vocabulary) or --codes: "
                                                         "the model's logits width")
    build.add_argument("--codes", metavar="FILE", help="build a semantic-id catalog from an .npy array (items x levels)")
    build.add_argument("--codebook-size", type=int, help="with --codes: codes per level")
    build.add_argument("--token-offset", type=int, help="with --codes: the token of level 0's code 0 (default 0)")
    build.add_argument("--keys", metavar="FILE", help="with --codes: one item key per line")
    build.add_argument(
        "--strict", action="store_true", help="with --prefix-dict: refuse what RTP-LLM would accept silently"
    )
    info = sub.add_parser("info", help="describe a trie file")
    info.add_argument("file")
    info.add_argument("--json", action="store_true", help="print the statistics as JSON")
    info.add_argument("--show", type=_count, default=0, metavar="N",
                      help="also print the first N entries (with --json: as its first_entries list)")
    info.add_argument("--no-verify", action="store_true", help="skip the checksum and structure checks")
    sub.add_parser("bench", help="run the benchmark suites, from a source checkout (trie-decode bench --help)")
    args = parser.parse_args(argv)
    if args.command == "build":
        _check_build_args(build, args)
    try:
        if args.command == "build":
            check_writable(args.output)  # before the work, not after it
        code = {"build": _cmd_build, "info": _cmd_info}[args.command](args)
        sys.stdout.flush()  # a reader that left fails the flush here, in the except below, not at exit
        return code
    except TrieDecodeError as exc:
        # An error whose fix names an option names it as a flag here (--context, not context=).
        message = exc.message_for(FLAGS) if isinstance(exc, ContextError) else str(exc)
        print(f"trie-decode {args.command}: error: {message}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader of the output left (`trie-decode info FILE --show 1000 | head`): stop quietly, as Python's
        # documentation advises, with no traceback (nor one more when the interpreter flushes stdout at exit).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
