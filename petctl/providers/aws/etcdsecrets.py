"""The etcd credentials of an AWS installation, kept in AWS Secrets Manager.

etcd requires a client certificate from every client and confines each job run's user to the job's
prefix (petctl/io/etcdauth.py, etcdpki.py). On AWS the CLI cannot reach etcd (nothing outside the VPC
can), so the etcd host creates the users itself from these secrets (worker_image/etcd_boot.sh.j2):

    <stack>/etcd/operator        both CAs with their keys and root's certificate (EtcdPki JSON). Read by
                                 the CLI only (run_job signs each job's certificate with it); no role of
                                 the stacks may read it.
    <stack>/etcd/host            what the etcd hosts need: both CA certificates, etcd's server certificate
                                 and key (the members' fixed addresses), root's certificate and key; a
                                 PEM bundle with `# petctl-etcd <name>` headers (split by the boot script).
                                 Readable by the etcd hosts' roles only.
    <stack>/etcd/jobs/<job>/<run> one job run's client certificate, key and the CA that verifies etcd
                                 (JSON: ca, cert, key), tagged `petctl:etcd-user` = its etcd user. Readable
                                 by that job's instance role only (the job stack grants exactly its ARN).

Which users etcd must have is not learnt from Secrets Manager: listing secrets (ListSecrets) has no
resource scope, so the etcd hosts would see the name of every secret in the account. Each run's user is
instead indexed in the stack's bucket, as an empty object `etcd-users/<job>/<user>` (USERS_INDEX), which
the etcd hosts list with `s3:ListBucket` on that prefix only, and keep etcd's job users equal to: a new
object is a new user, a deleted one a deleted user. Only the CLI writes there (a job's role writes only
its own state under jobs/<job>/); an entry alone grants nothing (a user authenticates with a certificate
signed by the operator's CA, which only run_job makes), and kill_job deletes a job's entries before its
secrets, so its users go first.

`setup` creates the first two (once: the CA outlives updates of the stack), `run_job` one per run,
`kill_job` (and the CLI's clean-up of an ended job) deletes a job's, `teardown` all of them. Deletion is
immediate (no recovery window): a deleted credential must not linger, and a name must be reusable.
"""

from __future__ import annotations

import json
from typing import Any

from petctl.core.errors import PetctlError
from petctl.io.aws import aws_errors, error_code

USER_TAG = "petctl:etcd-user"
USERS_INDEX = "etcd-users/"  # in the stack's bucket: `<job>/<user>`, one empty object per run's etcd user
HOST_PARTS = ("admin-ca", "jobs-ca", "server", "server-key", "root", "root-key")


def prefix(stack: str) -> str:
    return f"{stack}/etcd"


def operator_name(stack: str) -> str:
    return f"{prefix(stack)}/operator"


def host_name(stack: str) -> str:
    return f"{prefix(stack)}/host"


def jobs_prefix(stack: str, job: str = "") -> str:
    """Where job credentials are (one job's, with `job`): the trailing slash keeps job `a` from matching
    job `a-b` in a prefix match."""
    return f"{prefix(stack)}/jobs/" + (f"{job}/" if job else "")


def host_bundle(pki, member_ips: tuple[str, ...]) -> str:
    """The etcd hosts' secret: PEMs under `# petctl-etcd <name>` lines (HOST_PARTS, in that order)."""
    server = pki.server(member_ips)
    pems = dict(zip(HOST_PARTS, (pki.admin_ca.cert, pki.jobs_ca.cert, server.cert, server.key, pki.root.cert,
                                 pki.root.key), strict=True))
    return "".join(f"# petctl-etcd {name}\n{pem.strip()}\n" for name, pem in pems.items())


def _tags(stack: str, **extra: str) -> list[dict[str, str]]:
    return [{"Key": "petctl:stack", "Value": stack}, *({"Key": k, "Value": v} for k, v in extra.items())]


def _get(secrets: Any, name: str) -> str | None:
    """A secret's value, None when there is none. Raises PetctlError for any other failure."""
    from petctl.io.aws import ClientError

    with aws_errors(f"read secret {name}"):
        try:
            return secrets.get_secret_value(SecretId=name)["SecretString"]
        except ClientError as exc:
            if error_code(exc) == "ResourceNotFoundException":
                return None
            raise


