"""Small leaves every layer may use; they import nothing else of dpwa.

* :mod:`~dpwa.utils.socket_thread` -- the poll-until-stopped loop of a thread that owns one socket;
* :mod:`~dpwa.utils.bfloat16` -- bfloat16 as raw 16-bit data (no numpy dtype): conversion, finiteness;
* :mod:`~dpwa.utils.atomic` -- writing a file so that readers never see a torn one.
"""

__all__: list[str] = []
