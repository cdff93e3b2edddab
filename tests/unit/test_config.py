"""load_config: valid YAML and dicts load; every refusal is a ConfigError naming the key."""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from msd_dask import load_config
from msd_dask.core.config import (
    BatchConfig,
    Config,
    ParallelConfig,
    WeightSchedule,
    parse_config,
)
from msd_dask.errors import ConfigError


@pytest.fixture()
def data_dir(tmp_path: Path) -> Path:
    for sub in ("web", "code"):
        (tmp_path / sub).mkdir()
        for i in range(2):
            (tmp_path / sub / f"part-{i}.jsonl").write_text('{"text": "hello"}\n')
    return tmp_path


def base(data_dir: Path) -> dict[str, Any]:
    """A valid config dict whose globs match files under ``data_dir``."""
    return {
        "name": "mix",
        "seed": 7,
        "batch": {"seq_len": 128, "micro_batches": 2},
        "parallel": {"dp": 2, "tp": 2, "cp": 1, "pp": 1},
        "tokenizer": {"kind": "bytes"},
        "sources": [
            {"name": "web", "uri": str(data_dir / "web" / "*.jsonl"), "format": "jsonl",
             "weight": 0.7},
            {"name": "code", "uri": str(data_dir / "code" / "*.jsonl"), "format": "jsonl",
             "weight": 0.3, "shuffle_window": 2, "context": "long"},
        ],
    }


def refused(d: Any, key: str, *, check_files: bool = False) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(d, check_files=check_files)
    err = info.value
    assert err.key == key
    assert f"'{key}'" in str(err)
    return err


# ----------------------------------------------------------------------------- valid


def test_valid_dict_loads(data_dir: Path) -> None:
    cfg = load_config(base(data_dir))
    assert isinstance(cfg, Config)
    assert cfg.name == "mix" and cfg.seed == 7
    assert cfg.batch == BatchConfig(seq_len=128, micro_batches=2)
    assert cfg.parallel.dp == 2 and cfg.parallel.tp == 2 and cfg.parallel.world_size == 4
    assert [s.name for s in cfg.sources] == ["web", "code"]
    web, code = cfg.sources
    assert web.format == "jsonl" and web.weight.at(0) == 0.7
    assert code.shuffle_window == 2 and code.context == "long"
    assert web.shuffle_window == 4 and web.context == "short" and web.text_field == "text"
    assert cfg.source("code") is code
    w = cfg.weights_at(0)
    assert w["web"] == pytest.approx(0.7) and w["code"] == pytest.approx(0.3)
    # A Config passes through unchanged.
    assert load_config(cfg) is cfg


def test_valid_yaml_file_and_string_load(data_dir: Path, tmp_path: Path) -> None:
    d = base(data_dir)
    text = yaml.safe_dump(d)
    path = tmp_path / "service.yaml"
    path.write_text(text)
    from_dict = load_config(d)
    assert load_config(path) == from_dict
    assert load_config(str(path)) == from_dict
    assert load_config(text) == from_dict


def test_invalid_yaml_is_config_error() -> None:
    with pytest.raises(ConfigError):
        load_config("name: [unclosed\nsources: 1\n")


# -------------------------------------------------------------------------- refusals


def test_config_error_is_value_error(data_dir: Path) -> None:
    d = base(data_dir)
    d["batch"]["seq_len"] = 0
    with pytest.raises(ValueError):
        load_config(d)


def test_unknown_top_level_key(data_dir: Path) -> None:
    d = base(data_dir)
    d["sead"] = 3
    refused(d, "sead")


def test_unknown_key_inside_source(data_dir: Path) -> None:
    d = base(data_dir)
    d["sources"][1]["wieght"] = 0.5
    refused(d, "sources[1].wieght")


def test_missing_required_keys(data_dir: Path) -> None:
    d = base(data_dir)
    del d["batch"]
    refused(d, "batch")
    d = base(data_dir)
    del d["sources"][0]["uri"]
    refused(d, "sources[0].uri")


def test_negative_weight(data_dir: Path) -> None:
    d = base(data_dir)
    d["sources"][1]["weight"] = -0.1
    refused(d, "sources[1].weight")


