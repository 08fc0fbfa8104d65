"""A small IAM policy evaluator for the statements petctl renders, conditions included.

Why it exists: moto can enforce IAM (tests/aws/test_isolation.py switches that on), but it evaluates only
Action and Resource, and of conditions only StringEquals with the few keys it fills in itself: the
conditions petctl's isolation rests on (`s3:prefix` StringLike, `autoscaling:MinSize/MaxSize`
NumericEquals, Null, `iam:ResourceTag`, `aws:RequestTag`, `iam:PassedToService`) would all pass there. This
evaluator implements IAM's documented logic for one identity's policies:

- an explicit Deny wins, else an Allow that matches, else the implicit deny;
- Action and Resource (and NotAction/NotResource) with `*`/`?` wildcards, actions case-insensitively;
- in a Condition, every operator block must hold and every key within it; a key holds when any of the
  policy's values matches any of the request's; a key absent from the request makes the condition false,
  except for negated operators (`StringNotEquals`, ...: true), `...IfExists` (true) and `Null`;
- operators: String(Not)Equals, String(Not)Like, Numeric(Not)Equals/LessThan/GreaterThan(Equals),
  Arn(Not)Equals/Like, Bool, Null, with IfExists. Any other operator raises: a condition this evaluator
  does not understand must never pass silently;
- a role with a permissions boundary (`evaluate_bounded`): allowed only when both its identity policies
  and the boundary allow the request; an explicit Deny in either wins.

Keys are whatever the request context holds: `iam:PermissionsBoundary` (the boundary a CreateRole or
PutRolePermissionsBoundary asks for, or the one the target role has for PutRolePolicy, AttachRolePolicy,
DeleteRolePolicy, DetachRolePolicy, DeleteRolePermissionsBoundary), `aws:RequestTag/...`,
`iam:ResourceTag/...` (the role's tags: absent while a role has none) and so on.

`resolve` turns the rendered templates' `!Sub`/`!Ref`/`!GetAtt` into strings with known names, so the
statements can be evaluated without AWS.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

ALLOW, DENY, IMPLICIT = "allow", "explicit deny", "implicit deny"
PSEUDO = {"AWS::Partition": "aws", "AWS::Region": "us-east-1", "AWS::AccountId": "123456789012",
          "AWS::URLSuffix": "amazonaws.com"}


@dataclass(frozen=True)
class Request:
    """One API call as IAM sees it: the action, the resource's ARN and the request context's keys."""

    action: str
    resource: str
    context: dict[str, Any] = field(default_factory=dict)


def resolve(value: Any, names: dict[str, str]) -> Any:
    """`value` with CloudFormation's intrinsics replaced: `Fn::Sub` (${X}, ${X.Attr}), `Ref`, `Fn::GetAtt`
    and `Fn::Join`, from `names` and the pseudo parameters. Raises KeyError for an unknown name."""
    known = {**PSEUDO, **names}
    if isinstance(value, list):
        return [resolve(v, names) for v in value]
    if not isinstance(value, dict):
        return value
    if set(value) == {"Fn::Sub"}:
        text = value["Fn::Sub"]
        if isinstance(text, list):
            text, extra = text
            known = {**known, **{k: resolve(v, names) for k, v in extra.items()}}
        return re.sub(r"\$\{([^}!]+)\}", lambda m: known[m.group(1)], text)
    if set(value) == {"Ref"}:
        return known[value["Ref"]]
    if set(value) == {"Fn::GetAtt"}:
        return known[".".join(value["Fn::GetAtt"])]
    if set(value) == {"Fn::Join"}:
        sep, parts = value["Fn::Join"]
        return sep.join(resolve(parts, names))
    return {k: resolve(v, names) for k, v in value.items()}


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _glob(pattern: str, text: str, case: bool = True) -> bool:
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, text, 0 if case else re.IGNORECASE) is not None


def _number(value: Any) -> float:
    return float(value)


def _arn_like(pattern: str, arn: str) -> bool:
    """ArnLike: each of the six colon-separated parts matched on its own (wildcards within a part)."""
    want, got = pattern.split(":", 5), arn.split(":", 5)
    return len(want) == len(got) == 6 and all(_glob(w, g) for w, g in zip(want, got, strict=True))


OPERATORS = {  # name -> (match(policy value, request value), negated)
    "StringEquals": (lambda p, r: str(p) == str(r), False),
    "StringNotEquals": (lambda p, r: str(p) == str(r), True),
    "StringLike": (lambda p, r: _glob(str(p), str(r)), False),
    "StringNotLike": (lambda p, r: _glob(str(p), str(r)), True),
    "NumericEquals": (lambda p, r: _number(p) == _number(r), False),
    "NumericNotEquals": (lambda p, r: _number(p) == _number(r), True),
    "NumericLessThan": (lambda p, r: _number(r) < _number(p), False),
    "NumericLessThanEquals": (lambda p, r: _number(r) <= _number(p), False),
    "NumericGreaterThan": (lambda p, r: _number(r) > _number(p), False),
    "NumericGreaterThanEquals": (lambda p, r: _number(r) >= _number(p), False),
    "ArnEquals": (lambda p, r: str(p) == str(r), False),
    "ArnNotEquals": (lambda p, r: str(p) == str(r), True),
    "ArnLike": (lambda p, r: _arn_like(str(p), str(r)), False),
    "ArnNotLike": (lambda p, r: _arn_like(str(p), str(r)), True),
    "Bool": (lambda p, r: str(p).lower() == str(r).lower(), False),
}


def _condition_holds(operator: str, block: dict[str, Any], context: dict[str, Any]) -> bool:
    lowered = {k.lower(): v for k, v in context.items()}
    if operator == "Null":
        return all((key.lower() not in lowered) == (str(want).lower() == "true")
                   for key, want in block.items())
    if_exists = operator.endswith("IfExists")
    name = operator[:-len("IfExists")] if if_exists else operator
    if name not in OPERATORS:
        raise ValueError(f"condition operator {operator} is not implemented by this evaluator")
    match, negated = OPERATORS[name]
    for key, wanted in block.items():
        if key.lower() not in lowered:
            if if_exists or negated:
                continue
            return False
        got = _listed(lowered[key.lower()])
        hit = any(match(p, r) for p in _listed(wanted) for r in got)
        if hit == negated:
            return False
    return True


def _matches(statement: dict[str, Any], request: Request) -> bool:
    if "NotAction" in statement:
        action = not any(_glob(a, request.action, case=False) for a in _listed(statement["NotAction"]))
    else:
        action = any(_glob(a, request.action, case=False) for a in _listed(statement["Action"]))
    if not action:
        return False
    if "NotResource" in statement:
        resource = not any(_glob(r, request.resource) for r in _listed(statement["NotResource"]))
    else:
        resource = any(_glob(r, request.resource) for r in _listed(statement.get("Resource", "*")))
    if not resource:
        return False
    return all(_condition_holds(op, block, request.context)
               for op, block in statement.get("Condition", {}).items())


def evaluate(statements: list[dict[str, Any]], request: Request) -> str:
    """ALLOW, DENY (an explicit Deny matched) or IMPLICIT (nothing allowed it)."""
    for statement in statements:
        if any(isinstance(v, dict) for v in _listed(statement.get("Resource", "*"))):
            raise ValueError(f"unresolved intrinsic in statement {statement.get('Sid')}: resolve() it first")
    if any(s["Effect"] == "Deny" and _matches(s, request) for s in statements):
        return DENY
    if any(s["Effect"] == "Allow" and _matches(s, request) for s in statements):
        return ALLOW
    return IMPLICIT


def allowed(statements: list[dict[str, Any]], action: str, resource: str,
            context: dict[str, Any] | None = None) -> bool:
    return evaluate(statements, Request(action, resource, context or {})) == ALLOW


def evaluate_bounded(identity: list[dict[str, Any]], boundary: list[dict[str, Any]], request: Request) -> str:
    """What a role whose permissions boundary is `boundary` may do: an explicit Deny in either policy set
    wins; otherwise ALLOW only when both allow (a boundary grants nothing by itself)."""
    verdicts = (evaluate(identity, request), evaluate(boundary, request))
    if DENY in verdicts:
        return DENY
    return ALLOW if verdicts == (ALLOW, ALLOW) else IMPLICIT
