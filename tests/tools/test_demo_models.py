"""Demo-model pipeline (tools.demo_models) and the bundled models in models/demo."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tools.demo_models import build_main, matrix_main  # noqa: E402
from tools.demo_models.corpus import DOMAINS, load_split  # noqa: E402

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "models" / "demo"
MODEL_DIRS = ["target"] + [f"drafters/{n}" for n in ("en", "de", "fr", "es", "it", "code", "structured", "general")]

SAMPLES = {
    "code": (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text(encoding="utf-8")[:6000],
    "en": (
        "Q:\tHow many Bell Labs Vice Presidents does it take to change a light bulb?\n"
        "A:\tThat's proprietary information.  Answer available from AT&T on payment of license fee.\n%\n"
        '.TH LS 1 2023-01-01 "GNU coreutils"\n.SH NAME\nls \\- list directory contents\n.B \\-a\n'
        ":mod:`textwrap` --- Text wrapping and filling\n=============================================\n"
    ),
    "de": (
        ".SH BESCHREIBUNG\n\\fBls\\fP listet Informationen über die DATEIen auf (standardmäßig das aktuelle "
        "Verzeichnis).\nDie Einträge werden alphabetisch sortiert, wenn keine der Optionen angegeben ist.\n"
        "Das Debian-System ist ein freies Betriebssystem. Mit dem Paketwerkzeug können Sie Programme installieren.\n"
    ),
    "fr": (
        ".SH DESCRIPTION\nAfficher les informations des FICHIERs (du répertoire courant par défaut).\n"
        "Les entrées sont triées alphabétiquement si aucune des options n'est indiquée.\n"
        "Le système Debian est un système d'exploitation libre. Avec l'outil de paquets, vous pouvez installer des programmes.\n"
    ),
    "es": (
        ".SH DESCRIPCIÓN\nMuestra información acerca de los ARCHIVOs (del directorio actual por defecto).\n"
        "Las entradas se ordenan alfabéticamente si no se especifica ninguna de las opciones.\n"
        "El sistema Debian es un sistema operativo libre. Con la herramienta de paquetes puede instalar programas.\n"
    ),
    "it": (
        ".SH DESCRIZIONE\nElenca informazioni sui FILE (la directory corrente per impostazione predefinita).\n"
        "Le voci vengono ordinate alfabeticamente se non è specificata nessuna delle opzioni.\n"
        "Il sistema Debian è un sistema operativo libero. Con lo strumento dei pacchetti potete installare programmi.\n"
    ),
    "structured": (
        '---\n- name: Install packages\n  hosts: all\n  tasks:\n    - apt:\n        name: "{{ item }}"\n'
        '{"a": [1, 2.5e-3, null, true], "b": {"c": "\\u00e9"}}\n'
        "[section]\nkey = value ; comment\n\n[tool.black]\nline-length = 100\n"
    ),
    "edge": "tabs\tand  spaces \n\n\r\n trailing  \u00e9\u00e8 \u65e5\u672c\u8a9e \U0001f600 \x00\x7f <|endoftext|> done",
}


def _roundtrip(tok, text: str) -> bool:
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return tok.decode(ids, clean_up_tokenization_spaces=False) == text


@pytest.fixture(scope="module")
def quick_build(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("demo_quick")
    out, work = tmp / "out", tmp / "work"
    rc = build_main(["--quick", "--out", str(out), "--work", str(work)])
    assert rc == 0
    return out, work


def test_quick_pipeline_end_to_end(quick_build):
    out, work = quick_build
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for sub in MODEL_DIRS:
        d = out / sub
        assert (d / "model.safetensors").exists(), d
        assert (d / "README.md").exists()
        m = AutoModelForCausalLM.from_pretrained(str(d))
        tok = AutoTokenizer.from_pretrained(str(d))
        assert m.dtype in (torch.bfloat16, torch.float16)
        assert m.generation_config.eos_token_id == tok.eos_token_id
        if sub.startswith("drafters/"):  # each drafter scores only its token map's ids when served
            token_map = json.loads((d / "token_map.json").read_text())
            assert len(token_map) == len(set(token_map)) == 256 and max(token_map) < len(tok)
    md = (out / "acceptance.md").read_text()
    assert "Greedy per-token acceptance" in md and "Per-token cost" in md and "token_map.json" in md
    # the corpora have fixed splits and the tokenizer round-trips them
    tok = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    for d in DOMAINS:
        for split in ("train", "heldout", "unseen"):
            texts = load_split(work / "corpus", d, split)
            assert texts, (d, split)
            assert all(_roundtrip(tok, t) for t in texts[:10]), (d, split)


def test_quick_pipeline_resumes(quick_build):
    """A second run finds every stage done and only re-exports / re-measures."""
    out, work = quick_build
    rc = build_main(["--quick", "--out", str(out), "--work", str(work), "--no-matrix"])
    assert rc == 0
    assert json.loads((work / "target" / "state.json").read_text())["step"] > 0


def test_side_by_side_drafters_start_from_the_base_drafter(quick_build, tmp_path, capsys):
    """--drafters trains only the named drafters, and refuses to start before the base drafter exists
    (side-by-side runs must not each train it)."""
    import shutil

    out, work = quick_build
    work2 = tmp_path / "work"
    shutil.copytree(work, work2)
    for name in ("base", "de", "general"):
        shutil.rmtree(work2 / "drafters" / name)
    argv = ["--quick", "--out", str(tmp_path / "out"), "--work", str(work2), "--no-matrix"]
    with pytest.raises(SystemExit):
        build_main([*argv, "--drafters", "de"])
    assert "the base drafter is not trained yet" in capsys.readouterr().err
    assert build_main([*argv, "--drafters", "base"]) == 0
    assert (work2 / "drafters" / "base" / "state.json").exists() and not (work2 / "drafters" / "de").exists()
    assert build_main([*argv, "--drafters", "de"]) == 0
    assert (work2 / "drafters" / "de" / "state.json").exists() and not (work2 / "drafters" / "general").exists()


def test_matrix_cli(quick_build, tmp_path):
    out, work = quick_build
    dest = tmp_path / "m.md"
    assert matrix_main(["--quick", "--no-cost", "--models", str(out), "--work", str(work), "--output", str(dest)]) == 0
    assert "| general |" in dest.read_text()


# --------------------------------------------------------------------------- bundled models


def test_bundled_models_present_and_small():
    assert (DEMO / "tokenizer" / "tokenizer.json").exists(), "models/demo is missing; run the build"
    total = sum(f.stat().st_size for f in DEMO.rglob("*") if f.is_file())
    assert total <= 80 * 1024 * 1024, total
    for sub in MODEL_DIRS:
        cfg = json.loads((DEMO / sub / "config.json").read_text())
        assert cfg.get("dtype", cfg.get("torch_dtype")) in ("bfloat16", "float16")
        assert (DEMO / sub / "README.md").read_text().strip()


@pytest.mark.parametrize("sub", MODEL_DIRS)
def test_bundled_model_loads_and_generates(sub):
    """Each bundled model loads, generates, and predicts real text of every domain far better than an
    untrained model of its shape (which pays about log V nats a token, 9.0 here; the bundled ones 5 to 7)."""
    import math

    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = DEMO / sub
    tok = AutoTokenizer.from_pretrained(str(d))
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    assert model.generation_config.eos_token_id == tok.eos_token_id
    losses = []
    with torch.inference_mode():
        for text in SAMPLES.values():
            ids = tok(text, return_tensors="pt").input_ids[:, :256]
            losses.append(model(ids, labels=ids).loss.item())
    mean = sum(losses) / len(losses)
    assert mean < math.log(len(tok)) - 1.5, (mean, losses)
    prompt = tok("def main(argv):\n    ", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=5, do_sample=False, pad_token_id=tok.eos_token_id)
    assert out.shape[1] > prompt["input_ids"].shape[1]


def test_bundled_tokenizer_roundtrips_every_domain():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(DEMO / "tokenizer"))
    assert tok.eos_token is not None
    for name, text in SAMPLES.items():
        assert _roundtrip(tok, text), name
    # every model dir ships the same tokenizer
    ref = (DEMO / "tokenizer" / "tokenizer.json").read_text()
    for sub in MODEL_DIRS:
        assert (DEMO / sub / "tokenizer.json").read_text() == ref, sub


def test_language_specialists_token_maps_take_in_a_share_of_english():
    """--companion-share: a language specialist's map is chosen by its own language's frequencies
    plus a share of English's, so the English its documentation quotes gets in; 0 gives the
    own-domain map, domains without a companion (code) keep theirs, and the general map is the
    mix's either way."""
    import numpy as np

    from tools.demo_models.build import token_maps

    rng = np.random.default_rng(0)
    # "de" uses ids 0-49 heavily; "en" and "code" share ids 50-59, which "de" never uses
    streams = {
        "de": rng.integers(0, 50, 5000),
        "en": np.concatenate([rng.integers(50, 60, 4000), rng.integers(60, 100, 1000)]),
        "code": np.concatenate([rng.integers(50, 60, 1000), rng.integers(100, 140, 4000)]),
    }
    own = token_maps(streams, 55, 0.0)
    blended = token_maps(streams, 55, 0.5)
    assert own["general"] == blended["general"] and len(blended["de"]) == 55
    assert not set(range(50, 60)) <= set(own["de"])  # "de" alone ranks the English ids last
    assert set(range(50, 60)) <= set(blended["de"])
    assert len(set(range(50)) & set(blended["de"])) >= 40  # and keeps most of its own
    assert own["code"] == blended["code"] and own["en"] == blended["en"]


def test_export_writes_the_map_each_drafter_was_trained_with(quick_build, tmp_path):
    """A rebuild with another --companion-share reuses trained drafters and must export the maps they were
    trained with (kept in the work dir), not maps recomputed with the new setting."""
    import shutil

    out, work = quick_build
    work2 = tmp_path / "work"
    shutil.copytree(work, work2)
    assert build_main(["--quick", "--out", str(tmp_path / "out"), "--work", str(work2), "--no-matrix", "--companion-share", "0.9"]) == 0
    for name in ("de", "general"):
        trained = json.loads((work / "drafters" / name / "token_map.json").read_text())
        assert json.loads((tmp_path / "out" / "drafters" / name / "token_map.json").read_text()) == trained
        assert json.loads((out / "drafters" / name / "token_map.json").read_text()) == trained
