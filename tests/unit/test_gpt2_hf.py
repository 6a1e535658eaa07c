"""GPT-2 <-> Hugging Face layout: real transformers models built from a GPT2Config (no
download), logits compared, and the mistakes that load silently (a missed Conv1D
transpose of the square attn.c_proj) caught."""

import json
import os
import re

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"  # never download: every model here is built locally
transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'ftrain[test]')"
)

from safetensors.torch import save_file  # noqa: E402

from ftrain.recipes.gpt2 import GPT, GPTConfig  # noqa: E402
from ftrain.recipes.gpt2 import hf as gpt2_hf  # noqa: E402

SIZES = dict(vocab_size=96, n_layer=2, n_head=4, n_embd=32)  # attn.c_proj: 32 x 32, square


def hf_model(n_positions=16, seed=0, **kw):
    config = transformers.GPT2Config(
        n_positions=n_positions, bos_token_id=None, eos_token_id=None, **(SIZES | kw)
    )
    torch.manual_seed(seed)  # transformers initialises from the global RNG
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # non-trivial biases and norms, so a wrong mapping shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(torch.randn(p.shape) * 0.1)
    return model


def ftrain_gpt(block_size=16, **kw):
    cfg = GPTConfig(block_size=block_size, dropout=0.0, **(SIZES | kw))
    return GPT(cfg, generator=torch.Generator().manual_seed(1)).eval()


def tokens(n=12, seed=3):
    return torch.randint(
        0, SIZES["vocab_size"], (2, n), generator=torch.Generator().manual_seed(seed)
    )


def logits_equal(hf, ours, x):
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, rtol=1e-5, atol=1e-5)


def test_from_hf_gives_the_hf_models_logits(tmp_path):
    hf = hf_model()
    hf.save_pretrained(tmp_path)
    tensors, config = gpt2_hf.read_hf(tmp_path)
    assert gpt2_hf.gpt_fields_from_hf(config) == {"block_size": 16, **SIZES}
    ours = ftrain_gpt()
    ours.load_state_dict(tensors, strict=True)
    logits_equal(hf, ours, tokens())


def test_a_missed_conv1d_transpose_is_caught_by_the_logits(tmp_path, monkeypatch):
    hf = hf_model()
    hf.save_pretrained(tmp_path)
    # only the square attn.c_proj untransposed: every shape still fits
    monkeypatch.setattr(
        gpt2_hf, "CONV1D", ("attn.c_attn.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    )
    tensors, _ = gpt2_hf.read_hf(tmp_path)
    ours = ftrain_gpt()
    ours.load_state_dict(tensors, strict=True)  # loads "fine"
    with pytest.raises(AssertionError):
        logits_equal(hf, ours, tokens())


def test_original_hub_layout_without_prefix_with_mask_buffers(tmp_path):
    """The hub's gpt2 files: GPT2Model names (h.0...), attn.bias/masked_bias buffers."""
    from safetensors.torch import save_file

    hf = hf_model()
    sd = {k.removeprefix("transformer."): v.clone() for k, v in hf.state_dict().items()}
    del sd["lm_head.weight"]
    for i in range(SIZES["n_layer"]):
        sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 16, 16))
        sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(sd, str(tmp_path / "model.safetensors"))
    tensors, config = gpt2_hf.read_hf(tmp_path / "model.safetensors")  # a bare file
    assert config is None and gpt2_hf.infer_fields(tensors) == {
        "vocab_size": 96,
        "n_embd": 32,
        "block_size": 16,
        "n_layer": 2,
    }
    ours = ftrain_gpt()
    ours.load_state_dict(tensors, strict=True)
    logits_equal(hf, ours, tokens())


def test_to_hf_names_round_trip_and_from_pretrained(tmp_path):
    from safetensors.torch import save_file

    ours = ftrain_gpt()
    out = tmp_path / "hf"
    out.mkdir()
    save_file(gpt2_hf.to_hf_names(ours.state_dict()), str(out / "model.safetensors"))
    config = gpt2_hf.hf_config(ours.config.__dict__, torch.float32)
    (out / "config.json").write_text(json.dumps(config))
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    assert hf.lm_head.weight is hf.transformer.wte.weight
    logits_equal(hf, ours, tokens())
    back, _ = gpt2_hf.read_hf(out)
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())


