"""The bench's subjects: a model, its prepared artifact, the tokens to run and whose routing to use.

Each subject has two artifacts: ``artifact``, the recipe's (what ``moeprep`` runs: its whole plan), and
``lossless``, the experts as they are (what ``naive`` runs: per-layer LRU, no prediction, exact routing).

``reference``: the artifact of ``recipes/reference.yaml`` (mixed precision and the techniques; prepared
here, the stage cache makes that free when nothing changed) with the model's own routing, against its
original model; ``naive`` runs ``recipes/reference-lossless.yaml``'s artifact. ``reference-lossless``:
that lossless artifact for both (experts as trained, and the prefetch predictors: ``moeprep`` here is the
lossless mode), where a percentage budget really offloads. ``reference-neuron``: the neuron-layout
artifact for both, since its point is neuron reads against whole reads of the same records.

``mixtral-shape``: Mixtral-8x7B's architecture (32 layers, 8 experts, top-2) with hidden and expert sizes
scaled so the expert store is about 4 GB and a 25% budget about 1 GB, random (seeded) weights, a tiny
character tokenizer, experts stored as they are (passthrough, ``naive``'s) and at int4 (``moeprep``'s:
a uniform precision, the only mixed-precision reading that means something for random weights), and
the router decisions replayed from
the real Mixtral-8x7B GSM8K decode traces: the weights are fake, but which experts each token needs,
and so the compute and the I/O, are real. Built once under ``<output>/mixtral-shape/`` and reused while
its shape is unchanged.
"""

from __future__ import annotations

import gc
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loader.io import building_directory
from prep.errors import MoeprepError
from prep.fingerprint import model_fingerprint
from prep.methods.trace import read_mixtral_traces
from prep.pipeline import prepare
from prep.recipe import load_recipe, recipe_from_dict

# Attention is kept small (4 query heads of 64, one KV head, short context): the bench is about experts.
MIXTRAL_SHAPE = {"num_hidden_layers": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
                 "hidden_size": 768, "intermediate_size": 1792, "num_attention_heads": 4,
                 "num_key_value_heads": 1, "head_dim": 64, "max_position_embeddings": 512,
                 "vocab_size": 128, "dtype": "float32"}
QUICK_SHAPE = MIXTRAL_SHAPE | {"num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128,
                               "num_attention_heads": 2, "head_dim": 32}
SEED = 0
REFERENCE_TEXT = (
    "Question: Nadia has 12 boxes of pencils. Each box holds 8 pencils. She gives 15 pencils to her "
    "brother and shares the rest equally among 3 friends. How many pencils does each friend get?\n"
    "Answer: Nadia has 12 * 8 = 96 pencils. After giving 15 away she has 96 - 15 = 81 pencils. "
    "Each friend gets 81 / 3 = 27 pencils. The answer is 27.\n\n"
    "Question: A train travels 45 kilometres in the first hour and 60 kilometres in each of the next "
    "two hours. How far does it travel in total?\n"
    "Answer: In the next two hours it travels 2 * 60 = 120 kilometres. In total it travels 45 + 120 = "
    "165 kilometres. The answer is 165.\n\n"
)


@dataclass
class Subject:
    """What every system of one subject runs: the same tokens, routed the same way."""

    name: str
    model_dir: Path  # the original model (resident and accelerate)
    artifact: Path  # the recipe's artifact (moeprep)
    prompt_ids: list[int]
    decode_ids: list[int]
    replay: Path | None  # safetensors with expert_ids / weights [T, L, K]; None: the model's own routing
    routing: str  # one line saying whose routing it is
    facts: dict = field(default_factory=dict)
    lossless: Path | None = None  # the experts as they are (naive); None: the artifact itself

    @property
    def naive_artifact(self) -> Path:
        return self.lossless or self.artifact

    @property
    def manifest(self) -> dict:
        return json.loads((self.artifact / "manifest.json").read_text())


def _artifact_is_current(artifact: Path, model_dir: Path) -> bool:

    manifest = artifact / "manifest.json"
    if not manifest.is_file():
        return False
    return json.loads(manifest.read_text())["source_model"]["fingerprint"] == model_fingerprint(model_dir)


