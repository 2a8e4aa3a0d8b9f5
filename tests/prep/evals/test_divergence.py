"""The divergence of a prepared model from its source: the figures against direct computation, the bootstrap
interval's coverage in a seeded simulation, and the held-out text's disjointness from the calibration set."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from prep.calibration import CalibrationSection, calibration_sequences, check_disjoint, held_out_sequences
from prep.errors import MoeprepError
from prep.evals import divergence as D


def test_two_handwritten_distributions():
    """Two positions over a 3-token vocabulary, each figure computed by hand from the probabilities."""
    p = [[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]]  # the source
    q = [[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]]  # the prepared model
    tokens = torch.tensor([0, 1, 2])  # position 0 predicts 1, position 1 predicts 2; the last position predicts none
    last = [[1 / 3] * 3]
    got = D.token_divergence(torch.tensor(p + last).log(), torch.tensor(q + last).log(), tokens)
    kl = [sum(a * math.log(a / b) for a, b in zip(pi, qi, strict=True)) for pi, qi in zip(p, q, strict=True)]
    assert got.kl == pytest.approx(kl, rel=1e-6)
    assert got.agree.tolist() == [True, False]  # argmax 0 and 0; then 1 against 2
    assert got.nll_source == pytest.approx([-math.log(0.2), -math.log(0.3)], rel=1e-6)
    assert got.nll_prepared == pytest.approx([-math.log(0.3), -math.log(0.6)], rel=1e-6)
    stats = D.summarize([got], resamples=200)["stats"]
    assert stats["mean_kl"]["value"] == pytest.approx(sum(kl) / 2, rel=1e-6)
    assert stats["top_token_agreement"]["value"] == 0.5
    assert stats["ppl_source"]["value"] == pytest.approx(math.exp((-math.log(0.2) - math.log(0.3)) / 2), rel=1e-6)
    assert stats["ppl_ratio"]["value"] == pytest.approx(math.sqrt((0.2 * 0.3) / (0.3 * 0.6)), rel=1e-6)
    assert stats["kl_p99"]["value"] == pytest.approx(max(kl), rel=1e-6)  # 99% of two values: the larger


def test_quantiles_and_pooling_against_numpy():
    """Over several sequences of unequal length: means are token-weighted and the percentiles are numpy's inverted-CDF
    quantile of every token pooled."""
    rng = np.random.default_rng(3)
    seqs = [D.SequenceDivergence(rng.gamma(0.5, 0.01, n), rng.random(n) < 0.8, rng.exponential(2, n),
                                 rng.exponential(2.2, n)) for n in (5, 40, 300, 1200)]
    stats = D.summarize(seqs, resamples=200)["stats"]
    pooled = {f: np.concatenate([getattr(s, f) for s in seqs]) for f in ("kl", "agree", "nll_source", "nll_prepared")}
    assert stats["mean_kl"]["value"] == pytest.approx(pooled["kl"].mean(), rel=1e-9)
    assert stats["top_token_agreement"]["value"] == pytest.approx(pooled["agree"].mean(), rel=1e-9)
    assert stats["ppl_prepared"]["value"] == pytest.approx(math.exp(pooled["nll_prepared"].mean()), rel=1e-9)
    for name, q in D.QUANTILES.items():
        assert stats[name]["value"] == pytest.approx(np.quantile(pooled["kl"], q, method="inverted_cdf"), rel=1e-12)
    for s in stats.values():
        assert s["low"] <= s["value"] <= s["high"]


def test_the_model_against_itself_and_against_a_direct_computation(tmp_path):
    """The dense tiny model against itself: KL 0, every top token the same, perplexity ratio 1. Against a perturbed
    copy: the mean KL equals F.kl_div over every position, the agreement and the perplexities equal a direct count."""
    from tests.helpers.tiny_models import build_tiny_model

    model = build_tiny_model("mixtral", 0).eval()
    other = build_tiny_model("mixtral", 0).eval()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.02 * torch.randn_like(p))
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, model.config.vocab_size, (24,), generator=gen) for _ in range(6)]
    same = D.measure(model, model, sequences, resamples=200)["stats"]
    assert same["mean_kl"] == {"value": 0.0, "low": 0.0, "high": 0.0}
    assert same["top_token_agreement"]["value"] == 1.0 and same["ppl_ratio"]["value"] == pytest.approx(1.0, abs=1e-12)

    got = D.measure(model, other, sequences, resamples=200)["stats"]
    with torch.no_grad():
        a = torch.cat([torch.log_softmax(model(input_ids=s.view(1, -1)).logits[0, :-1].double(), -1) for s in sequences])
        b = torch.cat([torch.log_softmax(other(input_ids=s.view(1, -1)).logits[0, :-1].double(), -1) for s in sequences])
    targets = torch.cat([s[1:] for s in sequences])
    kl = torch.nn.functional.kl_div(b, a, log_target=True, reduction="sum").item() / len(targets)
    assert got["mean_kl"]["value"] == pytest.approx(kl, rel=1e-6) and kl > 0
    assert got["top_token_agreement"]["value"] == pytest.approx((a.argmax(-1) == b.argmax(-1)).double().mean().item())
    nll = -b.gather(1, targets.view(-1, 1)).mean().item()
    assert got["ppl_prepared"]["value"] == pytest.approx(math.exp(nll), rel=1e-9)


def test_bootstrap_interval_covers_the_true_mean_at_its_stated_rate():
    """Seeded simulation: sequences whose per-token KL is gamma-distributed (heavy right tail, like the real one) with
    a lognormal sequence effect, so the true mean per token is known. The 95% interval must cover it in 95% of 300
    repetitions, within three binomial standard errors (a 90% interval would not pass, a 68% one by far)."""
    rng = np.random.default_rng(2026)
    shape, scale, sigma = 0.5, 0.002, 0.5
    true_mean = shape * scale * math.exp(sigma ** 2 / 2)
    reps, hits = 300, 0
    for r in range(reps):
        seqs = []
        for _ in range(64):
            kl = rng.gamma(shape, scale * rng.lognormal(0, sigma), 64)
            seqs.append(D.SequenceDivergence(kl, np.ones(64, bool), np.ones(64), np.ones(64)))
        s = D.summarize(seqs, resamples=600, seed=r)["stats"]["mean_kl"]
        hits += s["low"] <= true_mean <= s["high"]
    error = 3 * math.sqrt(0.95 * 0.05 / reps)
    assert abs(hits / reps - 0.95) <= error, f"coverage {hits / reps:.3f} outside 0.95 ± {error:.3f}"


def test_held_out_text_shares_nothing_with_the_calibration_set():
    """The held-out windows come after the calibration's texts, share none of its texts and none of its windows."""
    from tests.helpers.tiny_models import tiny_tokenizer

    tokenizer = tiny_tokenizer(512)
    section = CalibrationSection(num_sequences=8, sequence_length=64)
    calibration = calibration_sequences(section, tokenizer, Path("."))
    held = held_out_sequences(section, tokenizer, Path("."), 16, 64)
    assert len(held.sequences) == 16 and all(len(s) == 64 for s in held.sequences)
    assert held.provenance["disjoint_from_calibration"] and held.provenance["after_calibration"]
    windows = {bytes(s.numpy()) for s in calibration}
    assert not any(bytes(s.numpy()) in windows for s in held.sequences)
    joined = torch.cat(calibration)
    for s in held.sequences:  # no held-out window appears inside the calibration stream either
        assert not any(torch.equal(joined[i:i + 64], s) for i in range(0, len(joined) - 63))


