"""Every Allow statement of every synthesized template, read against AWS's Service Authorization Reference.

cfn-lint ships the reference but its rule for resource types is off; cdk-nag checks wildcards, not whether a
grant can work. Here an action without resource-level permissions must be granted on "*", every action must name
a resource of a type it authorizes, and the requests our code makes that involve extra resource types (an SSM
command whose output goes to S3) are covered for each of them.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from tests.support.iam_reference import Grant, covered_types, findings, grants
from tests.support.synthesis import Synthesized

# Requests of our code whose authorization involves more resource types than the obvious one, as the reference
# lists them for the action: (action, the types every principal granting it needs, who makes the request).
REQUESTS = (
    (
        "ssm:sendcommand",
        {"instance", "document", "bucket"},
        "assets/lambda/pipeline_trigger/trigger_aws.py: SendCommand with OutputS3BucketName",
    ),
)


def all_grants(env: Synthesized) -> list[Grant]:
    """The stack's grants (ParallelCluster's provider is a nested stack of its own, published by AWS)."""
    return grants(env.template, env.config.name)


def test_every_grant_of_every_environment_follows_the_reference(synthesized: dict[str, Synthesized]) -> None:
    checked = [grant for env in synthesized.values() for grant in all_grants(env)]
    assert len(checked) > 40  # every role, managed policy, bucket, topic and key policy of both environments
    assert [line for grant in checked for line in findings(grant)] == []
    # Every resource resolved to an ARN the reference can match: nothing was skipped as unknown.
    assert [grant.where for grant in checked if any("<?>" in arn for arn in grant.resources)] == []


@pytest.mark.parametrize(("action", "needed", "caller"), REQUESTS)
def test_each_request_is_covered_for_every_resource_type_it_involves(
    synthesized: dict[str, Synthesized], action: str, needed: set[str], caller: str
) -> None:
    for env in synthesized.values():
        by_policy: dict[str, list[Grant]] = defaultdict(list)
        for grant in all_grants(env):
            by_policy[grant.where.rsplit("[", 1)[0]].append(grant)
        granting = {policy: found for policy, found in by_policy.items() if covered_types(found, action)}
        assert granting, f"{env.config.name}: nothing grants {action} ({caller})"
        for policy, found in granting.items():
            assert covered_types(found, action) >= needed, f"{policy}: {action} for {caller}"


def test_the_checks_find_what_a_reviewer_found() -> None:
    """The two findings of the review, as hand-made grants: both are reported."""
    task_only = Grant(
        "bad:export[0]", ("fsx:DescribeDataRepositoryTasks",), ("arn:aws:fsx:us-west-2:123456789012:task/*",)
    )
    assert findings(task_only) == [
        "bad:export[0]: fsx:describedatarepositorytasks has no resource-level permissions and must be granted on "
        "'*', not ['arn:aws:fsx:us-west-2:123456789012:task/*']",
        "bad:export[0]: arn:aws:fsx:us-west-2:123456789012:task/* is a resource of none of the statement's actions",
    ]
    send = [
        Grant("bad:trigger[0]", ("ssm:SendCommand",), ("arn:aws:ec2:us-west-2:123456789012:instance/*",)),
        Grant("bad:trigger[1]", ("ssm:SendCommand",), ("arn:aws:ssm:us-west-2::document/AWS-RunShellScript",)),
    ]
    assert [line for grant in send for line in findings(grant)] == []  # each statement alone is fine
    assert covered_types(send, "ssm:sendcommand") == {"instance", "document"}  # but the bucket is missing
    topic = "arn:aws:sns:us-west-2:123456789012:alarms"
    wrong_type = Grant("bad:read[0]", ("dynamodb:GetItem",), (topic,))
    assert findings(wrong_type) == [
        f"bad:read[0]: dynamodb:getitem authorizes ['table']; none of ['{topic}'] is one of them",
        f"bad:read[0]: {topic} is a resource of none of the statement's actions",
    ]
    assert findings(Grant("bad:typo[0]", ("s3:GetObjekt",), ("*",))) == [
        "bad:typo[0]: s3:GetObjekt is no action of the Service Authorization Reference"
    ]
