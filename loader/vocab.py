"""Every name list of the loader, once: precisions and their bits, dtypes, the miss policy's SKIP, pool
groups, held-form names, predictor names. Modules import these instead of restating them, so adding a
precision or a form is one edit here plus its implementation.
"""

from __future__ import annotations

# Quantized store precisions -> bits per code (``loader/codec.py`` packs them).
BITS = {"int8": 8, "int4": 4, "int3": 3, "int2": 2}
# Microscaling float precisions -> bits per weight: ``mxfp4`` is OCP MXFP4, an E2M1 code per weight and an E8M0
# scale per 32 (gpt-oss's released experts; ``loader/codec.py``). Its held forms are decoded floats.
MX = {"mxfp4": 4.25}
# Every store precision, most bits first: the source matrices as they are, or one of the quantized ones.
PRECISIONS = ("passthrough", "int8", "mxfp4", "int4", "int3", "int2")
# Bits per weight, to rank precisions: a higher-ranked record satisfies a request for a lower one.
PRECISION_BITS = {"passthrough": 32, "float32": 32, "bfloat16": 16, "float16": 16, **BITS, **MX}
# Model dtypes an artifact may hold.
DTYPES = ("float32", "float16", "bfloat16")
SKIP = "skip"  # a miss policy's answer: do not compute this expert
GROUPS = ("layer", "global")  # a pool's eviction groups: one per MoE layer, or one for all
# Held forms (``loader/forms.py``): what a cached expert is computed from. ``record`` is the record itself.
FORM_NAMES = ("record", "float32", "bfloat16", "float16", "int4pack", "qdot")
# The dense weights' held forms (``loader/dense.py``): as stored, or int8 codes the compiled kernels compute from.
DENSE_FORMS = ("float", "int8")
# What ``load(expert_dtype=...)`` accepts: a form, ``packed`` (the record form), or ``auto``.
EXPERT_DTYPES = ("auto", "float32", "bfloat16", "float16", "int4pack", "qdot", "packed")
PREDICTOR_NAMES = ("next_gates", "path_stats", "first_gate", "neuron_gates")
CPU_MISSES = ("auto", "always", "never")  # CUDA + host store: compute a decode miss on the CPU
# Routing and miss policy names that mean "the model's own top-k, every miss read at its planned precision".
DEFAULT_HOOKS = ("topk", "plan", "none")
# A router's weight function (the manifest's ``moe.routing_weights``; ``loader.routing.selection_weights`` runs it).
WEIGHT_FUNCTIONS = ("softmax", "softmax_selected", "sparsemixer")


def precision_rank(precision: str) -> float:
    return PRECISION_BITS.get(precision, 0)


def weights_spec_problem(spec) -> str | None:
    """What is wrong with a ``routing_weights`` spec (None when sound): its one shape, for the manifest's check
    (``loader/format.py``) and the routing policies that run it (``loader/routing.py``)."""
    if (not isinstance(spec, dict) or spec.get("function") not in WEIGHT_FUNCTIONS
            or not isinstance(spec.get("renormalize"), bool)
            or any(isinstance(spec.get(k), bool) or not isinstance(spec.get(k), int | float) for k in ("scale", "jitter_eps"))):
        return (f"routing_weights must be {{function: {'|'.join(WEIGHT_FUNCTIONS)}, renormalize: bool, "
                f"scale: number, jitter_eps: number}}, got {spec!r:.120}")
    return None
