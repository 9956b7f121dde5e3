"""The KV cache: its size, layout and blocks (:mod:`.pool`, plain Python), its tensors as whole
rows or as blocks of a pool (:mod:`.rows`, :mod:`.pages`), and the windows of it the model reads
through (:mod:`.layers`)."""
