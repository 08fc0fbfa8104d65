"""What the AWS tests (tests/aws/) share that is not a fixture: the emulated account, a fake etcd release,
the rendered boot scripts and a directory that runs them (fixtures live in tests/aws/conftest.py)."""
