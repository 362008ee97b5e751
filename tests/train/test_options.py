"""One definition per option (dask_dl/train/option_groups.py): fit's signature and docstring, the trainers' spec,
``dask-dl train`` and the config file agree with it, and fit takes the options flat or in groups.

Every check runs over every option defined, so an option added to a group and missing from any of those places
fails here, naming the place.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import fields
from pathlib import Path

import click
import pytest
import yaml

import dask_dl
from dask_dl import ConfigurationError
from dask_dl.testing import data as kit
from dask_dl.train.option_groups import DEFAULTS, GROUPS, OPTIONS, SETTINGS, Recovery, ScaleOut, Training
from dask_dl.train.options import RunOptions, check_run

SITE_ONLY = ("start_state", "proximal_mu", "weights_only")  # fit_sites' visits (run.fit_visit) only
#: keywords of fit that are not options of the run: where it runs and where it is recorded
PLACES = ("client", "wait", "workers", "tracking")


def _fit_keywords() -> dict[str, inspect.Parameter]:
    params = inspect.signature(dask_dl.fit).parameters
    return {n: p for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _documented() -> set[str]:
    """The names of ``fit``'s docstring's Parameters entries (``a, b : type``)."""
    doc = inspect.getdoc(dask_dl.fit)
    part = doc.split("Parameters\n----------\n")[1].split("\nReturns\n")[0]
    return {n.strip() for line in re.findall(r"^(\w[\w, ]*) :", part, flags=re.M) for n in line.split(",")}


def _train_params() -> dict[str, click.Parameter]:
    from dask_dl.cli import cli

    return {p.name: p for p in cli.commands["train"].params if p.expose_value}


def _config_train_keys() -> set[str]:
    path = Path(dask_dl.__file__).parent / "dask-dl.yaml"
    return set(yaml.safe_load(path.read_text())["dask-dl"]["train"])


@pytest.mark.parametrize("name", list(OPTIONS))
def test_every_option_is_a_keyword_of_fit_the_run_the_trainers_the_cli_and_the_config(name):
    opt = OPTIONS[name]
    keywords = _fit_keywords()
    assert name in keywords, f"fit has no keyword {name!r}: add it to fit's signature"
    assert keywords[name].default == DEFAULTS[name], f"fit's default of {name} is not its group's"
    assert name in _documented(), f"fit's docstring does not document {name}"
    assert name in RunOptions.__dataclass_fields__
    from dask_dl.train.spec import TrainerSpec

    assert name in TrainerSpec.__dataclass_fields__
    params = _train_params()
    if opt.flags:
        assert name in params, f"dask-dl train has no option for {name}"
        param = params[name]
        assert set(opt.flags) <= set(param.opts), (opt.flags, param.opts)
        if opt.cli == "flag":
            assert param.is_flag
        elif callable(opt.cli) and opt.cli not in (int, float, str):
            assert set(opt.cli()) <= set(param.type.choices)
        elif name == "lr":  # a number, or find: a learning-rate range test first
            assert param.callback(None, param, "0.01") == 0.01 and param.callback(None, param, "find") == "find"
        else:
            assert param.type == click.types.convert_type(opt.cli)
        assert param.default == DEFAULTS[name]
    else:
        assert name not in params
    if opt.config is not None:
        assert opt.config in _config_train_keys(), f"dask-dl.yaml has no train.{opt.config} (default of {name})"


def test_fit_takes_the_options_the_groups_and_where_it_runs_and_nothing_else():
    keywords = _fit_keywords()
    assert set(keywords) == {*OPTIONS, *GROUPS, *PLACES}
    assert all(keywords[g].default is None for g in GROUPS)
    assert list(inspect.signature(dask_dl.fit).parameters)[0] == "dataset"
    assert _documented() == {"dataset", *OPTIONS, *GROUPS, *PLACES}
    assert not set(SITE_ONLY) & set(keywords), "fit_sites' options left the public fit"
    from dask_dl.train.run import fit_visit

    assert set(SITE_ONLY) <= set(inspect.signature(fit_visit).parameters)


def test_the_train_command_has_an_option_per_flagged_option_and_its_own_few():
    own = {"store", "upload", "tracking", "scheduler", "workers", "quiet"}
    assert set(_train_params()) == own | {n for n, o in OPTIONS.items() if o.flags}
    # the flags of before the definitions are all there: scripts that call dask-dl train keep working
    flags = {f for p in _train_params().values() for f in p.opts if p.name not in own}
    assert flags >= {
        "--model",
        "-m",
        "--epochs",
        "-e",
        "--batch-size",
        "-b",
        "--trainers",
        "-t",
        "--compression",
        "-c",
        "--lr",
        "--optimizer",
        "--checkpoint-dir",
        "--resume",
        "--seed",
        "--augment",
        "--parallel",
        "--stages",
        "--microbatches",
        "--memory-budget",
        "--max-restarts",
        "--min-trainers",
        "--checkpoint-every",
        "--weights",
        "--freeze-epochs",
        "--head-lr",
        "--schedule",
        "--precision",
        "--accumulate",
        "--normalization",
    }


def test_every_config_key_of_train_is_an_option_or_a_setting():
    options = {o.config for o in OPTIONS.values() if o.config is not None}
    settings = {s.key for s in SETTINGS}
    assert not options & settings
    assert _config_train_keys() == options | settings
    run_fields = set(RunOptions.__dataclass_fields__)
    assert {s.field for s in SETTINGS if s.field} <= run_fields


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    path = kit.write_store(
        tmp_path_factory.mktemp("options") / "s.zarr",
        n=32,
        size=8,
        chunk=4,
        labels=["a"],
        split_of=lambda i: "train" if i < 24 else "val",
    )
    return dask_dl.open_dataset(path)


def test_the_trainers_spec_is_the_run_options_and_what_only_trainers_need(ds):
    from dask_dl.train.run import _trainer_spec

    options = check_run(ds, trainers=2, batch_size=2, schedule="cosine", lr=0.5, max_restarts=1)
    spec = _trainer_spec(options, "ck.pt", proximal_mu=0.5)
    for f in fields(options):
        assert getattr(spec, f.name) is getattr(options, f.name), f.name
    assert (spec.resume_from, spec.proximal_mu, spec.weights_only, spec.start_state) == ("ck.pt", 0.5, False, None)
    assert spec.model_name == options.model == "small_cnn"
    # fit's `schedule` is the learning rate's everywhere; the pipeline's is the setting pipeline_schedule
    assert spec.schedule == {"name": "cosine", "min_factor": 0.0} and spec.pipeline_schedule == "1f1b"


def test_groups_and_flat_keywords_make_the_same_run(ds):
    flat = check_run(ds, trainers=2, batch_size=2, max_restarts=5, min_trainers=1)
    grouped = check_run(
        ds,
        scale_out=ScaleOut(trainers=2),
        training=Training(batch_size=2),
        recovery=Recovery(max_restarts=5, min_trainers=1),
    )
    mixed = check_run(ds, trainers=2, batch_size=2, min_trainers=1, recovery=Recovery(max_restarts=5))
    for options in (grouped, mixed):
        assert options.to_dict() == flat.to_dict()
    assert (flat.max_restarts, flat.min_trainers, flat.trainers, flat.batch_size) == (5, 1, 2, 2)
    # the same value flat and in the group is no conflict
    assert check_run(ds, trainers=2, batch_size=2, max_restarts=5, recovery=Recovery(max_restarts=5)).max_restarts == 5


def test_an_option_set_twice_or_a_wrong_group_or_name_is_refused(ds):
    with pytest.raises(ConfigurationError) as err:
        check_run(ds, trainers=2, batch_size=2, max_restarts=2, recovery=Recovery(max_restarts=5))
    assert str(err.value) == (
        "max_restarts=2 and recovery=Recovery(max_restarts=5) set max_restarts twice; pass it once, as a keyword of "
        "fit or in recovery"
    )
    with pytest.raises(ConfigurationError) as err:
        check_run(ds, recovery={"max_restarts": 5})
    assert str(err.value) == (
        "recovery must be a dask_dl.Recovery(...), got dict: {'max_restarts': 5}; pass e.g. "
        "recovery=dask_dl.Recovery() or its options as keywords of fit"
    )
    with pytest.raises(ConfigurationError, match=r"recovery must be a dask_dl.Recovery\(...\), got ScaleOut"):
        check_run(ds, recovery=ScaleOut(trainers=2))
    with pytest.raises(ConfigurationError) as err:
        check_run(ds, max_restart=5)
    assert str(err.value) == (
        "fit has no option 'max_restart' (did you mean 'max_restarts'?); see help(dask_dl.fit) for its options"
    )
    with pytest.raises(TypeError, match="start_state"):
        dask_dl.fit(ds, start_state={})


def test_a_group_value_is_checked_as_the_flat_keyword_is(ds):
    with pytest.raises(ConfigurationError, match=r"^max_restarts must be an integer >= 0, got -1; pass e.g."):
        check_run(ds, trainers=2, batch_size=2, recovery=Recovery(max_restarts=-1))
    with pytest.raises(ConfigurationError, match=r"^epochs must be a positive integer, got 0; pass e.g. epochs=1$"):
        check_run(ds, training=Training(epochs=0))