def ensure_installation(secrets: Any, stack: str, member_ips: tuple[str, ...]) -> bool:
    """The operator's and the etcd hosts' secrets, created when missing (the PKI is made once and kept:
    the running etcd and every job's certificate depend on it). True when anything was created. Raises
    PetctlError (AWS's reason)."""
    from petctl.io.etcdpki import EtcdPki

    created = False
    text = _get(secrets, operator_name(stack))
    if text is None:
        pki = EtcdPki.new(stack)
        with aws_errors(f"create secret {operator_name(stack)}"):
            secrets.create_secret(Name=operator_name(stack), SecretString=pki.to_json(),
                                  Description=f"petctl {stack}: etcd CAs and root (the operator's only)",
                                  Tags=_tags(stack, **{"petctl:kind": "etcd-operator"}))
        created = True
    else:
        pki = EtcdPki.from_json(text)
    if _get(secrets, host_name(stack)) is None:
        with aws_errors(f"create secret {host_name(stack)}"):
            secrets.create_secret(Name=host_name(stack), SecretString=host_bundle(pki, member_ips),
                                  Description=f"petctl {stack}: the etcd hosts' certificates",
                                  Tags=_tags(stack, **{"petctl:kind": "etcd-host"}))
        created = True
    return created


def operator_pki(secrets: Any, stack: str):
    """The installation's EtcdPki. Raises NotSetUp when setup has not made it."""
    from petctl.core.errors import NotSetUp
    from petctl.io.etcdpki import EtcdPki

    text = _get(secrets, operator_name(stack))
    if text is None:
        raise NotSetUp(f"no etcd credentials for stack {stack} (secret {operator_name(stack)}): run "
                       "`petctl setup --provider aws` again")
    return EtcdPki.from_json(text)


def index_key(job: str, user: str = "") -> str:
    """Where a run's user is indexed in the bucket (the job's entries, without `user`): the slash keeps
    job `a` from matching job `a-b`."""
    return f"{USERS_INDEX}{job}/{user}"


def create_job_credentials(secrets: Any, s3: Any, bucket: str, stack: str, job: str) -> tuple[str, str]:
    """A new etcd user for one run of `job`, its certificate in a secret of its own, and the user indexed
    in the bucket for the etcd hosts; (the secret's ARN, the user). Raises PetctlError or NotSetUp (the
    secret is deleted again when the index cannot be written)."""
    from petctl.io.etcdauth import job_user, new_run_id

    pki = operator_pki(secrets, stack)
    run_id = new_run_id()
    user = job_user(job, run_id)
    pem = pki.job_client(user)
    name = f"{jobs_prefix(stack, job)}{run_id}"
    with aws_errors(f"create secret {name}"):
        reply = secrets.create_secret(
            Name=name, SecretString=json.dumps({"ca": pki.admin_ca.cert, "cert": pem.cert, "key": pem.key}),
            Description=f"petctl {stack}: etcd client certificate of job {job} (its instances only)",
            Tags=_tags(stack, **{"petctl:job": job, USER_TAG: user}))
    try:
        with aws_errors(f"index etcd user {user} in s3://{bucket}/{index_key(job)}"):
            s3.put_object(Bucket=bucket, Key=index_key(job, user), Body=b"")
    except PetctlError:
        delete(secrets, name)
        raise
    return reply["ARN"], user


def unindex(s3: Any, bucket: str, key_prefix: str) -> list[str]:
    """Delete the index entries under `key_prefix` (the etcd hosts then delete those users); the keys
    deleted. Raises PetctlError."""
    keys: list[str] = []
    with aws_errors(f"delete etcd users s3://{bucket}/{key_prefix}*"):
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key_prefix):
            keys += [o["Key"] for o in page.get("Contents", [])]
        for key in keys:
            s3.delete_object(Bucket=bucket, Key=key)
    return keys


def list_names(secrets: Any, name_prefix: str) -> list[str]:
    """Names of the secrets under `name_prefix` (Secrets Manager matches names by prefix). Raises
    PetctlError."""
    names: list[str] = []
    with aws_errors(f"list secrets {name_prefix}*"):
        for page in secrets.get_paginator("list_secrets").paginate(
                Filters=[{"Key": "name", "Values": [name_prefix]}]):
            names += [s["Name"] for s in page["SecretList"] if s["Name"].startswith(name_prefix)]
    return sorted(names)


def delete(secrets: Any, name_prefix: str) -> list[str]:
    """Delete every secret under `name_prefix` at once (no recovery window); the names deleted. Raises
    PetctlError."""
    from petctl.io.aws import ClientError

    names = list_names(secrets, name_prefix)
    for name in names:
        with aws_errors(f"delete secret {name}"):
            try:
                secrets.delete_secret(SecretId=name, ForceDeleteWithoutRecovery=True)
            except ClientError as exc:
                if error_code(exc) != "ResourceNotFoundException":
                    raise
    return names


def delete_job_credentials(secrets: Any, s3: Any, bucket: str, stack: str, job: str) -> list[str]:
    """Every run of `job`'s credentials: its users' index entries first (the etcd hosts then delete the
    users within their sync interval, so a certificate the job's code kept authenticates as nobody), then
    its secrets (their names are returned)."""
    unindex(s3, bucket, index_key(job))
    return delete(secrets, jobs_prefix(stack, job))
