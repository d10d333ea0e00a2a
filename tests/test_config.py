"""ClusterConfig: YAML topologies, strict validation and per-role engine configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from pdcluster.cluster.config import ClusterConfig

RAY_CONFIGS = Path(__file__).resolve().parent.parent / "ray_configs"
TOPOLOGIES = {
    "kuberay-1e1p1d.yaml": "1E1P1D",
    "local-1e1p1d.yaml": "1E1P1D",
    "local-1p1d.yaml": "1P1D",
    "local-mixed.yaml": "2mixed",
}


def make_config(**fields) -> ClusterConfig:
    """A 1P1D config with `fields` (nested dicts, as in YAML) on top."""
    return ClusterConfig.model_validate({"prefill": {"count": 1}, "decode": {"count": 1}, **fields})


def assert_rejected(match: str, **fields) -> None:
    with pytest.raises(ValidationError, match=match):
        make_config(**fields)


def write_yaml(tmp_path: Path, data) -> Path:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


# ---- shipped topologies ------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(RAY_CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    if {"cluster_name", "provider"} <= set(yaml.safe_load(path.read_text()) or {}):
        pytest.skip("a Ray cluster-launcher config, not a topology")
    if path.name not in TOPOLOGIES:
        pytest.fail(f"{path.name}: add its expected topology to TOPOLOGIES")
    config = ClusterConfig.from_yaml(path)
    assert config.topology_name() == TOPOLOGIES[path.name]
    assert config.gateway.host == "127.0.0.1"


def test_topology_name_lists_roles_in_e_p_d_mixed_order():
    config = make_config(encoder={"count": 2}, decode={"count": 3}, mixed={"count": 1})
    assert config.topology_name() == "2E1P3D1mixed"


# ---- strictness --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"modle": "preset:tiny-llava"}, "modle"),
        ({"engine": {"blok_size": 16}}, "engine.blok_size"),
        ({"mixed": {"count": 1, "gpus": 1}}, "mixed.gpus"),
        ({"gateway": {"hostname": "0.0.0.0"}}, "gateway.hostname"),
        ({"prefill": {"count": 1, "engine": {"num_block": 8}}}, "prefill.engine.num_block"),
    ],
)
def test_unknown_key_is_rejected_by_name(fields, key):
    with pytest.raises(ValidationError) as info:
        make_config(**fields)
    message = str(info.value)
    assert key in message and "Extra inputs are not permitted" in message


def test_unknown_key_in_yaml_is_rejected(tmp_path):
    path = write_yaml(tmp_path, {"mixed": {"count": 1}, "conector": {}})
    with pytest.raises(ValueError, match=f"{path}: invalid config: conector: Extra inputs"):
        ClusterConfig.from_yaml(path)


def test_yaml_that_is_not_a_mapping_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="YAML mapping"):
        ClusterConfig.from_yaml(write_yaml(tmp_path, ["mixed", 2]))


@pytest.mark.parametrize(
    "fields",
    [
        {"prefill": {"count": 0}, "decode": {"count": 0}},
        {"prefill": {"count": 0}, "decode": {"count": 0}, "encoder": {"count": 1}},
    ],
    ids=["nothing", "encoder-only"],
)
def test_topology_without_serving_instance_is_rejected(fields):
    assert_rejected("at least one prefill, decode or mixed instance", **fields)


def test_empty_yaml_is_rejected(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("", encoding="utf-8")
    with pytest.raises(
        ValueError, match="empty.yaml: invalid config: a topology needs at least one"
    ):
        ClusterConfig.from_yaml(path)


@pytest.mark.parametrize("setting", ["block_size", "max_model_len"])
def test_prefill_decode_mismatch_is_rejected(setting):
    assert_rejected(
        f"same {setting}", prefill={"count": 1, "engine": {setting: 32}}, decode={"count": 1}
    )


def test_matching_overrides_on_prefill_and_decode_are_accepted():
    same = {"engine": {"block_size": 32, "max_model_len": 4096}}
    config = make_config(prefill={"count": 1, **same}, decode={"count": 1, **same})
    assert config.engine_settings("decode").block_size == 32


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"decode": {"count": -1}}, "decode.count"),
        ({"engine": {"num_blocks": 0}}, "engine.num_blocks"),
        ({"engine": {"block_size": 0}}, "engine.block_size"),
        ({"engine": {"max_num_seqs": -4}}, "engine.max_num_seqs"),
        ({"prefill": {"count": 1, "num_cpus": -1}}, "prefill.num_cpus"),
        ({"decode": {"count": 1, "engine": {"max_num_seqs": 0}}}, "decode.engine.max_num_seqs"),
        ({"engine": {"dtype": "int8"}}, "engine.dtype"),
        ({"mixed": {"count": 1, "engine": {"dtype": "fp8"}}}, "mixed.engine.dtype"),
        ({"connector": {"kv_lease_s": 0}}, "connector.kv_lease_s"),
        ({"connector": {"kv_load_failure_policy": "retry"}}, "kv_load_failure_policy"),
    ],
)
def test_invalid_value_is_rejected_where_it_is(fields, where):
    assert_rejected(where, **fields)


# ---- engine configs ----------------------------------------------------------------------


def test_role_engine_overrides_apply_to_that_role_only():
    config = make_config(
        engine={"num_blocks": 256, "max_num_seqs": 32},
        prefill={"count": 1, "engine": {"num_blocks": 64, "dtype": "float16"}},
    )
    prefill = config.engine_config("prefill", "/models/m")
    decode = config.engine_config("decode", "/models/m")
    assert prefill.model == decode.model == "/models/m"
    assert (prefill.cache.num_blocks, prefill.dtype) == (64, "float16")
    assert (decode.cache.num_blocks, decode.dtype) == (256, "auto")
    assert prefill.scheduler.max_num_seqs == decode.scheduler.max_num_seqs == 32


def test_num_threads_is_unset_by_default_and_set_per_role():
    config = make_config(decode={"count": 1, "engine": {"num_threads": 2}})
    assert config.engine_config("prefill", "/models/m").num_threads is None  # its num_cpus
    assert config.engine_config("decode", "/models/m").num_threads == 2
    with pytest.raises(ValueError, match="num_threads"):
        make_config(engine={"num_threads": 0})


def test_speculative_config_is_set_per_role_and_checked_at_load():
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 16}
    config = make_config(decode={"count": 1, "engine": {"speculative_config": ngram}})
    assert config.engine_config("prefill", "/models/m").speculative is None
    decode = config.engine_config("decode", "/models/m").speculative
    assert (decode.num_speculative_tokens, decode.disable_by_batch_size) == (4, 16)
    with pytest.raises(ValueError, match="speculative_config.*prompt_lookup_min"):
        make_config(engine={"speculative_config": {**ngram, "prompt_lookup_min": 0}})
    with pytest.raises(ValueError, match="unknown key.*'draft_tokens'"):
        make_config(engine={"speculative_config": {**ngram, "draft_tokens": 2}})


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_kv_load_failure_policy_reaches_the_scheduler(policy):
    config = make_config(connector={"kv_load_failure_policy": policy})
    for role in ("prefill", "decode"):
        assert config.engine_config(role, "m").scheduler.kv_load_failure_policy == policy


def test_default_kv_load_failure_policy_is_recompute():
    assert make_config().engine_config("decode", "m").scheduler.kv_load_failure_policy == (
        "recompute"
    )


# ---- gateway -----------------------------------------------------------------------------


def test_gateway_binds_loopback_and_needs_no_key_by_default():
    gateway = make_config().gateway
    assert gateway.host == "127.0.0.1"
    assert gateway.api_key is None
    assert gateway.allowed_image_hosts == []  # remote image URLs are refused


# ---- built-in names, file errors, overrides ----------------------------------------------


def test_builtin_topologies_are_the_shipped_configs_by_name():
    from pdcluster.cluster.config_yaml import builtin_config_names

    assert builtin_config_names() == sorted(Path(name).stem for name in TOPOLOGIES)
    for name, topology in TOPOLOGIES.items():
        assert ClusterConfig.load(Path(name).stem).topology_name() == topology


def test_unknown_config_name_lists_the_builtin_ones():
    with pytest.raises(FileNotFoundError, match="no config file 'local-9p9d'.*local-1p1d"):
        ClusterConfig.load("local-9p9d")


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("mixed:\n  count: 1\n  num_cpus: [1\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"broken\.yaml:4:1: invalid YAML: expected ','"):
        ClusterConfig.load(path)


def test_overrides_are_merged_into_the_yaml_and_validated_with_it():
    config = ClusterConfig.load(
        "local-1p1d", {"gateway": {"port": 9001}, "decode": {"count": 2}, "model": "m"}
    )
    assert (config.gateway.port, config.gateway.host) == (9001, "127.0.0.1")
    assert config.topology_name() == "1P2D"
    assert config.engine.num_blocks == 512  # untouched YAML values stay
    assert config.model == "m"


def test_invalid_override_names_the_file_the_field_and_the_value():
    with pytest.raises(ValueError) as info:
        ClusterConfig.load("local-1p1d", {"gateway": {"port": 99999}})
    message = str(info.value)
    assert "local-1p1d.yaml with the command-line flags: invalid config:" in message
    assert "gateway.port: Input should be less than or equal to 65535 (got 99999)" in message


def test_overrides_alone_need_no_yaml():
    config = ClusterConfig.load(None, {"mixed": {"count": 1}, "engine": {"max_model_len": 64}})
    assert config.topology_name() == "1mixed"
    assert config.engine_settings("mixed").max_model_len == 64


# ---- autoscale ---------------------------------------------------------------------------


def test_autoscale_is_off_by_default():
    assert make_config().autoscale is None


def test_autoscale_section_takes_defaults_for_unset_keys():
    config = make_config(autoscale={"prefill": {"max": 4}, "decode": {"min": 1, "max": 8}})
    autoscale = config.autoscale
    assert (autoscale.prefill.min, autoscale.prefill.max) == (1, 4)
    assert autoscale.prefill.target_queued_prefill_tokens == 2048
    assert autoscale.prefill.target_ttft_p90_ms is None
    decode = autoscale.decode
    assert (decode.target_kv_usage, decode.target_running_per_instance) == (0.8, 48)
    assert (autoscale.interval_s, autoscale.scale_down_fraction) == (10.0, 0.5)
    assert autoscale.scale_up_cooldown_s < autoscale.scale_down_cooldown_s


def test_autoscale_of_one_role_leaves_the_other_fixed():
    config = make_config(autoscale={"decode": {"max": 2, "target_tpot_p90_ms": 50}})
    assert config.autoscale.prefill is None
    assert config.autoscale.decode.target_tpot_p90_ms == 50


@pytest.mark.parametrize(
    ("autoscale", "match"),
    [
        ({"prefill": {"min": 3, "max": 2}}, r"min \(3\) must not exceed max \(2\)"),
        ({"decode": {"max": 65}}, "autoscale.decode.max"),
        ({"decode": {"min": 0, "max": 2}}, "autoscale.decode.min"),
        ({"decode": {"max": 2, "target_kv_usage": 1.5}}, "autoscale.decode.target_kv_usage"),
        ({"prefill": {"max": 2}, "scale_down_fraction": 1.0}, "scale_down_fraction"),
        ({}, "autoscale needs a prefill or decode section"),
    ],
)
def test_invalid_autoscale_is_rejected(autoscale, match):
    assert_rejected(match, autoscale=autoscale)


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"autoscale": {"prefill": {"max": 2, "target_tokens": 1}}}, "autoscale.prefill.target"),
        ({"autoscale": {"decode": {"max": 2}, "cooldown": 5}}, "autoscale.cooldown"),
        ({"autoscale": {"mixed": {"max": 2}}}, "autoscale.mixed"),
    ],
)
def test_unknown_autoscale_key_is_rejected_by_name(fields, key):
    with pytest.raises(ValidationError) as info:
        make_config(**fields)
    assert key in str(info.value) and "Extra inputs are not permitted" in str(info.value)


@pytest.mark.parametrize(
    "fields",
    [
        {"decode": {"count": 3}, "autoscale": {"decode": {"min": 1, "max": 2}}},
        {"prefill": {"count": 1}, "autoscale": {"prefill": {"min": 2, "max": 4}}},
        {"prefill": {"count": 0}, "autoscale": {"prefill": {"max": 4}}},
    ],
    ids=["above-max", "below-min", "role-absent"],
)
def test_configured_count_outside_autoscale_bounds_is_rejected(fields):
    assert_rejected(r"count \(\d\) must lie within autoscale\.\w+ \[min", **fields)
