"""The shipped models hold the figures their cards state, and the examples run. The figures are
measured again here on the same held-out data the training scripts used (heavy: `slow`)."""
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import lamina as lm
from lamina.zoo import denoise, language, lines

ROOT = Path(__file__).resolve().parent.parent


def card(name):
    return json.loads((ROOT / "models" / name / "metrics.json").read_text())


@pytest.mark.slow
def test_language_model_holds_its_held_out_perplexity():
    metrics = card("python_lm")
    net = lm.load(ROOT / "models/python_lm/model.lamina")
    tok = language.tokenizer(net)
    _, held_files = language.stdlib_split()
    assert len(held_files) == metrics["held_out_files"]
    chunks = [c for t in language.read_texts(held_files) for c in language.chunk(tok.encode(t), 48)]
    held_eval = [chunks[i] for i in np.random.default_rng(1).permutation(len(chunks))[:2000]]
    assert sum(len(c) - 1 for c in held_eval) == metrics["held_out_tokens"]
    ppl = language.perplexity(net, held_eval)
    # the card was measured before the float16 rounding of the stored parameters
    assert abs(ppl - metrics["held_out_perplexity"]) < 0.01 * metrics["held_out_perplexity"], ppl


@pytest.mark.slow
def test_denoiser_holds_its_held_out_psnr():
    metrics = card("denoise3d")
    net = lm.load(ROOT / "models/denoise3d/model.lamina")
    clean = denoise.shapes(metrics["held_out_volumes"], np.random.default_rng(1))
    noisy = denoise.noisy_copy(clean, np.random.default_rng(2))
    assert abs(denoise.psnr(noisy, clean) - metrics["psnr_noisy_db"]) < 0.01
    out = net.run({"noisy": noisy}, ["denoised"])["denoised"]
    assert abs(denoise.psnr(out, clean) - metrics["psnr_denoised_db"]) < 0.05


def run_example(*args, timeout=600):
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_quickstart_example_learns_the_spirals():
    out = run_example(ROOT / "examples/quickstart.py")
    accuracy = float(re.search(r"test accuracy: ([0-9.]+)", out).group(1))
    assert accuracy > 0.95 and "identical outputs: True" in out


@pytest.mark.slow
def test_line_classifier_holds_its_held_out_accuracy():
    metrics = card("line_kind")
    net = lm.load(ROOT / "models/line_kind/model.lamina")
    _, held_files = language.stdlib_split()
    held = lines.held_out_sample(lines.labelled_lines(language.read_texts(held_files)), metrics["held_out_lines"])
    predicted = lines.predict(net, lines.encode(language.tokenizer(net), [line for line, _ in held]))
    accuracy = float(np.mean(predicted == np.array([kind for _, kind in held])))
    assert abs(accuracy - metrics["held_out_accuracy"]) <= 1 / metrics["held_out_lines"], accuracy


def test_line_classifier_names_statement_kinds():
    """The shipped encoder on lines it can tell apart only by what follows their first token."""
    net = lm.load(ROOT / "models/line_kind/model.lamina")
    cases = {"x = compute(a, b)": "assign", "total += step": "augmented assign", "compute(a, b)": "expression",
             "return x + 1": "return", "for item in items:": "loop", "import os": "import",
             "def parse(self, text):": "def", "raise ValueError(message)": "raise"}
    predicted = lines.predict(net, lines.encode(language.tokenizer(net), list(cases)))
    assert [lines.KINDS[k] for k in predicted] == list(cases.values())


@pytest.mark.slow
def test_demo_runs_and_reports_the_cards_figures(tmp_path):
    out = run_example(ROOT / "examples/demo.py", "--steps", "5")
    ppl = float(re.search(r"held-out perplexity ([0-9.]+)", out).group(1))
    assert 4 < ppl < 12  # a quarter of the held-out files (the card: 7.03 on 2000 chunks of all)
    before, after = map(float, re.search(r"PSNR .*: noisy ([0-9.]+) dB -> denoised ([0-9.]+) dB", out).groups())
    assert after > before + 10
    assert float(re.search(r"held-out accuracy ([0-9.]+) on 2000 lines", out).group(1)) > 0.95


@pytest.mark.parametrize("name", ["python_lm", "denoise3d", "line_kind"])
def test_shipped_models_carry_a_digest_of_their_whole_content(name):
    from lamina.io.model import VERSION, _read, digest
    metadata, tensors = _read(ROOT / "models" / name / "model.lamina")
    assert metadata["version"] == str(VERSION)
    assert metadata["digest"] == digest(tensors, metadata)
