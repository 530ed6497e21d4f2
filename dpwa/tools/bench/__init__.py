"""Benchmarks: speed and scale measured side by side in one run, printed as tables and written as JSON.

Each benchmark lives in its own module with its ``dpwa bench`` subcommand (listed in
:mod:`dpwa.cli.bench`) and prints figures and ratios taken in the same run on the same
machine; none of them is a pass/fail test:

* :mod:`~dpwa.tools.bench.exchange` -- one exchange against raw pyzmq and gloo's all_reduce;
* :mod:`~dpwa.tools.bench.train` -- dpwa against synchronous DDP, with and without a straggler;
* :mod:`~dpwa.tools.bench.scale` -- 4 to N local nodes.
"""

__all__: list[str] = []
