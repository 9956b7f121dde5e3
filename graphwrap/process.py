"""What graphwrap keeps for the whole process, in one place; everything else belongs to one
engine (one GraphedModule) and goes with it.

- Captures: one at a time in the process (``CAPTURE_LOCK``: a capture on one stream breaks
  work issued meanwhile on another), and the private streams warm-ups and checks run on, per
  device; the capture streams of pools that are gone, for new pools (see ``capture.cuda.Pool``).
- Compiles: one compiled forward run at a time (``COMPILE_LOCK``: each run raises Dynamo's
  process-wide recompile limits while it lasts), and the numbers that give each compiled
  forward a code name of its own.
- The module watch: one counter (``GENERATION``) that PyTorch's global registration hooks (on
  the modules of watched trees, ``FOLLOWED``), ``nn.Module.train`` and attribute assignments on
  watched objects (``WATCHED``) bump, installed once (``WATCH_INSTALLED``); per thread, whether
  graphwrap is running a forward itself.
- Background workers: every engine's worker, and the flag set when the interpreter exits.
- ``generate``: one lock per wrapped model (its static caches and its step are per model).
- Caches of facts about types: which dict types rebuild from their items, which registered
  pytree types rebuild the same type. They only grow, by one entry per type seen.
- Request numbers of the Batcher's queues (their order across queues).
"""

import collections
import itertools
import threading
import weakref
from typing import Dict

import torch

# ------------------------------------------------------------------ captures
CAPTURE_LOCK = threading.RLock()
SIDE_STREAMS: dict = {}  # device -> the private stream warm-ups and captures run on
CHECK_STREAMS: dict = {}  # device -> the private stream checks at other shapes run on
CAPTURE_STREAMS_FREE: dict = {}  # device -> private streams of pools that are gone, for new pools
WORKSPACE_POOLS: dict = {}  # device -> the pool the capture streams' cuBLAS workspaces live in, for good
WORKSPACES_PLACED: set = set()  # (cuBLAS handle, capture stream) whose workspace lies there; emptied by a clear

# ------------------------------------------------------------------ compiles
COMPILE_LOCK = threading.RLock()
COMPILE_IDS = itertools.count()

# ------------------------------------------------------------------ the module watch
GENERATION = [0]
WATCH_INSTALLED: list = []
# Modules and the plain objects they hold (a config) whose attributes graphs were captured with,
# by identity (a user's __hash__ or __eq__ is never called): id -> (a weak reference to the
# object, the names of the attributes its forward writes itself, which are not watched, and the
# names the forward read at capture, which are).
WATCHED: dict = {}
# Modules some engine or decode batch depends on (the trees they read), by id: a registration on
# any other module (a ModuleList a forward slices from its own, every call) moves no counter.
FOLLOWED: "weakref.WeakValueDictionary[int, torch.nn.Module]" = weakref.WeakValueDictionary()
# Per thread: how deep this thread is in runs of a forward that graphwrap makes (captures, checks).
FORWARD_RUNS = threading.local()

# ------------------------------------------------------------------ background workers
EXITING = threading.Event()
WORKERS: "weakref.WeakSet" = weakref.WeakSet()

# ------------------------------------------------------------------ facts about types
DICT_TYPES_REBUILT: Dict[type, bool] = {collections.OrderedDict: True}
REBUILDS_SAME: Dict[type, bool] = {}  # registered pytree type -> whether its registration rebuilds that type

# ------------------------------------------------------------------ requests
REQUEST_SEQ = itertools.count()
