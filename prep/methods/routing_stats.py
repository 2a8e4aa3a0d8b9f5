"""Routing statistics for prediction: what the loader's predictors are built from and
how well each predicts, measured on held-out calibration routing.

- ``fit_path_stats``: EdgeMoE's path counts (EdgeMoE section 3.3.2) in the tensor layout
  ``loader.predict.PathStats`` reads (the backoff lives there, one home for the loader and for the
  recall measured here).
- ``path_stats_recall``: per layer, top-1 accuracy and top-K set recall of the path statistics' ranking
  against what each held-out token chose, next to the marginal-frequency ranking fitted on the same data.
- ``next_gate_recall``: AdapMoE 2.3 / HOBBIT H2: layer l+d's router applied to layer l's router input,
  per layer and distance d, with the same two figures and the marginal baseline of the target layer.

Top-1 accuracy: the predicted first expert is the token's actual top-1 (the chosen expert with the
largest weight). Top-K recall: |predicted K ∩ chosen K| / K, averaged over tokens (AdapMoE's β at d = 1).
Layers are positions 0..L-1 among the MoE layers. Shapes use the legend declared in ``loader/__init__.py``.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from loader.predict import PathStats, stacked_router_logits
from loader.routing import AdaptiveGating, unimportance
from prep.errors import MoeprepError


def _check_routing(routing: list[torch.Tensor], num_experts: int) -> tuple[int, int]:
    if not routing:
        raise MoeprepError("no routed sequences to fit or measure on; record a trace with tokens in it")
    shapes = {tuple(r.shape[1:]) for r in routing}
    if len(shapes) != 1 or any(r.dim() != 3 for r in routing):
        raise MoeprepError(f"every sequence's routing must be [T, L, K] with one (L, K), got {sorted(shapes)}")
    num_layers, k = shapes.pop()
    top = max(int(r.max()) for r in routing if r.numel())
    if top >= num_experts or min(int(r.min()) for r in routing if r.numel()) < 0:
        raise MoeprepError(f"the routing names expert {top}, outside 0..{num_experts - 1}")
    return num_layers, k


def fit_path_stats(routing: list[torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """routing: per sequence the chosen experts [T, L, K] -> the path-statistics tensors (counts)."""
    num_layers, _k = _check_routing(routing, num_experts)
    marginal = torch.zeros(num_layers, num_experts, dtype=torch.int64)
    tables = {kind: [defaultdict(lambda: [torch.zeros(num_experts, dtype=torch.int64), 0])
                     for _ in range(num_layers)] for kind in ("prev1", "prev2")}
    for seq in routing:
        for token in seq.tolist():  # [L][K]
            sets = [tuple(sorted(set(row))) for row in token]
            for layer, chosen in enumerate(sets):
                marginal[layer, list(chosen)] += 1
                keys = []
                if layer >= 1:
                    keys.append(("prev1", sets[layer - 1]))
                if layer >= 2:
                    keys.append(("prev2", sets[layer - 2] + sets[layer - 1]))
                for kind, key in keys:
                    entry = tables[kind][layer][key]
                    entry[0][list(chosen)] += 1
                    entry[1] += 1
    tokens = sum(len(seq) for seq in routing)
    out = {"path.marginal.counts": marginal.int(),
           "path.marginal.totals": torch.full((num_layers,), tokens, dtype=torch.int32)}
    for kind, per_layer in tables.items():
        for layer, table in enumerate(per_layer):
            if not table:
                continue
            keys = sorted(table)
            out[f"path.{kind}.{layer}.keys"] = torch.tensor(keys, dtype=torch.int32)
            out[f"path.{kind}.{layer}.counts"] = torch.stack([table[key][0] for key in keys]).int()
            out[f"path.{kind}.{layer}.totals"] = torch.tensor([table[key][1] for key in keys], dtype=torch.int32)
    return out


def _top1(ids: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """ids [N, K], weights [N, K] or None -> each row's top-1 expert (slot 0 without weights)."""
    if weights is None:
        return ids[:, 0]
    return ids.gather(1, weights.argmax(1, keepdim=True)).squeeze(1)


