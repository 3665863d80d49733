# %% [markdown]
# # A batch pipeline with Ray Data's vLLM integration: one trie per row
#
# Constrained generation over a dataset: every row names its own trie in `sampling_params["extra_args"]` (a trie
# file, a registered name, or an inline JSON list), and Ray Data's vLLM stage (`ray.data.llm`) runs the engine
# replicas with `TrieLogitsProcessor` loaded. Rows go in and out through Ray Data only (`ray.data.read_json`,
# the chat template in Ray's chat-template stage, `Dataset.write_json`): the driver never holds the dataset, so the
# same script scales from this machine to a cluster by configuration alone:
#
# | knob | here | on a cluster |
# |---|---|---|
# | `--ray-address` / `RAY_ADDRESS` | none: a local Ray with `--cpus` CPUs | `auto` or `ray://head:10001` |
# | `--replicas` | 1 engine | N engines (Ray Data's actor pool; `N,M` autoscales between N and M) |
# | `--device`, `--tp` | `cpu`, 1 | `gpu`, the tensor-parallel size of each replica |
# | `--batch-size`, `--max-num-seqs` | 8, 16 | rows per engine call, the engine's batch |
# | `--input`, `--output` | a demo dataset, a local folder | JSONL files or folders on shared storage (`s3://`, NFS) |
# | trie files | a temporary folder | the same path on every node (shared storage), or registered names |
#
# Every engine process reads `TRIE_DECODE_ALLOWED_DIRS` (the folders whose trie files rows may name; closed by
# default, see docs/vllm.md "Security"): the script passes it, and the vLLM settings, to Ray's workers through
# `runtime_env`.
#
# Run: `python examples/vllm_batch_pipeline.py` (a demo dataset of 8 rows; 42 s on 2 CPU cores at load average 3,
# most of it Ray's and the engine's start-up). `--help` lists the knobs. It prints the first `--show` rows of what
# it wrote, read back through Ray Data.

# %%
import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

FQCN = "trie_decode.integrations.vllm:TrieLogitsProcessor"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Trie-constrained batch generation with Ray Data + vLLM.")
    p.add_argument("--input", help="JSONL file(s) or folder, local or remote (s3://, gs://, ...): rows with 'id', "
                                   "'question' and 'trie' (a path, a registered name or a JSON list as a string); "
                                   "default: a demo dataset")
    p.add_argument("--output", help="output folder, local or remote, that must not exist yet (JSONL files, one per "
                                    "block); default: a temporary folder")
    p.add_argument("--show", type=int, default=8, help="rows of the output to print")
    p.add_argument("--model", help="model folder or hub id (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--ray-address", default=os.environ.get("RAY_ADDRESS"), help="Ray cluster (default: a local Ray)")
    p.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray (ignored with --ray-address)")
    p.add_argument("--replicas", default="1", help="engine replicas: N, or N,M to autoscale between N and M")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of each replica")
    p.add_argument("--cpus-per-replica", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=8, help="rows per engine call")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--allowed-dir", action="append", default=[], help="folders whose trie files rows may name")
    return p.parse_args(argv)


PREFILL = "The answer is"  # the prompt ends with it; entries start with a space (tries built with leading_space)


def demo_input(tokenizer, folder: Path) -> str:
    """Eight questions, three tries (two files, countries and languages, and an inline JSON list of colors), written
    as a JSONL file like any input; returns its path."""
    import pycountry

    from trie_decode import TokenTrie

    countries = folder / "countries.trie"
    TokenTrie.from_strings(sorted({c.name for c in pycountry.countries}), tokenizer, leading_space=True).save(countries)
    languages = folder / "languages.trie"
    TokenTrie.from_strings(sorted({lang.name for lang in pycountry.languages if hasattr(lang, "alpha_2")}),
                           tokenizer, leading_space=True).save(languages)
    colors = json.dumps([" red", " green", " blue", " yellow", " white", " black"])
    qa = [("Which country is Paris the capital of?", countries), ("Which country is Rome in?", countries),
          ("Which country has Tokyo as its capital?", countries), ("Which country is Madrid in?", countries),
          ("What color is grass?", colors), ("What color is the sky on a clear day?", colors),
          ("What language is spoken in Brazil?", languages), ("Which language do people in Germany speak?", languages)]
    path = folder / "input" / "rows.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps({"id": i, "question": q, "trie": str(t)}) + "\n" for i, (q, t) in enumerate(qa)))
    return str(path)


