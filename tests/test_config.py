from __future__ import annotations

import dataclasses

import pytest

from quantkit.config import CalibConfig, LoadConfig, QuantkitError, QuantScheme


def test_scheme_validation():
    assert QuantScheme(4, 128, True).maxq == 15
    for bad in (dict(bits=5), dict(bits=1), dict(group_size=0), dict(group_size=100), dict(group_size=-2)):
        with pytest.raises(QuantkitError):
            QuantScheme(**bad)
    with pytest.warns(UserWarning, match="kernels"):
        QuantScheme(4, 256, True)


def test_frozen_and_aliases():
    scheme = QuantScheme()
    with pytest.raises(dataclasses.FrozenInstanceError):
        scheme.bits = 8
    assert LoadConfig(dtype="bf16").dtype == "bfloat16"
    with pytest.raises(QuantkitError, match="dtype"):
        LoadConfig(dtype="int8")
    with pytest.raises(QuantkitError, match="nsamples"):
        CalibConfig(nsamples=0)
