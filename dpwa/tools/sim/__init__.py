"""``dpwa simulate``: an event-driven simulator of an asynchronous cluster, on the rules' own code.

:mod:`~dpwa.tools.sim.engine` runs the nodes (the rule, schedule, flow control and push ledger of the network
path) on simulated time; :mod:`~dpwa.tools.sim.timing` and :mod:`~dpwa.tools.sim.links` model the compute and
the network; :mod:`~dpwa.tools.sim.churn` crashes, restarts, joins and leaves; :mod:`~dpwa.tools.sim.problems`
are the models trained; :mod:`~dpwa.tools.sim.runner` ties them into a run directory.
"""

from __future__ import annotations

__all__: list[str] = []
