"""graphwrap's kernels and fused layers for the decode step: attention read straight from the
paged pool (:mod:`.paged_attention`, :mod:`.piece_attention`), the model's attention folded onto
them (:mod:`.attention`), and the step's products, norms, rotary and cache writes
(:mod:`.fused`, :mod:`.qkv`, :mod:`.mlp`, :mod:`.norm`, :mod:`.rope`, :mod:`.step_write`); the
Triton sources in the ``_*_triton`` modules, imported only on a GPU."""
