"""The loader's spine: the routing/miss/predictor hooks, sequence resets, mixed-size records under a budget
(the reader's queue and the stores are in ``tests/loader/test_store.py``). Each hook is driven by a toy
implementation that proves it gets the right data."""

from __future__ import annotations

import dataclasses
import json
import shutil

import torch

from loader.plan import read_plan
from loader.predict import Predictor, PrefetchRequest
from loader.prefill import PrefillSpec
from loader.routing import SKIP, MissPolicy, RoutingPolicy
from loader.runtime import load, minimum_budget
from tests.helpers.tiny_models import mixed_precision_artifact, tiny_artifact


def _ids(n=9, seed=0):
    return torch.randint(4, 60, (1, n), generator=torch.Generator().manual_seed(seed))


def _greedy(model, ids, steps=5):
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=steps, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


class _ViewRecorder(RoutingPolicy):
    def __init__(self, cache_probe):
        self.calls = []
        self.cache_probe = cache_probe

    def route(self, layer, logits, weights, indices, view=None):
        self.calls.append((layer, tuple(logits.shape), dict(view.resident()), self.cache_probe(layer)))
        return weights, indices


def test_routing_policy_gets_logits_and_a_true_view_of_the_cache(tmp_path_factory):
    model, artifact = tiny_artifact(tmp_path_factory, "mixtral")
    holder = {}
    policy = _ViewRecorder(lambda layer: {e.expert for e in holder["loaded"].cache.layer_entries(layer)
                                          if not e.in_flight})
    loaded = load(artifact, memory_budget="unlimited", routing=policy)
    holder["loaded"] = loaded
    ids = _ids()
    with torch.no_grad():
        got = loaded.model(input_ids=ids).logits
        loaded.model(input_ids=ids)  # again: now experts are resident when the router runs
        expected = model(input_ids=ids).logits
    loaded.close()
    assert torch.allclose(got, expected, atol=1e-5)
    n_layers, n_experts = len(loaded.runtime.cache.counters), loaded.runtime.num_experts
    assert [c[0] for c in policy.calls] == list(range(n_layers)) * 2
    assert all(c[1] == (ids.numel(), n_experts) for c in policy.calls)
    assert all(c[2] == {} for c in policy.calls[:n_layers])  # cold: nothing resident
    assert all(set(c[2]) == c[3] and c[3] for c in policy.calls[n_layers:])  # the view is the cache


class _SkipAll(MissPolicy):
    def __init__(self):
        self.calls = []

    def decide(self, layer, expert, planned, indices, weights):
        self.calls.append((layer, expert, planned, bool((indices == expert).any())))
        return SKIP


def test_miss_policy_skip_drops_the_expert_exactly(tmp_path_factory):
    model, artifact = tiny_artifact(tmp_path_factory, "mixtral")
    policy = _SkipAll()
    loaded = load(artifact, memory_budget="unlimited", miss_policy=policy)
    ids = _ids(seed=3)
    with torch.no_grad():
        got = loaded.model(input_ids=ids).logits
    stats = loaded.stats()
    loaded.close()
    # every miss asked once, at the planned precision, for an expert the tokens really chose
    assert len(policy.calls) == stats["misses"] == stats["skipped"] > 0
    assert all(c[2] == "passthrough" and c[3] for c in policy.calls)
    assert stats["bytes_read"] == 0
    # reference: the same model with every expert's weights zeroed (a skipped expert adds nothing)
    zeroed = type(model)(model.config).eval()
    zeroed.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, p in zeroed.named_parameters():
            if ".experts." in name:
                p.zero_()
        expected = zeroed(input_ids=ids).logits
    assert torch.allclose(got, expected, atol=1e-5)


class _NextLayerOracle(Predictor):
    """Predicts, after layer l's router, the experts layer l+1 will use (from a replayed routing), and
    after the last layer the next token's layer-0 experts; records what it was given."""

    def __init__(self, future, precision=None, bogus=False):
        self.future = future  # callable (layer) -> experts the next call of that layer will use
        self.precision = precision
        self.bogus = bogus
        self.router_calls, self.last_calls, self.resets = [], [], 0

    def after_router(self, layer, router_input, indices):
        self.router_calls.append((layer, tuple(router_input.shape), indices.clone()))
        if layer + 1 >= self.num_layers:
            return []
        experts = range(self.num_experts) if self.bogus else self.future(layer + 1)
        return [PrefetchRequest(layer + 1, e, self.precision) for e in experts]

    def after_last_layer(self, hidden):
        self.last_calls.append(tuple(hidden.shape))
        return [PrefetchRequest(0, e) for e in (range(self.num_experts) if self.bogus else [])]

    def reset(self):
        self.resets += 1