def test_the_disjointness_check_refuses_an_overlap():
    window = torch.arange(10)
    with pytest.raises(MoeprepError, match="held-out sequence 1 is calibration sequence 0"):
        check_disjoint([torch.arange(10, 20), window.clone()], [window], set(), set())
    with pytest.raises(MoeprepError, match="held-out text"):
        check_disjoint([torch.arange(10, 20)], [window], {"a", "b"}, {"b"})


def test_repeated_texts_are_skipped_and_too_little_text_is_one_clear_error(tmp_path):
    """A files source that repeats a calibration text: the repeat is skipped, not measured on; when the text runs
    out the error says how many tokens there are and what to change."""
    from tests.helpers.tiny_models import tiny_tokenizer

    tokenizer = tiny_tokenizer(512)
    texts = ["alpha " * 20, "beta " * 20, "alpha " * 20, "gamma " * 30, "delta " * 30]
    for i, text in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(text)
    section = CalibrationSection(source="files", files=tuple(f"{i}.txt" for i in range(5)), num_sequences=1,
                                 sequence_length=100)
    held = held_out_sequences(section, tokenizer, tmp_path, 2, 100)
    assert held.provenance["texts_skipped_as_calibration"] == 1  # the second "alpha" text
    with pytest.raises(MoeprepError, match="held-out text.*tokens, 1000 needed"):
        held_out_sequences(section, tokenizer, tmp_path, 10, 100)


def test_one_long_calibration_file_goes_on_where_the_calibration_windows_end(tmp_path):
    """A single text: the held-out windows are its tokens after the calibration windows, none of them a calibration
    window."""
    from tests.helpers.tiny_models import tiny_tokenizer

    tokenizer = tiny_tokenizer(512)
    (tmp_path / "one.txt").write_text(" ".join(f"w{i}" for i in range(3000)))
    section = CalibrationSection(source="files", files=("one.txt",), num_sequences=4, sequence_length=64)
    calibration = calibration_sequences(section, tokenizer, tmp_path)
    held = held_out_sequences(section, tokenizer, tmp_path, 8, 64)
    stream = torch.tensor(tokenizer((tmp_path / "one.txt").read_text())["input_ids"])
    assert torch.equal(torch.cat(calibration), stream[:256])
    assert torch.equal(torch.cat(held.sequences), stream[256:256 + 512])  # the very next tokens
    assert held.provenance["rest_of_last_calibration_text"] == len(stream) + 1 - 256  # + the end-of-sequence token


