"""The local provider: the same job on one machine, every "instance" an agent process group (provider.py)."""