def _scores(ranked: torch.Tensor, ids: torch.Tensor, top1: torch.Tensor) -> dict:
    """ranked [N, K'] predicted experts best first; ids [N, K] chosen; top1 [N] -> the two figures."""
    k = ids.shape[1]
    hit = (ranked[:, :k].unsqueeze(-1) == ids.unsqueeze(-2)).any(-1).sum(-1).float() / k
    return {"top1": float((ranked[:, 0] == top1).float().mean()), f"top{k}_recall": float(hit.mean())}


def marginal_order(routing: list[torch.Tensor], num_experts: int) -> torch.Tensor:
    """[L, E]: each layer's experts by descending frequency in ``routing`` (ties by index)."""
    ids = torch.cat([r for r in routing])  # [N, L, K]
    counts = torch.stack([torch.bincount(ids[:, layer].flatten(), minlength=num_experts)
                          for layer in range(ids.shape[1])]).double()
    counts -= torch.arange(num_experts, dtype=torch.float64) * 1e-9  # stable: lower index first on ties
    return counts.argsort(1, descending=True)


def path_stats_recall(tensors: dict, held_ids: list[torch.Tensor], held_weights: list[torch.Tensor] | None,
                      fit_ids: list[torch.Tensor], num_experts: int, min_count: int = 5) -> dict:
    """Per layer, the path statistics against held-out routing, beside the marginal fitted on ``fit_ids``.

    Returns {"layers": [{layer, path: {top1, topK_recall}, marginal: {...}, tables: {prev2, prev1,
    marginal: share of tokens each table answered}}], "mean": {path, marginal}}.
    """
    num_layers, k = _check_routing(held_ids, num_experts)
    stats = PathStats.from_tensors(tensors, min_count)
    order = marginal_order(fit_ids, num_experts)
    ids = torch.cat(held_ids)  # [N, L, K]
    weights = torch.cat(held_weights) if held_weights is not None else None
    layers = []
    for layer in range(num_layers):
        ranked, used = [], defaultdict(int)
        for seq in held_ids:
            for token in seq.tolist():
                prev2 = token[layer - 2] if layer >= 2 else None
                prev1 = token[layer - 1] if layer >= 1 else None
                probs, table = stats.probs(layer, prev2, prev1)
                used[table] += 1
                ranked.append(probs.argsort(descending=True, stable=True)[:k])
        truth, top1 = ids[:, layer], _top1(ids[:, layer], weights[:, layer] if weights is not None else None)
        n = len(ranked)
        layers.append({"layer": layer, "path": _scores(torch.stack(ranked), truth, top1),
                       "marginal": _scores(order[layer].expand(n, -1), truth, top1),
                       "tables": {t: used[t] / n for t in ("prev2", "prev1", "marginal")}})
    return {"layers": layers, "mean": _means(layers, ("path", "marginal"))}


def cross_fit_path_recall(routing: list, num_experts: int, min_count: int = 5) -> list[dict]:
    """Path statistics fitted on each sequence of ``routing`` (``RoutingTrace``s) in turn and measured on
    each other one (the real Mixtral traces hold two GSM8K problems): the mean figures and table shares."""
    out = []
    for i, fit in enumerate(routing):
        for j, test in enumerate(routing):
            if i == j:
                continue
            r = path_stats_recall(fit_path_stats([fit.expert_ids], num_experts), [test.expert_ids],
                                  [test.expert_weights], [fit.expert_ids], num_experts, min_count)
            tables = {t: sum(row["tables"][t] for row in r["layers"]) / len(r["layers"])
                      for t in ("prev2", "prev1", "marginal")}
            out.append({"fit": i, "test": j, "fit_tokens": fit.num_tokens, "test_tokens": test.num_tokens,
                        "min_count": min_count, **r["mean"], "tables": tables})
    return out


def _means(rows: list[dict], names: tuple[str, ...]) -> dict:
    return {name: {m: sum(r[name][m] for r in rows) / len(rows) for m in rows[0][name]} for name in names} if rows else {}