def test_refusals_name_the_problem(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"not opened")
    with pytest.raises(gpt2_hf.HFFormatError, match="never unpickles pytorch_model.bin"):
        gpt2_hf.read_hf(tmp_path)
    with pytest.raises(gpt2_hf.HFFormatError, match="not a .safetensors file"):
        gpt2_hf.read_hf(tmp_path / "pytorch_model.bin")
    with pytest.raises(gpt2_hf.HFFormatError, match="no such file"):
        gpt2_hf.read_hf(tmp_path / "absent")
    crowded = tmp_path / "crowded"  # init.from_hf=/tmp printed every entry of /tmp
    crowded.mkdir()
    for i in range(20):
        (crowded / f"f{i:02d}").write_text("")
    with pytest.raises(gpt2_hf.HFFormatError, match=r"found: f00, .*, f07, \.\.\. \(12 more\)\)"):
        gpt2_hf.read_hf(crowded)
    untied = {"wte.weight": torch.zeros(4, 2), "lm_head.weight": torch.ones(4, 2)}
    with pytest.raises(gpt2_hf.HFFormatError, match="untied head"):
        gpt2_hf.from_hf_names(untied)
    with pytest.raises(gpt2_hf.HFFormatError, match="activation_function='relu'.*n_inner=7"):
        gpt2_hf.gpt_fields_from_hf({"activation_function": "relu", "n_inner": 7, "n_embd": 8})
    with pytest.raises(gpt2_hf.HFFormatError, match="bias=false"):
        gpt2_hf.hf_config({**SIZES, "block_size": 8, "bias": False}, torch.float32)
    # a damaged config.json: sizes that are not whole numbers, an epsilon that is text
    for bad, said in (
        ({"n_embd": 64.9}, "n_embd=64.9 is not a whole number"),
        ({"n_layer": "2"}, "n_layer='2' is not a whole number"),
        ({"n_head": True}, "n_head=True is not a whole number"),
        ({"n_layer": float("inf")}, "n_layer=inf is not a whole number"),
        ({"n_embd": float("nan")}, "n_embd=nan is not a whole number"),
        ({"layer_norm_epsilon": float("nan")}, "layer_norm_epsilon=nan is not a number"),
        ({"layer_norm_epsilon": "1e-5"}, "layer_norm_epsilon='1e-5' is not a number"),
    ):
        with pytest.raises(gpt2_hf.HFFormatError, match=re.escape(said)):
            gpt2_hf.gpt_fields_from_hf(bad)
    assert gpt2_hf.gpt_fields_from_hf({"n_embd": 64.0, "n_layer": 2})["n_embd"] == 64


def test_a_config_json_that_is_not_an_object_is_named(tmp_path):
    save_file({"wte.weight": torch.zeros(4, 2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(gpt2_hf.HFFormatError, match="config.json is not a JSON object"):
        gpt2_hf.read_hf(tmp_path)


def test_damaged_weight_files_are_named_with_the_fix(tmp_path):
    """A git-lfs pointer (a clone without git-lfs), a truncated file, a damaged index: these
    were SafetensorError/JSONDecodeError/KeyError tracebacks (exit 1)."""
    lfs = tmp_path / "lfs"
    lfs.mkdir()
    pointer = b"version https://git-lfs.github.com/spec/v1\noid sha256:ab\nsize 9\n"
    (lfs / "model.safetensors").write_bytes(pointer)
    with pytest.raises(gpt2_hf.HFFormatError, match="git-lfs pointer: fetch the weights"):
        gpt2_hf.read_hf(lfs)
    cut = tmp_path / "cut.safetensors"
    save_file({"wte.weight": torch.zeros(64, 64)}, str(cut))
    cut.write_bytes(cut.read_bytes()[:2000])
    with pytest.raises(gpt2_hf.HFFormatError, match="truncated or damaged download"):
        gpt2_hf.read_hf(cut)
    for text, why in (("{oops", "JSONDecodeError"), ("{}", "KeyError: 'weight_map'")):
        d = tmp_path / why.split(":")[0]
        d.mkdir()
        (d / "model.safetensors.index.json").write_text(text)
        with pytest.raises(gpt2_hf.HFFormatError, match=f"not a safetensors index .*{why}"):
            gpt2_hf.read_hf(d)
