"""What ``python -m zerojax_launch`` and the processes it starts agree on: variables, exit codes.

Without JAX, so that the launcher, which only starts and watches processes,
imports none of it.
"""

#: Environment variables that ``python -m zerojax_launch`` sets for each process.
COORDINATOR_ADDRESS = "ZEROJAX_COORDINATOR_ADDRESS"
NUM_PROCESSES = "ZEROJAX_NUM_PROCESSES"
PROCESS_ID = "ZEROJAX_PROCESS_ID"
#: Optional: the ``heartbeat_timeout`` (seconds) for ``initialize`` calls that do not pass one
#: (``python -m zerojax_launch --heartbeat-timeout`` sets it).
HEARTBEAT_TIMEOUT = "ZEROJAX_HEARTBEAT_TIMEOUT"

#: The exit status of a process that stopped because it was preempted, after
#: saving: ``EX_TEMPFAIL`` of ``sysexits.h`` ("a temporary failure; try again").
PREEMPTED_EXIT_CODE = 75
#: The exit status of a process whose collective failed because another process went away
#: (BSD's EX_PROTOCOL): a consequence, which the launcher blames on the process that went away.
PEER_LOST_EXIT_CODE = 76