@pytest.mark.parametrize("bad", [math.nan, math.inf, True, "0.5"])
def test_non_number_weight(data_dir: Path, bad: Any) -> None:
    d = base(data_dir)
    d["sources"][0]["weight"] = bad
    refused(d, "sources[0].weight")


def test_weights_sum_to_zero(data_dir: Path) -> None:
    d = base(data_dir)
    for s in d["sources"]:
        s["weight"] = 0
    refused(d, "sources")


def test_weights_whose_sum_overflows(data_dir: Path) -> None:
    """Each weight finite, their sum infinite: every share would be 0/0."""
    d = base(data_dir)
    for s in d["sources"]:
        s["weight"] = 1e308
    err = refused(d, "sources")
    assert "too large" in str(err)


def test_weights_sum_to_zero_later_in_a_schedule(data_dir: Path) -> None:
    d = base(data_dir)
    d["sources"][0]["weight"] = [{"until": 50, "weight": 1.0}, {"weight": 0.0}]
    d["sources"][1]["weight"] = 0
    err = refused(d, "sources")
    assert "50" in str(err)


def test_one_zero_weight_is_allowed(data_dir: Path) -> None:
    d = base(data_dir)
    d["sources"][1]["weight"] = 0
    cfg = load_config(d)
    assert cfg.weights_at(0) == {"web": 1.0, "code": 0.0}


def test_duplicate_source_name(data_dir: Path) -> None:
    d = base(data_dir)
    d["sources"][1]["name"] = "web"
    err = refused(d, "sources[1].name")
    assert "sources[0]" in str(err)


def test_glob_matching_no_file(data_dir: Path) -> None:
    d = base(data_dir)
    d["sources"][1]["uri"] = str(data_dir / "nothing-here" / "*.jsonl")
    refused(d, "sources[1].uri", check_files=True)
    # The same dict loads when files are not checked.
    assert parse_config(d).sources[1].uri.endswith("*.jsonl")


def test_seq_len_zero(data_dir: Path) -> None:
    d = base(data_dir)
    d["batch"]["seq_len"] = 0
    refused(d, "batch.seq_len")


def test_seq_len_not_an_integer(data_dir: Path) -> None:
    d = base(data_dir)
    d["batch"]["seq_len"] = 12.5
    refused(d, "batch.seq_len")


def test_unknown_format(data_dir: Path) -> None:
    d = base(data_dir)
    d["sources"][0]["format"] = "csv"
    err = refused(d, "sources[0].format")
    assert "csv" in str(err) and "package.module:Name" in str(err)
    d["sources"][0]["format"] = "my_formats:"  # an import path needs a name after the colon
    refused(d, "sources[0].format")


def test_a_format_of_your_own_is_an_import_path_not_imported_by_parsing(data_dir: Path) -> None:
    d = base(data_dir)
    d["sources"][0]["format"] = "not_installed_here.formats:Csv"
    # (the workers import it; the process that parses, a reader's say, need not have it)
    assert load_config(d).sources[0].format == "not_installed_here.formats:Csv"


def test_unknown_tokenizer_kind(data_dir: Path) -> None:
    d = base(data_dir)
    d["tokenizer"] = {"kind": "sentencepiece"}
    refused(d, "tokenizer.kind")


@pytest.mark.parametrize("order", ["tp-cp-dp", "tp-cp-dp-pp-dp", "tp-cp-dp-xx", "tp,cp,dp,pp", 3])
def test_bad_parallel_order(data_dir: Path, order: Any) -> None:
    d = base(data_dir)
    d["parallel"]["order"] = order
    refused(d, "parallel.order")


def test_bad_parallel_size(data_dir: Path) -> None:
    d = base(data_dir)
    d["parallel"]["dp"] = 0
    refused(d, "parallel.dp")


