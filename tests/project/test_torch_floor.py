"""The oldest torch petctl.elastic supports (setup.py: torch>=2.5,<3) is the newest first release among the
torch APIs it calls. CI installs one torch (constraints.txt, the one the unit tier runs with); no second,
older torch can be installed there (a CPU torch wheel is hundreds of MB and CI has 2 cores for 90 min),
so the floor is not run. What is run instead: every torch name petctl.elastic imports or calls (aliases
followed, e.g. `dcp.save`) must be in TORCH_API_SINCE with the release that added it, so a new API use
fails here until someone states its version, and the floor is the table's maximum.

The versions are from PyTorch's release notes and pull requests (e.g. get/add/clear_safe_globals "are
all available in 2.4", pytorch/accelerate#3036; DTensor moved to the public torch.distributed.tensor in
2.5; torch.distributed.checkpoint's save/load and state_dict APIs in 2.2)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BASICS = (1, 10)  # tensors, dtypes, save/load(weights_only), frombuffer, DDP, process groups, isend/irecv
TORCH_API_SINCE = {
    **dict.fromkeys(["torch." + name for name in (
        "Size", "Tensor", "__version__", "device", "dtype", "empty", "frombuffer", "int32", "int64", "load",
        "no_grad", "save", "strided", "tensor", "uint8", "zeros", "nn.DataParallel",
        "nn.parallel.DistributedDataParallel", "optim.Optimizer")], BASICS),
    # CUDA streams, events and the runtime handle (snapdevice.py), and the CPU RNG state (hfmemory.py):
    # all in torch 1.x's public API, long before the floor
    **dict.fromkeys(["torch.cuda." + name for name in (
        "Event", "Stream", "cudart", "current_stream", "is_available", "stream")], BASICS),
    "torch.random.get_rng_state": BASICS,
    # the data cursor (elastic/sampler.py, integrations/data.py): samplers, loaders and the permutation,
    # all in torch 1.x
    **dict.fromkeys(["torch." + name for name in (
        "Generator", "arange", "empty_like", "randperm", "unique")], BASICS),
    **dict.fromkeys(["torch.utils.data." + name for name in (
        "BatchSampler", "DataLoader", "IterableDataset", "RandomSampler", "Sampler", "SequentialSampler")],
        BASICS),
    **dict.fromkeys(["torch.distributed." + name for name in (
        "ReduceOp.MAX", "all_gather", "all_reduce", "barrier", "broadcast", "destroy_process_group",
        "get_backend", "get_rank", "get_world_size", "irecv", "isend", "is_available", "is_initialized",
        "new_group")], BASICS),
    "torch.distributed.checkpoint.save": (2, 2),
    "torch.distributed.checkpoint.load": (2, 2),
    "torch.distributed.checkpoint.state_dict.get_state_dict": (2, 2),
    "torch.distributed.checkpoint.state_dict.set_state_dict": (2, 2),
    "torch.distributed.checkpoint.stateful.Stateful": (2, 2),
    "torch.serialization.get_safe_globals": (2, 4),
    "torch.distributed.tensor.DTensor": (2, 5),
    "torch.distributed.tensor._utils.compute_local_shape_and_global_offset": (2, 5),
}


def torch_names(root: Path) -> dict[str, str]:
    """Every torch name the modules under `root` use (longest dotted chains, aliases followed) -> a file."""
    found: dict[str, str] = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        alias = {"torch": "torch"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for name in node.names:
                    if name.name.split(".")[0] == "torch":
                        found.setdefault(name.name, path.name)
                        alias[name.asname or "torch"] = name.name if name.asname else "torch"
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
                for name in node.names:
                    found.setdefault(f"{node.module}.{name.name}", path.name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                parts, value = [], node
                while isinstance(value, ast.Attribute):
                    parts.append(value.attr)
                    value = value.value
                if isinstance(value, ast.Name) and value.id in alias:
                    found.setdefault(".".join([alias[value.id], *reversed(parts)]), path.name)
    return {k: v for k, v in found.items() if not any(o.startswith(k + ".") for o in found)}


def test_every_torch_api_petctl_elastic_uses_has_a_first_release_and_the_floor_is_the_newest():
    used = torch_names(REPO / "petctl" / "elastic")
    unknown = {name: where for name, where in used.items() if name not in TORCH_API_SINCE}
    assert not unknown, f"add the torch release that introduced these to TORCH_API_SINCE: {unknown}"
    floor = max(TORCH_API_SINCE[name] for name in used)
    declared = set(re.findall(r'"torch>=(\d+)\.(\d+),<\d+"', (REPO / "setup.py").read_text()))
    assert declared == {tuple(map(str, floor))}, (declared, floor)


def test_the_scan_sees_aliased_calls(tmp_path: Path):
    (tmp_path / "m.py").write_text("import torch.distributed.checkpoint as dcp\nimport torch\n"
                                   "def f():\n    dcp.save({})\n    torch.distributed.tensor.DTensor\n")
    assert set(torch_names(tmp_path)) == {"torch.distributed.checkpoint.save",
                                          "torch.distributed.tensor.DTensor"}
