"""The callers' side of the shared batch: ``gm.generate``'s way in (:mod:`.front`), what a call
asks for (:mod:`.settings`), a call's record and its ending (:mod:`.calls`), the workers that
hand each call its tokens off the decode thread (:mod:`.delivery`), a call's grammar
(:mod:`.grammar`), a token's packed log-probabilities (:mod:`.logprobs`), and the turns of calls
the batch does not serve (:mod:`.turns`)."""