def test_a_source_streamed_under_a_bound_runs_before_the_prepared_model_and_measures_the_same(tmp_path):
    """``--expert-memory 0``: the source's last hidden states come first (its head then gives the logits a whole
    forward gives), no source layer stays resident while the prepared model runs, the loader runs at the artifact's
    minimum budget, and the figures equal those of a source held whole."""
    import json

    from loader.budget import minimum_budget
    from prep.adapters import get_adapter
    from prep.calibration import held_out_sequences as held
    from prep.pipeline import prepare
    from prep.stages import divergence as stage
    from prep.streaming import load_streamed, stream_of
    from tests.helpers.tiny_models import save_tiny_model, tiny_recipe

    save_tiny_model("mixtral", tmp_path / "model")
    recipe = tiny_recipe("int4")
    whole = prepare(recipe, root=tmp_path, output=tmp_path / "whole")
    streamed = prepare(recipe, root=tmp_path, output=tmp_path / "streamed", expert_memory=0, force="divergence")
    assert whole and streamed
    got = {name: json.loads((tmp_path / name / "report.json").read_text())["divergence"]
           for name in ("whole", "streamed")}
    assert got["whole"]["memory_budget"] == "unlimited"
    assert got["streamed"]["memory_budget"] == minimum_budget(tmp_path / "streamed")
    for key in ("mean_kl", "top_token_agreement", "ppl_source", "ppl_prepared"):
        assert got["streamed"]["stats"][key]["value"] == pytest.approx(got["whole"]["stats"][key]["value"],
                                                                       rel=1e-4, abs=1e-7), key

    source = load_streamed(tmp_path / "model", resident_bytes=0)
    whole_source = load_streamed(tmp_path / "model", resident_bytes=None)
    assert stage.bounded_stream(whole_source) is None and stage.source_hidden(whole_source, [torch.ones(4)]) is None
    from transformers import AutoTokenizer

    sequences = held(recipe.calibration, AutoTokenizer.from_pretrained(tmp_path / "model"), tmp_path, 4, 16).sequences
    hidden = stage.source_hidden(source, sequences)
    assert not stream_of(source, get_adapter(source)).resident  # dropped before the prepared model loads
    for seq, h in zip(sequences, hidden, strict=True):
        torch.testing.assert_close(D.head_logits(source, h), D.logits_of(whole_source, seq), rtol=1e-5, atol=1e-5)


def test_the_held_out_texts_messages_name_divergence_text(tmp_path):
    """A held-out source (``divergence.text``) that is missing, not UTF-8 or lacks its field: each message names
    the file and the ``divergence.text`` key, not the calibration section's."""
    from prep.stages.divergence import HeldOutText
    from tests.helpers.tiny_models import tiny_tokenizer

    tokenizer = tiny_tokenizer(512)
    calibration = CalibrationSection(num_sequences=2, sequence_length=16)
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 ".encode("latin-1") * 50)
    (tmp_path / "rows.jsonl").write_text('{"body": "a b c"}\n')
    (tmp_path / "a-directory").mkdir()
    for files, says in ((("gone.txt",), r"gone\.txt not found; fix divergence\.text\.files"),
                        (("a-directory",), r"a-directory is not a regular file; fix divergence\.text\.files"),
                        (("latin1.txt",), r"latin1\.txt is not UTF-8 text .*divergence\.text\.files"),
                        (("rows.jsonl",), r"rows\.jsonl:1 has no field 'text'; set divergence\.text\.text_field")):
        with pytest.raises(MoeprepError, match=says):
            held_out_sequences(calibration, tokenizer, tmp_path, 4, 16, HeldOutText(source="files", files=files))
    (tmp_path / "short.txt").write_text("a b c")
    with pytest.raises(MoeprepError, match=r"held-out text: divergence\.text gives \d+ tokens"):
        held_out_sequences(calibration, tokenizer, tmp_path, 4, 16, HeldOutText(source="files", files=("short.txt",)))


def test_the_held_out_files_are_the_stages_files():
    """``divergence.text``'s files are the stage's ``files``: prepare and its dry run check they are there, and their
    digests key the stage (another held-out text measures again instead of reusing the old figures)."""
    from prep.recipe import recipe_from_dict
    from prep.stages.divergence import STAGE

    base = {"name": "t", "model": {"path": "m"}}
    assert STAGE.files(recipe_from_dict(base)) == []
    recipe = recipe_from_dict(base | {"divergence": {"text": {"source": "files", "files": ["a.txt", "b.jsonl"]}}})
    assert STAGE.files(recipe) == ["a.txt", "b.jsonl"]
