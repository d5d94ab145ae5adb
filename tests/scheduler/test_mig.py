"""MIG placement: a job asking for a profile gets an instance of it; other jobs never land on MIG instances."""

from __future__ import annotations

import pytest
from sched_helpers import by_job, gpus, job, only, run, running, snap

from gpupool_sdk.errors import SpecError
from gpupool_sdk.resources import GiB, JobSpec
from gpupool_sdk.scheduler import Grant
from gpupool_sdk.scheduler.filter import features_match

POOL = "mig-node:1xA100-80GB:mig=3g.40gb+2g.20gb+1g.10gb,whole:1xA100-80GB"


def test_jobspec_mig_profile_is_validated_and_normalised() -> None:
    assert JobSpec(name="a", memory="10GiB", mig_profile=" 3G.40GB ").mig_profile == "3g.40gb"
    assert JobSpec(name="a", memory="10GiB", mig_profile="1c.3g.40gb").mig_profile == "1c.3g.40gb"
    assert JobSpec(name="a", memory="10GiB", mig_profile="1g.10gb+me").mig_profile == "1g.10gb+me"
    with pytest.raises(SpecError, match="mig_profile.*3g.40gb"):
        JobSpec(name="a", memory="10GiB", mig_profile="3g-40")
    with pytest.raises(SpecError, match="mig_profile"):
        JobSpec(name="a", memory="10GiB", mig_profile=3)  # type: ignore[arg-type]
    spec = JobSpec(name="a", memory="10GiB", mig_profile="2g.20gb")
    assert JobSpec.from_dict(spec.to_dict()) == spec
    assert "mig_profile" not in JobSpec(name="a", memory="1GiB").to_dict()  # old records unchanged


@pytest.mark.parametrize(
    ("offered", "wanted", "ok"),
    [
        (("bf16", "mig-instance", "mig:3g.40gb"), ("mig:3g.40gb",), True),
        (("bf16", "mig-instance", "mig:3g.40gb"), ("bf16", "mig:3g.40gb"), True),
        (("bf16", "mig-instance", "mig:3g.40gb"), ("mig:2g.20gb",), False),
        (("bf16", "mig-instance", "mig:3g.40gb"), (), False),  # no profile asked: never a MIG instance
        (("bf16", "mig-instance", "mig:3g.40gb"), ("bf16",), False),
        (("bf16", "mig"), ("bf16",), True),  # a MIG-capable whole GPU is an ordinary GPU
        (("bf16", "mig"), ("mig:3g.40gb",), False),
    ],
)
def test_features_match(offered: tuple[str, ...], wanted: tuple[str, ...], ok: bool) -> None:
    assert features_match(offered, wanted) is ok


def test_a_job_asking_a_profile_gets_an_instance_of_it() -> None:
    g = gpus(POOL)
    decisions = run(snap(g, [job("small", memory="8GiB", mig_profile="2g.20gb", qos="exclusive")]))
    grant = only(decisions, "small")
    assert isinstance(grant, Grant)
    (s,) = grant.slices
    assert g[s.gpu_uuid].mig_profile == "2g.20gb" and s.gpu_uuid.startswith("MIG-")
    assert s.memory_bytes == 20 * GiB  # exclusive: the whole instance


def test_a_job_without_a_profile_never_lands_on_mig() -> None:
    g = gpus(POOL)
    jobs = [job(f"j{i}", memory="10GiB", compute_share=0.2, order=i) for i in range(8)]
    decisions = run(snap(g, jobs))
    granted = [s.gpu_uuid for d in decisions if isinstance(d, Grant) for s in d.slices]
    assert granted and all(u == "GPU-sim-whole-0" for u in granted)  # 5 x 0.2 compute on the whole GPU, rest wait


def test_shares_of_one_instance_follow_the_qos_rules() -> None:
    g = gpus(POOL)
    jobs = [job(f"s{i}", memory="15GiB", compute_share=0.5, mig_profile="3g.40gb", order=i) for i in range(3)]
    decisions = run(snap(g, jobs))
    on = {s.gpu_uuid for d in decisions if isinstance(d, Grant) for s in d.slices}
    grants = [d for d in decisions if isinstance(d, Grant)]
    assert len(grants) == 2 and on == {"MIG-sim-mig-node-0-0"}  # two halves of the 3g.40gb, the third waits


def test_a_busy_instance_is_not_shared_with_an_exclusive_job() -> None:
    g = gpus(POOL)
    holder = running(job("holder", memory="10GiB", compute_share=0.5, mig_profile="1g.10gb"), [g["MIG-sim-mig-node-0-2"]])
    decisions = by_job(run(snap(g, [holder, job("x", mig_profile="1g.10gb", qos="exclusive")])))
    assert not any(isinstance(d, Grant) for d in decisions.get("x", []))


def test_an_absent_profile_is_rejected_with_the_profiles_there() -> None:
    g = gpus(POOL)
    decisions = run(snap(g, [job("big", memory="8GiB", mig_profile="7g.80gb")]))
    d = only(decisions, "big")
    assert "no MIG instance of profile 7g.80gb" in str(d) and "3g.40gb" in str(d) and "gpupool mig create" in str(d)
