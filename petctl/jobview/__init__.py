"""The read side: what a job is doing and did, for both providers and the CLI.

Status, events, logs, result, goodput and cost are read here, once, from the two places a job keeps its
records: etcd (live, while it answers) and the job's prefix (`s3://` or `file://`, where the agents
mirror their status, events and logs, and which outlives etcd, the instances and the stack). A provider
says where those are (`JobSources`); everything else is the same code for every provider.

Every stored record is parsed with `petctl.core.records`; a record that does not parse is skipped and
counted (`Corrupt`), never fatal, and the count is shown to the user.

Importing this package is cheap: etcd, boto3 and matplotlib are imported inside the functions that need
them.
"""
