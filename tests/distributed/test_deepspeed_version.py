"""The DeepSpeed versions zload uses: refused below the first release with the internals it uses,
warned about from the first minor release it is not tested with, checked once per process."""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import NamedTuple

import pytest
from safetensors.torch import save_file

import zload
from tests.support import models
from tests.support.harness import run_world
from tests.support.zero3 import DS_CONFIG, build_zero, check_against, load_expected
from zload.errors import UnsupportedEnvironmentError, ZloadWarning
from zload.integrations import deepspeed as integration


@contextmanager
def _installed(version: str):
    """DeepSpeed reporting ``version`` while active, and zload not yet having checked it."""
    import deepspeed

    installed = deepspeed.__version__
    deepspeed.__version__ = version
    integration._deepspeed.cache_clear()
    try:
        yield
    finally:
        deepspeed.__version__ = installed
        integration._deepspeed.cache_clear()


class Refused(NamedTuple):
    load: str  # the class, message and ranks of load_into's error
    ranks: tuple[int, ...] | None
    init: str  # and zload.init's


def _load_under_old_deepspeed(path):
    model = build_zero(models.ParamsOnly)
    with _installed("0.18.9"):
        with pytest.raises(UnsupportedEnvironmentError) as load:
            zload.load_into(model, path)
        with pytest.raises(UnsupportedEnvironmentError) as init, zload.init(DS_CONFIG):
            models.ParamsOnly()
    return Refused(str(load.value), load.value.ranks, str(init.value))


def test_an_older_deepspeed_is_refused_on_every_rank_before_anything_is_written(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file(models.state_with_seed(models.ParamsOnly, seed=3), str(path))
    for refused in run_world(2, _load_under_old_deepspeed, path):
        assert "DeepSpeed 0.18.9 is installed, but zload needs DeepSpeed 0.19.3 or later" in refused.load
        assert "the model was not changed" in refused.load and refused.ranks == (0, 1)
        assert "DeepSpeed 0.18.9 is installed" in refused.init


def _load_twice_under_new_deepspeed(path):
    model = build_zero(models.ParamsOnly)
    with _installed("0.20.1"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zload.load_into(model, path)
        zload.load_into(model, path)
    check_against(model, load_expected(path))
    return [str(w.message) for w in caught if issubclass(w.category, ZloadWarning)]


def test_a_newer_deepspeed_is_warned_about_once_and_loads(tmp_path):
    """Once per node: by rank 0 here, whose node rank 1 shares."""
    path = tmp_path / "model.safetensors"
    save_file(models.state_with_seed(models.ParamsOnly, seed=4), str(path))
    warned, on_its_node = run_world(2, _load_twice_under_new_deepspeed, path)
    assert len(warned) == 1 and "DeepSpeed 0.20.1 is installed" in warned[0], warned
    assert on_its_node == []