@pytest.mark.parametrize("where", ["sources[0]", "tokenizer"])
@pytest.mark.parametrize("options, says", [
    ("anon=true", "must be a mapping, got str"),
    ({1: 2}, "its keys are fsspec's option names, strings; got 1"),
])
def test_bad_storage_options_name_their_key(data_dir: Path, where: str, options: Any,
                                            says: str) -> None:
    # a string was refused with no word of what was given, and a key that is not a string
    # failed at the listing, blamed on the uri (or tokenizer.path; a review)
    d = base(data_dir)
    if where == "tokenizer":
        d["tokenizer"] = {"kind": "hf", "path": "tok.json", "storage_options": options}
    else:
        d["sources"][0]["storage_options"] = options
    assert says in str(refused(d, f"{where}.storage_options"))


def test_bad_context(data_dir: Path) -> None:
    d = base(data_dir)
    d["sources"][0]["context"] = "medium"
    refused(d, "sources[0].context")


# ------------------------------------------------------------------------- schedules


def test_schedule_mixing_until_and_step(data_dir: Path) -> None:
    d = base(data_dir)
    d["sources"][0]["weight"] = [{"step": 0, "weight": 0.5}, {"until": 100, "weight": 0.2},
                                 {"weight": 0.6}]
    refused(d, "sources[0].weight")


def test_schedule_point_with_both_until_and_step_is_refused(data_dir: Path) -> None:
    d = base(data_dir)
    d["sources"][0]["weight"] = [{"step": 0, "until": 10, "weight": 0.5},
                                 {"step": 100, "weight": 0.6}]
    with pytest.raises(ConfigError) as info:
        parse_config(d)
    assert info.value.key.startswith("sources[0].weight")


@pytest.mark.parametrize("points", [
    [{"step": 0, "weight": 0.1}, {"step": 100, "weight": 0.5}, {"step": 100, "weight": 0.9}],
    [{"step": 50, "weight": 0.1}, {"step": 10, "weight": 0.5}],
    [{"until": 100, "weight": 0.1}, {"until": 100, "weight": 0.5}, {"weight": 0.9}],
    [{"until": 200, "weight": 0.1}, {"until": 100, "weight": 0.5}, {"weight": 0.9}],
])
def test_schedule_steps_must_increase(data_dir: Path, points: list[dict[str, Any]]) -> None:
    d = base(data_dir)
    d["sources"][1]["weight"] = points
    err = refused(d, "sources[1].weight")
    assert "increase" in str(err)


def test_piecewise_schedule_must_end_without_until(data_dir: Path) -> None:
    d = base(data_dir)
    d["sources"][0]["weight"] = [{"until": 100, "weight": 0.2}, {"until": 200, "weight": 0.6}]
    refused(d, "sources[0].weight[1]")


def test_schedule_only_last_point_may_omit_until(data_dir: Path) -> None:
    d = base(data_dir)
    d["sources"][0]["weight"] = [{"weight": 0.2}, {"until": 200, "weight": 0.6}, {"weight": 1}]
    refused(d, "sources[0].weight[0]")


def test_schedule_point_negative_weight(data_dir: Path) -> None:
    d = base(data_dir)
    d["sources"][0]["weight"] = [{"until": 100, "weight": -0.2}, {"weight": 0.6}]
    refused(d, "sources[0].weight[0].weight")


def test_empty_schedule(data_dir: Path) -> None:
    d = base(data_dir)
    d["sources"][0]["weight"] = []
    refused(d, "sources[0].weight")


def test_piecewise_schedule_evaluates(data_dir: Path) -> None:
    d = base(data_dir)
    d["sources"][0]["weight"] = [{"until": 100, "weight": 0.2}, {"until": 300, "weight": 0.6},
                                 {"weight": 0.1}]
    cfg = load_config(d)
    w = cfg.sources[0].weight
    assert w.kind == "piecewise"
    assert [w.at(s) for s in (0, 1, 99)] == [0.2, 0.2, 0.2]
    assert [w.at(s) for s in (100, 200, 299)] == [0.6, 0.6, 0.6]
    assert [w.at(s) for s in (300, 10**9)] == [0.1, 0.1]
    assert w.breakpoints() == [100, 300]
    # Normalised with the constant 0.3 of the other source.
    assert cfg.weights_at(150)["web"] == pytest.approx(0.6 / 0.9)


