"""The decode engine: the thread that admits, steps, reads and retires (:mod:`.server`), the
rows and the queue (:mod:`.scheduler`), the forwards over the cache (:mod:`.step`, :mod:`.steps`,
:mod:`.pieces`), each row's next token (:mod:`.sampling`, :mod:`.grammar`), the tokens on their
way to the host (:mod:`.inflight`), the shapes and their captures beside the decode thread
(:mod:`.shapes`, :mod:`.captures`), the pool's growth and preemption (:mod:`.growth`), the probe
that shows a model served (:mod:`.probe`), its weights watched (:mod:`.weights`) and its
``stats()`` (:mod:`.report`)."""
