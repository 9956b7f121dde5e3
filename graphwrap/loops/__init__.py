"""What drives the engine: the direct call's general path, the prefetching pipeline, items joined
into one replay, the Batcher and its queue, joining requests, and the decode loop of generate."""