def test_linear_schedule_evaluates(data_dir: Path) -> None:
    d = base(data_dir)
    d["sources"][0]["weight"] = [{"step": 10, "weight": 0.0}, {"step": 110, "weight": 1.0},
                                 {"step": 210, "weight": 0.5}]
    w = load_config(d).sources[0].weight
    assert w.kind == "linear"
    assert w.at(0) == pytest.approx(0.0)     # constant before the first anchor
    assert w.at(10) == pytest.approx(0.0)
    assert w.at(35) == pytest.approx(0.25)
    assert w.at(60) == pytest.approx(0.5)
    assert w.at(110) == pytest.approx(1.0)
    assert w.at(160) == pytest.approx(0.75)
    assert w.at(210) == pytest.approx(0.5)
    assert w.at(5000) == pytest.approx(0.5)  # constant after the last anchor


def test_constant_schedule() -> None:
    w = WeightSchedule.constant(3)
    assert w.kind == "constant"
    assert w.at(0) == 3.0 and w.at(10**6) == 3.0
    assert w.breakpoints() == []


# ------------------------------------------------------------------------- round trip


def test_to_dict_round_trips(data_dir: Path) -> None:
    d = base(data_dir)
    d["sources"][0]["weight"] = [{"until": 100, "weight": 0.2}, {"weight": 0.6}]
    d["sources"][1]["weight"] = [{"step": 0, "weight": 0.8}, {"step": 100, "weight": 0.4}]
    d["sources"][1]["storage_options"] = {"anon": True}
    d["cost"] = {"linear": 2.0, "quadratic": 0.001}
    d["parallel"]["order"] = "dp-tp-cp-pp"
    d["balance"] = "sequential"
    d["timeout"] = 12.5
    d["prefetch"] = 3
    original = copy.deepcopy(d)
    cfg = load_config(d)
    assert d == original  # the input is not mutated
    out = cfg.to_dict()
    again = parse_config(out)
    assert again == cfg
    # ... and through YAML text too.
    assert parse_config(yaml.safe_dump(out)) == cfg
    assert again.to_dict() == out


def test_to_dict_round_trips_defaults(data_dir: Path) -> None:
    cfg = parse_config({"name": "x", "batch": {"seq_len": 8},
                       "sources": [{"name": "a", "uri": "mem://a/*.jsonl", "format": "jsonl"}]})
    assert parse_config(cfg.to_dict()) == cfg


# ---------------------------------------------------------------------------- mesh


def test_parallel_coords_default_order() -> None:
    p = ParallelConfig(dp=2, tp=2, cp=2, pp=1)
    assert p.order == "tp-cp-dp-pp"
    assert p.world_size == 8
    expected = {
        0: {"tp": 0, "cp": 0, "dp": 0, "pp": 0},
        1: {"tp": 1, "cp": 0, "dp": 0, "pp": 0},
        2: {"tp": 0, "cp": 1, "dp": 0, "pp": 0},
        3: {"tp": 1, "cp": 1, "dp": 0, "pp": 0},
        4: {"tp": 0, "cp": 0, "dp": 1, "pp": 0},
        5: {"tp": 1, "cp": 0, "dp": 1, "pp": 0},
        6: {"tp": 0, "cp": 1, "dp": 1, "pp": 0},
        7: {"tp": 1, "cp": 1, "dp": 1, "pp": 0},
    }
    for r, c in expected.items():
        assert p.coords(r) == c
    assert p.ranks_of_dp(0) == [0, 1, 2, 3]
    assert p.ranks_of_dp(1) == [4, 5, 6, 7]
    assert p.ranks_of_dp(2) == []
    for bad in (-1, 8):
        with pytest.raises(ValueError):
            p.coords(bad)


def test_parallel_coords_other_order() -> None:
    p = ParallelConfig(dp=2, tp=2, cp=2, pp=1, order="dp-tp-cp-pp")
    assert [p.coords(r)["dp"] for r in range(8)] == [0, 1] * 4
    assert p.ranks_of_dp(0) == [0, 2, 4, 6]
    assert p.ranks_of_dp(1) == [1, 3, 5, 7]
    assert p.coords(6) == {"dp": 0, "tp": 1, "cp": 1, "pp": 0}


