"""Loading a tokenizer by name: a local folder, the Hugging Face cache, or the hub, failing fast when it is none.

Why this exists: ``AutoTokenizer.from_pretrained(name)`` tries the hub for any name that is not a local folder, and
when the hub cannot be reached it retries every file with back-off before it looks in the cache: about 50 s on a
machine without network (measured: ``trie-decode build --tokenizer no-such/name`` took 51 s to fail), and then an
error that does not say the name was never a folder. :func:`load_tokenizer` is the one place trie_decode loads a
tokenizer by name (the CLI's ``--tokenizer``, the vLLM processor's ``model_config.tokenizer``):

1. an existing folder loads as before;
2. a file is "a file, not a tokenizer folder"; a name written as a path (``./x``, ``/x``, ``~/x``, ``x\\y``) that is
   not a folder is "no such folder";
3. with the hub off (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``, or ``online=False``) only the cache is read;
4. otherwise one request (:data:`PROBE_TIMEOUT_S`, through the hub's own HTTP session: ``HF_ENDPOINT``, proxies)
   tells whether the hub answers: if it does, ``from_pretrained`` runs exactly as it would without trie_decode (an
   online user's hub names, revisions and updates are unchanged); if not, the cache is read at once.

A name found nowhere is a :class:`~trie_decode.errors.TokenizerNotFoundError` that says it is neither a local folder
nor in the cache, and why the hub was not asked. The core imports transformers only inside :func:`load_tokenizer`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from .errors import TokenizerNotFoundError

__all__ = ["load_tokenizer", "hub_offline", "hub_unreachable", "PROBE_TIMEOUT_S"]

#: How long :func:`hub_unreachable` waits for the hub to answer (an unknown host or a refused connection fails at
#: once; this bounds a network that drops packets).
PROBE_TIMEOUT_S = 5.0
#: The environment variables that switch the hub off, and the values that mean on (as huggingface_hub reads them).
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
_TRUE = frozenset({"1", "ON", "YES", "TRUE"})


def hub_offline() -> Optional[str]:
    """The variable that switches the hub off (``HF_HUB_OFFLINE=1``), or None. Read now, and as huggingface_hub read
    it at import: a variable set after that import still counts here."""
    for name in OFFLINE_VARIABLES:
        if os.environ.get(name, "").strip().upper() in _TRUE:
            return name
    try:
        from huggingface_hub import constants
    except ImportError:
        return None
    return "HF_HUB_OFFLINE" if constants.HF_HUB_OFFLINE else None


def hub_unreachable(timeout: float = PROBE_TIMEOUT_S) -> Optional[str]:
    """Why the hub cannot be reached (the error of one HEAD request to its endpoint), or None when it answers (any
    HTTP status: the hub is there). Uses huggingface_hub's own session, so ``HF_ENDPOINT``, proxies and a client
    factory set with ``huggingface_hub.set_client_factory`` apply as they do to the download."""
    from huggingface_hub import constants, get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception as exc:  # noqa: BLE001  whatever stops the request (DNS, refused, TLS, timeout) means "not now"
        return f"{constants.ENDPOINT} did not answer: {type(exc).__name__}: {str(exc).strip()[:200]}"
    return None


def _looks_like_a_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or "\\" in name


def load_tokenizer(name: str, *, revision: Optional[str] = None, trust_remote_code: bool = False,
                   online: bool = True, what: str = "tokenizer") -> Any:
    """``AutoTokenizer.from_pretrained(name)``, without the minute-long wait when ``name`` is nowhere to be found.

    Args:
        name: a tokenizer folder, or a Hugging Face hub name (``org/model``).
        revision, trust_remote_code: passed to ``from_pretrained``.
        online: False: never ask the hub (only a folder or the cache).
        what: how messages name the argument (the CLI says ``--tokenizer``).

    Raises:
        TokenizerNotFoundError: a path that is not a folder; a hub name that is not in the cache while the hub is
            off or does not answer. Errors of the files themselves (a folder without a tokenizer, a bad file) and
            the hub's own answers (an unknown or gated name) are transformers' (``OSError``, ``ValueError``).
    """
    from transformers import AutoTokenizer

    options: dict[str, Any] = {"revision": revision, "trust_remote_code": trust_remote_code}
    if Path(name).expanduser().is_dir():
        return AutoTokenizer.from_pretrained(str(Path(name).expanduser()), **options)
    if Path(name).expanduser().is_file():
        raise TokenizerNotFoundError(f"{what} {name}: a file, not a tokenizer folder (give the folder that holds "
                                     "tokenizer.json or the tokenizer's other files)")
    if _looks_like_a_path(name):
        raise TokenizerNotFoundError(f"{what} {name}: no such folder")
    off = "online=False" if not online else hub_offline()
    if off:
        why = f"the hub is off ({off if not online else off + ' is set'})"
    else:
        unreachable = hub_unreachable()
        if unreachable is None:
            return AutoTokenizer.from_pretrained(name, **options)  # an online user's name, as transformers loads it
        why = f"the hub is not reachable ({unreachable})"
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True, **options)
    except (OSError, ValueError) as exc:  # not in the cache (ValueError: not even a valid hub name)
        raise TokenizerNotFoundError(
            f"{what} {name}: neither a local folder nor a tokenizer in the Hugging Face cache, and {why}; give the "
            "folder of the tokenizer's files (download it where the hub is reachable: hf download NAME)") from exc
