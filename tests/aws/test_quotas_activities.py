"""The pure decisions behind issue 11, item 7: which vCPU quota an instance type draws on, when a quota
refuses a job (only when known and below one instance), and what a scaling activity's message means."""

from __future__ import annotations

import pytest

from petctl.providers.aws.capacity import Quota, assess, quota_for
from petctl.providers.aws.inventory import Activity, explain, hint

VCPUS = {"g5.xlarge": 4, "g5.12xlarge": 48, "g6.xlarge": 4, "p4d.24xlarge": 96, "p5.48xlarge": 192,
         "c5.xlarge": 4}


@pytest.mark.parametrize("instance_type, market, code", [
    ("g5.xlarge", "spot", "L-3819A6DF"), ("gr6.4xlarge", "spot", "L-3819A6DF"),
    ("g4dn.xlarge", "spot", "L-3819A6DF"), ("p4d.24xlarge", "spot", "L-7212CCBC"),
    ("p3dn.24xlarge", "spot", "L-7212CCBC"), ("p5.48xlarge", "spot", "L-C4BD4855"),
    ("p5en.48xlarge", "spot", "L-C4BD4855"), ("c5.xlarge", "spot", "L-34B43A08"),
    ("m7i.large", "spot", "L-34B43A08"), ("g5.xlarge", "on-demand", "L-DB2E81BA"),
    ("p5.48xlarge", "on-demand", "L-417A185B"), ("c5.xlarge", "on-demand", "L-1216C47A"),
])
def test_each_type_draws_on_its_documented_quota(instance_type, market, code):
    assert quota_for(instance_type, market)[0] == code


def q(code: str, value: float | None) -> Quota:
    return Quota(code, code, value, "" if value is not None else "API unavailable")


def test_a_known_quota_below_one_instance_refuses_the_job():
    verdict = assess(["g5.xlarge"], VCPUS, {"L-3819A6DF": q("L-3819A6DF", 0)}, "spot", 2)
    assert verdict.error.startswith("no instance of this job can launch: the spot vCPU quota L-3819A6DF")
    assert "0 vCPUs, below the 4 of one g5.xlarge" in verdict.error and "\n" not in verdict.error


def test_an_unknown_quota_only_warns():
    verdict = assess(["g5.xlarge"], VCPUS, {"L-3819A6DF": q("L-3819A6DF", None)}, "spot", 2)
    assert verdict.error == "" and "not checked: API unavailable" in verdict.warnings[0]


def test_a_quota_short_of_size_warns_with_how_many_fit():
    verdict = assess(["g5.xlarge"], VCPUS, {"L-3819A6DF": q("L-3819A6DF", 8)}, "spot", 4)
    assert verdict.error == "" and "room for 2 of the 4 g5.xlarge" in verdict.warnings[0]


def test_mixed_families_refuse_only_when_no_family_can_launch():
    types = ["g5.xlarge", "p4d.24xlarge"]
    some = assess(types, VCPUS, {"L-3819A6DF": q("L-3819A6DF", 0), "L-7212CCBC": q("L-7212CCBC", 96)},
                  "spot", 1)
    assert some.error == ""
    none = assess(types, VCPUS, {"L-3819A6DF": q("L-3819A6DF", 0), "L-7212CCBC": q("L-7212CCBC", 64)},
                  "spot", 1)
    assert "L-3819A6DF" in none.error and "L-7212CCBC" in none.error


def test_the_smallest_type_of_a_family_decides():
    verdict = assess(["g5.12xlarge", "g5.xlarge"], VCPUS, {"L-3819A6DF": q("L-3819A6DF", 4)}, "spot", 1)
    assert verdict.error == ""


@pytest.mark.parametrize("message, meaning", [
    ("We currently do not have sufficient g5.xlarge capacity in the Availability Zone you requested "
     "(us-east-1a). (InsufficientInstanceCapacity)", "no capacity"),
    ("Max spot instance count exceeded. (MaxSpotInstanceCountExceeded)", "spot vCPU quota"),
    ("You have requested more vCPU capacity than your current vCPU limit of 0 allows (VcpuLimitExceeded)",
     "vCPU quota"),
    ("Invalid IAM Instance Profile name. Launching EC2 instance failed.", "propagating"),
    ("Value (p-job-a-WorkerInstanceProfile) for parameter iamInstanceProfile.name is invalid.",
     "propagating"),
])
def test_activity_messages_are_explained(message, meaning):
    assert meaning in hint(message)


def test_explain_is_one_line_with_status_description_reason_and_hint():
    line = explain(Activity("a", "Failed", "Launching a new EC2 instance.",
                            "Max spot instance count exceeded"))
    assert line.startswith("Failed: Launching a new EC2 instance. - Max spot instance count exceeded (")
    assert explain(Activity("b", "Successful", "Launching a new EC2 instance: i-1")) == (
        "Successful: Launching a new EC2 instance: i-1")