def test_round_steps_defaults_to_prefetch_minus_one_and_is_bounded_by_it():
    base = {"name": "r", "batch": {"seq_len": 8},
            "sources": [{"name": "a", "uri": "x/*.jsonl", "format": "jsonl"}]}
    assert parse_config(dict(base, prefetch=4)).steps_per_round == 3
    assert parse_config(dict(base, prefetch=1)).steps_per_round == 1
    assert parse_config(dict(base, prefetch=4, round_steps=4)).steps_per_round == 4
    with pytest.raises(ConfigError, match="round_steps.*<= prefetch"):
        parse_config(dict(base, prefetch=2, round_steps=3))
    with pytest.raises(ConfigError, match="round_steps.*>= 0"):
        parse_config(dict(base, round_steps=-1))


def test_errors_pickle_whole():
    """Raised in a Dask worker or a pool process, errors arrive with their fields."""
    import pickle

    from msd_dask.errors import DataError

    e = pickle.loads(pickle.dumps(ConfigError("sources[0].weight", "must be >= 0")))
    assert isinstance(e, ConfigError) and e.key == "sources[0].weight" and e.reason == "must be >= 0"
    assert str(e) == "config key 'sources[0].weight': must be >= 0"
    d = DataError("bad row", source="code", path="a.parquet", row=3)
    d2 = pickle.loads(pickle.dumps(d))
    assert (d2.source, d2.path, d2.row, str(d2)) == ("code", "a.parquet", 3, str(d))


# ------------------------------------------------------- found by a review of the parser


def test_yaml_exponent_floats_are_numbers(data_dir: Path) -> None:
    """``quadratic: 2e-5`` is a number (PyYAML's YAML 1.1 made it the string '2e-5', and the
    key was refused as 'must be a finite number, got '2e-5'')."""
    text = yaml.safe_dump(base(data_dir)) + "cost: {linear: 1, quadratic: 2e-5}\n"
    assert "quadratic: 2e-5" in text
    cfg = load_config(text)
    assert cfg.cost.quadratic == 2e-5 and cfg.cost.linear == 1.0
    refused(yaml.safe_dump(base(data_dir)) + "prefetch: 1e1\n", "prefetch")  # an int key


def test_a_mistyped_config_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no config file 'configs/tyop\.yaml'"):
        load_config("configs/tyop.yaml")
    # a Path raised FileNotFoundError, a folder IsADirectoryError (review)
    for path, why in ((Path("configs/tyop.yaml"), "No such file"), (tmp_path, "Is a directory")):
        with pytest.raises(ConfigError, match=rf"cannot read config file '{path}': {why}"):
            load_config(path)
    # a data file given for the config: the bare codec error named no file (a review)
    binary = tmp_path / "part-00000.parquet"
    binary.write_bytes(b"PAR1\x15\xa8\x00\xff")
    with pytest.raises(ConfigError, match=rf"config file '{binary}' is not UTF-8 text \(byte 5"):
        load_config(str(binary))


def test_a_config_file_error_names_the_file_not_a_key(tmp_path: Path) -> None:
    """A missing config file was "config key '<root>': no config file ...", naming a key
    the config does not have (a review); a ConfigError still, whole through a pickle."""
    import pickle

    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    for cfg, said in (("configs/tyop.yaml", "no config file 'configs/tyop.yaml' (a config is "
                       "the path of a YAML file, or YAML text)"),
                      (Path("configs/tyop.yaml"), "cannot read config file 'configs/tyop.yaml': "
                       "No such file or directory"),
                      (str(empty), f"config file '{empty}' is empty")):
        with pytest.raises(ConfigError) as info:
            load_config(cfg)
        err = info.value
        assert str(err) == said and err.reason == said and err.key == "<root>"
        again = pickle.loads(pickle.dumps(err))
        assert isinstance(again, ConfigError) and str(again) == said
    # (a key of the config is still named)
    with pytest.raises(ConfigError, match=r"^config key '<root>': not valid YAML"):
        load_config("a: [1\nb: 2\n")