def _store_facts(artifact: Path) -> dict:
    """Sizes the bench reports; a mixed-precision artifact reports the mean record and its largest store."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    stores = manifest["stores"]
    moe = manifest["moe"]
    n = len(moe["layers"]) * moe["num_experts"]
    store_bytes = sum(len(s["crc32"]) * s["record_bytes"] for s in stores.values())
    largest = max(stores.values(), key=lambda s: len(s["crc32"]) * s["record_bytes"])
    precision = "+".join(f"{p} x{len(s['crc32'])}" for p, s in stores.items()) if len(stores) > 1 else next(iter(stores))
    return {"precision": precision, "record_bytes": store_bytes / n, "experts": n,
            "store_bytes": store_bytes, "store_file": str(artifact / largest["file"]),
            "dense_bytes": (artifact / "dense.safetensors").stat().st_size,
            "moe_layers": len(moe["layers"]), "num_experts": moe["num_experts"], "top_k": moe["top_k"]}


def _prepared(root: Path, name: str, evaluate: bool = True) -> tuple[Path, Path]:
    """(model dir, artifact) of ``recipes/<name>.yaml``, prepared (reused when current) to the end, so that its
    report carries the accuracy check bench.md quotes, or only through the package stage (``evaluate`` off:
    the quick bench)."""

    recipe_path = root / "recipes" / f"{name}.yaml"
    if not recipe_path.is_file():
        raise MoeprepError(f"{recipe_path} not found; run `moeprep bench` from the repository root")
    recipe = load_recipe(recipe_path)
    model_dir = Path(recipe.model_path(root))
    if not (model_dir / "config.json").is_file():
        raise MoeprepError(f"reference model {model_dir} missing; run `make reference-model` first")
    prepare(recipe, root=root, until=None if evaluate else "package")
    return model_dir, root / "artifacts" / recipe.name / "artifact"


def reference_subject(root: Path, prompt_tokens: int, decode_tokens: int, name: str = "reference",
                      evaluate: bool = True) -> Subject:
    """The artifact of ``recipes/<name>.yaml`` and its model; ``reference`` runs naive on the lossless one."""
    from transformers import AutoTokenizer

    model_dir, artifact = _prepared(root, name, evaluate)
    lossless = _prepared(root, "reference-lossless", evaluate)[1] if name == "reference" else None
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    need = prompt_tokens + decode_tokens
    text = REFERENCE_TEXT
    ids = tokenizer(text)["input_ids"]
    while len(ids) < need:
        text += REFERENCE_TEXT
        ids = tokenizer(text)["input_ids"]
    facts = _store_facts(artifact) | ({"lossless": _store_facts(lossless)} if lossless else {})
    return Subject(name, model_dir, artifact, ids[:prompt_tokens], ids[prompt_tokens:need], None,
                   "the model's own routers (the loader's quantized experts may route a few tokens differently)",
                   facts, lossless)


def char_tokenizer(vocab_size: int):
    """A character-level fast tokenizer fitting ``vocab_size`` (unknown characters -> <unk>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    chars = [chr(c) for c in range(32, 127)][: vocab_size - len(specials)]
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(specials + chars)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")


def _build_mixtral_shape(model_dir: Path, shape: dict) -> None:
    """Random (seeded) Mixtral-architecture model of ``shape`` with a character tokenizer, written atomically."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(**{k: v for k, v in shape.items() if k != "dtype"}, tie_word_embeddings=False,
                           pad_token_id=3, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, shape["dtype"]))
    with building_directory(model_dir) as tmp:
        model.save_pretrained(tmp)
        del model
        gc.collect()
        char_tokenizer(shape["vocab_size"]).save_pretrained(tmp)
        (tmp / "bench-shape.json").write_text(json.dumps(shape | {"seed": SEED}, indent=2) + "\n")


def _replay_file(work: Path, traces: Path, layers: int, tokens: int) -> tuple[Path, str]:
    """The first ``tokens`` decisions of the longest recorded problem, first ``layers`` layers, as safetensors."""
    from safetensors.torch import save_file


    recorded = max(read_mixtral_traces(traces), key=lambda t: t.num_tokens)
    if recorded.num_tokens < tokens:
        raise MoeprepError(f"the longest recorded Mixtral problem has {recorded.num_tokens} tokens, the bench "
                           f"needs {tokens}; run fewer prompt or decode tokens")
    if recorded.num_layers < layers:
        raise MoeprepError(f"the traces have {recorded.num_layers} layers, the model {layers}")
    path = work / "replay.safetensors"
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({"expert_ids": recorded.expert_ids[:tokens, :layers].contiguous(),
               "weights": recorded.expert_weights[:tokens, :layers].contiguous()}, str(tmp))
    os.replace(tmp, path)
    return path, (f"replayed from the real Mixtral-8x7B GSM8K decode traces ({traces}): the first "
                  f"{tokens} of {recorded.num_tokens} recorded tokens of one problem, layers 0-{layers - 1}")


def mixtral_shape_subject(output: Path, traces: Path | None, quick: bool, prompt_tokens: int,
                          decode_tokens: int, own: bool = False) -> Subject:
    """Build (or reuse) the mixtral-shape model and its passthrough and int4 artifacts under ``output``;
    ``own``: the subject ``mixtral-shape-own``, routed by the model's own routers (what llama.cpp can run)."""

    shape = QUICK_SHAPE if quick else MIXTRAL_SHAPE
    name = "mixtral-shape"
    home = output / ("mixtral-shape-quick" if quick else name)
    home.mkdir(parents=True, exist_ok=True)
    model_dir, lossless, artifact = home / "model", home / "artifact", home / "artifact-int4"
    marker = model_dir / "bench-shape.json"
    if not marker.is_file() or json.loads(marker.read_text()) != shape | {"seed": SEED}:
        _build_mixtral_shape(model_dir, shape)
    for out, precision in ((lossless, "passthrough"), (artifact, "int4")):
        if _artifact_is_current(out, model_dir):
            continue
        # a one-sequence calibration is enough for a trace nobody reads (the routing is replayed)
        recipe = recipe_from_dict({"name": f"{name}-{precision}", "model": {"path": "model"},
                                   "calibration": {"num_sequences": 1, "sequence_length": 8},
                                   "quantize": {"precision": precision},
                                   "package": {"cache_fraction": 0.25}})
        prepare(recipe, root=home, output=out, until="package")
        gc.collect()
    need = prompt_tokens + decode_tokens
    gen = torch.Generator().manual_seed(SEED)
    ids = torch.randint(4, shape["vocab_size"], (need,), generator=gen).tolist()
    if own:
        replay, routing = None, "the model's own routers (random weights), as llama.cpp runs it"
        name = "mixtral-shape-own"
    elif traces is not None:
        replay, routing = _replay_file(home, traces, shape["num_hidden_layers"], need)
    else:
        replay, routing = None, "the model's own routers (random weights): the real traces are absent"
    facts = _store_facts(artifact) | {"shape": shape, "lossless": _store_facts(lossless)}
    return Subject(name, model_dir, artifact, ids[:prompt_tokens], ids[prompt_tokens:], replay, routing, facts,
                   lossless)
