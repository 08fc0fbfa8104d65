"""petctl's probe job (`petctl doctor --provider aws --probe`): 50 steps on one node, through petctl.elastic.

It reports what only a worker can see, as one JSON line (`probe.env`): whether its HOME takes a cache
(`~/.cache`, where Hugging Face and torch keep theirs), the soft limit on open files, and the version of
the one requirement its instance installed (requirements.txt). Then it trains a linear model for
$PROBE_STEPS steps ($PROBE_STEP_SECONDS each, so its instance is seen InService), one `train.step`
line each, and saves its state to the job's checkpoint URL.
"""

import json
import os
import resource
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch
import torch.distributed as dist

from petctl.elastic import Checkpointer, State

STEPS = int(os.environ.get("PROBE_STEPS", "50"))
STEP_SECONDS = float(os.environ.get("PROBE_STEP_SECONDS", "0"))


def emit(event: str, **fields) -> None:
    print(json.dumps({"ts": time.time(), "event": event, **fields}), flush=True)


def cache_check() -> str:
    """"" when a file can be written to and read back from ~/.cache, else the error."""
    try:
        path = Path.home() / ".cache" / "petctl-probe" / f"{os.environ.get('RANK', '0')}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("probe\n")
        return "" if path.read_text() == "probe\n" else f"{path} read back wrong"
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def requirement() -> str:
    try:
        return f"tqdm {version('tqdm')}"
    except Exception as exc:  # noqa: BLE001 the report says what is missing
        return f"missing: {exc}"


soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
emit("probe.env", home=str(Path.home()), cache_error=cache_check(), nofile=soft, nofile_hard=hard,
     requirement=requirement(), python=sys.version.split()[0], torch=torch.__version__)
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
state = State(model=model, optimizer=optimizer, extra={"step": -1})
ckpt = Checkpointer(keep=1, every=10, background=False)
start = ckpt.resume(state)
for step in range(start, STEPS):
    x = torch.randn(16, 4)
    loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    state.extra["step"] = step
    emit("train.step", step=step, rank=dist.get_rank(), loss=round(loss.item(), 5))
    time.sleep(STEP_SECONDS)
    if ckpt.step_end(step, state):
        break
ckpt.close()
emit("train.done", step=state.extra["step"], rank=dist.get_rank())
sys.stdout.flush()
os._exit(0)  # everything is saved and printed: no interpreter shutdown to wait for
