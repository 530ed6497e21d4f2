"""Small leaves every layer may use; they import nothing else of dpwa.

* :mod:`~dpwa.utils.socket_thread` -- the poll-until-stopped loop of a thread that owns one socket;
* :mod:`~dpwa.utils.bfloat16` -- bfloat16 as raw 16-bit data (no numpy dtype): conversion, finiteness;
* :mod:`~dpwa.utils.atomic` -- writing a file so that readers never see a torn one;
* :mod:`~dpwa.utils.settings` -- settings dataclasses whose fields say what they allow and check themselves
  (the rules' settings and the cluster file's keys);
* :mod:`~dpwa.utils.dtypes` -- the names of the dtypes arrays may travel in (``wire_dtype``);
* :mod:`~dpwa.utils.int8` -- blockwise int8 quantization (``wire_dtype: int8``, CHOCO's ``int8`` compressor);
* :mod:`~dpwa.utils.exiting` -- ending one of dpwa's own worker processes without the interpreter's teardown.
"""

__all__: list[str] = []
