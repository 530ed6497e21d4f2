"""Tools built on the node and the rules -- with :mod:`dpwa.adapters`, the only code that may import
torch or matplotlib:

* :mod:`~dpwa.tools.demo` -- the built-in demo job of ``dpwa run`` (``python -m dpwa.tools.demo``);
* :mod:`~dpwa.tools.plot` -- ``dpwa plot``: a run's metrics as one PNG;
* :mod:`~dpwa.tools.simulation` -- many nodes in one process, no sockets, the same rule and schedule code;
* :mod:`~dpwa.tools.bench` -- ``dpwa bench``: exchange, train and scale benchmarks.
"""

__all__: list[str] = []
