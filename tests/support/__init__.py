"""What the tests share that is not a fixture: helpers imported by name (fixtures live in conftest.py)."""
