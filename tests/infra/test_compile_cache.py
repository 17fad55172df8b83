"""The kept compile cache in the synthesized templates: nodes stage and read, only the promoter writes what nodes
later execute (issue 28: "nodes never write what nodes execute"), and the site file names both halves."""

from __future__ import annotations

import fnmatch
import json
from typing import Any

from stacks.compile_cache import COMPILE_CACHE_PREFIX, promoter_name
from tests.support.iam_reference import Grant, expand_action, grants
from tests.support.synthesis import Synthesized

WRITES = {"s3:putobject", "s3:deleteobject", "s3:deleteobjectversion"}
NODE_POLICIES = ("ClusterHeadNodePolicy", "ClusterComputeNodePolicy", "ClusterQueuePolicy")
KEY = "0" * 64


def object_arn(env: Synthesized, key: str) -> str:
    (bucket,) = env.resources_of_type("AWS::S3::Bucket")
    return f"arn:aws:s3:::{bucket.lower()}/{key}"


def allows(grant: Grant, actions: set[str], arn: str) -> bool:
    granted = {name for pattern in grant.actions for name in expand_action(pattern)}
    return bool(granted & actions) and any(fnmatch.fnmatchcase(arn, resource) for resource in grant.resources)


def logical(grant: Grant) -> str:
    return grant.where.split(":", 1)[1].rsplit("[", 1)[0]


def writers_of(env: Synthesized, key: str) -> set[str]:
    arn = object_arn(env, key)
    return {logical(grant) for grant in grants(env.template, env.config.name) if allows(grant, WRITES, arn)}


def test_no_node_role_may_write_a_promoted_cache_and_the_promoter_may(synthesized: dict[str, Synthesized]) -> None:
    for env in synthesized.values():
        promoted = f"{COMPILE_CACHE_PREFIX}/promoted/{KEY}/neuronxcc-2.21/MODULE_1+2/model.neff"
        writers = writers_of(env, promoted)
        assert [w for w in writers if w.startswith(NODE_POLICIES)] == [], env.config.name
        assert any(w.startswith("CompileCachePromoterRoleDefaultPolicy") for w in writers)
        # Staging: the Trainium queue's nodes only (the compile stage), never the head node or the CPU queue.
        staged = writers_of(env, f"{COMPILE_CACHE_PREFIX}/staging/{KEY}/run-a/neuronxcc-2.21/MODULE_1+2/model.neff")
        nodes = sorted(w for w in staged if w.startswith(NODE_POLICIES))
        assert len(nodes) == 1 and nodes[0].startswith(f"ClusterQueuePolicy{env.config.compute.queue_name}")


def test_the_bucket_denies_everyone_but_the_promoter_writing_promoted_caches(
    synthesized: dict[str, Synthesized],
) -> None:
    for env in synthesized.values():
        (policy,) = env.resources_of_type("AWS::S3::BucketPolicy").values()
        (deny,) = [
            s
            for s in policy["Properties"]["PolicyDocument"]["Statement"]
            if s.get("Sid") == "OnlyThePromoterWritesPromotedCompileCaches"
        ]
        assert deny["Effect"] == "Deny" and deny["Principal"] == {"AWS": "*"}
        assert {a.lower() for a in deny["Action"]} == WRITES
        assert deny["Resource"]["Fn::Join"][1][1] == f"/{COMPILE_CACHE_PREFIX}/promoted/*"
        (role,) = [
            name for name in env.resources_of_type("AWS::IAM::Role") if name.startswith("CompileCachePromoterRole")
        ]
        assert deny["Condition"] == {"ArnNotEquals": {"aws:PrincipalArn": {"Fn::GetAtt": [role, "Arn"]}}}


def test_the_trainium_nodes_read_promoted_caches_and_invoke_only_the_promoter(default_env: Synthesized) -> None:
    env = default_env
    queue = f"ClusterQueuePolicy{env.config.compute.queue_name}"
    node_grants = [g for g in grants(env.template, env.config.name) if logical(g).startswith(queue)]
    promoted = object_arn(env, f"{COMPILE_CACHE_PREFIX}/promoted/{KEY}/manifest.json")
    assert any(allows(g, {"s3:getobject"}, promoted) for g in node_grants)
    (function,) = [
        name
        for name, resource in env.resources_of_type("AWS::Lambda::Function").items()
        if resource["Properties"].get("FunctionName") == promoter_name(env.config.stack_name)
    ]
    invokes = [g for g in node_grants if "lambda:InvokeFunction" in g.actions]
    assert [g.resources for g in invokes] == [(f"arn:aws:lambda:us-west-2:123456789012:function:{function.lower()}",)]
    environment = env.template["Resources"][function]["Properties"]["Environment"]["Variables"]
    assert environment["PREFIX"] == COMPILE_CACHE_PREFIX


def test_the_site_file_names_the_store_and_the_promoter(default_env: Synthesized) -> None:
    site = site_settings_of(default_env)
    assert site["compile_cache_promoter"] == promoter_name(default_env.config.stack_name)
    assert site["compile_cache_store"].endswith(f"/{COMPILE_CACHE_PREFIX}")
    assert site["compile_cache_store"].startswith("s3://")


def site_settings_of(env: Synthesized) -> dict[str, Any]:
    """The site settings the pipeline's custom resource hands the head node (tokens left as they are)."""
    for resource in env.template["Resources"].values():
        settings = resource.get("Properties", {}).get("SiteSettings")
        if settings is not None:
            text = (
                settings
                if isinstance(settings, str)
                else "".join(part if isinstance(part, str) else "BUCKET" for part in settings["Fn::Join"][1])
            )
            return dict(json.loads(text))
    raise AssertionError("no SiteSettings in the template")
