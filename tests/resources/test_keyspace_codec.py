import pytest

from gpupool_sdk.errors import ConfigError, SchemaError
from gpupool_sdk.resources import GiB, JobSpec
from gpupool_sdk.store.codec import SCHEMA_VERSION, decode, decode_dict, encode
from gpupool_sdk.store.keyspace import Keyspace, ParsedKey


def test_keys_and_parse_round_trip():
    ks = Keyspace("/pool/v1/")
    assert ks.prefix == "/pool/v1"
    cases = [
        (ks.node("n1"), ParsedKey("nodes", ("n1",))),
        (ks.gpu("n1", "GPU-a"), ParsedKey("gpus", ("n1", "GPU-a"))),
        (ks.readings("n1", "GPU-a"), ParsedKey("readings", ("n1", "GPU-a"))),
        (ks.job_spec("j"), ParsedKey("jobs.spec", ("j",))),
        (ks.job_status("j"), ParsedKey("jobs.status", ("j",))),
        (ks.allocation("n1", "GPU-a", "j"), ParsedKey("allocations", ("n1", "GPU-a", "j"))),
        (ks.directive("j"), ParsedKey("directives", ("j",))),
        (ks.ack("j"), ParsedKey("acks", ("j",))),
        (ks.telemetry("j"), ParsedKey("telemetry", ("j",))),
        (ks.checkpoint("j"), ParsedKey("checkpoints", ("j",))),
        (ks.usage("j"), ParsedKey("usage", ("j",))),
        (ks.cordon("GPU-a"), ParsedKey("cordons", ("GPU-a",))),
        (ks.drain("n1"), ParsedKey("drains", ("n1",))),
        (ks.leader(), ParsedKey("leader", ())),
    ]
    for key, parsed in cases:
        assert key.startswith("/pool/v1/")
        assert ks.parse(key) == parsed
    assert ks.parse("/other/nodes/x") is None
    assert ks.parse("/pool/v1/gpus/only-node") is None
    assert ks.parse("/pool/v1/readings/only-node") is None
    assert ks.readings_prefix() == "/pool/v1/readings/" and ks.readings_prefix("n1") == "/pool/v1/readings/n1/"
    assert ks.parse("/pool/v1/jobs/j/other") is None


@pytest.mark.parametrize("prefix", ["relative", "/", "//x", ""])
def test_bad_prefix(prefix):
    with pytest.raises(ConfigError, match="prefix"):
        Keyspace(prefix)


def test_key_segments_are_validated():
    with pytest.raises(ConfigError, match="job"):
        Keyspace().job_spec("a/b")


def test_codec_round_trip_and_errors():
    spec = JobSpec(name="j", memory="2GiB")
    raw = encode(spec)
    assert decode_dict("k", raw)["memory_bytes"] == 2 * GiB
    assert decode("k", raw, JobSpec) == spec
    assert b'"schema":%d' % SCHEMA_VERSION in raw
    for bad, why in [
        (b"{not json", "not valid JSON"),
        (b"[1,2]", "JSON object"),
        (b'{"name":"j"}', "schema version"),
        (b'{"schema":1,"name":"J"}', "invalid value"),
        (b'{"schema":1,"name":"j","memory_bytes":"x"}', "invalid value"),
    ]:
        with pytest.raises(SchemaError, match=why) as err:
            decode("/p/jobs/j/spec", bad, JobSpec)
        assert err.value.key == "/p/jobs/j/spec"