def next_gate_recall(router_inputs: list[torch.Tensor], routers: list[tuple[torch.Tensor, torch.Tensor | None]],
                     ids: torch.Tensor, weights: torch.Tensor | None, fit_ids: list[torch.Tensor],
                     distances: int = 3) -> dict:
    """Layer l+d's router on layer l's router input, for d = 1..``distances``.

    router_inputs[l] [N, H] and ids [N, L, K] (weights [N, L, K] or None) are the held-out tokens;
    routers[l] = (weight [E, H], bias [E] or None); fit_ids: the routing the marginal baseline is fitted
    on. Returns {"layers": [{layer, distance, target, gate: {top1, topK_recall}, marginal: {...}}],
    "by_distance": {d: {gate, marginal} means}}.
    """
    num_layers, k = ids.shape[1], ids.shape[2]
    if len(router_inputs) != num_layers or len(routers) != num_layers:
        raise MoeprepError(f"next-gate recall needs {num_layers} router inputs and routers, got "
                           f"{len(router_inputs)} and {len(routers)}")
    num_experts = routers[0][0].shape[0]
    order = marginal_order(fit_ids, num_experts)
    weight = torch.stack([w.detach().float() for w, _ in routers])
    bias = torch.stack([b.detach().float() if b is not None else torch.zeros(num_experts) for _, b in routers])
    rows = []
    for layer in range(num_layers - 1):
        last = min(layer + distances, num_layers - 1)
        logits = stacked_router_logits(weight[layer + 1:last + 1], bias[layer + 1:last + 1], router_inputs[layer].float())
        for d, z in enumerate(logits, start=1):
            target = layer + d
            truth = ids[:, target]
            top1 = _top1(truth, weights[:, target] if weights is not None else None)
            rows.append({"layer": layer, "distance": d, "target": target,
                         "gate": _scores(z.topk(k, -1).indices, truth, top1),
                         "marginal": _scores(order[target].expand(len(truth), -1), truth, top1)})
    by_distance = {str(d): _means([r for r in rows if r["distance"] == d], ("gate", "marginal"))
                   for d in range(1, distances + 1) if any(r["distance"] == d for r in rows)}
    return {"layers": rows, "by_distance": by_distance}


# ---------------------------------------------------------------------------------- doing less per token


def precision_split(weights: torch.Tensor, t1: float, t2: float) -> dict:
    """weights [N, K] of recorded selections -> the shares of selections HOBBIT's rule would read high
    (unimportance <= t1), low (<= t2) and skip, over every selection (as if each were a miss)."""

    s = unimportance(weights.reshape(-1, weights.shape[-1]))
    n = s.numel()
    high = int((s <= t1).sum())
    low = int(((s > t1) & (s <= t2)).sum())
    return {"high": high / n, "low": low / n, "skip": (n - high - low) / n, "selections": n}


def split_thresholds(weights: torch.Tensor, high: float, skip: float = 0.0) -> tuple[float, float]:
    """(t1, t2) from quantiles of the unimportance score so that about ``high`` of the selections read high
    and ``skip`` are skipped (HOBBIT picks its thresholds by profiling this distribution)."""

    if not (0 <= skip <= 1 and 0 <= high <= 1 - skip):
        raise MoeprepError(f"a split needs 0 <= skip <= 1 and 0 <= high <= 1 - skip, got high {high}, skip {skip}")
    s = unimportance(weights.reshape(-1, weights.shape[-1])).flatten().double().sort().values
    n = len(s)

    def at(share: float) -> float:
        return float(s[min(max(round(share * n) - 1, 0), n - 1)]) if share > 0 else 0.0

    t1 = at(high)
    t2 = 1.0 if skip == 0 else max(t1, at(1 - skip))
    return t1, t2


def gating_share(weights: torch.Tensor, sensitivity: list[float], threshold: float) -> dict:
    """AdapMoE's rule on recorded routing weights [N, L, K] (no forward pass): the share of (token, layer)
    decisions left with one expert and the share of expert runs saved, overall and per layer."""

    policy = AdaptiveGating(threshold, sensitivity)
    per_layer = []
    for layer in range(weights.shape[1]):
        keep = policy.keep_mask(layer, weights[:, layer])
        per_layer.append({"single": float((keep.sum(-1) == 1).float().mean()) if weights.shape[-1] > 1 else 0.0,
                          "runs_saved": 1 - float(keep.float().mean())})
    return {"single": sum(r["single"] for r in per_layer) / len(per_layer),
            "runs_saved": sum(r["runs_saved"] for r in per_layer) / len(per_layer), "layers": per_layer}
