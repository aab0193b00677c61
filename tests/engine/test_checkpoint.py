"""Reading a checkpoint without transformers (`specfleet/engine/checkpoint.py`) gives the model transformers gives.

The forward-pass tests (test_llama.py) load every family through `load_model`, so through the direct
reader, and compare logits with transformers'; here the tensors themselves are compared, and what
falls back to transformers does.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from specfleet.engine import checkpoint, load_model
from specfleet.engine.llama import from_hf
from tests.engine.test_llama import FAMILIES, _configs, _save
from tests.harness import REPO


def _tensors(model) -> dict[str, torch.Tensor]:
    out = {"embed": model.embed, "norm": model.norm, "lm_head": model.lm_head, "cos": model.cos, "sin": model.sin}
    for i, layer in enumerate(model.layers):
        out.update({f"{i}.{k}": v for k, v in vars(layer).items() if v is not None})
    return out


def _transformers_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32).eval()


def _same(ours, hf_model) -> None:
    theirs = from_hf(hf_model)
    a, b = _tensors(ours.model), _tensors(theirs)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert (ours.model.heads, ours.model.kv_heads, ours.model.head_dim, ours.model.eps) == (
        theirs.heads,
        theirs.kv_heads,
        theirs.head_dim,
        theirs.eps,
    )
    assert ours.parameters == sum(p.numel() for p in hf_model.parameters())


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_reads_as_transformers_reads_it(tmp_path, name):
    _save(tmp_path, _configs()[name], name)
    assert checkpoint.read_config(tmp_path / name) is not None  # save_pretrained states every field: the direct reader
    _same(load_model(name, tmp_path / name), _transformers_model(tmp_path / name))


@pytest.mark.parametrize("path", ["models/demo/target", "models/demo/drafters/general"])
def test_the_bundled_models_read_as_transformers_reads_them(path):
    assert checkpoint.read_config(REPO / path) is not None
    loaded = load_model("m", REPO / path)
    _same(loaded, _transformers_model(REPO / path))
    assert loaded.eos_token_id == 0 and loaded.max_context == 512


def test_a_config_leaving_a_field_to_the_familys_default_is_read_by_transformers(tmp_path):
    shutil.copytree(REPO / "models/demo/target", tmp_path / "m", symlinks=False)
    config = json.loads((tmp_path / "m/config.json").read_text())
    del config["num_key_value_heads"]  # transformers' Llama default: as many as the attention heads
    (tmp_path / "m/config.json").write_text(json.dumps(config))
    assert checkpoint.read_config(tmp_path / "m") is None
    _same(load_model("m", tmp_path / "m"), _transformers_model(tmp_path / "m"))


def test_an_untied_checkpoint_without_an_output_layer_is_refused_by_name(tmp_path):
    shutil.copytree(REPO / "models/demo/target", tmp_path / "m", symlinks=False)
    config = json.loads((tmp_path / "m/config.json").read_text())
    config["tie_word_embeddings"] = False
    (tmp_path / "m/config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="model 'm' at .*no lm_head.weight is stored"):
        load_model("m", tmp_path / "m")


def test_the_direct_reader_imports_no_transformers_model_code():
    probe = (
        "import sys; from specfleet.engine import load_model; load_model('t', 'models/demo/target'); "
        "sys.exit(any(m.startswith('transformers.models.llama.modeling') or m == 'transformers.modeling_utils' for m in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", probe], cwd=REPO, timeout=120).returncode == 0
