"""P5's worker: print one line and exit 0 at once, so only the rendezvous is measured (no torch)."""

import json
import os
import time

print(json.dumps({"ts": time.time(), "event": "worker.trivial", "rank": int(os.environ.get("RANK", "0")),
                  "world_size": int(os.environ.get("WORLD_SIZE", "1")),
                  "cpu_s": round(time.process_time(), 4)}), flush=True)  # its start-up's CPU (P5 reports it)
