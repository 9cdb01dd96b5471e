"""Params profiles: the three shipped profiles load, bad ones fail naming the key."""
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3lib.params import ParamsError, load_params


def write(tmp_path: Path, text: str, name="p.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", ["ci", "local", "b300"])
def test_shipped_profiles_load(name):
    p = load_params(f"params/{name}.yaml")
    assert p.run_name == name
    assert len(p.aux_layer_ids()) == 3


def test_inheritance_only_overrides_stated_keys():
    ci, local, b300 = (load_params(f"params/{n}.yaml") for n in ("ci", "local", "b300"))
    assert local.data.max_length != ci.data.max_length
    assert local.target.path == ci.target.path          # inherited
    assert local.train.decay == ci.train.decay          # inherited default
    assert b300.aux_layer_ids() == [2, 30, 58]          # (2, N//2, N-3) with N = 61
    assert b300.train.nproc == 8 and b300.train.distributed == "fsdp"
    assert b300.train.max_steps is None and b300.train.optimizer == "adamw"   # nothing from the 2-core run


@pytest.mark.parametrize("text, key", [
    ("trian: {}", "trian"),
    ("train: {lr: 0.1, lrr: 1}", "train.lrr"),
    ("data: {draft_vocab_size: '8192'}", "data.draft_vocab_size"),
    ("data: {max_length: 12.5}", "data.max_length"),
    ("train: {resume: 1}", "train.resume"),
    ("data: {max_length: true}", "data.max_length"),
    ("eval: {ngram_k: 4}", "eval.ngram_k"),
    ("eval: {decoder_prompts: 0}", "eval.decoder_prompts"),
    ("eval: {vllm_prompts: 0}", "eval.vllm_prompts"),
    ("data: {draft_vocab_size: 60000}", "data.draft_vocab_size"),      # > 49152
    ("extract: {aux_layers: [2, 15, 30]}", "extract.aux_layers"),       # 30 layers: ids 0..29
    ("extract: {aux_layers: [2, 15]}", "extract.aux_layers"),
    ("train: {optimizer: sgd}", "train.optimizer"),
    ("extract: {dtype: auto}", "extract.dtype"),                       # the cache dtype is never guessed
    ("eval: {dtype: auto}", "eval.dtype"),
    ("train: {ttt_steps: 0}", "train.ttt_steps"),
    ("train: {feature_noise: -0.1}", "train.feature_noise"),
    ("train: {freeze_lm_head: true, init_lm_head: false}", "train.freeze_lm_head"),
    ("train: {norm_before_fc: true}", "train.fc_input_scaling"),
    ("train: {init_from_layer: 30}", "train.init_from_layer"),
    ("target: {path: /nonexistent/model}", "target.path"),
    ("data: 5", "data"),
])
def test_bad_profiles_name_the_key(tmp_path, text, key):
    with pytest.raises(ParamsError) as err:
        load_params(write(tmp_path, text))
    assert str(err.value).startswith(key + ":"), str(err.value)


def test_int_is_accepted_for_float(tmp_path):
    p = load_params(write(tmp_path, "train: {lr: 1, decay: 1}"))
    assert p.train.lr == 1.0 and isinstance(p.train.lr, float)


def test_target_shape_lets_an_absent_checkpoint_validate(tmp_path):
    text = ("target: {path: /models/absent, shape: {num_hidden_layers: 8, hidden_size: 64, vocab_size: 1000}}\n"
            "data: {draft_vocab_size: 2000}\n")
    with pytest.raises(ParamsError, match="data.draft_vocab_size"):
        load_params(write(tmp_path, text))


def test_inherit_cycle_and_missing_file(tmp_path):
    write(tmp_path, "inherit: b.yaml", "a.yaml")
    write(tmp_path, "inherit: a.yaml", "b.yaml")
    with pytest.raises(ParamsError, match="cycle"):
        load_params(tmp_path / "a.yaml")
    with pytest.raises(ParamsError, match="not found"):
        load_params(tmp_path / "missing.yaml")


def test_cli_params_rejects_bad_profile_naming_the_key(tmp_path):
    bad = write(tmp_path, "train: {lr: fast}")
    r = subprocess.run([sys.executable, "-m", "eagle3lib.cli", "params", "--params", str(bad)],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "train.lr" in r.stderr
    good = subprocess.run([sys.executable, "-m", "eagle3lib.cli", "params", "--params", "params/local.yaml"],
                          capture_output=True, text=True)
    assert good.returncode == 0 and "run_name: local" in good.stdout


def test_params_module_imports_nothing_heavy():
    code = "import sys, eagle3lib.params, eagle3lib.plan, eagle3lib.cli; print(any(m in sys.modules for m in ('torch', 'transformers', 'papermill')))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.strip() == "False"


def test_non_causal_config_is_a_params_error(tmp_path):
    model = tmp_path / "t5"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "t5", "d_model": 64, "vocab_size": 100}')
    with pytest.raises(ParamsError, match="target.path"):
        load_params(write(tmp_path, f"target: {{path: {model}}}"))


CPUINFO = {
    "avx2": "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx fma avx2\n\nprocessor\t: 1\nflags\t\t: fpu sse2 avx fma avx2\n",
    "amx": "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\n",
    "arm": "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n",
}


@pytest.mark.parametrize("cpu, cuda, expected", [
    ("avx2", False, "float32"), ("amx", False, "bfloat16"), ("arm", False, "bfloat16"), ("avx2", True, "bfloat16"),
])
def test_auto_dtype_is_bf16_only_where_bf16_math_is_native(tmp_path, cpu, cuda, expected):
    from eagle3lib.params import auto_dtype, cpu_flags
    flags = cpu_flags(write(tmp_path, CPUINFO[cpu], "cpuinfo"))
    assert auto_dtype(flags, cuda=cuda) == expected
    assert cpu_flags(tmp_path / "no-such-file") == set()


@pytest.mark.parametrize("cpu, expected", [("avx2", "float32"), ("amx", "bfloat16")])
def test_load_params_resolves_dtype_auto_for_this_machine(tmp_path, monkeypatch, cpu, expected):
    import torch
    import eagle3lib.params as params
    info, read_flags = write(tmp_path, CPUINFO[cpu], "cpuinfo"), params.cpu_flags
    monkeypatch.setattr(params, "cpu_flags", lambda: read_flags(info))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    p = load_params(write(tmp_path, "target: {dtype: auto}\ntrain: {dtype: auto}\nextract: {dtype: bfloat16}"))
    assert (p.target.dtype, p.train.dtype, p.extract.dtype) == (expected, expected, "bfloat16")
    assert "dtype: auto" not in params.dump(p)     # reports, cache keys and subprocesses see the concrete dtype
