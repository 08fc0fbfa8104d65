"""Framework callbacks that speak petctl's protocol: one line in a Trainer's `callbacks=[...]`.

- `petctl.elastic.integrations.transformers.PetctlCallback`: the Hugging Face `Trainer`;
- `petctl.elastic.integrations.lightning.PetctlCallback`: PyTorch Lightning (`lightning.pytorch` or
  `pytorch_lightning`), with `num_nodes()` / `devices_per_node()` for a world that changes size.

Each reports the steps and checkpoints to the agent (true status, goodput and lost steps) and, at
petctl's save-now flag, has the framework save its own checkpoint at the next step boundary on every rank
and leave its loop: 0 steps redone at a spot notice or a planned scale change. Each module imports its
framework; this package imports neither (install `petctl[transformers]` or `petctl[lightning]`).
`protocol.py` is the framework-neutral half; docs/elastic.md says what each callback does and costs.
"""
