"""An instance runs at the node's normal CPU priority.

Ray starts every worker process at a low one (its `worker_niceness`, 15), so that the
raylet and other node processes stay responsive. An instance is the service itself: at nice
15 its step loop yields the CPU to every normal-priority process of the node (the gateway,
clients, other tenants) and a served token waits behind them.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def run_at_normal_priority() -> None:
    """Set every thread of this process to niceness 0 (on Linux niceness is per thread, and
    Ray's own threads start before the actor). Raising a priority needs root or
    CAP_SYS_NICE; without it the process stays as it started, and says so once."""
    if os.getpriority(os.PRIO_PROCESS, 0) <= 0:
        return
    try:
        thread_ids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the priority is the process's
        thread_ids = [0]
    for tid in thread_ids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, 0)
        except PermissionError:
            logger.info("kept the low CPU priority Ray started this worker at (no CAP_SYS_NICE)")
            return
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
