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

``mixtral-shape-techniques``: the same model, replayed tokens and lossless artifact (``naive``), and one artifact
per technique, each prepared through the real pipeline stages fed by the recorded routing (``trace.recorded``) of
the *other* GSM8K problems than the one replayed (the decisions are cross-fitted): ``int4`` (uniform int4, no
technique: the mixtral-shape subject's plan), ``int4+gating`` (AdapMoE's rule with the per-layer sensitivity and
threshold AdapMoE's own code sets for Mixtral-8x7B), ``int4+dynamic_precision`` (HOBBIT: int4 high, int2 low,
skip, thresholds from quantiles of the fitted weights), ``int4+path_stats`` (EdgeMoE's path statistics),
``int4+allocation`` (AdapMoE's DP allocation and HOBBIT's tuned eviction on the fitted miss curves, with this
machine's device profile, calibrated: ``device-planning.json``) and ``moeprep`` (all of them). Which experts each token needs, and so what each
technique decides, is what Mixtral decides on those tokens; the outputs are random, so accuracy is cited
(``bench.md``), not measured here.

The registry (``SUBJECTS``, at the end): each subject declared once, with its builder, the systems it runs, what it
needs (the real traces), its notes and whether it has prefill rows. Adding a subject is one ``SubjectEntry``.
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loader.format import SCHEMA_VERSION
from loader.io import building_directory
from loader.vocab import PREDICTOR_NAMES
from prep.errors import MoeprepError
from prep.fingerprint import model_fingerprint
from prep.methods.trace import read_mixtral_traces
from prep.pipeline import prepare
from prep.recipe import load_recipe, recipe_from_dict
from prep.studies.bench.llama import QUANT, logit_check, prepare_gguf
from prep.studies.bench.llama import missing as llama_missing
from prep.studies.bench.worker import TUNED

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
    variants: dict = field(default_factory=dict)  # system -> its own artifact (mixtral-shape-techniques)

    @property
    def naive_artifact(self) -> Path:
        return self.lossless or self.artifact

    def artifact_for(self, system: str) -> Path:
        """The artifact a loader system runs: a variant's own, naive's lossless one, else the recipe's."""
        base = system.split("@", 1)[0]
        if base in self.variants:
            return self.variants[base]
        return self.naive_artifact if base.startswith("naive") else self.artifact

    @property
    def manifest(self) -> dict:
        return json.loads((self.artifact / "manifest.json").read_text())


def _artifact_is_current(artifact: Path, model_dir: Path) -> bool:
    """Whether ``artifact`` was prepared from ``model_dir`` in the loader's current schema (else prepare it again)."""
    manifest = artifact / "manifest.json"
    if not manifest.is_file():
        return False
    raw = json.loads(manifest.read_text())
    return (raw.get("schema_version") == SCHEMA_VERSION
            and raw["source_model"]["fingerprint"] == model_fingerprint(model_dir))


def _store_facts(artifact: Path) -> dict:
    """Sizes the bench reports; a mixed-precision artifact reports the mean record and its largest store."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    stores = manifest["stores"]
    moe = manifest["moe"]
    n = len(moe["layers"]) * moe["num_experts"]
    store_bytes = sum(len(s["xxh3"]) * s["record_bytes"] for s in stores.values())
    largest = max(stores.values(), key=lambda s: len(s["xxh3"]) * s["record_bytes"])
    precision = "+".join(f"{p} x{len(s['xxh3'])}" for p, s in stores.items()) if len(stores) > 1 else next(iter(stores))
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


    everything = read_mixtral_traces(traces)
    recorded = everything[_replay_index(everything)]
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


def _replay_index(recorded: list) -> int:
    """The replayed problem: the longest recorded one (the others fit what the techniques decide)."""
    return max(range(len(recorded)), key=lambda i: recorded[i].num_tokens)


def mixtral_shape_subject(output: Path, traces: Path | None, quick: bool, prompt_tokens: int,
                          decode_tokens: int, own: bool = False, int4: bool = True) -> Subject:
    """Build (or reuse) the mixtral-shape model and its passthrough and int4 artifacts under ``output``;
    ``own``: the subject ``mixtral-shape-own``, routed by the model's own routers (what llama.cpp can run);
    ``int4`` off: the passthrough artifact only (mixtral-shape-techniques prepares its own int4)."""

    shape = QUICK_SHAPE if quick else MIXTRAL_SHAPE
    name = "mixtral-shape"
    home = output / ("mixtral-shape-quick" if quick else name)
    home.mkdir(parents=True, exist_ok=True)
    model_dir, lossless, artifact = home / "model", home / "artifact", home / "artifact-int4"
    marker = model_dir / "bench-shape.json"
    if not marker.is_file() or json.loads(marker.read_text()) != shape | {"seed": SEED}:
        _build_mixtral_shape(model_dir, shape)
    for out, precision in ((lossless, "passthrough"), (artifact, "int4"))[:2 if int4 else 1]:
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
    facts = (_store_facts(artifact) if int4 else {}) | {"shape": shape, "lossless": _store_facts(lossless)}
    return Subject(name, model_dir, artifact if int4 else lossless, ids[:prompt_tokens], ids[prompt_tokens:], replay,
                   routing, facts, lossless)


def prefill_prompt(subject: Subject, tokens: int) -> list[int]:
    """A ``tokens``-token prompt for the prefill rows of a mixtral-shape subject: seeded random ids of its character
    vocabulary (its weights are random, so any text is as good as another), the same for every system; a shorter
    prompt is the start of a longer one."""
    shape = subject.facts["shape"]
    gen = torch.Generator().manual_seed(SEED + 1)
    return torch.randint(4, shape["vocab_size"], (tokens,), generator=gen).tolist()


def tiled_replay(traces: Path, layers: int, tokens: int, path: Path) -> tuple[Path, str]:
    """Routing decisions for a ``tokens``-token prompt from the real traces, written to ``path`` (safetensors):
    every recorded problem's decisions (layers 0 to ``layers`` - 1) one after another, repeated until there are
    ``tokens``. The traces hold a few hundred decode tokens, fewer than a long prompt; a chunk of a prompt needs
    nearly every expert of a layer whichever tokens it holds, so repeating them changes little of what is read."""
    from safetensors.torch import save_file

    recorded = read_mixtral_traces(traces)
    if recorded[0].num_layers < layers:
        raise MoeprepError(f"the traces have {recorded[0].num_layers} layers, the model {layers}")
    ids = torch.cat([r.expert_ids[:, :layers] for r in recorded])
    weights = torch.cat([r.expert_weights[:, :layers] for r in recorded])
    repeats = -(-tokens // ids.shape[0])
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file({"expert_ids": ids.repeat(repeats, 1, 1)[:tokens].contiguous(),
               "weights": weights.repeat(repeats, 1, 1)[:tokens].contiguous()}, str(tmp))
    os.replace(tmp, path)
    return path, (f"replayed from the real Mixtral-8x7B GSM8K decode traces ({traces}): the {ids.shape[0]} recorded "
                  f"tokens of its {len(recorded)} problems one after another"
                  + (f", repeated {repeats} times" if repeats > 1 else "") + f", layers 0-{layers - 1}")


SENSITIVITY_FILE = "adapmoe_sensitivity.json"  # beside gsm8k_routing.jsonl: AdapMoE's S_l and T for Mixtral-8x7B
# HOBBIT's split, stated: 67% of selected experts at int4 (every top-1 and the heavier second experts), 30% at
# int2, the 3% least important skipped (quantiles of the fitted problems' weights; HOBBIT leaves the split open)
DYNAMIC_SPLIT = {"high_share": 0.67, "skip_share": 0.03}
TECHNIQUES = ("int4", "int4+gating", "int4+dynamic_precision", "int4+path_stats", "int4+allocation", "moeprep")


def technique_recipes(file: Path, sensitivity: Path, fit: list[int], profile: Path, tune_trials: int) -> dict:
    """System -> recipe dict of each technique artifact; one recipe name, so their stages (the quantization
    above all) are shared in one stage cache and prepared once."""
    threshold = json.loads(sensitivity.read_text()).get("threshold_T", 0.005)
    base = {"name": "mixtral-shape-techniques", "model": {"path": "model"},
            "calibration": {"num_sequences": 1, "sequence_length": 8},  # unread: the routing is imported
            "trace": {"recorded": str(file), "problems": fit},
            "quantize": {"precision": "int4", "also": ["int2"]},
            "package": {"cache_fraction": 0.25}}
    gating = {"gating": {"enabled": True, "sensitivity_file": str(sensitivity), "threshold": threshold}}
    dynamic = {"dynamic_precision": {"enabled": True, "low": "int2", **DYNAMIC_SPLIT}}
    path = {"predict": {"predictors": ["path_stats"], "held_out": 0.25}}
    plan = {"plan": {"device": str(profile), "allocate": {"enabled": True, "cost": "measured"},
                     "tune": {"enabled": True, "trials": tune_trials, "seed": 0, "share": 0.25}}}
    return {"int4": base, "int4+gating": base | gating, "int4+dynamic_precision": base | dynamic,
            "int4+path_stats": base | path, "int4+allocation": base | plan,
            "moeprep": base | gating | dynamic | path | plan}


def mixtral_shape_techniques_subject(output: Path, traces: Path, quick: bool, prompt_tokens: int,
                                     decode_tokens: int, echo=print) -> Subject:
    """The mixtral-shape model and replay, with one artifact per technique (module docstring); ``traces`` must
    hold ``mixtral-8x7b/gsm8k_routing.jsonl`` and ``adapmoe_sensitivity.json`` beside it."""
    from loader.device import calibrated, load_profile, measure_device, write_profile
    from prep.methods.trace import _find_mixtral_file

    file = _find_mixtral_file(Path(traces)).resolve()
    sensitivity = file.parent / SENSITIVITY_FILE
    if not sensitivity.is_file():
        raise MoeprepError(f"mixtral-shape-techniques needs AdapMoE's sensitivity file {sensitivity} beside the "
                           "routing traces")
    plain = mixtral_shape_subject(output, traces, quick, prompt_tokens, decode_tokens, int4=False)
    home = plain.model_dir.parent
    recorded = read_mixtral_traces(file)
    replayed = _replay_index(recorded)
    fit = [i for i in range(len(recorded)) if i != replayed]
    if not fit:
        raise MoeprepError(f"{file} holds one problem; the techniques are fitted on the others, so it needs two")
    shape = json.loads((plain.model_dir / "bench-shape.json").read_text())
    # measured once: the planning stages' key covers it, so it is kept. Calibrated: the planner models the loader's
    # step, one disk for demand reads and prefetches (a prefetch is not free), with the loader's overhead per MoE
    # layer call from an earlier bench in this output (its device-calibrated.json), else none
    profile = home / "device-planning.json"
    if not profile.is_file():
        echo("mixtral-shape-techniques: measuring this machine's device profile for the planning stages")
        # timed on the shape rounded up to what measure_compute takes; the planning stages scale it to these experts
        rounded = tuple(-(-n // 256) * 256 for n in (shape["hidden_size"], shape["intermediate_size"]))
        measured = measure_device(home, file_bytes=(16 if quick else 256) << 20, expert_shape=rounded)
        earlier = Path(output) / "device-calibrated.json"
        overhead = (load_profile(earlier).calibration.get("layer_overhead_s", 0.0) if earlier.is_file() else 0.0)
        write_profile(calibrated(measured, overhead), profile)
    variants = {}
    for system, raw in technique_recipes(file, sensitivity, fit, profile.resolve(), 4 if quick else 16).items():
        out = home / "techniques" / system.replace("+", "-")
        echo(f"mixtral-shape-techniques: preparing {system} (the stage cache shares what the artifacts share)")
        prepare(recipe_from_dict(raw), root=home, output=out, until="package")
        gc.collect()
        variants[system] = out
    facts = _store_facts(variants["moeprep"]) | {
        "shape": shape, "lossless": plain.facts["lossless"],
        "techniques": {"fitted_problems": fit, "replayed_problem": replayed, "routing_file": str(file),
                       "sensitivity_file": str(sensitivity), "dynamic_split": DYNAMIC_SPLIT,
                       "stores": {s: _store_facts(a) for s, a in variants.items()}}}
    return Subject("mixtral-shape-techniques", plain.model_dir, variants["moeprep"], plain.prompt_ids,
                   plain.decode_ids, plain.replay, plain.routing + "; the techniques fitted on the other problems",
                   facts, plain.lossless, {s: a for s, a in variants.items() if s != "moeprep"})


# ------------------------------------------------------------------------------------------- the registry

LLAMA = "llama.cpp"
LLAMA_MAX_LOGIT_ERROR = 1e-3  # llama.cpp's float32 logits against transformers', checked before timing
PREDICTOR_SYSTEMS = tuple(f"naive+{name}" for name in PREDICTOR_NAMES)


@dataclass(frozen=True)
class BuildContext:
    """What a subject's builder is given: where the repository and the output are, the real traces (None where
    absent), the run's size and tokens, and where to say what it does."""

    root: Path
    output: Path
    traces: Path | None
    quick: bool
    reference_tokens: tuple[int, int]  # (prompt, decode) of the reference subjects
    shape_tokens: tuple[int, int]  # (prompt, decode) of the mixtral-shape subjects
    echo: Callable[[str], None] = print


@dataclass(frozen=True)
class SubjectEntry:
    """One subject, declared once. ``build(context, name)`` makes it and returns it with the notes learned while
    building (a system that cannot run, and why); ``systems`` are what it runs at each budget beside ``resident``
    and the ``@unlimited`` floors, in the report's order (``runnable`` drops those the built subject lacks: a
    predictor its plan does not have, llama.cpp without its extra); ``traces``: the files ``--traces`` must hold
    for it (None: it needs none), ``quick_without_traces``: a quick run routes it with its own routers instead;
    ``notes`` go into the report whenever it runs; ``prefill``: it has prefill rows (``prefill.py``)."""

    name: str
    build: Callable[[BuildContext, str], tuple[Subject, list[str]]]
    systems: tuple[str, ...]
    preparing: str  # what is said before it is built: "preparing subject <name> <preparing>"
    traces: str | None = None
    quick_without_traces: bool = False
    notes: tuple[str, ...] = ()
    prefill: bool = False


def _reference(context: BuildContext, name: str) -> tuple[Subject, list[str]]:
    return reference_subject(context.root, *context.reference_tokens, name, evaluate=not context.quick), []


def _mixtral_shape(context: BuildContext, name: str) -> tuple[Subject, list[str]]:
    return mixtral_shape_subject(context.output, context.traces, context.quick, *context.shape_tokens), []


def _mixtral_shape_own(context: BuildContext, name: str) -> tuple[Subject, list[str]]:
    """The model with its own routers, and llama.cpp's GGUF of it where the extra is installed."""
    subject = mixtral_shape_subject(context.output, None, context.quick, *context.shape_tokens, own=True)
    reason = llama_missing()
    if reason is None:
        reason = prepare_llama(subject, context.output, context.echo)
    if reason is None:
        return subject, []
    context.echo(reason)
    return subject, [reason]


def _mixtral_shape_techniques(context: BuildContext, name: str) -> tuple[Subject, list[str]]:
    return mixtral_shape_techniques_subject(context.output, context.traces, context.quick, *context.shape_tokens,
                                            context.echo), []


def prepare_llama(subject: Subject, output: Path, echo) -> str | None:
    """Convert and quantize the subject's model for llama.cpp and check its float32 logits against
    transformers' on the prompt; records the facts on the subject. Returns why it cannot run, or None."""

    echo("llama.cpp: converting mixtral-shape to GGUF (float32, then Q4_0), reused while the model is unchanged")
    files = prepare_gguf(subject.model_dir, output / "llama-gguf" / subject.model_dir.parent.name)
    error = logit_check(files["f32"], subject.model_dir, subject.prompt_ids)
    if error > LLAMA_MAX_LOGIT_ERROR:
        return (f"llama.cpp skipped: its float32 logits differ from transformers' by {error:.3g} on the prompt "
                f"(more than {LLAMA_MAX_LOGIT_ERROR}); the conversion is wrong")
    subject.facts["llama_cpp"] = {"quant": QUANT, "file": str(files[QUANT]), "file_bytes": files[QUANT].stat().st_size,
                                  "f32_logit_max_abs_diff": error}
    return None


_REFERENCE = "with its accuracy check (the stage cache makes this free when nothing changed)"
_PLANNED = ("accelerate", "naive", "naive+neuron", *PREDICTOR_SYSTEMS, "moeprep", TUNED)  # what the artifact's plan has
_MIXTRAL_TRACES = "mixtral-8x7b/gsm8k_routing.jsonl"
SUBJECTS = {entry.name: entry for entry in (
    # naive on the lossless artifact, moeprep on the recipe's
    SubjectEntry("reference", _reference, ("accelerate", "naive", "moeprep"), _REFERENCE),
    SubjectEntry("reference-lossless", _reference, _PLANNED, _REFERENCE),
    SubjectEntry("reference-neuron", _reference, _PLANNED, _REFERENCE),
    SubjectEntry("mixtral-shape", _mixtral_shape, ("accelerate", "naive", "moeprep"), "(built once, then reused)",
                 traces=_MIXTRAL_TRACES, quick_without_traces=True, prefill=True,
                 notes=("mixtral-shape runs no prefetch predictor: its weights are random and its routing replayed, "
                        "so hidden-state predictors (next_gates, first_gate) would predict noise",)),
    # against llama.cpp, which cannot replay routing
    SubjectEntry("mixtral-shape-own", _mixtral_shape_own, ("naive", "moeprep", TUNED, LLAMA),
                 "(the mixtral-shape model with its own routers)", prefill=True),
    # each technique alone (its own artifact), then all together
    SubjectEntry("mixtral-shape-techniques", _mixtral_shape_techniques, ("naive", *TECHNIQUES, TUNED),
                 "(one artifact per technique, fitted on the problems not replayed; built once, then reused)",
                 traces=f"{_MIXTRAL_TRACES} and {SENSITIVITY_FILE}"),
)}


def subject_entries(text: str) -> list[SubjectEntry]:
    """``--subject``: "all" -> every registered subject; "a,b" -> those, in the order given; an unknown or empty
    one is one error naming the known subjects."""
    names = tuple(SUBJECTS) if text == "all" else tuple(x.strip() for x in text.split(",") if x.strip())
    if not names or set(names) - set(SUBJECTS):
        raise MoeprepError(f"--subject {text!r} unknown; use all, or a comma-separated subset of {', '.join(SUBJECTS)}")
    return [SUBJECTS[name] for name in names]


def known_systems() -> set[str]:
    """Every system some subject runs, ``resident`` included (what ``--systems`` may name)."""
    return {"resident", *(system for entry in SUBJECTS.values() for system in entry.systems)}


def runnable(subject: Subject, system: str) -> bool:
    """Whether the built subject can run ``system``: ``naive+neuron`` needs its plan's neuron-level loading,
    ``naive+<predictor>`` that predictor in its plan, llama.cpp its GGUF (the optional extra)."""
    if system == LLAMA:
        return "llama_cpp" in subject.facts
    if not system.startswith("naive+"):
        return True
    plan = json.loads((Path(subject.artifact) / "plan.json").read_text())
    if system == "naive+neuron":
        return plan.get("neuron", {}).get("name", "off") != "off"
    return system.split("+", 1)[1] in {p["name"] for p in plan["predictors"]}


def subject_systems(subject: Subject) -> list[str]:
    """The systems ``subject`` runs at each budget (its registry entry's, those it can run)."""
    return [system for system in SUBJECTS[subject.name].systems if runnable(subject, system)]