def test_a_source_max_loaders_below_its_min_is_refused(data_dir: Path) -> None:
    """The rule ``min <= max`` holds per source, with scaling's bound where the source has
    none (the policy used to raise the max to the min silently)."""
    d = base(data_dir)
    d["sources"][0].update(min_loaders=5, max_loaders=2)
    refused(d, "sources[0].max_loaders")
    d = base(data_dir)
    d["sources"][1]["min_loaders"] = 9  # above scaling.max_loaders (8)
    refused(d, "sources[1].min_loaders")
    d["scaling"] = {"max_loaders": 9}
    assert load_config(d).sources[1].min_loaders == 9


def test_a_seed_of_32_bits_or_more_is_refused(data_dir: Path) -> None:
    """The streams are seeded with 32 bits: seeds 0 and 2**32 gave the same batches."""
    d = base(data_dir)
    d["seed"] = 2**32
    assert "[0, 2**32)" in str(refused(d, "seed"))
    d["seed"] = 2**32 - 1
    assert load_config(d).seed == 2**32 - 1


def test_a_seq_len_context_parallel_ranks_cannot_split_is_refused(data_dir: Path) -> None:
    """cp = 3 splits each row into 6 chunks: seq_len 128 is refused when the config is
    read (it failed only when a rank of the group first asked for its batch)."""
    d = base(data_dir)
    d["parallel"] = {"dp": 2, "cp": 3}
    err = refused(d, "batch.seq_len")
    assert "2 x parallel.cp = 6" in str(err) and "got 128" in str(err)
    d["batch"]["seq_len"] = 132
    assert load_config(d).parallel.cp == 3


@pytest.mark.parametrize("extra, key", [
    ("seed: 7\n", "seed"),  # the dump has a seed already
    ("sources:\n  - {name: extra, uri: x, format: jsonl}\n", "sources"),
])
def test_a_key_given_twice_is_refused(data_dir: Path, extra: str, key: str) -> None:
    """PyYAML keeps a repeated key's last value: a second ``sources:`` block dropped the
    first list without a word (review).  It is refused, naming the key and both lines."""
    d = base(data_dir)
    d["seed"] = 3
    text = yaml.safe_dump(d, sort_keys=False)
    first = next(i for i, line in enumerate(text.splitlines(), 1) if line.startswith(key + ":"))
    with pytest.raises(ConfigError, match=rf"given twice \(lines {first} and "
                                          rf"{len(text.splitlines()) + 1}\)") as info:
        load_config(text + extra)
    assert info.value.key == key


def test_a_key_given_twice_inside_a_source_names_its_path(data_dir: Path) -> None:
    text = yaml.safe_dump(base(data_dir), sort_keys=False, default_flow_style=False)
    text = text.replace("  weight:", "  weight: 0.0\n  weight:", 2)
    assert text.count("weight:") >= 3
    with pytest.raises(ConfigError, match="given twice") as info:
        load_config(text)
    assert info.value.key == "sources[0].weight"


def test_a_recursive_alias_is_a_config_error(data_dir: Path) -> None:
    """The repeated-key check followed an alias inside its own anchor without end
    (RecursionError: review); the config's own check names the key."""
    text = yaml.safe_dump(base(data_dir)) + "cost: &c {model: *c}\n"
    with pytest.raises(ConfigError) as info:
        load_config(text)
    assert info.value.key.startswith("cost.model")


@pytest.mark.parametrize("image", [False, 0, "", []])
def test_an_image_setting_that_is_no_mapping_is_refused(data_dir: Path, image: Any) -> None:
    """``image: false`` made a text source an image+text source with the default image."""
    cfg = base(data_dir)
    cfg["sources"][0]["image"] = image
    with pytest.raises(ConfigError, match=r"sources\[0\]\.image': must be a mapping"):
        parse_config(cfg)


