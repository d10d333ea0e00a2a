"""Role: one enum whose members are the plain names YAML, JSON and HTTP carry."""

from __future__ import annotations

import json

import pytest

from pdcluster.actors.instance_base import InstanceSpec
from pdcluster.engine.config import EngineConfig
from pdcluster.routing.role import Role


def test_a_role_is_its_name_wherever_a_string_was():
    assert Role.PREFILL == "prefill" and {"prefill": 1}[Role.PREFILL] == 1
    assert f"{Role.DECODE}" == str(Role.DECODE) == "decode"
    assert json.dumps({Role.MIXED: Role.ENCODER}) == '{"mixed": "encoder"}'
    assert [r.value for r in Role] == ["encoder", "prefill", "decode", "mixed"]


def test_an_unknown_role_is_named_in_the_error():
    with pytest.raises(ValueError, match="role must be one of encoder, prefill, decode, mixed"):
        Role.parse("prefil")


def test_an_instance_spec_takes_a_role_name():
    spec = InstanceSpec("P0", "prefill", EngineConfig(model="m"), "m")
    assert spec.role is Role.PREFILL
    with pytest.raises(ValueError, match="role must be one of"):
        InstanceSpec("X0", "prefil", EngineConfig(model="m"), "m")
