"""Binding an artifact to what runs it: the checks that need more than the artifact's files.

``check_model`` checks the manifest against the model skeleton built from ``config.json`` (module paths,
layouts, dense weights) before any weight is assigned; ``check_predictors`` binds the plan's predictors as the
loader binds them; ``read_tokenizer`` builds the tokenizer. ``load`` (``loader/runtime.py``) runs them while it
builds the model, ``verify`` the ones that need no weights, so both refuse an artifact with the same message.
"""

from __future__ import annotations

from pathlib import Path

from loader.codec import NeuronLayout, RecordLayout
from loader.errors import PREPARE_AGAIN as _PREPARE_AGAIN
from loader.errors import ArtifactError
from loader.format import DENSE, MANIFEST, Manifest, StoreInfo
from loader.io import read_safetensors_header
from loader.plan import PLAN_FILE, Plan
from loader.predict import PREDICTORS_FILE, PredictorContext, PredictorError, make_predictor


def read_predictor_tensors(manifest: Manifest) -> dict:
    """The artifact's ``predictors.safetensors`` as torch tensors ({} when it has none), its header read bounded
    and every float value finite; an unreadable file is one ArtifactError naming it."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if PREDICTORS_FILE not in manifest.files:
        return {}
    path = manifest.path(PREDICTORS_FILE)
    read_safetensors_header(path, PREDICTORS_FILE)  # a garbage header or a 2**60 length is refused before loading
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ArtifactError(f"{PREDICTORS_FILE} cannot be read ({e}); {_PREPARE_AGAIN}", file=PREDICTORS_FILE) from None
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ArtifactError(f"{PREDICTORS_FILE}: {name} holds NaN or infinite values; {_PREPARE_AGAIN}",
                                file=PREDICTORS_FILE)
    return tensors


def check_predictors(manifest: Manifest, plan: Plan) -> None:
    """Bind the predictors ``plan`` names as the loader binds them (the routers' weights from dense.safetensors, the
    artifact's predictor tensors), so ``verify`` refuses what ``load`` would; one ArtifactError naming the file."""
    from safetensors import safe_open

    tensors = read_predictor_tensors(manifest)
    if not plan.predictors:
        return
    moe = manifest.moe
    routers = []
    with safe_open(str(manifest.path(DENSE)), framework="pt") as f:
        names = set(f.keys())
        for path in moe.router_modules:
            weight = f.get_tensor(f"{path}.weight") if f"{path}.weight" in names else None
            bias = f.get_tensor(f"{path}.bias") if f"{path}.bias" in names else None
            routers.append((weight.float() if weight is not None else None, bias.float() if bias is not None else None))
    context = PredictorContext(len(moe.layers), moe.num_experts, moe.top_k, routers, tensors)
    for spec in plan.predictors:
        try:
            make_predictor(spec.name, spec.params).bind(context)
        except PredictorError as e:
            raise ArtifactError(f"{PLAN_FILE} names the predictor {spec.name}, which this artifact cannot run: {e}",
                                file=PREDICTORS_FILE if PREDICTORS_FILE in manifest.files else PLAN_FILE) from None


def read_tokenizer(artifact: Path):
    """The artifact's tokenizer, loaded as ``load`` loads it (``AutoTokenizer`` over the artifact directory); a
    tokenizer that cannot be built (a tokenizer.json without its model, a config naming nothing) is one
    ArtifactError naming the files. ``verify`` loads it too: it needs no weights."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(artifact)
    except Exception as e:  # transformers and tokenizers raise many kinds for a malformed file
        raise ArtifactError(f"the artifact's tokenizer files (tokenizer.json, tokenizer_config.json) cannot be read "
                            f"({type(e).__name__}: {str(e)[:200]}); {_PREPARE_AGAIN}", file="tokenizer.json") from None


def _check_neuron_store(info: StoreInfo, experts, num_experts: int, path: str, fail) -> None:
    """A neuron store fits an experts module when its gate [I, H] and neuron rows [I, 2H] come from the module's
    fused parameters: gate_up_proj [E, 2I, H] (or [E, H, 2I]) and down_proj [E, H, I] (or [E, I, H])."""
    layout = NeuronLayout(RecordLayout.from_json(info.layout))
    i, h = layout.intermediate, layout.hidden
    want = {"gate_up_proj": {(num_experts, 2 * i, h), (num_experts, h, 2 * i)},
            "down_proj": {(num_experts, h, i), (num_experts, i, h)}}
    if "gate_bias" in layout.specs:
        want |= {"gate_up_proj_bias": {(num_experts, 2 * i)}, "down_proj_bias": {(num_experts, h)}}
    params = experts._parameters
    if set(params) != set(want):
        raise fail(f"the {info.precision} neuron layout comes from {sorted(want)}, the experts module {path!r} has "
                   f"{sorted(params)}")
    for name, shapes in want.items():
        if params[name] is None or tuple(params[name].shape) not in shapes:
            raise fail(f"{path}.{name} is {tuple(params[name].shape)} in the model, the {info.precision} neuron "
                       f"layout needs one of {sorted(shapes)}")


_TORCH_ST = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
             "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def check_model(manifest: Manifest, model) -> None:
    """Check the manifest against the model skeleton built from config.json (meta device is fine), before
    any weight is assigned: every module path exists, each layout matrix has the shape of its experts
    parameter, and ``dense.safetensors`` holds exactly the non-expert weights with their shapes and dtypes.
    """
    moe = manifest.moe

    def fail(what: str, file: str = MANIFEST) -> ArtifactError:
        return ArtifactError(f"{manifest.root / file} does not fit the model built from config.json: {what}; "
                             f"{_PREPARE_AGAIN}", file=file)

    def module(path: str):
        try:
            return model.get_submodule(path)
        except AttributeError:
            raise fail(f"it names the module {path!r}, which the model does not have") from None

    for path in moe.router_modules:  # a router scores every expert: it holds a parameter of E rows
        params = module(path)._parameters.values()
        if not any(p is not None and p.dim() >= 1 and p.shape[0] == moe.num_experts for p in params):
            raise fail(f"its router module {path!r} holds no parameter with {moe.num_experts} rows (one per "
                       "expert): it is not this model's router")
    module(moe.last_decoder_layer)
    for path in moe.experts_modules:
        experts = module(path)
        for info in manifest.stores.values():
            if info.neuron is not None:
                _check_neuron_store(info, experts, moe.num_experts, path, fail)
                continue
            names = [spec["name"] for spec in info.layout]
            if names != list(experts._parameters):  # a record holds every parameter, in the module's order
                raise fail(f"the {info.precision} layout holds {names}, the experts module {path!r} has "
                           f"{list(experts._parameters)} in this order")
            for spec in RecordLayout.from_json(info.layout).matrices:
                param = experts._parameters.get(spec.name)
                shape = spec.shape[::-1] if spec.transposed else spec.shape
                if param is None or tuple(param.shape) != (moe.num_experts, *shape):
                    got = None if param is None else tuple(param.shape)
                    raise fail(f"{path}.{spec.name} is {got} in the model, the {info.precision} layout says "
                               f"{moe.num_experts} x {tuple(shape)}")
    header, _, _ = read_safetensors_header(manifest.path(DENSE), DENSE)
    state = model.state_dict(keep_vars=True)
    experts = set(moe.expert_params)
    for name, entry in header.items():
        tensor = state.get(name)
        if tensor is None or name in experts:
            raise fail(f"it holds {name!r}, which is not a dense weight of the model", DENSE)
        want = _TORCH_ST.get(str(tensor.dtype).removeprefix("torch."))
        if list(tensor.shape) != entry["shape"] or entry["dtype"] != want:
            raise fail(f"{name!r} is {entry['dtype']} {entry['shape']}, the model has {want} "
                       f"{list(tensor.shape)}", DENSE)
    groups: dict[int, list[str]] = {}
    for name, tensor in state.items():  # tied weights share one tensor: one name of a group suffices
        groups.setdefault(id(tensor), []).append(name)
    for names in groups.values():
        if not any(n in header or n in experts for n in names):
            raise fail(f"the weight {names[0]!r} is missing", DENSE)