def test_a_yaml_file_with_a_syntax_error_or_nothing_in_it_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nbatch: {seq_len: 64\nsources: []\n")
    with pytest.raises(ConfigError) as info:
        parse_config(str(bad))
    # (one line naming the file and where, not the parser's six lines quoting the text)
    assert str(info.value) == (
        f"config key '<root>': not valid YAML: '{bad}', line 3, column 8: expected ',' or "
        "'}', but got ':' (while parsing a flow mapping from line 2)"), info.value
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(ConfigError, match=rf"config file '{empty}' is empty"):
        parse_config(empty)


def test_missing_keys_are_named_the_same_under_every_hash_seed() -> None:
    # the required keys were looked for in a set's order: which one the error named
    # depended on PYTHONHASHSEED (a review)
    import os
    import subprocess
    import sys

    code = ("from msd_dask.core.config import parse_config\n"
            "try:\n"
            "    parse_config({'name': 'x', 'batch': {'seq_len': 8}, 'sources': [{}]})\n"
            "except ValueError as e:\n"
            "    print(e)\n")
    said = {subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                           text=True, env=dict(os.environ, PYTHONHASHSEED=str(seed))
                           ).stdout.strip() for seed in range(4)}
    assert len(said) == 1, said
    (one,) = said
    assert "'sources[0].format'" in one and "is required" in one
    assert "sources[0].name" in one and "sources[0].uri" in one  # (all of them, at once)


@pytest.mark.parametrize("change, key", [
    # each passed parsing and failed in the planner with an OverflowError naming no key,
    # or a wait Python's threading cannot make (a review)
    ({"batch": {"seq_len": 2**31}}, "batch.seq_len"),
    ({"parallel": {"dp": 2**40}}, "parallel.dp"),
    ({"parallel": {"dp": 2**20}, "batch": {"seq_len": 2**11, "micro_batches": 2**10}},
     "batch.seq_len"),  # (2**41 tokens a step)
    ({"cost": {"linear": 1e308, "quadratic": 1e308}}, "cost"),
    ({"cost": {"model": {"hidden_size": 10**160, "layers": 1}}}, "cost.model.hidden_size"),
    ({"timeout": 1e300}, "timeout"),
    # (the fit's sums overflowed near 1e300, a RuntimeWarning and no key named: a review)
    ({"cost": {"fit": True, "prior_weight": 1e300}}, "cost.prior_weight"),
])
def test_values_too_large_to_plan_with_are_refused(data_dir: Path, change: dict[str, Any],
                                                   key: str) -> None:
    d = base(data_dir)
    d["parallel"] = {"dp": 2}
    for k, v in change.items():
        d[k] = v
    refused(d, key)


@pytest.mark.parametrize("seq_len", ["1:04", "0100"])
def test_yaml_numbers_that_read_as_other_numbers_are_refused(data_dir: Path,
                                                             seq_len: str) -> None:
    # YAML 1.1 read 1:04 as 64 (base 60) and 0100 as 64 (octal), silently (a review)
    text = yaml.safe_dump(base(data_dir)).replace("seq_len: 128", f"seq_len: {seq_len}")
    assert f"seq_len: {seq_len}" in text
    err = refused(text, "batch.seq_len")
    assert repr(seq_len) in str(err)
    # (the numbers a config writes still read as written)
    assert load_config(yaml.safe_dump(base(data_dir)).replace(
        "seq_len: 128", "seq_len: 1_024")).batch.seq_len == 1024


def test_a_whitespace_name_is_refused(data_dir: Path) -> None:
    d = base(data_dir)
    d["sources"][0]["name"] = "  "
    refused(d, "sources[0].name")


def test_read_ahead_tokens_may_be_a_large_count(data_dir: Path) -> None:
    # bench_memory's "no cap" is 10**15 tokens: the int32 limit refused it
    d = base(data_dir)
    d["sources"][0]["read_ahead_tokens"] = 10**15
    assert load_config(d).sources[0].read_ahead_tokens == 10**15


def test_more_loaders_than_the_sources_max_is_refused(data_dir: Path) -> None:
    # loaders: 10 under the default max_loaders 8 started 10; a planner re-created after a
    # loss clamped them to 8, silently (a review of the elastic paths)
    d = base(data_dir)
    d["sources"][0]["loaders"] = 10
    err = refused(d, "sources[0].loaders")
    assert "at most the source's max_loaders, 8" in str(err)
    d["sources"][0]["max_loaders"] = 12
    assert load_config(d).sources[0].loaders == 10


