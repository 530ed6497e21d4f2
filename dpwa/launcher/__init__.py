"""``dpwa run``: start a cluster's local nodes as processes, watch them, stop them, summarize.

* :mod:`~dpwa.launcher.job` -- :class:`~dpwa.launcher.job.Job` and :func:`~dpwa.launcher.job.run_job`,
  the run loop (start, watch, restart, stop, evaluate the demo, write ``summary.json``);
* :mod:`~dpwa.launcher.placement` -- which nodes of a cluster file run on this machine, and each
  node process's environment (``DPWA_NODE``, ``DPWA_CONFIG``, ``DPWA_RUN_DIR``, thread counts);
* :mod:`~dpwa.launcher.ports` -- whether a node's port is already in use here (checked by ``dpwa run``
  and ``dpwa validate`` before anything starts);
* :mod:`~dpwa.launcher.supervisor` -- child processes: start, watch, stop (only its own, by pid
  and process group);
* :mod:`~dpwa.launcher.lifeline` -- the guard process that stops them should the launcher die first;
* :mod:`~dpwa.launcher.restarts` -- the ``--restart-failed`` policy;
* :mod:`~dpwa.launcher.rundir` -- the run directory's files;
* :mod:`~dpwa.launcher.launchrecord` -- which launcher started which node (``--resume`` in each one's place);
* :mod:`~dpwa.launcher.progress` -- the live progress lines and the summary table.

The command that builds a job from its arguments is :mod:`dpwa.cli.run`. Nothing here imports
torch; with the CLI, this is the only code that starts processes.
"""

from dpwa.launcher.job import Job, run_job

__all__ = ["Job", "run_job"]
