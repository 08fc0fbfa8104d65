"""P5's worker: print one line and exit 0 at once, so only the rendezvous is measured (no torch)."""

import json
import os
import time

print(json.dumps({"ts": time.time(), "event": "worker.trivial", "rank": int(os.environ.get("RANK", "0")),
                  "world_size": int(os.environ.get("WORLD_SIZE", "1"))}), flush=True)