@pytest.mark.parametrize("where", ["weight", "timeout", "schedule", "cost"])
def test_an_integer_too_long_for_a_float_is_a_config_error(data_dir: Path, where: str) -> None:
    """A YAML literal of hundreds of digits raised OverflowError from math.isfinite, a
    traceback from ``msd-dask validate`` (a review)."""
    big = 10**400
    cfg = base(data_dir)
    key = {"weight": "sources[0].weight", "timeout": "timeout",
           "schedule": "sources[0].weight[0].weight", "cost": "cost.quadratic"}[where]
    if where == "weight":
        cfg["sources"][0]["weight"] = big
    elif where == "schedule":
        cfg["sources"][0]["weight"] = [{"until": 5, "weight": big}, {"weight": 1}]
    elif where == "cost":
        cfg["cost"] = {"quadratic": big}
    else:
        cfg["timeout"] = big
    with pytest.raises(ConfigError, match=rf"config key '{re.escape(key)}': must be a finite "):
        parse_config(cfg)


@pytest.mark.parametrize("name", ["team/demo", " demo", "demo ", "a\0b"])
def test_a_service_name_that_cannot_name_a_file_is_refused(data_dir: Path, name: str) -> None:
    """A name holding '/' was taken, then ``msd-dask agent`` failed on its socket's path
    (/tmp/msd-dask-UID/agent-NAME.sock); one with blanks around it is not the name
    ``msd-dask stats NAME`` is given (a review)."""
    cfg = base(data_dir)
    cfg["name"] = name
    with pytest.raises(ConfigError, match=r"config key 'name': must hold no '/'"):
        parse_config(cfg)
    cfg["name"] = "train eval-1.x"  # (anything else goes)
    assert parse_config(cfg).name == "train eval-1.x"


def test_the_configs_repr_leaves_the_credentials_out(data_dir: Path) -> None:
    """A source's and the tokenizer's ``storage_options`` hold credentials: the config's
    repr, which a log line or a traceback may print, printed them (a security review)."""
    cfg = base(data_dir)
    cfg["sources"][0]["storage_options"] = {"key": "AKIA_SECRET", "secret": "s3cr3t"}
    parsed = parse_config(cfg)
    assert parsed.sources[0].storage_options["key"] == "AKIA_SECRET"
    assert "AKIA_SECRET" not in repr(parsed) and "s3cr3t" not in repr(parsed)
    assert "AKIA_SECRET" not in repr(parsed.sources[0])


# ------------------------------------------- bounds found by a review (each accepted before)


def test_a_mesh_of_more_ranks_than_int32_holds_is_refused(data_dir: Path) -> None:
    """``msd-dask validate`` said OK to 4.6e18 ranks; start-up lays out every rank."""
    d = base(data_dir)
    d["parallel"] = {"dp": 2, "tp": 65536, "cp": 1, "pp": 65536}
    err = refused(d, "parallel.tp")
    assert "8589934592 ranks" in str(err) and "2**31 - 1" in str(err)
    d["parallel"] = {"dp": 2, "tp": 32768, "cp": 1, "pp": 32767}  # 2**31 - 2**16: fits
    assert load_config(d, check_files=False).parallel.world_size == 2 * 32768 * 32767


def test_more_constructors_than_dp_groups_are_refused(data_dir: Path) -> None:
    """Each constructor serves whole DP groups: those beyond ``dp`` served none."""
    d = base(data_dir)
    d["constructors"] = 3  # dp 2
    err = refused(d, "constructors")
    assert "parallel.dp (2)" in str(err) and "got 3" in str(err)
    d["constructors"] = 2
    assert load_config(d, check_files=False).constructors == 2


@pytest.mark.parametrize("value", [1, 1.0, 5])
def test_a_starve_fraction_of_the_whole_window_or_more_is_refused(data_dir: Path,
                                                                  value: float) -> None:
    """The planner waits at most the whole window: 1 or more turned the reactive rule off."""
    d = base(data_dir)
    d["scaling"] = {"policy": "adaptive", "starve_fraction": value}
    assert "must be below 1" in str(refused(d, "scaling.starve_fraction"))


def test_too_many_loaders_say_which_key_to_raise(data_dir: Path) -> None:
    d = base(data_dir)
    d["sources"][0]["loaders"] = 16
    err = refused(d, "sources[0].loaders")
    assert "raise sources[0].max_loaders or scaling.max_loaders" in str(err)
