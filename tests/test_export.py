"""Export for vLLM: both layouts load back bit-exactly, config.json carries every choice
explicitly, no frozen embedding is written, and choices vLLM cannot express are refused."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eagle3lib.checkpoints import save_final
from eagle3lib.export import (
    LAYOUTS,
    VllmExportError,
    config_from_export,
    export_layout,
    export_vllm,
    load_drafter,
    load_export,
    vllm_incompatibilities,
)
from eagle3lib.model import Eagle3Config, Eagle3Drafter
from eagle3lib.target import load_target_tensors

CHOICES = [dict(norm_before_residual=True),
           dict(norm_before_residual=False, norm_before_fc=True),
           dict(norm_before_residual=False, next_step_hidden="post_norm"),
           dict(norm_before_residual=True, rope_scaling={"rope_type": "linear", "factor": 2.0}),
           dict(norm_before_residual=False, num_hidden_layers=3)]


def make_drafter(target_dir, draft_vocab_size, seed=0, **choices) -> Eagle3Drafter:
    """A drafter with non-trivial weights everywhere (random norms, a permuted draft vocab)."""
    from transformers import AutoConfig
    tcfg = AutoConfig.from_pretrained(str(target_dir))
    V = tcfg.vocab_size
    g = torch.Generator().manual_seed(seed)
    kept = torch.randperm(V, generator=g)[:draft_vocab_size].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    d2t = kept - torch.arange(draft_vocab_size)
    cfg = Eagle3Config.from_target_config(tcfg, draft_vocab_size=draft_vocab_size,
                                          aux_layer_ids=[1, 3, 4], **choices)
    torch.manual_seed(seed)
    w = load_target_tensors(target_dir)
    model = Eagle3Drafter.from_target_weights(cfg, d2t, t2d, w["embed"], w["lm_head"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "embed_tokens.weight":
                p.normal_(generator=g)
    return model.eval()


def assert_same_drafter(a: Eagle3Drafter, b: Eagle3Drafter):
    assert a.config == b.config
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), f"{k} differs after export -> load"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("choice", range(len(CHOICES)))
def test_export_roundtrip_is_bit_exact(tiny_target_dir, tmp_path, layout, choice):
    model = make_drafter(tiny_target_dir, 512, seed=choice, **CHOICES[choice])
    out = export_vllm(model, tmp_path / "export", tiny_target_dir, layout=layout, k=3)
    assert export_layout(out) == layout
    back = load_export(out, tiny_target_dir)
    assert_same_drafter(model, back)
    # and it computes the same function
    H = model.config.hidden_size
    torch.manual_seed(0)
    aux, ids = torch.randn(1, 6, 3 * H), torch.randint(1000, (1, 6))
    pos = torch.arange(6)[None]
    with torch.no_grad():
        assert torch.equal(model(model.fuse(aux), ids, pos)[0], back(back.fuse(aux), ids, pos)[0])


def test_weights_file_holds_what_vllm_loads(tiny_target_dir, tmp_path):
    model = make_drafter(tiny_target_dir, 512, norm_before_fc=True)
    out = export_vllm(model, tmp_path / "export", tiny_target_dir)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    assert "embed_tokens.weight" not in names
    expected = {"fc.weight", "input_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
        f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm",
                                         "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                         "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert names == expected
    assert d2t.dtype == torch.int64 and d2t.shape == (512,)
    assert t2d.dtype == torch.bool and t2d.shape == (model.config.vocab_size,)
    assert torch.equal(torch.arange(512) + d2t, t2d.nonzero().flatten())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_multi_layer_export_uses_vllms_layer_names(tiny_target_dir, tmp_path, layout):
    """Two layers: layers.0.* (layer 0, 2H inputs) and layers.1.* (H inputs) as vLLM's llama_eagle3
    names them, num_hidden_layers 2 in the config, the unused layers.1.hidden_norm written as ones."""
    model = make_drafter(tiny_target_dir, 512, num_hidden_layers=2)
    H = model.config.hidden_size
    out = export_vllm(model, tmp_path / "export", tiny_target_dir, layout=layout)
    weights = load_file(str(out / "model.safetensors"))
    layer_names = {f"{n}.weight" for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
                                          "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                          "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "hidden_norm")}
    assert set(weights) == {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
        f"layers.{i}.{n}" for i in (0, 1) for n in layer_names}
    assert weights["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * H
    assert weights["layers.1.self_attn.q_proj.weight"].shape[1] == H
    assert torch.equal(weights["layers.1.hidden_norm.weight"], torch.ones(H))
    assert torch.equal(weights["layers.1.mlp.up_proj.weight"], model.later_layers[0].mlp.up_proj.weight)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg.get("transformer_layer_config") or cfg)["num_hidden_layers"] == 2
    assert load_export(out, tiny_target_dir).config.num_hidden_layers == 2


@pytest.mark.parametrize("norm_before_residual", [True, False])
def test_config_json_keys(tiny_target_dir, tmp_path, norm_before_residual):
    model = make_drafter(tiny_target_dir, 512, norm_before_residual=norm_before_residual)
    c = model.config
    spec = json.loads((export_vllm(model, tmp_path / "b", tiny_target_dir, k=5) / "config.json").read_text())
    assert spec["speculators_model_type"] == "eagle3" and spec["architectures"] == ["Eagle3Speculator"]
    assert spec["norm_before_residual"] is norm_before_residual          # explicit, not the default
    assert spec["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert spec["draft_vocab_size"] == 512 and spec["target_hidden_size"] == c.hidden_size
    layer = spec["transformer_layer_config"]
    assert layer["vocab_size"] == c.vocab_size and layer["num_hidden_layers"] == 1
    assert layer["model_type"] == "llama"
    sc = spec["speculators_config"]
    assert sc["proposal_methods"][0]["speculative_tokens"] == 5
    assert sc["verifier"]["name_or_path"] == str(tiny_target_dir)
    assert sc["verifier"]["architectures"] == ["LlamaForCausalLM"]

    orig_dir = export_vllm(model, tmp_path / "a", tiny_target_dir, layout="eagle3")
    orig = json.loads((orig_dir / "config.json").read_text())
    assert orig["architectures"] == ["LlamaForCausalLMEagle3"] and orig["num_hidden_layers"] == 1
    assert orig["norm_before_residual"] is norm_before_residual
    assert orig["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "max_position_embeddings", "vocab_size", "draft_vocab_size", "target_hidden_size"):
        assert key in orig, key
    # the layouts default norm_before_residual differently: reading relies on the explicit key
    for cfg, default in ((dict(spec), True), (dict(orig), False)):
        cfg.pop("norm_before_residual")
        assert config_from_export(cfg).norm_before_residual is default


def test_full_vocab_export_leaves_out_d2t(tiny_target_dir, tmp_path):
    from transformers import AutoConfig
    V = AutoConfig.from_pretrained(str(tiny_target_dir)).vocab_size
    model = make_drafter(tiny_target_dir, V)
    out = export_vllm(model, tmp_path / "export", tiny_target_dir)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert "d2t" not in set(f.keys())     # vLLM has no mapping to load it into at Dv == V
    assert_same_drafter(model, load_export(out, tiny_target_dir))


def test_export_from_trainer_folder(tiny_target_dir, tmp_path):
    """The trainer's final/ folder, written by the trainer's own writer (checkpoints.save_final), loads
    back bit-exactly and exports. Planted fault shown caught: save_final keeping embed_tokens in
    model.safetensors fails the embed_tokens assertion."""
    model = make_drafter(tiny_target_dir, 300, norm_before_residual=False)
    final = tmp_path / "train" / "final"
    save_final(final, model.state_dict(), model.config, {"steps": 1})
    assert "embed_tokens.weight" not in load_file(str(final / "model.safetensors"))
    assert_same_drafter(model, load_drafter(final, tiny_target_dir))
    out = export_vllm(final, tmp_path / "export", tiny_target_dir)
    assert_same_drafter(model, load_export(out, tiny_target_dir))
    # a second export replaces the first one in place
    out2 = export_vllm(final, tmp_path / "export", tiny_target_dir, layout="eagle3")
    assert out2 == out and export_layout(out) == "eagle3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "train"]   # no temp folders left


def test_export_refuses_what_vllm_cannot_express(tiny_target_dir, tmp_path):
    model = make_drafter(tiny_target_dir, 256)
    assert vllm_incompatibilities(model.config) == []
    # a rope type vLLM computes differently (Gemma-4 "proportional" rope)
    bad = dataclasses.replace(model.config, rope_scaling={"rope_type": "proportional", "factor": 1.0})
    assert any("proportional" in p for p in vllm_incompatibilities(bad))
    final = tmp_path / "final"
    final.mkdir()
    (final / "config.json").write_text(json.dumps(dataclasses.asdict(bad)))
    with pytest.raises(VllmExportError, match="proportional"):
        export_vllm(final, tmp_path / "export", tiny_target_dir)
    model.config = bad
    with pytest.raises(VllmExportError, match="cannot be exported"):
        export_vllm(model, tmp_path / "export", tiny_target_dir)
    assert not (tmp_path / "export").exists()

    # a design choice the exporter does not know how to write (a future config field)
    @dataclasses.dataclass
    class FutureConfig(Eagle3Config):
        fc_norm: bool = True
    future = FutureConfig(**dataclasses.asdict(make_drafter(tiny_target_dir, 256).config))
    assert any("fc_norm" in p for p in vllm_incompatibilities(future))


def test_bad_inputs_raise_clear_errors(tiny_target_dir, tmp_path):
    model = make_drafter(tiny_target_dir, 256)
    with pytest.raises(ValueError, match="layout"):
        export_vllm(model, tmp_path / "x", tiny_target_dir, layout="medusa")
    with pytest.raises(FileNotFoundError, match="config.json"):
        export_vllm(tmp_path / "missing", tmp_path / "x", tiny_target_dir)
    with pytest.raises(FileNotFoundError):
        load_export(tmp_path / "missing", tiny_target_dir)


def test_shrunk_head_proposes_the_full_heads_argmax_where_kept(tiny_target_dir, tmp_path):
    """with_draft_rows + vocab.shrink_draft_vocab: the cut head's logits are the full head's kept
    rows, and the smaller drafter exports and loads back exactly (bench/draft_vocab.py's path)."""
    from eagle3lib.vocab import draft_to_target_ids, shrink_draft_vocab
    model = make_drafter(tiny_target_dir, 512, seed=3)
    counts = torch.randint(0, 50, (model.config.vocab_size,), generator=torch.Generator().manual_seed(1))
    rows, d2t, t2d = shrink_draft_vocab(model.d2t, counts, 128)
    small = model.with_draft_rows(rows, d2t, t2d)
    assert small.config.draft_vocab_size == 128 and small.lm_head.weight.shape[0] == 128
    H = model.config.hidden_size
    torch.manual_seed(0)
    aux, ids, pos = torch.randn(2, 6, 3 * H), torch.randint(1000, (2, 6)), torch.arange(6)[None]
    with torch.no_grad():
        full_logits = model(model.fuse(aux), ids, pos)[0]                # [2, 6, 512]
        small_logits = small(small.fuse(aux), ids, pos)[0]               # [2, 6, 128]
    assert torch.equal(small_logits, full_logits[..., rows])
    full_pick = model.draft_to_target(full_logits.argmax(-1))           # target ids [2, 6]
    small_pick = small.draft_to_target(small_logits.argmax(-1))
    kept = t2d[full_pick]
    assert torch.equal(small_pick[kept], full_pick[kept])
    assert bool(t2d[small_pick].all()) and torch.equal(draft_to_target_ids(small.d2t), draft_to_target_ids(d2t))
    back = load_export(export_vllm(small, tmp_path / "small", tiny_target_dir, k=2), tiny_target_dir)
    assert_same_drafter(small, back)