def engine_config(args, model: str):
    """Ray Data's vLLM processor config: engine kwargs with the trie processor, resources per replica."""
    from ray.data.llm import vLLMEngineProcessorConfig

    replicas = tuple(int(x) for x in str(args.replicas).split(","))
    engine_kwargs = dict(
        dtype="float32" if args.device == "cpu" else "auto", max_model_len=1024, enforce_eager=args.device == "cpu",
        max_num_seqs=args.max_num_seqs, tensor_parallel_size=args.tp,
        logits_processors=[FQCN],  # a string: the engine is built in a Ray worker, which imports it there
    )
    if args.device == "cpu":
        # vllm-cpu: one process per replica unless tp > 1 (then one worker process per rank, bound to one core).
        engine_kwargs["distributed_executor_backend"] = "uni" if args.tp == 1 else "mp"
        bundles = [{"CPU": args.cpus_per_replica * args.tp}]
    else:
        engine_kwargs["distributed_executor_backend"] = "uni" if args.tp == 1 else "ray"
        bundles = [{"GPU": 1, "CPU": 1} for _ in range(args.tp)]
    return vLLMEngineProcessorConfig(
        model_source=model,
        engine_kwargs=engine_kwargs,
        placement_group_config={"bundles": bundles},
        batch_size=args.batch_size,
        concurrency=replicas if len(replicas) > 1 else replicas[0],
        log_engine_metrics=False,
        # The chat template runs in Ray's own stage (an actor pool beside the engines). It reserves no CPU: it is a
        # Jinja template per row, and any reservation would leave two local CPUs short of a whole CPU for the read
        # and write tasks next to the engine (they would wait forever). The engine tokenizes and detokenizes.
        chat_template_stage={"enabled": True, "concurrency": 1, "num_cpus": 0},
        tokenize_stage={"enabled": False}, detokenize_stage={"enabled": False},
    )


def make_preprocess(max_tokens: int):
    """The per-row request: the chat messages (an assistant message ``PREFILL`` that the answer continues) and the
    row's own trie in extra_args (trie_decode's request keys)."""

    def preprocess(row: dict) -> dict:
        return dict(
            messages=[{"role": "user", "content": row["question"]}, {"role": "assistant", "content": PREFILL}],
            sampling_params=dict(temperature=0.0, max_tokens=max_tokens, extra_args={"trie": row["trie"]}),
            id=row["id"], question=row["question"], trie=row["trie"],
        )

    return preprocess


def postprocess(row: dict) -> dict:
    return dict(id=row["id"], question=row["question"], trie=row["trie"], answer=row["generated_text"],
                tokens=[int(t) for t in row["generated_tokens"]])


# %%
if __name__ == "__main__":
    args = parse_args()
    import ray
    from ray.data.llm import build_processor

    from trie_decode.integrations.smollm2 import smollm2_path

    model = args.model or smollm2_path()
    work = Path(tempfile.mkdtemp(prefix="trie_batch_"))
    output = args.output or str(work / "out")
    source = args.input
    if source is None:  # the demo: tries and rows in a local folder (a cluster needs them on shared storage)
        from transformers import AutoTokenizer

        source = demo_input(AutoTokenizer.from_pretrained(model), work)
        args.allowed_dir.append(str(work))

    env_vars = {k: os.environ[k] for k in ("VLLM_CPU_KVCACHE_SPACE", "TOKENIZERS_PARALLELISM", "VLLM_CPU_OMP_THREADS_BIND",
                                           "TRIE_DECODE_NAMED_TRIES") if k in os.environ}
    env_vars["TRIE_DECODE_ALLOWED_DIRS"] = os.pathsep.join(args.allowed_dir)
    env_vars.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    t0 = time.perf_counter()
    if args.ray_address:
        ray.init(address=args.ray_address, runtime_env={"env_vars": env_vars})
    else:
        ray.init(num_cpus=args.cpus, object_store_memory=256 * 2**20, include_dashboard=False,
                 log_to_driver=False,  # the workers' logs stay in Ray's session folder (/tmp/ray/session_latest/logs)
                 runtime_env={"env_vars": env_vars})
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    processor = build_processor(engine_config(args, model), preprocess=make_preprocess(args.max_tokens),
                                postprocess=postprocess)
    # Read, generate and write stream through the cluster: blocks go from the readers to the engines to the writers.
    processor(ray.data.read_json(source)).write_json(output, mode="error")
    elapsed = time.perf_counter() - t0
    written = ray.data.read_json(output)  # what was written, read back (a count, and a few rows to show)
    for r in sorted(written.take(args.show), key=lambda r: r["id"]):
        print(f"{r['question']:<45} {r['answer']!r}")
    print(f"{written.count()} rows in {elapsed:.1f} s (Ray and engine start-up included); results in {output}")
    ray.shutdown()
