"""A writer SIGKILLed in the middle of its uploads (real process, moto S3 with multipart): whatever
instant it dies, resume loads the newest checkpoint that has a manifest, its bytes verify, and it is at
least as new as the last save the writer reported complete."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from petctl.core.eventlog import parse_line
from petctl.elastic import Checkpointer, S3Store, State
from petctl.elastic import manifest as mf

REPO = Path(__file__).resolve().parents[2]

WRITER = r'''
import os, sys, torch
from petctl.elastic import Checkpointer, S3Options, State
from petctl.elastic import S3Store

url = sys.argv[1]
model = torch.nn.Linear(2048, 2048)  # 16 MiB of weights: 4 parts of 5 MiB per save
state = State(model=model, extra={"step": 0})
store = S3Store(url, S3Options(multipart_threshold=5 << 20, multipart_chunksize=5 << 20, max_concurrency=2))
ckpt = Checkpointer(url, keep=2, every=1, store=store)
for step in range(10_000):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))  # the checkpoint of step s holds s everywhere: easy to check
    state.extra["step"] = step
    ckpt.step_end(step, state)
'''


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("delay", [0.0, 0.37, 0.81])
def test_sigkill_during_upload_leaves_newest_complete_checkpoint(s3_url: str, tmp_path: Path,
                                                                 delay: float) -> None:
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PETCTL_CACHE_DIR": str(tmp_path / "writer-cache")}
    proc = subprocess.Popen([sys.executable, str(script), s3_url], env=env, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    saved: list[int] = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # wait for two completed saves, then kill mid-way through later ones
            event = parse_line(line)
            if event and event["event"] == "checkpoint.saved":
                saved.append(event["step"])
                if len(saved) == 2:
                    break
        assert len(saved) == 2, "the writer never completed two saves"
        time.sleep(delay)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        if proc.stderr is not None:
            proc.stderr.close()

    store = S3Store(s3_url)
    newest = mf.manifest_steps(store)[0]
    assert newest >= saved[-1]
    fresh = State(model=torch.nn.Linear(2048, 2048), extra={})
    with Checkpointer(s3_url, use_cache=False, store=store) as ckpt:
        assert ckpt.resume(fresh) == newest + 1
    assert fresh.extra["step"] == newest
    assert all(torch.all(p == float(newest)) for p in fresh.model.parameters())
    # retention never left a manifest whose data is gone
    for step in mf.manifest_steps(store):
        m = mf.read_manifest(store, step)
        sizes = {o.key: o.size for o in store.list(mf.data_prefix(step))}
        assert all(sizes.get(m.key_of(e)) == e.size for e in m.objects)
