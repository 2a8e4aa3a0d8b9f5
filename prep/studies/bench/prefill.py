"""The bench's prefill rows (``moeprep bench --prefill 512,2048``): a user's first wait is the prompt.

For each prompt length, subject and budget, each system loads fresh in its own worker process
(``prep/studies/bench/worker.py``, ``"mode": "prefill"``) and runs the prompt once; nothing is decoded. A row gives
the time to the first token's logits (``ttft_s``) and prompt tokens/s:

- ``resident`` and ``accelerate``: one forward of the whole prompt (transformers; accelerate's page cache dropped
  before it, as for decode). ``resident`` runs the fastest of its candidates (dtype x experts implementation) on the
  shortest prompt, chosen per subject by prefill speed (a prompt's best kernel need not be a decode step's).
- ``naive`` and ``moeprep``: ``LoadedModel.prefill``, the prompt in chunks inside the budget's prefill reserve,
  from a cold cache (``loader/prefill.py``).
- ``moeprep@unlimited``: the prompt once untimed, then timed with every expert held: the compute floor.
- ``llama.cpp`` (``mixtral-shape-own``, the optional extra): ``Llama.eval`` of the prompt in a memory cgroup of the
  budget, as its decode rows.

Each moeprep row states its bound: tokens / max(the compute floor's seconds, the bytes the row's chunks read over the
disk's measured read bandwidth), and the fraction of it reached. Memory: the peak RSS of the process during the
prompt less its RSS before the model was loaded (llama.cpp: its cgroup's peak during the prompt), against the
budget (``within_budget``; None for resident, which has none).

The prefill rows run on ``mixtral-shape`` (the real traces' decisions, all problems one after another and repeated
to the prompt's length: ``subjects.tiled_replay``) and ``mixtral-shape-own`` (its own routers). Their model says
``max_position_embeddings`` 512; its rotary embedding (``rope_type`` default) has no weights that depend on it and
computes any position, so longer prompts run as they are (rebuilding the 4 GB model and its artifacts to change
one number in its config is not worth it); the loader sizes its prefill reserve at that context and cuts each
chunk to its real one (``loader.prefill.chunk_sizes``), and llama.cpp is opened with a context of the prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

from loader.io import write_bytes_atomic
from prep.errors import MoeprepError
from prep.studies.bench.subjects import SUBJECTS, Subject, prefill_prompt, tiled_replay

PREFILL_SUBJECTS = tuple(name for name, entry in SUBJECTS.items() if entry.prefill)  # the registry says which
# transformers' experts implementations a prompt cannot run: batched_mm gathers each token's experts' weights (T x K
# copies of an expert: 17 GB for a 512-token prompt of mixtral-shape in float32), fine for one decode token
UNFIT_FOR_PROMPTS = {"batched_mm": "it copies every token's experts' weights (T x K copies of an expert; 17 GB for "
                                   "512 tokens of mixtral-shape in float32)"}
PREFILL_BUDGETS = "100%,25%,4bit-25%"  # what the prefill rows run where --budgets is not given (issue 43)
FLOOR = "moeprep@unlimited"
LLAMA = "llama.cpp"
MAX_PROMPT = 1 << 16


def parse_prompts(text: str | None) -> list[int]:
    """"512,2048" -> [512, 2048] (sorted, each once); None or "" -> [] (no prefill rows)."""
    if not text:
        return []
    out = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or not 1 <= int(part) <= MAX_PROMPT:
            raise MoeprepError(f"--prefill: {part!r} is not a prompt length in tokens (1 to {MAX_PROMPT}); pass e.g. "
                               "--prefill 512,2048")
        out.add(int(part))
    if not out:
        raise MoeprepError("--prefill is empty; pass e.g. --prefill 512,2048")
    return sorted(out)


def prefill_systems(subject: Subject, budgets: list[str]) -> list[tuple[str, str]]:
    """(system, budget) of each prefill row of ``subject``: resident and the floor once, the rest at each budget."""
    others = ["accelerate", "naive", "moeprep"] + ([LLAMA] if "llama_cpp" in subject.facts else [])
    return [("resident", "100%"), (FLOOR, "unlimited")] + [(s, b) for b in budgets for s in others]


def summarize_prefill(runs: list[dict]) -> dict:
    """One row from the repeats of a prefill configuration: the median run's figures (by prompt tokens/s), with
    the median, min and max of tokens/s and of time to first token; an error when none succeeded."""
    ok = sorted((r for r in runs if "error" not in r), key=lambda r: r["prefill_tokens_per_s"])
    if not ok:
        return {"repeats": 0, "error": runs[-1]["error"]}

    def median(values):
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2

    speeds, ttfts = [r["prefill_tokens_per_s"] for r in ok], sorted(r["ttft_s"] for r in ok)
    return ok[len(ok) // 2] | {"repeats": len(ok), "failed_repeats": len(runs) - len(ok),
                               "prefill_tokens_per_s": median(speeds), "prefill_tokens_per_s_min": speeds[0],
                               "prefill_tokens_per_s_max": speeds[-1], "ttft_s": median(ttfts),
                               "ttft_s_runs": ttfts}


def add_bounds(rows: list[dict], read_bandwidth: float | None) -> None:
    """Give each moeprep row (in place) its bound: tokens / max(the floor's seconds (``moeprep@unlimited`` on the
    same subject and prompt), its bytes read / ``read_bandwidth`` bytes/s), and ``fraction_of_bound``: its
    tokens/s over that; None with ``bound_error`` where the floor or the bandwidth is missing."""
    floors = {(r["subject"], r["prompt_tokens"]): r.get("ttft_s") for r in rows
              if r["system"] == FLOOR and not r.get("error")}
    for r in rows:
        if r["system"] != "moeprep" or r.get("error"):
            continue
        floor = floors.get((r["subject"], r["prompt_tokens"]))
        io = r["bytes_read"] / read_bandwidth if read_bandwidth else None
        r |= {"floor_s": floor, "io_floor_s": io}
        if not floor or io is None:
            r |= {"bound_tokens_per_s": None, "fraction_of_bound": None,
                  "bound_error": f"{FLOOR} did not run" if not floor else "no read bandwidth measured"}
            continue
        r["bound_tokens_per_s"] = r["prompt_tokens"] / max(floor, io)
        r["bound_by"] = "compute" if floor >= io else "reads"
        r["fraction_of_bound"] = r["prefill_tokens_per_s"] / r["bound_tokens_per_s"]


def add_memory_verdicts(rows: list[dict]) -> None:
    """``within_budget`` of each row (in place): the memory of its prompt (``prefill_memory_bytes``) at most its
    budget; None for the budget-free rows or where the memory was not measured."""
    for r in rows:
        memory = r.get("prefill_memory_bytes")
        free = r["system"] in ("resident", FLOOR)
        r["within_budget"] = None if free or memory is None or r.get("error") else memory <= r["budget_bytes"]


def kv_cache_bytes(shape: dict, tokens: int) -> int:
    """The KV cache of ``tokens`` tokens of a mixtral-shape model (keys and values of every layer, in its dtype):
    memory a prompt needs that the loader's budget does not count, stated beside each row's memory."""
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[shape["dtype"]]
    return 2 * shape["num_hidden_layers"] * tokens * shape["num_key_value_heads"] * shape["head_dim"] * dtype_bytes


def run_prefill(subjects: list[Subject], budgets: list[str], prompts: list[int], repeats: int, work: Path,
                traces: Path | None, spec_for, run_worker, choose_resident, chosen_systems: set | None,
                echo=print, progress=None) -> dict:
    """Measure every prefill row, in interleaved rounds (each configuration once per round).

    spec_for(subject, system, budget) -> the worker spec the decode rows use; run_worker(spec) -> its result (a
    memory cgroup around llama.cpp); choose_resident(spec) -> the resident candidates measured on ``spec`` and the
    chosen one (``measure.measure_resident_candidates``), or None where resident is not run. Returns the rows (one per
    subject, prompt, system and budget: the budget-free ones at each budget) and the runs, candidates and notes."""
    notes, ran = [], []
    usable = []
    for subj in subjects:
        if subj.name in PREFILL_SUBJECTS:
            usable.append(subj)
        else:
            notes.append(f"{subj.name}: no prefill rows (they run on {' and '.join(PREFILL_SUBJECTS)})")
    replays = {}
    for subj in usable:
        if subj.replay is not None and traces is not None:  # mixtral-shape: the real decisions, tiled to the prompt
            path, how = tiled_replay(traces, subj.facts["shape"]["num_hidden_layers"], max(prompts),
                                     work / f"{subj.name}-prefill-replay.safetensors")
            replays[subj.name] = str(path)
            notes.append(f"{subj.name} prefill routing: {how}")
    configs = {s.name: [c for c in prefill_systems(s, budgets)
                        if chosen_systems is None or c[0].split("@", 1)[0] in chosen_systems] for s in usable}
    residents = {}
    measured: dict = {}
    for repeat in range(repeats):
        for subj in usable:
            for tokens in prompts:
                def spec(system, budget, subj=subj, tokens=tokens):
                    return spec_for(subj, system, budget) | {
                        "mode": "prefill", "prompt_ids": prefill_prompt(subj, tokens), "decode_ids": [],
                        "replay": replays.get(subj.name), "record_routing": None,
                        "tag": f"{subj.name}-prefill{tokens}-{system}-{budget.replace('%', 'pct')}"}

                if repeat == 0 and tokens == prompts[0] and any(s == "resident" for s, _ in configs[subj.name]):
                    residents[subj.name] = choose_resident(spec("resident", "100%"))
                chosen = (residents.get(subj.name) or {}).get("chosen") or {}
                for system, budget in configs[subj.name]:
                    if progress is not None:
                        progress(f"prefill {tokens} round {repeat + 1}/{repeats} {subj.name} {system} {budget}")
                    one = spec(system, budget)
                    if system == "resident" and chosen:
                        one |= {"dtype": chosen["dtype"], "experts_implementation": chosen["experts_implementation"]}
                    result = run_worker(one)
                    ran.append({"subject": subj.name, "prompt_tokens": tokens, "system": system, "budget": budget,
                                "repeat": repeat} | result)
                    # nothing measured is lost to a run cut short
                    write_bytes_atomic(work / "prefill-raw.json", (json.dumps(ran, indent=1) + "\n").encode())
                    if "error" in result:
                        echo(f"{subj.name} prefill {tokens} {system} {budget}: FAILED {result['error']}")
                    measured.setdefault((subj.name, tokens, system, budget), []).append(result)
    rows = []
    shapes = {s.name: s.facts["shape"] for s in usable}
    for (name, tokens, system, budget), runs in measured.items():
        row = summarize_prefill(runs)
        once = system in ("resident", FLOOR)
        for b in (budgets if once else [budget]):
            rows.append({"subject": name, "prompt_tokens": tokens, "system": system, "budget": b} | row
                        | {"kv_cache_bytes": kv_cache_bytes(shapes[name], tokens)}
                        | ({"measured_once": True} if once else {}))
    return {"prompts": prompts, "budgets": budgets, "rows": rows, "raw": ran, "resident": residents,
            "notes": notes}
