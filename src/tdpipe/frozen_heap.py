"""Objects that live as long as the process are moved out of the cyclic garbage collector's reach.

The collector's full passes walk every tracked object and hold the interpreter lock while they do. With torch,
transformers and a tokenizer loaded that is a few hundred thousand objects, and it costs in two places:

- At the end: the interpreter's teardown runs full collections over everything still tracked. On this
  project's 2-core machine it made every `tdpipe` command, engine core and server end about 0.45 s later than
  its work did (0.61-0.69 s from the last line of Python to the exit against 0.18 s after a freeze).
- While serving: a full collection (0.2-0.7 s here over a test process's heap) stops the server's event loop
  along with every thread, so /health and every stream wait. vLLM's server and engine core freeze their
  start-up heap for the same reason.

Collecting the garbage that exists now (so its finalizers still run: a file object in a cycle is flushed and
closed) and then freezing the survivors moves them out of those passes; later garbage is collected as before.
Only for processes tdpipe owns from start to end: a library user's process keeps its collector as it is.
"""
from __future__ import annotations

import gc


def freeze_heap() -> None:
    """Collect now, then move every surviving object out of the collector's reach: called once a server or
    engine core is up (the model, the tokenizer, the modules) and by tdpipe's processes before they exit."""
    gc.collect()
    gc.freeze()
