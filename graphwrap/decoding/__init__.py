"""Many generations at once: concurrent ``gm.generate`` calls share one decode step.

- :mod:`.settings`: what a ``generate`` call asks for, per sequence, or why the batch cannot serve it.
- :mod:`.scheduler`: which sequence holds which row of the cache, what is queued, when each ends
  (plain Python: no tensors).
- :mod:`.pool`: the cache's size and layout (from the memory free) and its blocks (plain Python).
- :mod:`.rows`, :mod:`.pages`: the KV cache, one row per sequence each with its own length, as
  whole rows or as blocks of a pool; :mod:`.layers`: the windows of it the model reads through;
  :mod:`.paged_attention`: a step's attention read straight from the pool (Triton).
- :mod:`.sampling`: each row's next token under its own settings.
- :mod:`.step`: the prompts' forward (prefill, long prompts in pieces) and the decode step,
  through graphwrap's engine; :mod:`.inflight`: the steps' tokens on their way to the host.
- :mod:`.server`: the thread that runs the steps (admit, step, read, retire) and ends each call;
  :mod:`.report`: its ``stats()``.
- :mod:`.calls`: a call's record, its ending (streamer, result) and the errors of a full or
  closed batch.
- :mod:`.delivery`: the workers that hand each call its tokens and result, off the decode thread.
- :mod:`.shapes`: which captured shape serves a forward, and how; :mod:`.captures`: the thread
  that captures new shapes beside the decode thread, over twins of the paged cache;
  :mod:`.pieces`: a long prompt prefilled a piece a turn; :mod:`.weights`: whether the model's
  weights moved since the batch was made.
- :mod:`.front`: ``gm.generate``'s way in: which batch, made when, and the one-call loop's turn.
"""
