"""The decode engine: the batch and its thread (:mod:`.server`), whose turn schedules, runs and
processes outputs (:mod:`.loop`: :mod:`.schedule`, :mod:`.prefill`, :mod:`.outputs`), each
sequence's record, the rows and the queue (:mod:`.scheduler`), the forwards over the cache
(:mod:`.step`, :mod:`.first_token`, :mod:`.steps`, :mod:`.pieces`), each row's next token (:mod:`.sampling`, :mod:`.grammar`), the tokens on their
way to the host (:mod:`.inflight`), the shapes and their captures beside the decode thread
(:mod:`.shapes`, :mod:`.captures`), the pool's growth and preemption (:mod:`.growth`), the probe
that shows a model served (:mod:`.probe`), its weights watched (:mod:`.weights`) and its
``stats()`` (:mod:`.report`)."""
