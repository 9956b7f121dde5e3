"""Many generations at once: concurrent ``gm.generate`` calls share one decode step.

- :mod:`.settings`: what a ``generate`` call asks for, per sequence, or why the batch cannot serve it.
- :mod:`.scheduler`: which sequence holds which row of the cache, what is queued, when each ends
  (plain Python: no tensors).
- :mod:`.rows`: the KV cache of rows (one row per sequence, each with its own length) and the
  windows of it a step attends over.
- :mod:`.sampling`: each row's next token under its own settings.
- :mod:`.step`: the prompt's forward (prefill) and the decode step, through graphwrap's engine.
- :mod:`.server`: the thread that runs the steps (admit, step, read, retire) and ends each call.
- :mod:`.calls`: a call's record, its ending (streamer, result) and the errors of a full or
  closed batch.
- :mod:`.delivery`: the workers that hand each call its tokens and result, off the decode thread.
- :mod:`.shapes`: which captured shape serves a forward; :mod:`.weights`: whether the model's
  weights moved since the batch was made.
- :mod:`.front`: ``gm.generate``'s way in: which batch, made when, and the one-call loop's turn.
"""
