"""Where a cluster's nodes come from when its file does not list them: the *engines* people run.

A cluster file may leave ``nodes`` out (or there may be no file: every setting has a default); then the
engine that started the job knows the nodes:

* ``dpwa run -n N`` -- N nodes on this machine, on ports no other ``dpwa run -n`` holds
  (:mod:`dpwa.engines.local`)::

      reservation = reserve_ports(4)               # held until the job ends
      config = config.with_nodes(local_nodes(reservation.ports))

Everything here reads the environment and the file system only (stdlib); it never starts a process and
never imports torch, so the launcher, the CLI and the adapters share it.
"""

from __future__ import annotations

from dpwa.engines.local import PortReservation, local_nodes, reserve_ports

__all__ = ["PortReservation", "local_nodes", "reserve_ports"]
