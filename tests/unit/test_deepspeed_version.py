"""The DeepSpeed versions zload uses: refused below the first release with the internals it uses,
warned about from the first minor release it is not tested with, checked once per process."""

from __future__ import annotations

import warnings

import pytest

import zload
from zload.errors import UnsupportedEnvironmentError, ZloadWarning
from zload.integrations import deepspeed as integration


@pytest.mark.parametrize("version", ["0.19.3", "0.19.8", "0.19.8+8c41d2f", "0.19.10.dev0"])
def test_a_tested_version_passes_silently(version):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        integration.check_version(version)


@pytest.mark.parametrize("version", ["0.19.2", "0.19.0", "0.18.9", "0.16.0", "0.9"])
def test_an_older_version_is_refused_naming_it_and_what_to_install(version):
    with pytest.raises(UnsupportedEnvironmentError) as raised:
        integration.check_version(version)
    message = str(raised.value)
    assert f"DeepSpeed {version} is installed" in message
    assert "0.19.3 or later" in message and "tested with DeepSpeed 0.19.x (0.19.8)" in message
    assert "pip install 'deepspeed>=0.19.3'" in message
    assert isinstance(raised.value, zload.ZloadError)
    assert zload.UnsupportedEnvironmentError is UnsupportedEnvironmentError


@pytest.mark.parametrize("version", ["0.20.0", "0.20.0rc1", "0.21", "1.0.0"])
def test_a_newer_minor_version_is_warned_about_not_refused(version):
    with pytest.warns(ZloadWarning, match=rf"DeepSpeed {version} is installed.*tested with DeepSpeed 0\.19\.x"):
        integration.check_version(version)


def test_an_unreadable_version_is_warned_about():
    with pytest.warns(ZloadWarning, match="cannot read DeepSpeed's version 'main'"):
        integration.check_version("main")


def test_the_installed_version_passes():
    import deepspeed

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        integration.check_version(deepspeed.__version__)
        assert integration._deepspeed() is deepspeed
