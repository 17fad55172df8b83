"""IAM statements checked against AWS's Service Authorization Reference, as cfn-lint ships it.

The reference (`cfnlint/data/AdditionalSpecs/Policies.json`) lists, per service and action, the resource types
the action authorizes, and per resource type its ARN formats. Two mistakes it exposes that no other check here
does: an action without resource types granted on a specific ARN (IAM then never allows it), and an action whose
grant names no resource of any type the action authorizes (also never allowed). Template values are resolved to
representative ARNs (a fixed partition, region and account; a resource's own name for its logical id).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

import cfnlint.data.AdditionalSpecs
from cfnlint.helpers import load_resource

PSEUDO = {
    "AWS::Partition": "aws",
    "AWS::Region": "us-west-2",
    "AWS::AccountId": "123456789012",
    "AWS::URLSuffix": "amazonaws.com",
}
# The ARN each resource type's `Arn` attribute (or, where it is one, its Ref) stands for; `{name}` is the logical id.
ARN_OF_TYPE = {
    "AWS::S3::Bucket": "arn:aws:s3:::{name}",
    "AWS::Lambda::Function": "arn:aws:lambda:us-west-2:123456789012:function:{name}",
    "AWS::IAM::Role": "arn:aws:iam::123456789012:role/{name}",
    "AWS::IAM::ManagedPolicy": "arn:aws:iam::123456789012:policy/{name}",
    "AWS::KMS::Key": "arn:aws:kms:us-west-2:123456789012:key/{name}",
    "AWS::Logs::LogGroup": "arn:aws:logs:us-west-2:123456789012:log-group:{name}:*",
    "AWS::SNS::Topic": "arn:aws:sns:us-west-2:123456789012:{name}",
    "AWS::StepFunctions::StateMachine": "arn:aws:states:us-west-2:123456789012:stateMachine:{name}",
    "AWS::DynamoDB::Table": "arn:aws:dynamodb:us-west-2:123456789012:table/{name}",
}
# Types whose Ref is their ARN (the others' Ref is a name or id).
REF_IS_ARN = {"AWS::SNS::Topic", "AWS::StepFunctions::StateMachine", "AWS::IAM::ManagedPolicy"}
POLICY_TYPES = {
    "AWS::IAM::Policy",
    "AWS::IAM::ManagedPolicy",
    "AWS::IAM::Role",
    "AWS::S3::BucketPolicy",
    "AWS::SNS::TopicPolicy",
    "AWS::KMS::Key",
}


@cache
def reference() -> Mapping[str, Any]:
    return load_resource(cfnlint.data.AdditionalSpecs, "Policies.json")


@dataclass(frozen=True)
class Grant:
    """One Allow statement: where it is, its actions and its resources as representative strings."""

    where: str
    actions: tuple[str, ...]
    resources: tuple[str, ...]


def expand_action(pattern: str) -> list[str]:
    """`service:Action` names of the reference matching `pattern` (IAM's wildcards, case-insensitive)."""
    service, _, action = pattern.lower().partition(":")
    actions = reference().get(service, {}).get("Actions", {})
    return [f"{service}:{name}" for name in actions if fnmatch.fnmatchcase(name, action)]


def resource_types(action: str) -> list[str]:
    service, _, name = action.partition(":")
    return list(reference()[service]["Actions"][name].get("Resources", []))


def resource_entry(service: str, resource_type: str) -> Mapping[str, Any] | None:
    """A resource type of the reference by name, case-insensitively: actions may spell a type otherwise than the
    service's list of types does (Secrets Manager's actions say "Secret", its types "secret")."""
    resources = reference()[service]["Resources"]
    if resource_type in resources:
        return dict(resources[resource_type])
    same = [entry for name, entry in resources.items() if name.lower() == resource_type.lower()]
    return dict(same[0]) if same else None


def arn_pattern(service: str, resource_type: str) -> list[re.Pattern[str]]:
    entry = resource_entry(service, resource_type)
    formats = entry["ARNFormats"] if entry else []
    return [re.compile(re.sub(r"\$\{[^}]+\}", "[^:]*", text)) for text in formats]


def matching_types(action: str, arn: str) -> set[str]:
    """The action's resource types that `arn` is one of ("*" is all of them)."""
    service = action.partition(":")[0]
    types = resource_types(action)
    if arn == "*":
        return set(types)
    found = set()
    for resource_type in types:
        target_service = service
        if resource_entry(service, resource_type) is None:
            continue
        if any(pattern.fullmatch(arn) for pattern in arn_pattern(target_service, resource_type)):
            found.add(resource_type)
    return found


def resolve(value: Any, resources: Mapping[str, Any]) -> str:
    """A template value as a representative string; an intrinsic it cannot follow becomes `<?>`."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and len(value) == 1:
        ((function, argument),) = value.items()
        if function == "Ref":
            if argument in PSEUDO:
                return PSEUDO[argument]
            kind = resources.get(argument, {}).get("Type", "")
            if kind in REF_IS_ARN:
                return ARN_OF_TYPE[kind].format(name=argument.lower())
            return argument.lower()
        if function == "Fn::GetAtt":
            logical, attribute = argument if isinstance(argument, list) else argument.split(".", 1)
            kind = resources.get(logical, {}).get("Type", "")
            if attribute == "Arn" and kind in ARN_OF_TYPE:
                return ARN_OF_TYPE[kind].format(name=logical.lower())
            return f"{logical.lower()}-{attribute.lower()}"
        if function == "Fn::Join":
            separator, parts = argument
            return separator.join(resolve(part, resources) for part in parts)
        if function == "Fn::Sub":
            text, variables = (argument, {}) if isinstance(argument, str) else argument

            def substitute(match: re.Match[str]) -> str:
                name = match.group(1)
                if name in variables:
                    return resolve(variables[name], resources)
                if name in PSEUDO:
                    return PSEUDO[name]
                logical, _, attribute = name.partition(".")
                return resolve({"Fn::GetAtt": [logical, attribute]} if attribute else {"Ref": logical}, resources)

            return re.sub(r"\$\{([^}!]+)\}", substitute, text)
        if function == "Fn::ImportValue":
            return "<?>"
    return "<?>"


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def documents(resource: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    properties = resource.get("Properties", {})
    if resource["Type"] == "AWS::IAM::Role":
        for policy in properties.get("Policies", []):
            yield policy["PolicyDocument"]
    elif resource["Type"] == "AWS::KMS::Key":
        yield properties["KeyPolicy"]
    else:
        yield properties["PolicyDocument"]


def grants(template: Mapping[str, Any], label: str) -> list[Grant]:
    """Every Allow statement of every policy, key policy and resource policy in `template`."""
    resources = template.get("Resources", {})
    found = []
    for logical, resource in resources.items():
        if resource["Type"] not in POLICY_TYPES:
            continue
        for document in documents(resource):
            for index, statement in enumerate(as_list(document.get("Statement", []))):
                if statement.get("Effect") != "Allow" or "NotAction" in statement or "NotResource" in statement:
                    continue
                found.append(
                    Grant(
                        where=f"{label}:{logical}[{index}]",
                        actions=tuple(as_list(statement["Action"])),
                        resources=tuple(resolve(r, resources) for r in as_list(statement.get("Resource", "*"))),
                    )
                )
    return found


def works(action: str, grant: Grant) -> bool:
    """Whether IAM can ever allow `action` through this grant's resources."""
    types = resource_types(action)
    if not types:
        return "*" in grant.resources
    return any(matching_types(action, arn) for arn in grant.resources)


def findings(grant: Grant) -> list[str]:
    """What the reference says is wrong with one grant, one line each.

    A named action must work on the grant's resources; a wildcard (`s3:List*`) grants whichever of its actions
    apply, so only one of them has to."""
    problems = []
    known = []
    for pattern in grant.actions:
        expanded = expand_action(pattern)
        if not expanded:
            problems.append(f"{grant.where}: {pattern} is no action of the Service Authorization Reference")
        known += expanded
        if "*" in pattern:
            if expanded and not any(works(action, grant) for action in expanded):
                problems.append(f"{grant.where}: no action of {pattern} applies to {list(grant.resources)}")
            continue
        for action in expanded:
            types = resource_types(action)
            if works(action, grant):
                continue
            if not types:
                problems.append(
                    f"{grant.where}: {action} has no resource-level permissions and must be granted on '*', "
                    f"not {list(grant.resources)}"
                )
            else:
                problems.append(
                    f"{grant.where}: {action} authorizes {types}; none of {list(grant.resources)} is one of them"
                )
    for arn in grant.resources:
        if arn != "*" and "<?>" not in arn and not any(matching_types(action, arn) for action in known):
            problems.append(f"{grant.where}: {arn} is a resource of none of the statement's actions")
    return problems


def covered_types(grants_of_principal: list[Grant], action: str) -> set[str]:
    """The resource types of `action` that a principal's grants cover together."""
    covered: set[str] = set()
    for grant in grants_of_principal:
        if any(action in expand_action(pattern) for pattern in grant.actions):
            for arn in grant.resources:
                covered |= matching_types(action, arn)
    return covered
