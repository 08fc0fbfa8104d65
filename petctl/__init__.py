"""petctl: elastic, fault-tolerant PyTorch training on EC2 spot capacity.

Kept import-free on purpose: `petctl --help` and the agent must start without pulling boto3 or torch.
"""

__version__ = "0.1.0"
