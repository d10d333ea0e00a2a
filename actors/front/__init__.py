"""One gateway replica's client of the instance pool, by concern:

- `front.py`: `Front`, the API the gateway streams through;
- `bridge.py`: the Front's own thread and event loop, and batches to callers on others;
- `flights.py` (with `flight.py`, `accounting.py`): requests in flight, their optimistic
  load accounting, and their moves off lost instances;
- `instances.py`: the instances' handles and the calls to them, the stats fan-out included;
- `pulls.py`: one long-polling pull loop per instance;
- `membership.py`: joins and leaves at run time, the KV pool's events, latency reports;
- `traces.py`: finished requests' traces and latencies;
- `leaks.py`: pulls' object ids, which a leak check must not count.
"""

from pdcluster.actors.front.front import CLOSE_TIMEOUT_S, STATS_TIMEOUT_S, Front
from pdcluster.actors.front.leaks import pull_object_ids
from pdcluster.actors.front.traces import MAX_TRACES, TRACE_PROMPT_HEAD

__all__ = [
    "CLOSE_TIMEOUT_S",
    "MAX_TRACES",
    "STATS_TIMEOUT_S",
    "TRACE_PROMPT_HEAD",
    "Front",
    "pull_object_ids",
]
