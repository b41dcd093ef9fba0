import pytest

from distsync.config import RunConfig, parse_key_values, parse_slow
from distsync.errors import ConfigError


def test_parse_slow_accepts_several_ranks():
    assert parse_slow("1:3,0:1.5") == {1: 3.0, 0: 1.5}
    assert parse_slow("2:2x") == {2: 2.0}
    assert parse_slow(None) == {}


@pytest.mark.parametrize(
    "spec, message",
    [
        ("1", "expected RANK:FACTOR"),
        ("a:2", "expected RANK:FACTOR"),
        ("1:0.5", "FACTOR must be >= 1"),
        ("1:2,1:3", "rank 1 is given twice"),
    ],
)
def test_parse_slow_rejects_bad_specs(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_slow(spec)


def test_slow_rank_must_be_a_worker():
    with pytest.raises(ConfigError, match=r"rank 4 is not a worker \(workers are ranks 0..3\)"):
        RunConfig(workers=4, slow={4: 2.0}).validate()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("workers", 0, "--workers must be an integer >= 1, got 0"),
        ("steps", -1, "--steps must be an integer >= 1"),
        ("lr", 0.0, "--lr must be > 0"),
        ("optimizer", "lbfgs", "unknown --optimizer 'lbfgs'; valid: sgd, adam"),
        ("timeout_s", 0, "--timeout must be > 0"),
        ("master_port", 70000, "--master-port must be an integer in 1..65535"),
    ],
)
def test_config_validation_messages(field, value, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RunConfig(**{field: value}).validate()


def test_config_round_trips_through_json(tmp_path):
    cfg = RunConfig(workload="mnist", solver="ddp", workers=3, slow={2: 4.0}, solver_options={"bucket_mb": 1.0})
    cfg.write(tmp_path / "c.json")
    assert RunConfig.read(tmp_path / "c.json") == cfg


def test_config_file_with_unknown_field_is_refused(tmp_path):
    (tmp_path / "c.json").write_text('{"workers": 2, "wokers": 3}')
    with pytest.raises(ConfigError, match="unknown config field\\(s\\): wokers"):
        RunConfig.read(tmp_path / "c.json")


def test_key_values():
    assert parse_key_values(["bucket-mb=1", "overlap = false"]) == {"bucket_mb": "1", "overlap": "false"}
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_key_values(["bucket_mb"])


def test_a_solver_prefix_keeps_its_dashes_and_option_names_take_either():
    from distsync.config import parse_key_values
    from distsync.experiments import split_solver_options

    raw = parse_key_values(["ea-wild.tau=16", "ad-psgd.seed=3", "bucket-mb=1", "ea-wild.min-interval-ms=2"])
    assert raw == {"ea-wild.tau": "16", "ad-psgd.seed": "3", "bucket_mb": "1", "ea-wild.min_interval_ms": "2"}
    per = split_solver_options(["ea-wild", "ad-psgd", "allreduce"], {k: v for k, v in raw.items()
                                                                     if "min_interval" not in k})
    assert per == {"ea-wild": {"tau": "16"}, "ad-psgd": {"seed": "3"}, "allreduce": {"bucket_mb": "1"}}
