"""Call 6's scratch script, kept as it ran (its imports since sorted): the int4 tiles with each group's sum scaled
(whole=False, 3b6a517's form) against the weights made whole first (whole=True), over a
``weight_only.tiles`` that took a ``whole`` flag for this call only (a809855 keeps the whole
form alone). Run from the repository root of that tree."""
import itertools
import sys

import torch

sys.path.insert(0, "benchmarks/diagnostics")
from swapped_tiles import DEV, LABELS, WIDTHS, _copies, _timed

from graphwrap import weight_only
from graphwrap.quantized import Int4Linear

g = torch.Generator(device=DEV).manual_seed(3)
sms = torch.cuda.get_device_properties(DEV).multi_processor_count
for rows in (1, 16, 64):
    for label in LABELS:
        k, n = WIDTHS[label]
        x = torch.randn(rows, k, generator=g, device=DEV).half()
        layer = Int4Linear(torch.nn.Linear(k, n, bias=False, device=DEV, dtype=torch.float16))
        w4, s4 = layer.weight_int4, layer.weight_scale
        want = x.float() @ weight_only.unpack(w4, s4).t()
        turn = itertools.cycle(_copies([w4, s4]))
        rule = weight_only.tile_shape(max(rows, 2), n, k, sms)
        shapes = {rule, (rule[0], 128, 4, 4, 3), (rule[0], 128, 2, 4, 4), (rule[0], 128, 8, 4, 4), (rule[0], 64, 4, 4, 3), (rule[0], 128, 1, 4, 4)}
        configs = [dict(shape=s, whole=w) for s in sorted(shapes) for w in (False, True)]
        found = _timed(configs, lambda w, v, kw: weight_only.tiles(x, w, v, kw["shape"], kw["whole"]), (w4, s4), turn, want)
        print(f"int4 {rows} rows {label} [{k}, {n}] rule {rule}:", flush=True)
        for t, kw, err in found[:6]:
            print(f"   {1e3*t:7.1f} us ({n*k/2e9/t:4.2f} TB/s) {kw} err {err:.1e}", flush=True)