def test_prefetching_never_changes_greedy_outputs(tmp_path_factory):
    model, artifact = tiny_artifact(tmp_path_factory, "mixtral", "int4")
    ids = _ids(seed=5)
    plain = load(artifact, memory_budget="unlimited")
    expected = _greedy(plain.model, ids)
    plain.close()
    for budget in ("unlimited", None):
        predictor = _NextLayerOracle(None, bogus=True)  # prefetch everything it can, evicting to make room
        loaded = load(artifact, memory_budget=budget if budget else minimum_budget(artifact), predictors=[predictor])
        got = _greedy(loaded.model, ids)
        stats = loaded.stats()
        loaded.close()
        assert got == expected, budget
        assert stats["prefetches"] > 0
        assert predictor.resets == 1  # one sequence
        hidden = model.config.hidden_size
        assert all(shape == (ids.shape[1], hidden) or shape[0] == 1 for _, shape, _ in predictor.router_calls)
        assert predictor.last_calls and all(s[-1] == hidden for s in predictor.last_calls)
        assert stats["peak_expert_bytes"] <= loaded.budget["limit_bytes"] - loaded.budget["dense_bytes"] \
            if loaded.budget["limit_bytes"] else True


def test_mixed_precision_records_stay_inside_the_budget(tmp_path_factory, tmp_path):
    model, art, _, low = mixed_precision_artifact(tmp_path_factory, tmp_path)
    from loader.codec import RecordLayout
    from loader.format import expert_key, read_record_offsets

    # reference: the model whose odd experts carry their decoded int4 weights
    store = json.loads((low / "manifest.json").read_text())["stores"]["int4"]
    layout = RecordLayout.from_json(store["layout"])
    offsets, record_bytes, _ = read_record_offsets(low / store["file"])
    raw = (low / store["file"]).read_bytes()
    reference = type(model)(model.config).eval()
    reference.load_state_dict(model.state_dict())
    paths = json.loads((art / "manifest.json").read_text())["moe"]["experts_modules"]
    with torch.no_grad():
        for layer, path in enumerate(paths):
            module = reference.get_submodule(path)
            for e in range(1, module.num_experts, 2):
                off = offsets[expert_key(layer, e)]
                rec = torch.frombuffer(bytearray(raw[off:off + record_bytes]), dtype=torch.uint8)
                for name, tensor in layout.decode(rec).items():
                    getattr(module, name)[e].copy_(tensor)
    minimum = minimum_budget(art)
    ids = _ids(12, seed=7)
    for budget in (minimum, minimum + 3 * 4096, "unlimited"):
        loaded = load(art, memory_budget=budget)
        with torch.no_grad():
            out = loaded.model(input_ids=ids[:, :6], use_cache=True)
            logits = [out.logits]
            for t in range(6, ids.shape[1]):
                out = loaded.model(input_ids=ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
                logits.append(out.logits)
            expected = reference(input_ids=ids).logits
        stats, b = loaded.stats(), loaded.budget
        loaded.close()
        assert torch.allclose(torch.cat(logits, 1), expected, atol=1e-4), budget
        assert set(b["record_bytes"]) == {"passthrough", "int4"}
        assert b["record_bytes"]["int4"] < b["record_bytes"]["passthrough"]
        if budget != "unlimited":
            assert stats["peak_expert_bytes"] <= b["limit_bytes"] - b["dense_bytes"]
            assert stats["misses"] > 2 * loaded.runtime.num_layers


def test_a_new_sequence_resets_the_clock_and_the_predictors(tmp_path_factory):
    _, artifact = tiny_artifact(tmp_path_factory, "mixtral")
    predictor = _NextLayerOracle(None, bogus=False)
    predictor.future = lambda layer: []

    class Counting(RoutingPolicy):
        resets = 0

        def reset(self):
            Counting.resets += 1

    loaded = load(artifact, memory_budget="unlimited", predictors=[predictor], routing=Counting())
    ids = _ids(7, seed=2)
    with torch.no_grad():
        out = loaded.model(input_ids=ids, use_cache=True)
        assert loaded.cache.clock.token == 6 and predictor.resets == Counting.resets == 1
        loaded.model(input_ids=ids[:, :1], past_key_values=out.past_key_values, use_cache=True)
        assert loaded.cache.clock.token == 7 and predictor.resets == Counting.resets == 1  # same sequence
        loaded.model(input_ids=ids[:, :3])
        assert loaded.cache.clock.token == 2 and predictor.resets == Counting.resets == 2  # a new one
    loaded.close()


def test_an_oracle_prefetch_turns_misses_into_hits_without_double_reads(tmp_path_factory):
    """Prefetching exactly what the next layer uses: its demands find the records (resident or in flight,
    never read twice), so misses fall and every byte read is a prefetch's."""
    from loader.routing import ReplayRouting

    _, artifact = tiny_artifact(tmp_path_factory, "mixtral")
    manifest = json.loads((artifact / "manifest.json").read_text())
    n_layers, n_experts = len(manifest["moe"]["layers"]), manifest["moe"]["num_experts"]
    record = manifest["stores"]["passthrough"]["record_bytes"]
    steps = 6
    gen = torch.Generator().manual_seed(4)
    ids = torch.stack([torch.randperm(n_experts, generator=gen)[:2] for _ in range(steps * n_layers)]).view(steps, n_layers, 2)
    weights = torch.full((steps, n_layers, 2), 0.5)
    replay = ReplayRouting(ids, weights)
    predictor = _NextLayerOracle(lambda layer: ids[replay.cursor[layer], layer].tolist())
    # decode only: the budget keeps the smallest prefill reserve (one-token chunks), so the 2 records above the
    # minimum go to the cache
    plan = dataclasses.replace(read_plan(artifact), prefill=PrefillSpec(chunk=1))
    loaded = load(artifact, memory_budget=minimum_budget(artifact, plan=plan) + 2 * 8192, predictors=[predictor],
                  routing=replay, plan=plan)
    tokens = torch.randint(4, 60, (1, steps), generator=gen)
    with torch.no_grad():
        out = loaded.model(input_ids=tokens[:, :1], use_cache=True)
        for t in range(1, steps):
            out = loaded.model(input_ids=tokens[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
    stats = loaded.stats()
    loaded.close()
    later = [stats["layers"][str(layer)] for layer in range(1, n_layers)]
    assert sum(s["misses"] for s in later) == 0  # every later layer's experts were prefetched in time
    assert sum(s["prefetch_used"] for s in later) > 0
    assert stats["bytes_read"] == (stats["misses"] + stats["prefetches"]) * record


def test_a_load_racing_a_swap_retries_on_the_new_version(tmp_path_factory, tmp_path, monkeypatch):
    """prepare swaps the artifact symlink and deletes the old version; a load caught in between (it resolved
    the old version, whose files then vanish) loads the new one instead of failing."""
    import loader.runtime as runtime

    _, artifact = tiny_artifact(tmp_path_factory, "mixtral")
    old, new = tmp_path / ".art.v-1", tmp_path / ".art.v-2"
    shutil.copytree(artifact.resolve(), old)
    shutil.copytree(artifact.resolve(), new)
    link = tmp_path / "art"
    link.symlink_to(old.name)
    real_check = runtime.check_model
    swaps = []

    def check_then_swap(manifest, model):
        if not swaps:  # the first load has resolved the old version: publish the new one, delete the old
            tmp = tmp_path / ".art.link"
            tmp.symlink_to(new.name)
            tmp.replace(link)
            shutil.rmtree(old)
            swaps.append(manifest.root)
        return real_check(manifest, model)

    monkeypatch.setattr(runtime, "check_model", check_then_swap)
    loaded = load(link, memory_budget="unlimited")
    with torch.no_grad():
        loaded.model(input_ids=_ids())
    assert swaps == [old] and loaded.stats()["misses"] > 0
    assert all(s.path.parent == new for s in loaded.runtime.stores.values())
    loaded.close()
