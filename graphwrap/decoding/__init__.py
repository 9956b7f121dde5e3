"""Many generations at once: concurrent ``gm.generate`` calls share one decode step.

- :mod:`.callers`: ``gm.generate``'s way in (``front``), what a call asks for (``settings``),
  a call's record and ending (``calls``), delivery off the decode thread (``delivery``), a call's
  grammar (``grammar``), packed log-probabilities (``logprobs``), and the turns of calls the batch
  does not serve (``turns``).
- :mod:`.engine`: the batch and its decode thread (``server``), the thread's turn (``loop``:
  ``schedule``, the run, ``outputs``), each sequence's record, the rows and the queue
  (``scheduler``, plain Python), the forwards over the cache (``step``, ``prefill``,
  ``first_token``, ``steps``, ``pieces``), sampling and grammars (``sampling``, ``grammar``), the tokens in flight
  (``inflight``), the shapes and their captures (``shapes``, ``captures``), the pool's growth
  and preemption (``growth``), the probe (``probe``), the weights watched (``weights``) and
  ``stats()`` (``report``).
- :mod:`.cache`: the KV cache's size and blocks (``pool``, plain Python), its tensors as whole
  rows or paged (``rows``, ``pages``) and the windows the model reads through (``layers``).
- :mod:`.kernels`: attention read from the paged pool, the model's attention folded onto it,
  and the step's fused products, norms, rotary and writes (Triton, on a GPU).
"""
