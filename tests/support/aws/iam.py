"""A job's worker role as moto's CloudFormation created it, read back for the isolation tests."""

from __future__ import annotations

import ast

from tests.support.aws.account import boto


def role_documents(moto: str, stack: str, job: str) -> tuple[dict, list[dict]]:
    """Job `job`'s worker role as moto's CloudFormation created it, and its policies' statements."""
    iam = boto(moto, "iam")
    (role,) = iam.list_roles(PathPrefix=f"/petctl/{stack}/{job}/")["Roles"]
    statements = []
    for name in iam.list_role_policies(RoleName=role["RoleName"])["PolicyNames"]:
        doc = iam.get_role_policy(RoleName=role["RoleName"], PolicyName=name)["PolicyDocument"]
        if isinstance(doc, str):  # moto's CloudFormation stores the document as Python's repr of a dict
            doc = ast.literal_eval(doc)
        statements += doc["Statement"] if isinstance(doc["Statement"], list) else [doc["Statement"]]
    return role, statements
